"""Mixed precision: matmuls, attention and MLPs compute in bf16 (or fp16); norms, softmax, the loss
and reductions stay fp32; parameters stay fp32 master weights.

Invariant: a value leaving a lowered region is cast back to the dtype it was captured with, so the
graph's outputs and everything outside the lowered regions keep their dtypes; parameters are read
through casts in the graph, so autograd returns fp32 gradients to the optimizer.

    before:  y = linear(silu(linear(x, Wg)) * linear(x, Wu), Wd)                 # all fp32
    after:   xb = x.to(bf16)                                                      # region entry
             y = linear(silu(linear(xb, Wg.to(bf16))) * linear(xb, Wu.to(bf16)), Wd.to(bf16))
             y = y.to(float32)                                                    # region exit

Casts sit on region boundaries only (plus around the few ops the policy keeps fp32 inside a low
region); edges inside a region are left alone, so a model's own `.float()` upcasts still hold.

With the policy's "matmul_output" at "fp32" (the default "auto" does so for attention, and for
MLPs that mini-sequence chunks) only the matmuls and attention of a region are low; each linear
hands on its fp32 accumulator, the ops between compute in fp32 and save for backward in bf16:

    after:   xb = x.to(bf16)
             g = linear_fp32_out(xb, Wg.to(bf16)); u = linear_fp32_out(xb, Wu.to(bf16))  # fp32
             y = linear_fp32_out((silu(g) * u).to(bf16), Wd.to(bf16))                    # fp32
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from tailorfx.passes import register
from tailorfx.passes.precision.policy import AUTO, DTYPES, LOW, POLICY, VIEW_OPS, resolve_policy, router_nodes  # noqa: F401
from tailorfx.passes.precision.cleanup import cleanup, is_cast, to_dtype
from tailorfx import compat
from tailorfx.rewrite import match, saved_dtype
from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.passes import PASS_META, PassContext, PassResult, annotate, clone
from tailorfx.rewrite.regions import KINDS, Region, normalize_path
from tailorfx.runtime import ops

NAME = "precision"
MAX_ATTEMPTS = 64        # regions given up on, one per attempt, before the pass stops trying
# Factories whose dtype=torch.float32 means "the working dtype" (HF's KV cache starts as
# torch.tensor([], dtype=k.dtype)). Not arange/linspace/full: their values may not fit in 16 bits.
_FACTORIES = frozenset({"tensor", "empty", "zeros", "ones", "empty_like", "zeros_like", "ones_like",
                        "new_empty", "new_zeros", "new_ones"})
_META_METHODS = frozenset({"size", "dim", "numel", "stride", "element_size", "is_contiguous",
                           "storage_offset", "data_ptr", "get_device"})


@dataclass(frozen=True)
class Zone:
    """Where a node computes: a region (or one op inside it) and that zone's dtype."""
    key: str                        # region path, or "path:node" for an op zone
    region: str                     # the region path (skipping a zone skips its region)
    dtype: torch.dtype
    low: bool                       # computes below fp32 (else: as captured)
    fp32_out: bool = False          # a low linear that hands on its fp32 accumulator


