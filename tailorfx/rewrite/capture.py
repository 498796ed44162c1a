"""Capture: mark the sequence dimension dynamic and let Dynamo hand graphs to a backend.

Marking the sequence dim dynamic makes every tensor size that depends on it a sympy expression in
one symbol, so analyses find sequence dims exactly and the memory model predicts any length from
one capture.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import sympy
import torch
import torch.fx as fx

from tailorfx import compat


def _is_sequence_input(t: Any, seq_dim: int = 1) -> bool:
    """An integer (B, S) or float (B, S, H) tensor: one whose `seq_dim` is the sequence."""
    if not isinstance(t, torch.Tensor) or t.dim() <= seq_dim:
        return False
    integer = not t.is_floating_point()
    return ((integer and t.dim() == 2) or (not integer and t.dim() == 3)) and t.shape[seq_dim] >= 2


def _sequence_inputs(args: tuple, kwargs: dict, seq_dim: int = 1) -> list[torch.Tensor]:
    """The integer (B, S) and float (B, S, H) inputs: those whose `seq_dim` is the sequence."""
    return [t for t in list(args) + list(kwargs.values()) if _is_sequence_input(t, seq_dim)]


def mark_sequence_dims(args: tuple, kwargs: dict, seq_dim: int = 1) -> Optional[int]:
    """Mark `seq_dim` of every integer (B, S) or float (B, S, H) input dynamic; return S (or None)."""
    seq_len = None
    for t in _sequence_inputs(args, kwargs, seq_dim):
        compat.maybe_mark_dynamic(t, seq_dim)
        seq_len = seq_len or int(t.shape[seq_dim])
    return seq_len


_PRIMES = (17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 101, 103, 107, 109, 113, 127)


def distinct_length_inputs(model: torch.nn.Module, args: tuple, kwargs: dict,
                           seq_dim: int = 1) -> Optional[tuple[int, tuple, dict]]:
    """The inputs cut to a sequence length no size of the model shares: a prime <= S that divides
    no parameter, buffer or batch size, so a static capture at it tells the sequence dim from
    every other by its size alone (capture_graphs(static=True)). (length, args, kwargs), or None
    when S is shorter than every such prime or also sizes another dim of an input."""
    seqs = _sequence_inputs(args, kwargs, seq_dim)
    if not seqs:
        return None
    S = int(seqs[0].shape[seq_dim])
    tensors = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    other = {int(d) for t in tensors for i, d in enumerate(t.shape) if not (i == seq_dim and any(t is x for x in seqs))}
    if any(int(t.shape[seq_dim]) != S for t in seqs) or S in other:
        return None
    sizes = other | {int(d) for t in [*model.parameters(), *model.buffers()] for d in t.shape}
    length = next((p for p in _PRIMES if p <= S and all(d % p for d in sizes if d > 1)), None)
    if length is None:
        return None

    def cut(t):
        return t.narrow(seq_dim, 0, length) if any(t is x for x in seqs) else t
    return length, tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


@dataclass
class SeqInfo:
    """How to recognise the sequence dimension in one captured graph."""
    symbol: Optional[sympy.Symbol]   # the dynamic sequence length, if the capture kept it symbolic
    length: int                      # its value in the example inputs
    hints: dict = field(default_factory=dict)   # every shape symbol -> its traced value
    depth: Any = None   # rewrite/depth.Depth: the graph's blocks stand for a deeper model's (sizing's captures)

    def dims(self, t: Any) -> tuple[int, ...]:
        """Dimensions of tensor t whose size depends on the sequence length."""
        if not isinstance(t, torch.Tensor):
            return ()
        out = []
        for i, s in enumerate(t.shape):
            e = compat.sym_expr(s)
            if self.symbol is not None:
                if self.symbol in e.free_symbols:
                    out.append(i)
            elif self.length > 1 and e.is_Integer and int(e) % self.length == 0 and int(e) > 1:
                # static capture: a size equal to S (or B*S rows) is taken as a sequence dim
                q = int(e) // self.length
                if q == 1 or (i == 0 and q <= 64):
                    out.append(i)
        return tuple(out)


def node_value(node: fx.Node) -> Any:
    """The fake value Dynamo or AOTAutograd recorded for a node."""
    return node.meta.get("val", node.meta.get("example_value"))


_DROPOUTS = (torch.nn.functional.dropout, torch.dropout)


def autocast_of(v: Any) -> Optional[torch.dtype]:
    """The dtype torch.autocast casts to on the device of tensor `v`, None where it is off. A graph
    runs under the autocast it was captured under (Dynamo guards on it), so the passes read it
    while they rewrite: what they put in its place must cast as autocast did."""
    if not isinstance(v, torch.Tensor) or not torch.is_autocast_enabled(v.device.type):
        return None
    return torch.get_autocast_dtype(v.device.type)


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """(device type, dtype) of each torch.autocast on now: what a graph captured now runs under."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))


