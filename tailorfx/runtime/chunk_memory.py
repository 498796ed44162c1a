"""Bytes the chunked ops (token_chunked, token_segment, the fused head's) allocate and free
inside themselves, which the graph does not show: the memory model adds them at each call.
"""
from __future__ import annotations

import math
from collections.abc import Callable

from torch import Tensor

from tailorfx.runtime import linear_ops, log_prob_ops, vocab_parallel
from tailorfx.runtime.chunk_backward import summed_in_place
from tailorfx.runtime.region_registry import live_region

__all__ = ["transient_bytes", "chunk_weight_grad_bytes"]


def _copies(as_int: Callable, tensors: list) -> int:
    """Bytes of the contiguous (tensor, sequence dim) pairs whose chunks the cost simulation copied
    (some dim before the sequence dim is not 1) and one whole-tensor chunk does not."""
    return sum(as_int(t.numel()) * t.element_size() for t, dim in tensors
               if isinstance(t, Tensor) and t.is_contiguous() and any(as_int(d) != 1 for d in t.shape[:dim]))


def _held(lines: tuple, tokens: int) -> int:
    """Bytes a chunk of `tokens` holds in backward: the region's cost line (passes/minisequence/
    cost.py: per token, constant, and the tokens it holds from) that `tokens` falls under."""
    per_token, const = next(line for line in reversed(lines) if (line[2] if len(line) > 2 else 0) <= tokens)[:2]
    return int(per_token * tokens + const)


def transient_bytes(op_name: str, args: list, as_int: Callable, cuda: bool = False) -> int:
    """Bytes an op of this module allocates and frees inside itself (invisible to the graph).

    `args` are the node's arguments with tensors as fake values; `as_int` turns a size or SymInt
    into an int at the length being predicted; `cuda`: as the ops run on CUDA (a GPU budget
    predicted on CPU fake tensors).
    """
    op_name = op_name.replace("token_chunked_random", "token_chunked")   # the same chunks, plus an RNG state
    if op_name in ("token_chunked", "token_chunked_backward"):
        key = args[0]
        seq = args[1] if op_name == "token_chunked" else args[2]
        seq_dim, n = (args[3], args[4]) if op_name == "token_chunked" else (args[4], args[5])
        region = live_region(key)
        fwd, lines = region.cost if region is not None else (0.0, ((0.0, 0.0),))
        tokens = as_int(seq[0].numel()) // max(1, as_int(seq[0].shape[-1])) if seq else 0
        n = max(1, min(as_int(n), tokens or 1))
        if op_name == "token_chunked":
            return int(fwd * -(-tokens // n))
        # the chunk costs were simulated with each chunk (and its output gradient) copied; one
        # chunk is the whole tensor, which .contiguous() returns as it is
        whole = _copies(as_int, [(seq[0], seq_dim), (args[1], seq_dim)]) if n == 1 and seq else 0
        return max(0, _held(lines, -(-tokens // n)) - whole)
    if op_name in ("token_segment", "token_segment_backward"):
        fwd_op = op_name == "token_segment"
        key, seq = args[0], (args[1] if fwd_op else args[2])
        in_dims, n = (args[3], args[5]) if fwd_op else (args[4], args[6])
        region = live_region(key)
        fwd, lines = region.cost if region is not None else (0.0, ((0.0, 0.0),))
        tokens = math.prod(as_int(d) for d in seq[0].shape[:in_dims[0] + 1]) if seq else 0
        n = max(1, min(as_int(n), as_int(seq[0].shape[in_dims[0]]) if seq else 1))
        per_chunk = -(-tokens // n)
        if fwd_op:
            return int(fwd * per_chunk)
        # as token_chunked_backward: one chunk is not copied (the output gradients always were)
        whole = _copies(as_int, list(zip(seq, in_dims))) + sum(
            as_int(g.numel()) * g.element_size() for g in args[1] if isinstance(g, Tensor) and g.is_contiguous()
        ) if n == 1 else 0
        return max(0, _held(lines, per_chunk) - whole)
    if op_name.startswith("vocab_parallel_cross_entropy"):
        return vocab_parallel.transient_bytes(op_name, args, as_int)
    if op_name.startswith("chunked_token_log_probs"):
        return log_prob_ops.transient_bytes(op_name, args, as_int, cuda)
    return linear_ops.transient_bytes(op_name, args, as_int, cuda)


def chunk_weight_grad_bytes(op_name: str, args: list, as_int: Callable) -> int | None:
    """The largest weight gradient one chunk of a token_chunked backward makes through autograd
    before it is added into its accumulator (0 where the chunk sums every weight's share in place:
    chunk_backward.summed_in_place); None for other ops. `args` as transient_bytes takes them."""
    if op_name not in ("token_chunked_backward", "token_chunked_random_backward"):
        return None
    region = live_region(args[0])
    seq, whole, needs = args[2], args[3], args[7]
    if region is None:
        return None
    done = summed_in_place(region, [x.dtype for x in seq], [w.dtype for w in whole])
    return max([as_int(w.numel()) * w.element_size() for i, (w, need) in enumerate(zip(whole, needs))
                if need and i not in done], default=0)