@dataclass
class _Rewriter:
    """One attempt at rewriting a clone; the only code that mutates the graph."""
    gm: fx.GraphModule
    zones: dict[str, Zone]
    fake_mode: Any
    retarget: dict = field(default_factory=dict)   # node name -> dtype, besides low zones' casts
    casts: dict = field(default_factory=dict)      # (value, dtype, owner) -> cast node
    retargeted: list = field(default_factory=list)
    fresh: set = field(default_factory=set)        # nodes whose fake value was recomputed
    captured: dict = field(default_factory=dict)   # node -> its value before this pass
    fp32_out: list = field(default_factory=list)   # linears now handing on fp32 results

    def run(self) -> None:
        for n in list(self.gm.graph.nodes):
            z = self.zones.get(n.name)
            dtype = self.retarget.get(n.name, z.dtype if z is not None and z.low else None)
            if dtype is not None and _retarget(n, dtype):
                self.retargeted.append(n.name)
                self.fresh.add(n)
            if n.op != "placeholder" and not is_cast(n) and not _is_meta(n):
                for a in list(n.all_input_nodes):
                    want = self._wanted(a, z)
                    if want is not None:
                        n.replace_input_with(a, self._cast(a, want, z, n))
                        self.fresh.add(n)
            if z is not None and z.fp32_out and n.op == "call_function" and match.op_name(n) == "linear":
                n.args, n.kwargs = _linear_args(n), {}
                n.target = ops.linear_fp32_out_op
                self.fp32_out.append(n.name)
                self.fresh.add(n)
            if n.op in ("call_function", "call_method") and (
                    n in self.fresh or any(a in self.fresh for a in n.all_input_nodes)):
                self._propagate(n, z)

    def _wanted(self, a: fx.Node, z: Optional[Zone]) -> Optional[torch.dtype]:
        """The dtype `a` must be cast to before a node of zone `z` reads it, or None."""
        v = node_value(a)
        if not (isinstance(v, torch.Tensor) and v.is_floating_point()):
            return None
        za = self.zones.get(a.name)
        if za is not None and z is not None and za.key == z.key:
            return None   # an edge inside one zone: the model's own dtypes hold there
        want = z.dtype if (z is not None and z.low) else self._captured(a).dtype
        return want if v.dtype != want else None

    def _cast(self, a: fx.Node, dtype: torch.dtype, z: Optional[Zone], user: fx.Node) -> fx.Node:
        """`a.to(dtype)`, owned by the lower-precision side: a region's entry, or its exit."""
        down = torch.finfo(dtype).bits <= torch.finfo(node_value(a).dtype).bits
        owner, site = (z, user) if down or a.op == "placeholder" else (self.zones.get(a.name), a)
        key = (a, dtype, owner.key if owner else None)
        if key in self.casts:
            return self.casts[key]
        g = self.gm.graph
        with (g.inserting_before(user) if site is user else g.inserting_after(a)):
            c = g.call_method("to", (a, dtype))
        with self.fake_mode:
            val = node_value(a).to(dtype)
        annotate(c, val=val, pass_name=NAME)
        stack = _stack_prefix(site, owner.region if owner else None)
        if stack is not None:
            c.meta["nn_module_stack"] = stack
        self.casts[key] = c
        self.fresh.add(c)
        if owner is not None:
            self.zones[c.name] = owner
        return c

    def _propagate(self, n: fx.Node, z: Optional[Zone]) -> None:
        """Recompute n's fake value from its inputs'; keep the old one if nothing changed."""
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), node_value)
        fn = n.target if n.op == "call_function" else getattr(type(args[0]), n.target)
        try:
            with self.fake_mode, _quiet_fake_tensor_log(), compat.guards_suppressed(self.fake_mode):
                val = fn(*args, **kwargs)
        except Exception as e:   # e.g. a matmul that would mix bf16 and fp32
            if z is None:
                raise
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise _RegionFailed(z.region, f"{n.name} ({match.op_name(n)}) fails in {_short(z.dtype)}: "
                                          f"{msg[:160]}") from e
        old = node_value(n)
        val = _symbolic_as(old, val)
        if _same_meta(old, val):
            self.fresh.discard(n)
            return
        self.captured.setdefault(n, old)
        n.meta["val"] = n.meta["example_value"] = val
        self.fresh.add(n)

    def _captured(self, n: fx.Node) -> Any:
        """The value a node had before this pass (a cast of ours reports its source's)."""
        while n.meta.get(PASS_META) == NAME and is_cast(n):
            n = n.args[0]
        return self.captured.get(n, node_value(n))


class _RegionFailed(Exception):
    def __init__(self, region: str, reason: str):
        super().__init__(reason)
        self.region, self.reason = region, reason


