"""Opaque custom ops that run token-wise regions in sequence chunks (Mini-Sequence Transformer).

The ops are ``torch.library.custom_op``s with fake and autograd registrations so AOTAutograd and
Inductor keep each one as a single node: a plain-torch version would be decomposed back into the
unchunked pattern and save the full-size intermediates.

    token_chunked(key, seq_inputs, whole_inputs, seq_dim, num_chunks)      # MLP-like regions
    token_segment(key, seq_inputs, whole_inputs, in_dims, out_dims, num_chunks)   # a block's token-wise segments
    chunked_linear_cross_entropy(hidden, weight, bias, labels, ...)        # LM head + loss

and one the precision pass uses: ``linear_fp32_out`` (a bf16/fp16 matmul with an fp32 result);
those two live in runtime/linear_ops.py and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from tailorfx.compat import autograd_enabled as _autograd_enabled
from tailorfx.runtime.linear_ops import (chunked_linear_cross_entropy, linear_fp32_out, linear_fp32_out_op,  # noqa: F401
                                         loss_dtype)
from tailorfx.runtime.region_registry import (ChunkedRegion, chunked_region, enter_autocast,  # noqa: F401
                                              exit_autocast, function_apply, get_region, live_region,
                                              register_region)
from tailorfx.runtime.chunk_memory import transient_bytes  # noqa: F401  (the memory model reads it here)
from tailorfx.runtime.chunk_backward import region_chunk_grads, store_grads  # noqa: F401  (cost.py reads the first here)

__all__ = ["ChunkedRegion", "register_region", "chunked_region", "get_region", "token_chunked",
           "chunked_linear_cross_entropy", "transient_bytes", "linear_fp32_out"]


def _num_chunks(seq_inputs: Sequence[Tensor], seq_dim: int, num_chunks: int) -> int:
    if not seq_inputs:
        raise ValueError("token_chunked needs at least one sequence input to chunk")
    return max(1, min(num_chunks, seq_inputs[0].size(seq_dim)))


def acc_dtype(t: Tensor) -> torch.dtype:
    # Parameter grads summed over chunks: low-precision floats accumulate in fp32.
    return torch.promote_types(t.dtype, torch.float32) if t.is_floating_point() else t.dtype


# ---------------------------------------------------------------------------------------------
# token_chunked: a registered region run chunk by chunk along the sequence
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("tailorfx::token_chunked", mutates_args=())
def _token_chunked(
    key: str, seq_inputs: list[Tensor], whole_inputs: list[Tensor], seq_dim: int, num_chunks: int
) -> Tensor:
    """Run region ``key`` on chunks of ``seq_inputs`` and concatenate along ``seq_dim``."""
    return _run_chunks(key, seq_inputs, whole_inputs, seq_dim, num_chunks)


def _run_chunks(key: str, seq_inputs: list[Tensor], whole_inputs: list[Tensor], seq_dim: int,
                num_chunks: int) -> Tensor:
    fn = get_region(key)
    n = _num_chunks(seq_inputs, seq_dim, num_chunks)
    if n == 1:
        out = fn(*seq_inputs, *whole_inputs).contiguous()
        if any(out.untyped_storage()._cdata == t.untyped_storage()._cdata for t in
               (*seq_inputs, *whole_inputs)):
            out = out.clone()  # custom ops may not return aliases of their inputs
        return out
    chunks = [x.tensor_split(n, seq_dim) for x in seq_inputs]
    out, start = None, 0
    for i in range(n):
        # a chunk of a (B, S, ...) tensor is strided; regions may .view() it (GPT-2's Conv1D)
        y = fn(*(c[i].contiguous() for c in chunks), *whole_inputs)
        length = chunks[0][i].size(seq_dim)
        if y.size(seq_dim) != length:
            raise RuntimeError(
                f"token_chunked({key}): region changed the sequence length ({length} -> "
                f"{y.size(seq_dim)}); only token-wise regions can be chunked"
            )
        if out is None:
            shape = list(y.shape)
            shape[seq_dim] = seq_inputs[0].size(seq_dim)
            out = y.new_empty(shape)
        out.narrow(seq_dim, start, length).copy_(y)
        start += length
        del y  # else it stays alive while the next chunk runs
    return out


@_token_chunked.register_fake
def _token_chunked_fake(key, seq_inputs, whole_inputs, seq_dim, num_chunks):
    # Runs the region once on the (fake, possibly symbolic) full inputs: costs no memory, and the
    # shape follows whatever the region computes, including SymInt sequence lengths.
    with torch.no_grad():
        y = get_region(key)(*seq_inputs, *whole_inputs)
    return y.new_empty(y.shape)


@torch.library.custom_op("tailorfx::token_chunked_backward", mutates_args=())
def _token_chunked_backward(
    key: str, grad_out: Tensor, seq_inputs: list[Tensor], whole_inputs: list[Tensor],
    seq_dim: int, num_chunks: int, seq_needs_grad: list[bool], whole_needs_grad: list[bool],
) -> list[Tensor]:
    """Grads of the flagged seq then whole inputs, recomputing the region one chunk at a time."""
    return _chunk_grads(key, grad_out, seq_inputs, whole_inputs, seq_dim, num_chunks, seq_needs_grad,
                        whole_needs_grad)


def _chunk_grads(key, grad_out, seq_inputs, whole_inputs, seq_dim, num_chunks, seq_needs_grad,
                 whole_needs_grad) -> list[Tensor]:
    region = chunked_region(key)
    n = _num_chunks(seq_inputs, seq_dim, num_chunks)
    seq_grads = [torch.empty_like(x) if need else None for x, need in zip(seq_inputs, seq_needs_grad)]
    whole = [w.detach().requires_grad_(need) for w, need in zip(whole_inputs, whole_needs_grad)]
    whole_acc = [torch.zeros_like(w, dtype=acc_dtype(w)) if need else None
                 for w, need in zip(whole_inputs, whole_needs_grad)]
    seq_chunks = [x.tensor_split(n, seq_dim) for x in seq_inputs]
    grad_chunks = [g.tensor_split(n, seq_dim) if g is not None else [None] * n for g in seq_grads]
    go_chunks = grad_out.tensor_split(n, seq_dim)
    with _autograd_enabled():
        for i in range(n):
            xs = [c[i].contiguous().detach().requires_grad_(need)
                  for c, need in zip(seq_chunks, seq_needs_grad)]
            region_chunk_grads(region.fn, xs, whole, go_chunks[i].contiguous(), [g[i] for g in grad_chunks],
                               whole_acc, region.tail, region.heads)
    return [g for g in seq_grads if g is not None] + [
        acc.to(w.dtype) for acc, w in zip(whole_acc, whole_inputs) if acc is not None
    ]


@_token_chunked_backward.register_fake
def _token_chunked_backward_fake(key, grad_out, seq_inputs, whole_inputs, seq_dim, num_chunks,
                                 seq_needs_grad, whole_needs_grad):
    return [torch.empty_like(x) for x, need in zip(seq_inputs, seq_needs_grad) if need] + [
        torch.empty_like(w) for w, need in zip(whole_inputs, whole_needs_grad) if need
    ]


def _token_chunked_setup(ctx, inputs, output):
    key, seq_inputs, whole_inputs, seq_dim, num_chunks = inputs
    ctx.save_for_backward(*seq_inputs, *whole_inputs)  # inputs only: chunks are recomputed
    ctx.region = (key, len(seq_inputs), seq_dim, num_chunks)
    ctx.owner = live_region(key)   # a pending backward keeps its region registered


def _token_chunked_grad(ctx, grad_out):
    key, num_seq, seq_dim, num_chunks = ctx.region
    saved = ctx.saved_tensors
    seq_inputs, whole_inputs = list(saved[:num_seq]), list(saved[num_seq:])
    _, seq_need, whole_need, _, _ = ctx.needs_input_grad
    grads = iter(torch.ops.tailorfx.token_chunked_backward(
        key, grad_out, seq_inputs, whole_inputs, seq_dim, num_chunks,
        list(seq_need), list(whole_need)))
    seq_grads = [next(grads) if need else None for need in seq_need]
    whole_grads = [next(grads) if need else None for need in whole_need]
    return None, seq_grads, whole_grads, None, None


_token_chunked.register_autograd(_token_chunked_grad, setup_context=_token_chunked_setup)


# ---------------------------------------------------------------------------------------------
# token_chunked_random: a region that draws random numbers (dropout). Forward also returns the
# RNG state it started from; backward restores it and recomputes the chunks in the same order,
# so each chunk draws the masks its forward drew (torch.utils.checkpoint's preserve_rng_state).
# ---------------------------------------------------------------------------------------------
_CPU_STATE_BYTES = torch.get_rng_state().numel()


def rng_state_bytes(device: torch.device) -> int:
    """Bytes of the RNG state token_chunked_random returns for inputs on `device` (CUDA's Philox:
    seed and offset)."""
    return 16 if device.type == "cuda" else _CPU_STATE_BYTES


def _rng_state(device: torch.device) -> Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


@torch.library.custom_op("tailorfx::token_chunked_random", mutates_args=())
def _token_chunked_random(
    key: str, seq_inputs: list[Tensor], whole_inputs: list[Tensor], seq_dim: int, num_chunks: int
) -> tuple[Tensor, Tensor]:
    """token_chunked for a region with random ops: (output, the RNG state it started from)."""
    state = _rng_state(seq_inputs[0].device)
    return _run_chunks(key, seq_inputs, whole_inputs, seq_dim, num_chunks), state


@_token_chunked_random.register_fake
def _token_chunked_random_fake(key, seq_inputs, whole_inputs, seq_dim, num_chunks):
    out = _token_chunked_fake(key, seq_inputs, whole_inputs, seq_dim, num_chunks)
    size = rng_state_bytes(seq_inputs[0].device)
    return out, torch.empty(size, dtype=torch.uint8, device="cpu")


@torch.library.custom_op("tailorfx::token_chunked_random_backward", mutates_args=())
def _token_chunked_random_backward(
    key: str, grad_out: Tensor, seq_inputs: list[Tensor], whole_inputs: list[Tensor],
    seq_dim: int, num_chunks: int, seq_needs_grad: list[bool], whole_needs_grad: list[bool], rng_state: Tensor,
) -> list[Tensor]:
    """token_chunked_backward replaying the forward's random draws from `rng_state`."""
    device = seq_inputs[0].device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if device.type == "cuda":
            torch.cuda.set_rng_state(rng_state, device)
        else:
            torch.set_rng_state(rng_state)
        return _chunk_grads(key, grad_out, seq_inputs, whole_inputs, seq_dim, num_chunks, seq_needs_grad,
                            whole_needs_grad)


