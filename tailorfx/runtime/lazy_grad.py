"""Reattach the gradient path of outputs a compiled graph returned detached (rewrite/lazy_outputs.py).

The autograd node does nothing unless a gradient reaches the output (autograd then never calls
it, and nothing is materialised); when one does, it recomputes the output's chain from the saved
chain inputs and backpropagates through it, so the result is exact.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch


class _LazyVJP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, chain: Callable, value: torch.Tensor, *inputs):
        ctx.set_materialize_grads(False)
        ctx.chain = chain
        ctx.is_tensor = [isinstance(t, torch.Tensor) for t in inputs]
        ctx.others = [None if is_t else t for t, is_t in zip(inputs, ctx.is_tensor)]
        ctx.save_for_backward(*[t for t in inputs if isinstance(t, torch.Tensor)])
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        n = len(ctx.is_tensor)
        if grad is None:
            return (None, None) + (None,) * n
        saved = iter(ctx.saved_tensors)
        needs = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            inputs = [next(saved).detach().requires_grad_(need) if is_t else other
                      for is_t, other, need in zip(ctx.is_tensor, ctx.others, needs)]
            out = ctx.chain(*inputs)
            wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return (None, None) + tuple(next(grads) if isinstance(t, torch.Tensor) and t.requires_grad else None
                                    for t in inputs)


def reattach(outs: Sequence, args: Sequence, lazy: Sequence, num_outputs: int) -> list:
    """The graph's outputs as the model returns them: lazy ones given their gradient path back,
    the extra chain inputs dropped."""
    outs = list(outs)
    for lz in lazy:
        inputs = ([outs[lz.anchor_index]] if lz.anchor_index is not None else []) + \
            [args[i] for i in lz.input_indices]
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
            outs[lz.index] = _LazyVJP.apply(lz.chain, outs[lz.index], *inputs)
    return outs[:num_outputs]