def under_autocast(state: tuple[tuple[str, torch.dtype], ...]) -> contextlib.ExitStack:
    """The autocast of `autocast_state()` entered again (a graph traced later, as it was captured)."""
    stack = contextlib.ExitStack()
    for device, dtype in state:
        stack.enter_context(torch.autocast(device, dtype=dtype))
    return stack


def cast_value(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fake value of `v.to(dtype)` for a node a pass inserts: in v's fake mode, needing a
    gradient where v does (what reads the graph's outputs tells a loss by it)."""
    with v.fake_mode:
        out = v.to(dtype)
    return out.requires_grad_(True) if v.requires_grad and not out.requires_grad else out


def dropout_is_identity(n: fx.Node) -> bool:
    """A dropout node (F.dropout, torch.dropout, native_dropout) with p=0 or training=False."""
    p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
    train = n.args[2] if len(n.args) > 2 else n.kwargs.get("training", n.kwargs.get("train", True))
    return p == 0 or train is False


def _strippable(n: fx.Node) -> bool:
    """An out-of-place dropout call that returns its input (strip_identity_dropout removes it)."""
    if n.op != "call_function" or n.target not in _DROPOUTS:
        return False
    inplace = n.args[3] if len(n.args) > 3 else n.kwargs.get("inplace", False)
    return dropout_is_identity(n) and inplace is False and isinstance(n.args[0], fx.Node)


OWNED = "tailorfx_owned"      # GraphModule attribute: name -> object its code needs at run time


def clone(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy whose graph can be mutated without touching `gm` (node meta is shared, read-only);
    it owns what `gm` owns."""
    g = fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    copy = fx.GraphModule(gm, g)
    if OWNED in gm.__dict__:
        copy.__dict__[OWNED] = dict(gm.__dict__[OWNED])
    return copy


def own(gm: fx.GraphModule, name: str, obj: Any) -> None:
    """Make `gm` own `obj`, which its code reaches by `name` at run time (a region token_chunked
    runs by key): the object lives as long as the graph, and copies made by clone() own it too."""
    gm.__dict__.setdefault(OWNED, {})[name] = obj


def owned(gm: fx.GraphModule) -> dict:
    """What `gm` owns, by name."""
    return dict(gm.__dict__.get(OWNED, {}))


def without_identity_dropout(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm`, or a copy of it without the dropouts that return their input, for the memory model
    (memory.trace_step): eager dropout(p=0) is its input, traced it is a copy and a mask. A copy,
    since `gm` may be Dynamo's cached graph, which runs as it is."""
    if not any(_strippable(n) for n in gm.graph.nodes):
        return gm
    gm = clone(gm)
    strip_identity_dropout(gm)
    return gm


def strip_identity_dropout(gm: fx.GraphModule) -> int:
    """Remove dropouts that return their input (p=0, or training=False), in place; returns how many.

    Eager dropout(p=0) returns its input, but traced by AOTAutograd it becomes native_dropout: an
    output copy and a mask saved for backward (Gemma-2's eager attention: S x S per layer)."""
    removed = 0
    for n in list(gm.graph.nodes):
        if _strippable(n):
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
            removed += 1
    if removed:
        gm.recompile()
    return removed


def with_eager_grouped_mm(gm: fx.GraphModule) -> fx.GraphModule:
    """The graph with eager's MoE kernel back (a copy; `gm` itself if there is nothing to swap).

    transformers runs a MoE layer's experts with torch's grouped_mm in eager, but while Dynamo
    traces it with weights other than bf16 it calls its own fallback (an opaque custom op looping
    over the experts, a .tolist() sync first), written for Inductor, which cannot compile
    grouped_mm in fp32 (neither can AOTAutograd trace it: its meta kernel wants bf16). A graph
    run as captured, under eager autograd, can run eager's op with the same arguments: the same
    kernel and numbers as eager, 10% less time than the fallback on a small Mixtral step. Only
    that lowering gets it; the memory model traces the fallback, which holds the same bytes."""
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None)
    hits = [n.name for n in gm.graph.nodes if n.op == "call_function"
            and compat.op_qualified_name(n.target) == "transformers::grouped_mm_fallback"]
    if grouped_mm is None or not hits:
        return gm
    out = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    for n in out.graph.nodes:
        if n.name in hits:     # grouped_mm takes offs by keyword only
            n.target = grouped_mm
            if len(n.args) > 2:
                n.args, n.kwargs = n.args[:2], {**n.kwargs, "offs": n.args[2]}
    out.recompile()
    return out


def pin_to_model(gm: fx.GraphModule, example_inputs: list, seq_dim: int = 1, inference: bool = False) -> list[str]:
    """Make a Dynamo graph what optimize() would capture for this model, whatever was compiled
    before it: symbolic in the sequence length, the model's own values constant.

    transformers' models share one forward code object, so after a model of another size or
    `rms_norm_eps` Dynamo's automatic dynamic turns that model's float attributes into tensors
    (whose `.item()` no pass can see through) and its buffers' sizes into symbols; a first
    torch.compile call is static, and a static graph tells the sequence dim from a hidden dim of
    the same size by nothing. So: tensorified floats make Dynamo trace the frame again with them
    constant, and (B, S) / (B, S, H) inputs with a static S are marked dynamic there and traced
    again (both raise Dynamo's restart, as its own tensorify pass does; asked once each). Their
    lengths, where Dynamo gave each input a symbol of its own, are guarded equal (one sequence
    symbol, as Dynamo's duck sizing gives a fresh process). Every other size symbol (the model's
    own sizes, a batch size that changed) is pinned to its value with a guard, as in a process
    that compiled nothing before; an int passed in the call (e.g. `num_items_in_batch`) stays as
    Dynamo made it (pinned, every new value would compile again). In an `inference` graph (grad
    off: generate()'s decode steps, whose KV cache grows a token a call) the inputs' sizes stay
    as Dynamo made them: pinned, each step would compile again.
    Returns the pinned symbols' names.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    floats = compat.tensorified_float_names(placeholders)
    if floats:
        compat.restart_with_floats_specialized(floats)
    user = [(n, t) for n, t in zip(placeholders, example_inputs) if not compat.is_model_state_input(n)]
    static_seq = [t for n, t in user if _is_sequence_input(t, seq_dim)
                  and isinstance(node_value(n).shape[seq_dim], int) and seq_dim not in compat.marked_dynamic(t)]
    if static_seq:
        for t in static_seq:
            compat.maybe_mark_dynamic(t, seq_dim)
        compat.restart_tracing()
    lengths = [node_value(n).shape[seq_dim] for n, t in user if _is_sequence_input(t, seq_dim)]
    compat.specialize_equal(lengths)
    keep = {compat.sym_expr(length) for length in lengths}
    keep |= {compat.sym_expr(node_value(n)) for n, _ in user
             if isinstance(node_value(n), torch.SymInt) and not compat.is_size_input(n)}
    if inference:
        keep |= {compat.sym_expr(size) for n, _ in user if isinstance(node_value(n), torch.Tensor)
                 for size in node_value(n).shape}
    pinned = []
    for n in placeholders:
        v = node_value(n)
        for size in [v] if isinstance(v, torch.SymInt) else list(v.shape) if isinstance(v, torch.Tensor) else []:
            e = compat.sym_expr(size)
            if isinstance(e, sympy.Symbol) and e not in keep and size.node.hint is not None:
                compat.specialize_symint(size)
                pinned.append(str(e))
        if isinstance(v, torch.SymInt) and compat.sym_expr(v).is_Integer:   # a pinned size input: its value
            _replace_uses(n, int(compat.sym_expr(v)))
    if pinned:
        gm.recompile()
    return pinned


def _replace_uses(node: fx.Node, value: Any) -> None:
    """Every use of `node` in its users' arguments replaced by the constant `value`."""
    def swap(a):
        return value if a is node else a
    for user in list(node.users):
        user.args = compat.tree_map(swap, user.args)
        user.kwargs = compat.tree_map(swap, user.kwargs)


# the Depth a capture's blocks stand for, while sizing captures a shallower copy (rewrite/depth.py)
STANDS_FOR: contextvars.ContextVar = contextvars.ContextVar("tailorfx_stands_for", default=None)


def seq_info(gm: fx.GraphModule, seq_len: Optional[int]) -> SeqInfo:
    """Find the sequence symbol: the SymInt placeholder whose hint equals the example length."""
    fake_mode = compat.own_fake_mode(node_value(n) for n in gm.graph.nodes if n.op == "placeholder")
    hints = compat.shape_env_hints(fake_mode) if fake_mode is not None else {}
    # The symbol most of the graph's tensors are sized by: inputs of the same length (ids, labels,
    # a padding mask) may each get a symbol of their own.
    counts: dict = {}
    for n in gm.graph.nodes:
        v = node_value(n)
        if isinstance(v, torch.Tensor):
            for d in v.shape:
                e = compat.sym_expr(d)
                if isinstance(e, sympy.Symbol) and (seq_len is None or hints.get(e) == seq_len):
                    counts[e] = counts.get(e, 0) + 1
    symbol = max(counts, key=counts.get) if counts else None
    for n in gm.graph.nodes:
        v = node_value(n)
        if symbol is None and n.op == "placeholder" and isinstance(v, torch.SymInt):
            e = compat.sym_expr(v)
            if isinstance(e, sympy.Symbol) and (seq_len is None or hints.get(e) == seq_len):
                symbol = e
    if symbol is not None and seq_len is None:
        seq_len = int(hints.get(symbol, 0))
    if symbol is None and seq_len is None:   # a static capture through torch.compile: the ids' length
        ids = [v for n in gm.graph.nodes if n.op == "placeholder" and isinstance(v := node_value(n), torch.Tensor)
               and v.dim() == 2 and not v.is_floating_point() and isinstance(v.shape[1], int)]
        seq_len = int(ids[0].shape[1]) if ids else None
    return SeqInfo(symbol=symbol, length=int(seq_len or 0), hints=hints, depth=STANDS_FOR.get())


@dataclass
class Captured:
    """One Dynamo subgraph as the backend received it."""
    gm: fx.GraphModule
    example_inputs: list
    seq: SeqInfo


def capture_graphs(model: torch.nn.Module, args: tuple = (), kwargs: Optional[dict] = None,
                   seq_dim: int = 1, static: bool = False) -> tuple[list[Captured], Any]:
    """Run `model` once through Dynamo with a recording backend; return the subgraphs and output.

    Works under a FakeTensorMode too (a model built there costs no memory), which is how very large
    configs are analysed on a small machine. static=True: for analyses that do not need the
    sequence symbol, a capture with static shapes (about 2x faster) on the inputs cut to
    distinct_length_inputs' length; symbolic as above when there is none.
    """
    kwargs = dict(kwargs or {})
    short = distinct_length_inputs(model, args, kwargs, seq_dim) if static else None
    if short is not None:
        seq_len, args, kwargs = short
        ran, out = run_recorded(model, args, kwargs)
        return [Captured(gm, inputs, seq_info(gm, seq_len)) for gm, inputs in ran], out
    seq_len = mark_sequence_dims(args, kwargs, seq_dim)
    graphs: list[Captured] = []

    def record(gm: fx.GraphModule, example_inputs: list) -> Callable:
        pin_to_model(gm, example_inputs, seq_dim)
        graphs.append(Captured(gm, list(example_inputs), seq_info(gm, seq_len)))
        return gm.forward

    # a backend of its own: no cached graph (whose symbols would carry another call's lengths) matches it
    with compat.capture_config():
        out = compat.compile_apart(model, backend=record, dynamic=None)(*args, **kwargs)
    return graphs, out


def run_recorded(model: torch.nn.Module, args: tuple = (), kwargs: Optional[dict] = None,
                 fullgraph: bool = False) -> tuple[list[tuple[fx.GraphModule, list]], Any]:
    """Run `model` once through Dynamo with static shapes and a recording backend; return the
    graphs that ran (each once, in order, with this call's inputs) and the output.

    Nothing is reset (that would drop the user's compiled frames too): a model Dynamo's guards
    find the same as one run before (another instance of a config, at the same shapes) reuses its
    graph without tracing again, and its own parameters are the inputs recorded. Past Dynamo's
    recompile limit, when no graph ran, or (fullgraph) when the cached frames are not one graph,
    it traces afresh with a backend no cached frame was compiled for (in a region of its own).
    """
    kwargs = dict(kwargs or {})

    def run(backend: Callable, apart: bool = False) -> Any:
        _RAN.clear()
        with compat.capture_config(), compat.fail_on_recompile_limit():
            compile_ = compat.compile_apart if apart else torch.compile
            return compile_(model, backend=backend, dynamic=False, fullgraph=fullgraph)(*args, **kwargs)
    def afresh_run() -> Any:     # a new backend object: no cached frame was compiled for it
        return run(lambda gm, example_inputs: _record_runs(gm, example_inputs), apart=True)
    if _ISOLATED:
        return _unique(afresh_run())
    try:
        out = run(_record_runs)
        # cached frames of a capture with graph breaks; or none ran: Dynamo runs the frame eagerly
        # in the default region once a compile there (the user's) has hit its recompile limit
        afresh = not _RAN or (fullgraph and len({id(gm) for gm, _ in _RAN}) != 1)
    except compat.FailOnRecompileLimitHit:
        afresh = True
    except RuntimeError as e:   # fullgraph, the frame run eagerly there: Dynamo says it compiled nothing
        if not compat.compiled_no_frames(e):
            raise
        afresh = True
    if afresh:
        out = afresh_run()
    return _unique(out)


def _unique(out: Any) -> tuple[list[tuple[fx.GraphModule, list]], Any]:
    """The graphs recorded (each once, in order) and the call's output."""
    seen, ran = set(), []
    for gm, inputs in _RAN:
        if id(gm) not in seen:
            seen.add(id(gm))
            ran.append((gm, inputs))
    _RAN.clear()
    return ran, out


@contextlib.contextmanager
def isolated_captures():
    """run_recorded inside traces in a compile region of its own (compat.compile_apart), never in
    Dynamo's default one: a prediction's many captures of fake copies
    (plan_world's layouts) would fill the recompile limit that a user's own torch.compile of the
    same model class meets there, and Dynamo would then run the user's model eagerly, unseen."""
    global _ISOLATED
    _ISOLATED += 1
    try:
        yield
    finally:
        _ISOLATED -= 1


_RAN: list = []
_ISOLATED = 0


def _record_runs(gm: fx.GraphModule, example_inputs: list) -> Callable:
    """run_recorded's Dynamo backend, one for every capture (a new one per call would never match
    Dynamo's cache): the graph runs as it is and each run records it with that call's inputs."""
    def run(*args):
        _RAN.append((gm, list(args)))
        return gm.forward(*args)
    return run


def graph_device(gm: fx.GraphModule) -> torch.device:
    """Where a captured graph runs: the device of its first tensor input not on the CPU, else the CPU."""
    for n in gm.graph.nodes:
        v = node_value(n) if n.op == "placeholder" else None
        if isinstance(v, torch.Tensor) and v.device.type != "cpu":
            return v.device
    return torch.device("cpu")
