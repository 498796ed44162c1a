"""What a chunked region costs inside its op: bytes per token a chunk holds in forward and in
backward (the backward measured by running the runtime's own chunk backward on fake tensors), so
the memory model sees the transients the graph cannot show.
"""
from __future__ import annotations

import collections
import math
from typing import Callable, Hashable, Optional

import torch
import torch.fx as fx

from tailorfx import compat
from tailorfx.passes.minisequence.chunks import NAME
from tailorfx.rewrite import match
from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.passes import PassContext
from tailorfx.runtime import ops

# ((bytes per token, constant bytes, first token), ...): a chunk of t tokens holds p * t + c of the
# last line whose first token is at most t
Lines = tuple
ENVELOPE_TOKENS = 16384   # backward costs sampled up to chunks of this many tokens (past it: the last line)
MIN_TOKENS = 64           # and down to this many (below it: the first line)
# held(n) samples kept per process by what they depend on (the region's structure, the concrete
# shapes at n): a model planned again, at another length or budget, or another model with blocks
# like it, simulates no chunk backward twice. Plain tuples of ints and strings: they hold no graph.
_SAMPLES: collections.OrderedDict = collections.OrderedDict()
_SAMPLES_SIZE = 4096


def hint_tokens(t, seq_dim: int, ctx: PassContext) -> int:
    """Tokens (batch x sequence positions) a (B, S, ...) fake tensor holds at the captured length."""
    shape = [int(compat.sym_expr(d).xreplace(ctx.seq.hints)) for d in t.shape[:seq_dim + 1]]
    return max(1, math.prod(shape))


def region_cost(members: list[fx.Node], out, ctx: PassContext, tokens: int) -> tuple[float, float]:
    """(`out`: the output node, or a set of them.) Per-token bytes a chunk holds inside the op: the most live at once in forward (a storage is
    freed after the last use of any view of it), and in backward all intermediates (saved by the
    recompute) plus the largest gradient pair alive while they are consumed. Views (chunk, getitem,
    view, a same-dtype .float()) allocate nothing: aliasing is read from the fake values."""
    index = {n: i for i, n in enumerate(members)}
    root: dict[fx.Node, fx.Node] = {}
    sizes: dict[fx.Node, int] = {}
    for n in members:
        base = next((a for a in n.all_input_nodes if _shares_storage(n, a)), None)
        root[n] = root.get(base, base) if base is not None else n
        if root[n] is n:
            sizes[n] = sum(hint_bytes(v, ctx) for v in match.tensors_in(node_value(n)))
    last: dict[fx.Node, int] = {}
    for n in members:
        r = root[n]
        last[r] = max(last.get(r, index[n]), *(index.get(u, len(members)) for u in n.users))
    kept = {root[o] for o in (out if isinstance(out, (set, list, tuple)) else [out])}   # the outputs
    live, peak, total, largest = 0, 0, 0, 0
    for i, n in enumerate(members):
        if root[n] is n:
            live += sizes[n]
            total += sizes[n]
            largest = max(largest, sizes[n])
        peak = max(peak, live)
        for r in {root[a] for a in n.all_input_nodes if a in index}:
            if r in sizes and last[r] <= i and r not in kept:
                live -= sizes.pop(r)
    return peak / tokens, (total + 2 * largest) / tokens


def cached_backward_cost(chunked: ops.ChunkedRegion, sub: fx.GraphModule, ctx: PassContext,
                         tokens: int) -> Optional[Lines]:
    """_simulated_backward_cost, memoised in ctx.memo by the region's structure: the planner runs
    this pass once per candidate plan, and every block of a model has a region like it."""
    skey = structure_key(sub)
    vals = [node_value(n) for n in sub.graph.nodes if n.op == "placeholder"]
    memo = (NAME, "backward_cost", skey, _values_key(vals), str(ctx.seq.symbol), ctx.seq.length, tokens,
            runs_on_cpu(ctx, [v for v in vals if isinstance(v, torch.Tensor)]))
    if memo not in ctx.memo:
        ctx.memo[memo] = _simulated_backward_cost(sub, chunked.tail, ctx, tokens, skey, chunked.heads)
    return ctx.memo[memo]


