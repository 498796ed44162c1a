"""Reattach the gradient path of outputs a compiled graph returned detached (rewrite/lazy_outputs.py).

The autograd node does nothing unless a gradient reaches the output (autograd then never calls
it, and nothing is materialised); when one does, it recomputes the output's head chain from the
saved chain input and parameters and backpropagates through it, so the result is exact.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch


class _LazyVJP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, chain: Callable, value: torch.Tensor, anchor: torch.Tensor, *params: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.chain = chain
        ctx.save_for_backward(anchor, *params)
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        if grad is None:
            return (None, None) + (None,) * len(saved)
        needs = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(need) for t, need in zip(saved, needs)]
            out = ctx.chain(*inputs)
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return (None, None) + tuple(next(grads) if t.requires_grad else None for t in inputs)


def reattach(outs: Sequence, args: Sequence, lazy: Sequence, num_outputs: int) -> list:
    """The graph's outputs as the model returns them: lazy ones given their gradient path back,
    the extra chain inputs dropped."""
    outs = list(outs)
    for lz in lazy:
        value, anchor = outs[lz.index], outs[lz.anchor_index]
        params = [args[i] for i in lz.param_indices]
        if torch.is_grad_enabled() and (anchor.requires_grad or any(p.requires_grad for p in params)):
            outs[lz.index] = _LazyVJP.apply(lz.chain, value, anchor, *params)
    return outs[:num_outputs]
