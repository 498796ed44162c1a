"""One chunk's backward inside the chunked ops (runtime/ops.py): the chunk recomputed and
differentiated, its input gradients written into their slices and its weights' gradients summed
into accumulators. A region's final linear (ChunkedRegion.tail) is differentiated by hand: the
last matmul is not recomputed, and its weight's share is one GEMM into its sum
(kernels/weight_grad.py).
"""
from __future__ import annotations

import torch

from tailorfx.kernels.weight_grad import add_weight_grad

__all__ = ["region_chunk_grads", "store_grads"]


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


def region_chunk_grads(fn, xs, whole, grad_out, seq_grads, whole_acc, tail=None):
    """Recompute one chunk and backprop it: writes seq_grads, adds into whole_acc. With a `tail`
    (ChunkedRegion.tail), the region's final linear is differentiated by hand, not recomputed, and
    its weight's gradient summed into its accumulator by one GEMM.

    A call per chunk, so the chunk's activations and grads die before the next chunk starts.
    """
    wrt = [t for t in (*xs, *whole) if t.requires_grad]
    out = fn(*xs, *whole) if tail is None else tail[0](*xs, *whole)
    if tail is not None:
        grad_out = _linear_tail_grads(tail, out, whole, grad_out, whole_acc)
    store_grads(torch.autograd.grad(out, wrt, grad_out, allow_unused=True), xs, seq_grads, whole, whole_acc)