def _simulated_backward_cost(sub: fx.GraphModule, tail, ctx: PassContext,
                             tokens: int, skey: str, heads=None) -> Optional[Lines]:
    """The bytes one chunk holds in backward, as lines (_cost_lines): the runtime's own chunk
    backward (ops.region_chunk_grads: the chunk's contiguous copies, the recompute, what eager
    autograd saves, the grads) run on fake tensors under memory.LiveBytes, at the captured length
    halved and doubled, so weight-sized transients are not scaled with the chunk. None when the
    region cannot run alone on fake tensors."""
    from tailorfx.rewrite import memory
    phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    vals = [node_value(n) for n in phs]
    length = ctx.seq.length
    if not length or not all(isinstance(v, torch.Tensor) for v in vals) or len(ctx.seq.dims(vals[0])) != 1:
        return None
    seq_dim = ctx.seq.dims(vals[0])[0]
    on_cpu = runs_on_cpu(ctx, vals)

    def shape(v, seq_len):
        if ctx.seq.symbol is None:   # a static capture (pipeline stages): only the chunked input has the length
            return [int(d) * seq_len // length if v is vals[0] and i == seq_dim else int(d) for i, d in enumerate(v.shape)]
        subs = {**ctx.seq.hints, ctx.seq.symbol: seq_len}
        return [int(compat.sym_expr(d).xreplace(subs)) for d in v.shape]

    def held(seq_len) -> int:
        with compat.FakeTensorMode():
            # what needs a gradient as the step has it: a frozen weight (LoRA's base) gets none
            x, *whole = [torch.empty(shape(v, seq_len), dtype=v.dtype).requires_grad_(v.requires_grad and
                                                                                     v.is_floating_point())
                         for v in vals]
            with torch.no_grad():
                go = sub(x, *whole)
            seq_grad = [torch.empty_like(x) if x.requires_grad else None]
            acc = [torch.zeros_like(w, dtype=ops.acc_dtype(w)) if w.requires_grad else None for w in whole]
            # a chunk is copied (.contiguous()) unless every dim before the sequence dim is 1
            copied = any(d != 1 for d in x.shape[:seq_dim])
            with torch.enable_grad(), memory.LiveBytes(cpu_scratch=on_cpu) as live:
                xc = x.detach().clone() if copied else x.detach()
                ops.region_chunk_grads(sub, [xc.requires_grad_(x.requires_grad)], whole,
                                       go.clone() if copied else go, seq_grad, acc, tail, heads)
            return live.peak
    tail_key = None if tail is None else (
        (structure_key(tail[0]), *tail[1:]) if isinstance(tail[0], fx.GraphModule) else False)
    base = None if tail_key is False else ("region", skey, tail_key, seq_dim)
    return _cost_lines(_kept(base, vals, shape, held, on_cpu), length, tokens)


def _cost_lines(held: Callable[[int], int], length: int, tokens: int) -> Optional[Lines]:
    """The backward's bytes as lines (bytes per token, constant bytes, first token), one through
    each pair of neighbouring samples of `held` at the captured length halved down to MIN_TOKENS
    tokens and doubled up to ENVELOPE_TOKENS; a chunk of t tokens holds the line of the samples t
    lies between, the outermost lines extended beyond them (chunk_memory.transient_bytes): exact at
    the samples. `held` is mostly the most of a few phases each linear in the tokens (the weight
    gradients' phase at small chunks, the activations' at large ones), a convex function, which
    each line bounds from above between its samples (one line through two small samples, extended,
    fell 16% under at 512-token chunks); a 16-bit matmul's oneDNN scratch grows with its rows up to
    a few hundred and then stays, so a line through smaller samples extended past them ran 1.2% over
    a whole fp16 step, and each line holds between its own samples only. None when `held` cannot
    run (the estimate by hand, region_cost, stands in)."""
    lengths = [length]
    while lengths[0] % 2 == 0 and lengths[0] // 2 * tokens // length >= MIN_TOKENS:   # shorter chunks too
        lengths.insert(0, lengths[0] // 2)
    while lengths[-1] * tokens // length < ENVELOPE_TOKENS or len(lengths) < 2:
        lengths.append(2 * lengths[-1])
    try:
        samples = [(n * tokens // length, held(n)) for n in lengths]
    except Exception:
        return None
    lines = []
    for (t1, b1), (t2, b2) in zip(samples, samples[1:]):
        per_token = max(0.0, (b2 - b1) / (t2 - t1))
        line = (per_token, max(0.0, b1 - per_token * t1), t1 if lines else 0)
        if not lines or lines[-1][:2] != line[:2]:
            lines.append(line)
    return tuple(lines)


def cached_segment_backward_cost(chunked: ops.ChunkedRegion, sub: fx.GraphModule, xs, whole, x_dims,
                                 ctx: PassContext, tokens: int) -> Optional[Lines]:
    """The bytes one chunk of a token segment holds in backward, as lines: the runtime's own
    ops.segment_chunk_grads run on fake tensors under memory.LiveBytes at the captured length
    halved and doubled (memoised like cached_backward_cost, with its inputs' shapes). None when it
    cannot run."""
    from tailorfx.rewrite import memory
    xvs, wvs = [node_value(x) for x in xs], [node_value(w) for w in whole]
    skey = structure_key(sub)
    memo = (NAME, "segment_backward_cost", skey, tuple(x_dims), _values_key(xvs + wvs),
            str(ctx.seq.symbol), ctx.seq.length, tokens, runs_on_cpu(ctx, xvs))
    if memo in ctx.memo:
        return ctx.memo[memo]
    length = ctx.seq.length
    ctx.memo[memo] = None
    if not length or ctx.seq.symbol is None:
        return None
    on_cpu = runs_on_cpu(ctx, xvs)

    def shape(v, seq_len):
        subs = {**ctx.seq.hints, ctx.seq.symbol: seq_len}
        return [int(compat.sym_expr(d).xreplace(subs)) for d in v.shape]

    def held(seq_len) -> int:
        with compat.FakeTensorMode():
            x = [torch.empty(shape(v, seq_len), dtype=v.dtype).requires_grad_(v.requires_grad and v.is_floating_point())
                 for v in xvs]
            w = [torch.empty(shape(v, seq_len), dtype=v.dtype).requires_grad_(v.requires_grad and v.is_floating_point())
                 for v in wvs]
            with torch.no_grad():
                ys = sub(*x, *w)
            grads = [torch.empty_like(y) for y in ys]
            seq_grads = [torch.empty_like(t) if t.requires_grad else None for t in x]
            acc = [torch.zeros_like(t, dtype=ops.acc_dtype(t)) if t.requires_grad else None for t in w]
            with torch.enable_grad(), memory.LiveBytes(cpu_scratch=on_cpu) as live:
                # each chunk is a .contiguous() copy unless every dim before its sequence dim is 1
                xc = [t.detach().clone() if any(d != 1 for d in t.shape[:dim]) else t.detach()
                      for t, dim in zip(x, x_dims)]
                ops.segment_chunk_grads(sub, [c.requires_grad_(t.requires_grad) for c, t in zip(xc, x)], w,
                                        [g.clone() for g in grads], seq_grads, acc)
            return live.peak
    base = ("segment", skey, tuple(x_dims), len(xvs))
    ctx.memo[memo] = _cost_lines(_kept(base, xvs + wvs, shape, held, on_cpu), length, tokens)
    return ctx.memo[memo]


def runs_on_cpu(ctx: PassContext, vals: list) -> bool:
    """Whether a chunk's backward runs on the CPU, and so holds a 16-bit matmul's oneDNN scratch:
    a CPU model not planned for a GPU budget (the setup's device). Its costs run on CPU fake
    tensors whatever the model's device."""
    setup = ctx.options.get("setup")
    return all(v.device.type == "cpu" for v in vals) and getattr(setup, "device", None) is None


def _kept(base: Optional[Hashable], vals: list, shape: Callable, held: Callable[[int], int],
          on_cpu: bool) -> Callable[[int], int]:
    """`held`, its samples kept per process (_SAMPLES) under `base` (what the region computes) and
    the concrete shape, dtype and requires_grad each input takes at the length, and on the CPU
    (`on_cpu`) the intra-op threads: all a sample reads.
    `base` None: not kept. The samples run on CPU fake tensors with autocast off, as the compiled
    graph runs the op (a region captured under autocast enters it itself: extract.py)."""
    def quiet(n: int) -> int:
        with torch.autocast("cpu", enabled=False):
            return held(n)
    if base is None:
        return quiet

    def sample(n: int) -> int:
        # a CPU sample holds oneDNN's matmul scratch, sized for the intra-op threads
        key = (base, n, on_cpu and torch.get_num_threads(),
               tuple((tuple(shape(v, n)), str(v.dtype), v.requires_grad) for v in vals))
        if key in _SAMPLES:
            _SAMPLES.move_to_end(key)
            return _SAMPLES[key]
        _SAMPLES[key] = got = quiet(n)
        if len(_SAMPLES) > _SAMPLES_SIZE:
            _SAMPLES.popitem(last=False)
        return got
    return sample


def _shares_storage(n: fx.Node, a: fx.Node) -> bool:
    """A tensor of n's value is a view of (shares storage with) a tensor of a's value."""
    mine = {t.untyped_storage()._cdata for t in match.tensors_in(node_value(n))}
    return any(t.untyped_storage()._cdata in mine for t in match.tensors_in(node_value(a)))


def hint_bytes(t, ctx: PassContext) -> int:
    """Bytes of a fake tensor at the captured sequence length."""
    if not isinstance(t, torch.Tensor):
        return 0
    e = compat.sym_expr(t.numel()).xreplace({k: v for k, v in ctx.seq.hints.items()})
    try:
        return int(e) * t.element_size()
    except TypeError:
        return 0


def structure_key(gm: fx.GraphModule) -> str:
    """A hash of what a region computes, blind to its nodes' names (each block of a model names its
    own): every op with its arguments by position, the shapes, dtypes and strides it recorded, and
    its attributes' (a tensor's shape and dtype, a subgraph's structure). Equal keys run the same
    ops on the same fake shapes, so a cost simulated for one block holds for every block like it:
    a 32-layer model's segments are costed once, not 32 times."""
    import hashlib
    index: dict[fx.Node, int] = {}
    h = hashlib.sha256()
    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{index[a]}")
        if n.op == "get_attr":
            attr = gm
            for part in str(n.target).split("."):
                attr = getattr(attr, part)
            target = (structure_key(attr) if isinstance(attr, fx.GraphModule)
                      else _values_key([attr]) if isinstance(attr, torch.Tensor) else repr(attr))
        elif n.op == "call_function":
            target = f"{getattr(n.target, '__module__', '')}.{getattr(n.target, '__qualname__', n.target)}"
            if getattr(n.target, "__closure__", None) or not hasattr(n.target, "__qualname__"):
                target += f"@{id(n.target)}"   # a closure or partial: its captured values are part of it
        else:   # a placeholder is known by its position; a method by its name
            target = "" if n.op == "placeholder" else str(n.target)
        h.update(f"{n.op}|{target}|{args}|{_values_key(match.tensors_in(node_value(n)))}\n".encode())
    return h.hexdigest()[:24]


def _values_key(values) -> str:
    """Shapes, strides, dtypes and requires_grad of tensors, symbolic sizes as expressions."""
    def dims(ds):
        return ",".join(str(compat.sym_expr(d)) for d in ds)
    return ";".join(f"{dims(v.shape)}/{dims(v.stride())}/{v.dtype}/{int(v.requires_grad)}"
                    if isinstance(v, torch.Tensor) else repr(v) for v in values)