class Precision:
    """Run the regions the policy lowers in bf16/fp16, with casts at their entries and exits."""
    name = NAME
    after = ("attention",)   # lowers the attention the attention pass chose

    def __init__(self, options: dict):
        self.precision = options.get("precision") or "bf16"
        self.policy = resolve_policy(self.precision, options.get("precision_policy"))
        self._save_low: dict[str, torch.dtype] = {}   # node -> dtype it is saved in (see _zones)
        self._matmuls_only: set[str] = set()            # regions that run only their matmuls low

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        dtypes, skipped = self._region_dtypes(gm, ctx)
        stats = {"precision": self.precision, "policy": {k: _short(v) for k, v in self.policy.items()}}
        # the mode the recorded values belong to (an enclosing tracing context may hold another)
        fake_mode = next((v.fake_mode for n in gm.graph.nodes if n.op == "placeholder"
                          and isinstance(v := node_value(n), compat.FakeTensor)), None)
        given_up: set[str] = set()
        routers = router_nodes(gm) if self.policy.get("router") == torch.float32 else {}
        for attempt in range(1, MAX_ATTEMPTS + 1):
            zones = self._zones(gm, ctx, dtypes, routers)
            tails = self._norm_outputs(gm, ctx, zones, given_up)
            if not any(z.low for z in zones.values()) and not tails:
                stats.update(regions={p: _short(d) for p, d in dtypes.items()}, attempts=attempt)
                return PassResult(gm, False, stats, (), tuple(skipped))
            new = clone(gm)   # an attempt that fails is thrown away, and the next starts from gm
            rw = _Rewriter(new, zones, fake_mode, {cast: d for _, cast, d in tails})
            try:
                rw.run()
                break
            except _RegionFailed as e:   # give that region up (left as captured) and start again
                if e.region in given_up:
                    raise RuntimeError(f"precision: {e.region} failed as captured: {e.reason}") from e
                given_up.add(e.region)
                skipped.append(f"{e.region}: {e.reason}; left as captured")
                dtypes[e.region] = torch.float32
        else:
            stats["stop"] = f"gave up after {MAX_ATTEMPTS} attempts"
            return PassResult(gm, False, stats, (), tuple(skipped))
        for n in new.graph.nodes:
            if n.name in self._save_low:
                saved_dtype.tag(n, self._save_low[n.name])
        removed, cleanup_stop = cleanup(new)
        regions = {p: _short(d) for p, d in dtypes.items()}
        outputs = {r: _short(d) for r, _, d in tails}
        stats.update(regions=regions, norm_outputs=outputs,
                     op_zones={z.key.split(":")[1]: _short(z.dtype) for z in zones.values() if ":" in z.key},
                     num_casts=sum(n.meta.get(PASS_META) == NAME for n in new.graph.nodes),
                     retargeted=rw.retargeted, fp32_out=rw.fp32_out,
                     cleanup={"removed": removed, "stop": cleanup_stop}, attempts=attempt)
        touched = tuple(f"{p} ({d}{' matmuls' if p in self._matmuls_only else ''})"
                        for p, d in regions.items() if d != "fp32") + tuple(
            f"{p} (fp32, output {d})" for p, d in outputs.items())
        return PassResult(new, bool(stats["num_casts"] or rw.retargeted), stats, touched, tuple(skipped))

    def _region_dtypes(self, gm: fx.GraphModule, ctx: PassContext) -> tuple[dict[str, torch.dtype], list[str]]:
        """Region path -> the dtype the policy gives it, fp32 for those that cannot be lowered."""
        nodes = {n.name: n for n in gm.graph.nodes}
        out, skipped = {}, []
        for r in ctx.regions.regions:
            if r.kind not in self.policy:
                continue
            dtype = self.policy[r.kind]
            why = _cannot_lower(r, nodes) if dtype != torch.float32 else None
            if why:
                skipped.append(f"{r.path}: {why}; left as captured")
                dtype = torch.float32
            out[r.path] = dtype
        return out, skipped

    def _norm_outputs(self, gm: fx.GraphModule, ctx: PassContext, zones: dict[str, Zone],
                      given_up: set[str]) -> list[tuple[str, str, torch.dtype]]:
        """(region, cast node, dtype) for each norm whose every reader is in a low zone of one dtype:
        its final cast back to the working dtype goes to that dtype (see "norm_output" in POLICY)."""
        if self.policy.get("norm_output", torch.float32) == torch.float32:
            return []
        nodes = {n.name: n for n in gm.graph.nodes}
        out = []
        for r in ctx.regions.of_kind("norm"):
            if r.path in given_up or any(n in zones and zones[n].low for n in r.nodes):
                continue
            readers = [u for o in r.outputs for u in nodes[o].users]
            dtypes = {zones[u.name].dtype if u.name in zones and zones[u.name].low else None for u in readers}
            cast = _final_cast(r, nodes)
            if cast is not None and len(dtypes) == 1 and None not in dtypes:
                out.append((r.path, cast, dtypes.pop()))
        return out

    def _zones(self, gm: fx.GraphModule, ctx: PassContext, dtypes: dict[str, torch.dtype],
               routers: dict[str, str]) -> dict[str, Zone]:
        """Zone of every node the policy covers: its innermost region with a policy entry, or the
        op itself where the policy names the op with another dtype."""
        nodes = {n.name: n for n in gm.graph.nodes}
        best: dict[str, tuple[int, Region]] = {}
        for r in ctx.regions.regions:
            if r.path not in dtypes:
                continue
            depth = r.path.count(".") + 1
            for name in r.nodes:
                if name not in best or best[name][0] < depth:
                    best[name] = (depth, r)
        zones: dict[str, Zone] = {}
        self._save_low, self._matmuls_only = {}, set()
        for name, (_, r) in best.items():
            dtype = dtypes[r.path]
            if name in routers and dtype != torch.float32:   # an fp32 island, like softmax
                zones[name] = Zone(f"{r.path}:router:{routers[name]}", r.path, torch.float32, False)
                continue
            z = Zone(r.path, r.path, dtype, dtype != torch.float32)
            op_name = match.op_name(nodes[name])
            if z.low and self._fp32_out(r, ctx):
                self._matmuls_only.add(r.path)
                # each matmul/attention op is a zone of its own; the ops between them stay as
                # captured (fp32) and save for backward in the low dtype (not attention's statistics)
                if op_name in match.MATMUL_OPS or op_name in match.ATTENTION_OPS:
                    zones[name] = Zone(f"{r.path}:{name}", r.path, dtype, True, op_name == "linear")
                if op_name not in match.ATTENTION_OPS and self.policy.get(op_name) != torch.float32:
                    self._save_low[name] = dtype
                continue
            op = self.policy.get(op_name) if op_name not in KINDS else None
            if op is not None and op != dtype and (z.low or op != torch.float32):
                z = Zone(f"{r.path}:{name}", r.path, op, op != torch.float32)
            zones[name] = z
        for n in gm.graph.nodes:   # a view of a low op's result joins its zone: no cast to reshape it
            src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            if n.name in best and n.name not in zones and src is not None and src.name in zones \
                    and zones[src.name].low and ":" in zones[src.name].key and match.op_name(n) in VIEW_OPS:
                zones[n.name] = zones[src.name]
        return zones

    def _fp32_out(self, r: Region, ctx: PassContext) -> bool:
        """Whether low region `r` runs only its matmuls low (see "matmul_output" in POLICY)."""
        mode = self.policy.get("matmul_output", LOW)
        if mode == AUTO:
            return r.kind == "attention" or (r.kind == "mlp" and r.token_wise and "minisequence" in ctx.pipeline)
        return mode == "fp32"


