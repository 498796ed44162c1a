"""The memory model: simulated execution of one training step on fake tensors.

AOTAutograd traces the graph into the forward and backward graphs that will really run (same
partitioner as the lowering), on fake tensors, so nothing is allocated. Walking them in order,
each op allocates its outputs (views and in-place ops alias their base) and every storage is
freed after its last use, as fx-generated code does; forward outputs saved for backward live
until the backward graph returns (autograd's ctx holds them); gradients live to the end of the
step. Sizes are sympy expressions in the sequence length, so one trace predicts every length.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import sympy
import torch
import torch.fx as fx

from tailorfx.rewrite import compat
from tailorfx.rewrite.capture import SeqInfo, node_value
from tailorfx.rewrite.regions import is_param


@dataclass
class StepGraphs:
    """The forward and backward graphs of one captured subgraph, as AOTAutograd partitions them."""
    fw: fx.GraphModule
    bw: Optional[fx.GraphModule]
    num_user_outputs: int
    static_inputs: list[bool]          # per fw placeholder: a parameter or buffer
    requires_grad: list[bool]          # per fw placeholder


def fake_inputs(gm: fx.GraphModule) -> list:
    """The fake (possibly symbolic) example inputs Dynamo recorded on the placeholders."""
    return [node_value(n) for n in gm.graph.nodes if n.op == "placeholder"]


def trace_step(gm: fx.GraphModule, example_inputs: Optional[Sequence] = None,
               partition: str = "default") -> StepGraphs:
    """Trace `gm` with AOTAutograd on fake tensors and keep the partitioned graphs (runs nothing).

    By default it traces on the fake inputs Dynamo recorded, so sizes stay symbolic in the
    sequence length.
    """
    example_inputs = fake_inputs(gm) if example_inputs is None else example_inputs
    rec: dict = {}
    partition_fn = (compat.default_partition if partition == "default"
                    else compat.min_cut_rematerialization_partition)

    def part(joint, joint_inputs, *, num_fwd_outputs, **kw):
        fw, bw = partition_fn(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)
        rec.update(fw=fw, bw=bw, n=num_fwd_outputs)
        return fw, bw

    def fw_compiler(g, _):
        rec.setdefault("fw", g)
        return compat.make_boxed_func(g.forward)

    def bw_compiler(g, _):
        return compat.make_boxed_func(g.forward)

    compat.aot_module_simplified(gm, list(example_inputs), fw_compiler=fw_compiler,
                                 bw_compiler=bw_compiler, partition_fn=part)
    return make_step(gm, rec["fw"], rec.get("bw"), rec.get("n"))


def make_step(gm: fx.GraphModule, fw: fx.GraphModule, bw: Optional[fx.GraphModule],
              num_user_outputs: Optional[int]) -> StepGraphs:
    """StepGraphs from a Dynamo graph and the forward/backward graphs AOTAutograd made of it."""
    dyn_ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fw_ph = [n for n in fw.graph.nodes if n.op == "placeholder"]
    static = [is_param(n) for n in dyn_ph]
    if len(static) != len(fw_ph):   # AOTAutograd added or removed inputs: fall back on requires_grad
        static = [isinstance(node_value(n), torch.Tensor) and node_value(n).requires_grad for n in fw_ph]
    grads = [isinstance(v, torch.Tensor) and v.requires_grad for v in fake_inputs(gm)]
    n_out = num_user_outputs if num_user_outputs is not None else len(_outputs(fw))
    return StepGraphs(fw, bw, n_out, static, grads + [False] * (len(fw_ph) - len(grads)))


def _outputs(g: fx.GraphModule) -> list:
    out = next(n for n in reversed(g.graph.nodes) if n.op == "output")
    return list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]


class Sizer:
    """Bytes of a tensor, evaluated at a chosen sequence length (other symbols at their hints)."""

    def __init__(self, seq: Optional[SeqInfo], seq_len: Optional[int] = None):
        self.subs = {}
        if seq is not None:
            self.subs = {k: v for k, v in seq.hints.items()}
            if seq.symbol is not None and seq_len is not None:
                self.subs[seq.symbol] = seq_len
        self._cache: dict = {}

    def as_int(self, x) -> int:
        """A size or SymInt at the predicted length."""
        e = compat.sym_expr(x)
        if e.is_Integer:
            return int(e)
        return int(e.xreplace({k: sympy.Integer(v) for k, v in self.subs.items() if k in e.free_symbols}))

    def __call__(self, t: torch.Tensor) -> int:
        e = compat.sym_expr(t.numel())
        if e.is_Integer:
            return int(e) * t.element_size()
        key = e
        if key not in self._cache:
            val = e.xreplace({k: sympy.Integer(v) for k, v in self.subs.items() if k in e.free_symbols})
            if not val.is_number:
                raise ValueError(f"tensor size {e} depends on symbols with no known value: {val.free_symbols}")
            self._cache[key] = int(val)
        return self._cache[key] * t.element_size()


@dataclass
class Timeline:
    """Live bytes after each op of the simulated step (above what existed before the step)."""
    points: list[tuple[str, str, int]] = field(default_factory=list)   # (phase, node, bytes)

    def peak(self) -> tuple[int, str, str]:
        if not self.points:
            return 0, "", ""
        phase, node, b = max(self.points, key=lambda p: p[2])
        return b, phase, node


@dataclass
class MemoryEstimate:
    """Predicted memory of one training step."""
    peak_bytes: int            # static + dynamic peak: what a device must hold
    static_bytes: int          # parameters, buffers and optimizer state, held across steps
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int       # optimizer state (0 when no optimizer is modelled)
    dynamic_peak_bytes: int    # peak above static during the step (what measure_peak sees)
    saved_bytes: int           # activations saved for backward, at the end of forward
    peak_phase: str
    peak_node: str
    timeline: Timeline

    def summary(self) -> dict[str, int]:
        return {"peak": self.peak_bytes, "static": self.static_bytes, "params": self.param_bytes,
                "grads": self.grad_bytes, "optimizer_state": self.optimizer_bytes,
                "dynamic_peak": self.dynamic_peak_bytes, "saved_activations": self.saved_bytes}


class _Pool:
    """Storages alive during the simulation, each with the set of values holding it."""

    def __init__(self, timeline: Timeline):
        self.bytes: dict[int, int] = {}
        self.holders: dict[int, set] = {}
        self.total = 0
        self.next_id = 0
        self.timeline = timeline

    def alloc(self, nbytes: int, holder) -> int:
        sid = self.next_id
        self.next_id += 1
        self.bytes[sid] = nbytes
        self.holders[sid] = {holder}
        self.total += nbytes
        return sid

    def hold(self, sid: int, holder) -> None:
        if sid in self.holders:
            self.holders[sid].add(holder)

    def release(self, sid: int, holder) -> None:
        h = self.holders.get(sid)
        if h is None:
            return
        h.discard(holder)
        if not h:
            self.total -= self.bytes.pop(sid)
            del self.holders[sid]

    def mark(self, phase: str, node: str) -> None:
        self.timeline.points.append((phase, node, self.total))


def _op_transient(node: fx.Node, sizer: Sizer) -> int:
    """Bytes an opaque tailorfx op allocates inside itself while it runs (its chunk buffers)."""
    t = node.target
    if not (isinstance(t, torch._ops.OpOverload) and t.namespace == "tailorfx"):
        return 0
    from tailorfx.runtime import attention_kernels, ops
    args = list(fx.node.map_arg(node.args, node_value))
    return (ops.transient_bytes(t._opname, args, sizer.as_int)
            + attention_kernels.transient_bytes(t._opname, args, sizer.as_int))


def _aliases_input(node: fx.Node) -> bool:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return any(r.alias_info is not None for r in t._schema.returns)
    return False


def _run_graph(g: fx.GraphModule, pool: _Pool, env: dict, sizer: Sizer, phase: str,
               pinned_outputs: bool = True) -> list:
    """Simulate one graph. `env` maps placeholder names to storage-id lists (pre-existing values)."""
    nodes = list(g.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    last = {n: max((index[u] for u in n.users), default=index[n]) for n in nodes}
    out_node = nodes[-1]
    held: dict[fx.Node, list[int]] = {}
    for i, n in enumerate(nodes):
        if n.op == "placeholder":
            held[n] = list(env.get(n.name, []))
            for sid in held[n]:
                pool.hold(sid, n)
            continue
        if n.op == "output":
            break
        val = node_value(n)
        if n.op == "call_function" and n.target.__name__ == "getitem" and isinstance(n.args[0], fx.Node):
            parent = held.get(n.args[0], [])
            k = n.args[1]
            held[n] = [parent[k]] if isinstance(k, int) and k < len(parent) else list(parent)
        elif _aliases_input(n):
            base = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            held[n] = list(held.get(base, [])) if base is not None else []
        else:
            vals = val if isinstance(val, (list, tuple)) else [val]
            held[n] = [pool.alloc(sizer(v), n) if isinstance(v, torch.Tensor) else -1 for v in vals]
            held[n] = [s for s in held[n] if s >= 0] if not isinstance(val, (list, tuple)) else held[n]
        for sid in held[n]:
            pool.hold(sid, n)
        inner = _op_transient(n, sizer)
        pool.total += inner
        pool.mark(phase, n.name)
        pool.total -= inner
        for a in set(n.all_input_nodes) | {n}:
            if last[a] <= i and not (a in out_node.all_input_nodes and pinned_outputs):
                for sid in held.get(a, []):
                    pool.release(sid, a)
    outs = []
    for o in _outputs(g):
        outs.append(list(held.get(o, [])) if isinstance(o, fx.Node) else [])
        for sid in outs[-1]:
            pool.hold(sid, "__out__")
    # the graph's frame is gone: values survive only through what it returned
    for n, sids in held.items():
        for sid in sids:
            pool.release(sid, n)
    return outs


def simulate_step(steps: Sequence[StepGraphs], seq: Optional[SeqInfo] = None,
                  seq_len: Optional[int] = None, optimizer: Optional[str] = None,
                  keep_outputs: bool = True) -> MemoryEstimate:
    """Predict one training step over captured subgraphs run in order (forward, then backward).

    `optimizer`: None, "sgd" (no state) or "adamw" (two states per parameter, created at the
    step). `keep_outputs`: the caller holds the model outputs (e.g. logits) through backward.
    """
    sizer = Sizer(seq, seq_len)
    timeline = Timeline()
    pool = _Pool(timeline)
    param_bytes = grad_bytes = 0
    saved_total = 0
    pending = []   # (step, saved-name -> sids, user outputs' sids)
    for k, st in enumerate(steps):
        fw_ph = [n for n in st.fw.graph.nodes if n.op == "placeholder"]
        for n, static in zip(fw_ph, st.static_inputs):
            v = node_value(n)
            if static and isinstance(v, torch.Tensor):
                param_bytes += sizer(v)
        outs = _run_graph(st.fw, pool, {}, sizer, f"forward[{k}]")
        fw_out_nodes = _outputs(st.fw)
        saved = {}
        for o, sids in zip(fw_out_nodes[st.num_user_outputs:], outs[st.num_user_outputs:]):
            if isinstance(o, fx.Node):
                saved[o.name] = sids
                for sid in sids:
                    pool.hold(sid, ("saved", k, o.name))
        user = [sid for sids in outs[:st.num_user_outputs] for sid in sids]
        for sid in user:
            pool.hold(sid, ("user", k))
        for sids in outs:
            for sid in sids:
                pool.release(sid, "__out__")
        saved_total += sum(pool.bytes.get(s, 0) for s in {s for sids in saved.values() for s in sids})
        pending.append((k, st, saved, user))
    for k, st, saved, user in reversed(pending):
        if st.bw is None:
            continue
        env = {}
        for n in st.bw.graph.nodes:
            if n.op != "placeholder":
                continue
            if n.name in saved:
                env[n.name] = saved[n.name]
            elif n.name.startswith("tangents") and isinstance(node_value(n), torch.Tensor):
                env[n.name] = [pool.alloc(sizer(node_value(n)), ("tangent", k))]
        # AOTAutograd's backward receives the saved tensors from autograd's ctx, which keeps them
        # until the whole backward graph returns (measured: freeing at last use under-predicts)
        grads = _run_graph(st.bw, pool, env, sizer, f"backward[{k}]")
        for n in st.bw.graph.nodes:
            if n.op == "placeholder":
                for sid in env.get(n.name, []):
                    pool.release(sid, ("tangent", k))
        # AccumulateGrad copies a gradient whose layout differs from its (contiguous) parameter,
        # one at a time, while the others are held
        relayout = [sizer(node_value(o)) for o in _outputs(st.bw)
                    if isinstance(o, fx.Node) and isinstance(node_value(o), torch.Tensor)
                    and not node_value(o).is_contiguous()]
        if relayout:
            pool.total += max(relayout)
            pool.mark(f"backward[{k}]", "accumulate_grad")
            pool.total -= max(relayout)
        for name, sids in saved.items():
            for sid in sids:
                pool.release(sid, ("saved", k, name))
        for sids in grads:   # accumulated into .grad: they live to the end of the step
            for sid in sids:
                grad_bytes += pool.bytes.get(sid, 0)
                pool.hold(sid, ("grad", k))
                pool.release(sid, "__out__")
        if not keep_outputs:
            for sid in user:
                pool.release(sid, ("user", k))
    optimizer_bytes = 0
    if optimizer == "adamw":
        # Steady state: two states per parameter (in its dtype) live through the whole step, like
        # the weights. The per-parameter update computes (exp_avg_sq.sqrt() / bias_correction):
        # two parameter-sized temporaries (measured on CPU).
        optimizer_bytes = 2 * grad_bytes   # one per trained parameter, in its dtype
        temp = 2 * _largest_param(steps, sizer)
        pool.total += temp
        pool.mark("optimizer", "adamw.step")
        pool.total -= temp
    dyn_peak, phase, node = timeline.peak()
    static = param_bytes + optimizer_bytes
    return MemoryEstimate(peak_bytes=static + dyn_peak, static_bytes=static,
                          param_bytes=param_bytes, grad_bytes=grad_bytes,
                          optimizer_bytes=optimizer_bytes, dynamic_peak_bytes=dyn_peak,
                          saved_bytes=saved_total, peak_phase=phase, peak_node=node,
                          timeline=timeline)


def _largest_param(steps: Sequence[StepGraphs], sizer: Sizer) -> int:
    sizes = [sizer(node_value(n)) for st in steps
             for n, s in zip([n for n in st.fw.graph.nodes if n.op == "placeholder"], st.static_inputs)
             if s and isinstance(node_value(n), torch.Tensor)]
    return max(sizes, default=0)


def predict(graphs: Sequence[fx.GraphModule], seq: Optional[SeqInfo] = None,
            seq_len: Optional[int] = None, partition: str = "default",
            optimizer: Optional[str] = None) -> MemoryEstimate:
    """Trace and simulate: the peak of one step of these Dynamo graphs, run in order."""
    steps = [trace_step(gm, None, partition) for gm in graphs]
    return simulate_step(steps, seq, seq_len, optimizer)