@_token_chunked_random_backward.register_fake
def _token_chunked_random_backward_fake(key, grad_out, seq_inputs, whole_inputs, seq_dim, num_chunks,
                                        seq_needs_grad, whole_needs_grad, rng_state):
    return _token_chunked_backward_fake(key, grad_out, seq_inputs, whole_inputs, seq_dim, num_chunks,
                                        seq_needs_grad, whole_needs_grad)


def _token_chunked_random_setup(ctx, inputs, output):
    key, seq_inputs, whole_inputs, seq_dim, num_chunks = inputs
    ctx.save_for_backward(*seq_inputs, *whole_inputs, output[1])
    ctx.region = (key, len(seq_inputs), seq_dim, num_chunks)
    ctx.owner = live_region(key)
    ctx.mark_non_differentiable(output[1])


def _token_chunked_random_grad(ctx, grad_out, _grad_state):
    key, num_seq, seq_dim, num_chunks = ctx.region
    saved = ctx.saved_tensors
    seq_inputs, whole_inputs, state = list(saved[:num_seq]), list(saved[num_seq:-1]), saved[-1]
    _, seq_need, whole_need, _, _ = ctx.needs_input_grad
    grads = iter(torch.ops.tailorfx.token_chunked_random_backward(
        key, grad_out, seq_inputs, whole_inputs, seq_dim, num_chunks, list(seq_need), list(whole_need), state))
    seq_grads = [next(grads) if need else None for need in seq_need]
    whole_grads = [next(grads) if need else None for need in whole_need]
    return None, seq_grads, whole_grads, None, None