def _cannot_lower(r: Region, nodes: dict[str, fx.Node]) -> Optional[str]:
    """Why a region must stay as captured, or None."""
    for p in r.params:
        v = node_value(nodes[p])
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != torch.float32:
            return (f"parameter {p} is {v.dtype}, not fp32: the pass keeps fp32 master weights and "
                    "casts them, a model already in low precision is left as it is")
    members = set(r.nodes)
    for name in r.nodes:
        n = nodes[name]
        if n.op == "call_module":
            return f"{n.name} calls submodule {n.target}, whose dtypes the pass cannot follow"
        if match.op_name(n).endswith("_") and not match.op_name(n).endswith("__") and n.args and \
                isinstance(n.args[0], fx.Node) and n.args[0].name not in members:
            return (f"{n.name} ({match.op_name(n)}) writes in place into {n.args[0].name}, which comes "
                    "from outside the region: a cast copy would take the write")
    return None


_STATS = match.STAT_OPS | match.NORM_OPS | {"mean", "sum", "pow", "sqrt", "div", "var_mean"}


def _final_cast(r: Region, nodes: dict[str, fx.Node]) -> Optional[str]:
    """The last `.to(float32)` of a norm with no statistic after it (HF's `x.to(input_dtype)`)."""
    members = set(r.nodes)
    for name in reversed(r.nodes):
        n = nodes[name]
        where = to_dtype(n) if n.op == "call_method" and n.target in ("to", "type") else None
        if where is None or (n.kwargs if where[0] == "kw" else n.args)[where[1]] != torch.float32:
            continue
        after = [u for u in match.users_closure([n]) if u.name in members and u is not n]
        return name if not any(match.op_name(u) in _STATS for u in after) else None
    return None


