"""One chunk's backward inside the chunked ops (runtime/ops.py): the chunk recomputed and
differentiated, its input gradients written into their slices and its weights' gradients summed
into accumulators. A region's final linear (ChunkedRegion.tail) and leading ones (.heads) are
differentiated by hand: the last matmul is not recomputed, and each weight's share is one GEMM
into its sum (kernels/weight_grad.py), not a weight-sized gradient from autograd added in after.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from tailorfx.kernels.weight_grad import add_weight_grad

__all__ = ["region_chunk_grads", "store_grads", "summed_in_place"]


def _linear_tail_grads(tail, a, whole, grad_out, whole_acc):
    """Grads through the region's final linear by hand, its input `a` recomputed by the caller:
    returns grad_a to backprop into pre."""
    _, wi, bi = tail
    # autocast as the region entered it (pre did), whatever the caller's: a `pre` that ran under it
    # made `a` in a lower precision than the fp32 weight, and the linear ran in a's dtype
    with torch.no_grad(), torch.autocast(a.device.type, enabled=False):
        w = whole[wi]
        low = a.dtype if a.is_floating_point() and a.dtype.itemsize < w.dtype.itemsize else None
        go2 = grad_out.reshape(-1, grad_out.shape[-1])
        if w.requires_grad:
            acc, a2 = whole_acc[wi], a.detach().reshape(-1, a.shape[-1])
            if low is None:
                add_weight_grad(acc, go2, a2)
            else:   # the chunk's product in autocast's dtype, summed in the master's
                acc.add_(go2.t().to(low) @ a2)
        if bi >= 0 and whole[bi].requires_grad:
            whole_acc[bi].add_(go2.sum(0).to(whole_acc[bi].dtype))
        # an fp32 grad_out when the linear was linear_fp32_out
        grad_a = grad_out.to(w.dtype) @ w if low is None else grad_out.to(low) @ w.to(low)
    return grad_a


def _heads_apply(heads, xs, whole) -> bool:
    """Whether the region's leading linears (ChunkedRegion.heads) can be differentiated by hand:
    not where the linear cast its operands (dtypes apart, autocast on)."""
    return (_heads_dtypes_agree(heads, [x.dtype for x in xs], [w.dtype for w in whole])
            and not torch.is_autocast_enabled(xs[0].device.type))


def _heads_dtypes_agree(heads, seq_dtypes, whole_dtypes) -> bool:
    return not any(seq_dtypes[xi] != whole_dtypes[wi] or (bi >= 0 and whole_dtypes[bi] != whole_dtypes[wi])
                   for xi, wi, bi in heads[1])


def summed_in_place(region, seq_dtypes, whole_dtypes) -> set[int]:
    """Indices of the whole inputs whose gradients a chunk's backward sums into their accumulators
    itself (the tail's, the heads' where they apply): autograd makes no per-chunk gradient of
    them (the memory model's pipeline walk: parallel/profile.py)."""
    tail, heads = region.tail, region.heads
    if tail is None:
        return set()
    done = {i for i in tail[1:] if i >= 0}
    if heads is not None and _heads_dtypes_agree(heads, seq_dtypes, whole_dtypes):
        done |= _taken(heads[1])
    return done


def _head_grads(specs, grads_h, xs, whole, whole_acc) -> list[Optional[Tensor]]:
    """Each leading linear's weight (and bias) gradient summed into whole_acc in one GEMM, no
    weight-sized temporary; returns the gradient each seq input gets through them."""
    grad_x: list[Optional[Tensor]] = [None] * len(xs)
    with torch.no_grad():
        for (xi, wi, bi), g in zip(specs, grads_h):
            if g is None:
                continue
            x, w = xs[xi], whole[wi]
            g2 = g.reshape(-1, g.shape[-1])
            if w.requires_grad:
                add_weight_grad(whole_acc[wi], g2, x.detach().reshape(-1, x.shape[-1]))
            if bi >= 0 and whole[bi].requires_grad:
                whole_acc[bi].add_(g2.sum(0).to(whole_acc[bi].dtype))
            if x.requires_grad:   # several heads on one input (gate, up): summed by the GEMM
                grad_x[xi] = g @ w if grad_x[xi] is None else grad_x[xi].view(-1, w.shape[1]).addmm_(g2, w).view(
                    grad_x[xi].shape)
    return grad_x


def store_grads(grads, xs, seq_grads, whole, whole_acc) -> None:
    """One chunk's grads (of the inputs that require them, in order) written into its slices of
    seq_grads and added into whole_acc."""
    grads = iter(grads)
    for x, out in zip(xs, seq_grads):
        if x.requires_grad:
            g = next(grads)
            out.copy_(g) if g is not None else out.zero_()
    for w, acc in zip(whole, whole_acc):
        if w.requires_grad and (g := next(grads)) is not None:
            acc.add_(g)


def region_chunk_grads(fn, xs, whole, grad_out, seq_grads, whole_acc, tail=None, heads=None):
    """Recompute one chunk and backprop it: writes seq_grads, adds into whole_acc. With a `tail`
    (ChunkedRegion.tail), the region's final linear is differentiated by hand, not recomputed;
    with `heads` too, so are its leading ones (their weight gradients summed in place).

    A call per chunk, so the chunk's activations and grads die before the next chunk starts.
    """
    if heads is None or tail is None or not _heads_apply(heads, xs, whole):
        wrt = [t for t in (*xs, *whole) if t.requires_grad]
        out = fn(*xs, *whole) if tail is None else tail[0](*xs, *whole)
        if tail is not None:
            grad_out = _linear_tail_grads(tail, out, whole, grad_out, whole_acc)
        store_grads(torch.autograd.grad(out, wrt, grad_out, allow_unused=True), xs, seq_grads, whole, whole_acc)
        return
    store_grads(_heads_tail_grads(heads, tail, xs, whole, grad_out, whole_acc), xs, seq_grads,
                [w.detach() if i in _taken(heads[1]) else w for i, w in enumerate(whole)], whole_acc)


def _taken(specs) -> set[int]:
    return {i for _, wi, bi in specs for i in (wi, bi) if i >= 0}


def _heads_tail_grads(heads, tail, xs, whole, grad_out, whole_acc) -> list[Optional[Tensor]]:
    """The chunk's backward with its leading linears' outputs as inputs of `core`, computed here
    without autograd: the grads store_grads reads (xs', then the other weights'), the leading
    weights' summed into whole_acc."""
    core, specs = heads
    with torch.no_grad():
        hs = [torch.nn.functional.linear(xs[xi], whole[wi], whole[bi] if bi >= 0 else None).requires_grad_()
              for xi, wi, bi in specs]
    rest = [w.detach() if i in _taken(specs) else w for i, w in enumerate(whole)]
    a = core(*xs, *rest, *hs)
    grad_a = _linear_tail_grads(tail, a, whole, grad_out, whole_acc)
    wrt = [t for t in (*xs, *rest) if t.requires_grad] + hs
    grads = list(torch.autograd.grad(a, wrt, grad_a, allow_unused=True))
    del a, grad_a, hs   # the chunk's activations: gone before the weight GEMMs
    num_own = len(grads) - len(specs)
    through = _head_grads(specs, grads[num_own:], xs, whole, whole_acc)
    own, merged = iter(grads[:num_own]), []
    for x, gx in zip(xs, through):
        if x.requires_grad:
            g = next(own)
            merged.append(gx if g is None else g if gx is None else gx.add_(g))
    return merged + list(own)