_token_chunked_random.register_autograd(_token_chunked_random_grad, setup_context=_token_chunked_random_setup)


def token_chunked(key: str, seq_inputs: Sequence[Tensor], whole_inputs: Sequence[Tensor],
                  seq_dim: int, num_chunks: int) -> Tensor:
    """``region(*seq_inputs, *whole_inputs)`` computed in ``num_chunks`` pieces along ``seq_dim``."""
    return torch.ops.tailorfx.token_chunked(key, list(seq_inputs), list(whole_inputs),
                                            seq_dim, num_chunks)


# ---------------------------------------------------------------------------------------------
# token_segment: a token-wise segment of a block (several outputs, each tensor with its own
# sequence dim), e.g. norm -> q/k/v projections -> rotary, or o_proj -> residual -> norm -> MLP.
# ---------------------------------------------------------------------------------------------


def _segment_chunks(seq_inputs: Sequence[Tensor], in_dims: Sequence[int], num_chunks: int):
    if not seq_inputs:
        raise ValueError("token_segment needs at least one sequence input to chunk")
    n = max(1, min(num_chunks, seq_inputs[0].size(in_dims[0])))
    return n, [x.tensor_split(n, d) for x, d in zip(seq_inputs, in_dims)]


@torch.library.custom_op("tailorfx::token_segment", mutates_args=())
def _token_segment(
    key: str, seq_inputs: list[Tensor], whole_inputs: list[Tensor], in_dims: list[int],
    out_dims: list[int], num_chunks: int,
) -> list[Tensor]:
    """Run segment ``key`` (returning a tuple) on chunks of ``seq_inputs`` (each along its own
    dim) and concatenate each output along its own dim."""
    fn = get_region(key)
    n, chunks = _segment_chunks(seq_inputs, in_dims, num_chunks)
    outs: Optional[list[Tensor]] = None
    starts = [0] * len(out_dims)
    for i in range(n):
        ys = fn(*(c[i].contiguous() for c in chunks), *whole_inputs)
        if outs is None:
            outs = []
            for y, d in zip(ys, out_dims):
                shape = list(y.shape)
                shape[d] = seq_inputs[0].size(in_dims[0])
                outs.append(y.new_empty(shape))
        length = chunks[0][i].size(in_dims[0])
        for j, (y, d) in enumerate(zip(ys, out_dims)):
            if y.size(d) != length:
                raise RuntimeError(f"token_segment({key}): output {j} has {y.size(d)} positions for a chunk "
                                   f"of {length}; only token-wise segments can be chunked")
            outs[j].narrow(d, starts[j], length).copy_(y)
            starts[j] += length
        del ys   # else the chunk's outputs stay alive while the next chunk runs
    return outs