# ---- helpers ---------------------------------------------------------------------------------


def _linear_args(n: fx.Node) -> tuple:
    """(input, weight, bias) of an F.linear call, however they were passed."""
    names = ("input", "weight", "bias")
    args = list(n.args) + [n.kwargs.get(k) for k in names[len(n.args):]]
    return tuple(args[:3])


def _is_meta(n: fx.Node) -> bool:
    return n.op == "call_method" and n.target in _META_METHODS


def _retarget(n: fx.Node, dtype: torch.dtype) -> bool:
    """In a low region, the model's `.to(torch.float32)` means "to the working dtype" (Dynamo
    records `x.to(q.dtype)` as a constant), and so does a factory's dtype=torch.float32: point them
    at the region's dtype. `.float()` is an explicit upcast and stays."""
    if n.op == "call_method" and n.target in ("to", "type"):
        where = to_dtype(n)
    elif match.op_name(n) in _FACTORIES and "dtype" in n.kwargs:
        where = ("kw", "dtype")
    else:
        return False
    if where is None:
        return False
    kind, i = where
    if (n.kwargs[i] if kind == "kw" else n.args[i]) != torch.float32:
        return False
    if kind == "kw":
        n.update_kwarg(i, dtype)
    else:
        n.update_arg(i, dtype)
    return True


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """A region that fails in low precision is expected and reported; FakeTensorMode would also
    log the failure with a traceback."""
    log = logging.getLogger(compat.FAKE_TENSOR_LOGGER)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _symbolic_as(old: Any, new: Any) -> Any:
    """`new` with `old`'s symbolic sizes and strides where it has the same ones by value: a dtype
    changes no shape, but torch 2.11's CPU linear on 16-bit inputs computes its output's from its
    sizes read as ints, which would leave the sequence symbol out of everything downstream."""
    if isinstance(old, (tuple, list)) and isinstance(new, (tuple, list)) and len(old) == len(new):
        vals = [_symbolic_as(a, b) for a, b in zip(old, new)]
        return type(new)(vals) if type(new) in (tuple, list) else new
    if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)) or old.dim() != new.dim():
        return new
    concrete = [all(isinstance(x, int) for x in t.shape) for t in (old, new)]
    if concrete[0] or not concrete[1] or _hints(old.shape + old.stride()) != _hints(new.shape + new.stride()):
        return new
    with new.fake_mode:
        out = torch.empty_strided(old.shape, old.stride(), dtype=new.dtype, device=new.device)
    return out.requires_grad_(new.requires_grad)


def _hints(sizes) -> list[int]:
    return [compat.size_hint(x) for x in sizes]


def _same_meta(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_meta(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and not isinstance(a, torch.Tensor)


def _stack_prefix(node: fx.Node, region_path: Optional[str]) -> Optional[dict]:
    """node's nn_module_stack cut just below `region_path` (so a cast joins that region, not a
    submodule of it); the whole stack if the region is not on it."""
    stack = node.meta.get("nn_module_stack")
    if stack is None:
        return None
    out = {}
    for k, v in stack.items():
        out[k] = v
        if region_path is not None and normalize_path(v[0] if isinstance(v, tuple) else str(v)) == region_path:
            return out
    return dict(stack)


def _short(dtype: Any) -> str:
    if isinstance(dtype, str):
        return dtype
    return {v: k for k, v in DTYPES.items()}.get(dtype, str(dtype).replace("torch.", ""))


@register(NAME)
def _factory(options: dict) -> Precision:
    return Precision(options)