@_token_segment.register_fake
def _token_segment_fake(key, seq_inputs, whole_inputs, in_dims, out_dims, num_chunks):
    with torch.no_grad():
        ys = get_region(key)(*seq_inputs, *whole_inputs)
    return [y.new_empty(y.shape) for y in ys]


def segment_chunk_grads(fn, xs, whole, grad_outs, seq_grads, whole_acc) -> None:
    """Recompute one chunk of a segment and backprop every output's grad into it: writes
    seq_grads, adds into whole_acc."""
    wrt = [t for t in (*xs, *whole) if t.requires_grad]
    ys = fn(*xs, *whole)
    pairs = [(y, g) for y, g in zip(ys, grad_outs) if y.requires_grad and g is not None]
    store_grads(torch.autograd.grad([y for y, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True),
                 xs, seq_grads, whole, whole_acc)


@torch.library.custom_op("tailorfx::token_segment_backward", mutates_args=())
def _token_segment_backward(
    key: str, grad_outs: list[Tensor], seq_inputs: list[Tensor], whole_inputs: list[Tensor],
    in_dims: list[int], out_dims: list[int], num_chunks: int, seq_needs_grad: list[bool],
    whole_needs_grad: list[bool],
) -> list[Tensor]:
    """Grads of the flagged seq then whole inputs, recomputing the segment one chunk at a time."""
    fn = get_region(key)
    n, chunks = _segment_chunks(seq_inputs, in_dims, num_chunks)
    seq_grads = [torch.empty_like(x) if need else None for x, need in zip(seq_inputs, seq_needs_grad)]
    whole = [w.detach().requires_grad_(need) for w, need in zip(whole_inputs, whole_needs_grad)]
    whole_acc = [torch.zeros_like(w, dtype=acc_dtype(w)) if need else None
                 for w, need in zip(whole_inputs, whole_needs_grad)]
    grad_chunks = [g.tensor_split(n, d) if g is not None else [None] * n for g, d in zip(seq_grads, in_dims)]
    go_chunks = [g.tensor_split(n, d) for g, d in zip(grad_outs, out_dims)]
    with _autograd_enabled():
        for i in range(n):
            xs = [c[i].contiguous().detach().requires_grad_(need) for c, need in zip(chunks, seq_needs_grad)]
            segment_chunk_grads(fn, xs, whole, [g[i].contiguous() for g in go_chunks],
                                [g[i] for g in grad_chunks], whole_acc)
    return [g for g in seq_grads if g is not None] + [
        acc.to(w.dtype) for acc, w in zip(whole_acc, whole_inputs) if acc is not None]


@_token_segment_backward.register_fake
def _token_segment_backward_fake(key, grad_outs, seq_inputs, whole_inputs, in_dims, out_dims, num_chunks,
                                 seq_needs_grad, whole_needs_grad):
    return [torch.empty_like(x) for x, need in zip(seq_inputs, seq_needs_grad) if need] + [
        torch.empty_like(w) for w, need in zip(whole_inputs, whole_needs_grad) if need]


def _token_segment_setup(ctx, inputs, output):
    key, seq_inputs, whole_inputs, in_dims, out_dims, num_chunks = inputs
    ctx.save_for_backward(*seq_inputs, *whole_inputs)   # inputs only: chunks are recomputed
    ctx.segment = (key, len(seq_inputs), list(in_dims), list(out_dims), num_chunks)
    ctx.owner = live_region(key)


def _token_segment_grad(ctx, grad_outs):
    key, num_seq, in_dims, out_dims, num_chunks = ctx.segment
    saved = ctx.saved_tensors
    seq_inputs, whole_inputs = list(saved[:num_seq]), list(saved[num_seq:])
    _, seq_need, whole_need, _, _, _ = ctx.needs_input_grad
    grads = iter(torch.ops.tailorfx.token_segment_backward(
        key, list(grad_outs), seq_inputs, whole_inputs, in_dims, out_dims, num_chunks,
        list(seq_need), list(whole_need)))
    seq_grads = [next(grads) if need else None for need in seq_need]
    whole_grads = [next(grads) if need else None for need in whole_need]
    return None, seq_grads, whole_grads, None, None, None


_token_segment.register_autograd(_token_segment_grad, setup_context=_token_segment_setup)
