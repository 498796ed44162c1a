"""Mini-sequence on a model's own modules, eagerly: a token-wise module (an MLP) runs in chunks
along the sequence, each chunk one activation-checkpointing unit, so its intermediates exist for
one chunk at a time, in forward and in backward (MST, NeurIPS 2024; DeepSpeed's TiledMLP).

What tensor parallelism runs: a sharded MLP's linears are DTensor modules whose hooks gather and
reduce, which the graph pass's region check does not take; each chunk runs them unchanged, the
reduction of each chunk's output included. Exact: the same ops on the same token rows.

    chunk_modules(model, ["model.layers.0.mlp", ...], ideal={"model.layers.0.mlp": 3})
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from tailorfx import compat

__all__ = ["chunk_modules", "chunk_count", "SequenceChunked"]


def chunk_count(tokens: int, ideal: int, num_chunks: Optional[int], min_tokens: int) -> int:
    """M: `num_chunks` when given, else min(ideal, tokens // min_tokens), at least 1 (the graph
    pass's rule too: minisequence.chunks.Chunking, at a static length)."""
    if num_chunks:
        return num_chunks
    return max(1, min(ideal, tokens // min_tokens))


class SequenceChunked:
    """Mixed into a module's class (as FSDP2's fully_shard does): its forward runs in chunks along
    dim 1 of its first argument, each chunk checkpointed; other arguments are passed whole. Off
    (one call) without grad, or when one chunk would do."""
    _tailorfx_chunking: tuple[int, Optional[int], int]     # (ideal, num_chunks, min_tokens)

    def forward(self, x, *args, **kwargs):
        ideal, num_chunks, min_tokens = self._tailorfx_chunking
        m = chunk_count(math.prod(x.shape[:2]), ideal, num_chunks, min_tokens) if x.dim() >= 3 else 1
        run = super().forward
        if m <= 1 or not torch.is_grad_enabled():
            return run(x, *args, **kwargs)
        m = min(m, x.shape[1])
        sizes = [x.shape[1] // m + (i < x.shape[1] % m) for i in range(m)]
        # split, not slices: its backward is one cat of the chunks' gradients, where each slice's
        # would be a zero-filled tensor of x's size, added up
        parts = [checkpoint(_waited, run, part, *args, use_reentrant=False, **kwargs) for part in x.split(sizes, dim=1)]
        return torch.cat(parts, dim=1)


def _waited(run, *args, **kwargs):
    """A chunk's output with its collective done inside the chunk: a checkpoint's recompute stops
    once it has what backward needs, and a chunk's all-reduce it had started would otherwise stay
    in flight, its buffers held (measured on gloo: +26% of a tp rank's peak under recompute)."""
    return compat.collective_waited(run(*args, **kwargs))


def chunk_modules(model: nn.Module, paths: list[str], *, ideal: dict[str, int], num_chunks: Optional[int] = None,
                  min_tokens: int = 1024) -> None:
    """Each module at `paths` runs in sequence chunks (SequenceChunked; its parameters and their
    names stay as they are); `ideal`: the chunk count that makes one chunk's intermediates no
    larger than its input, per path."""
    mods = dict(model.named_modules())
    for path in paths:
        mod = mods[path]
        if not isinstance(mod, SequenceChunked):
            cls = type(mod)
            mod.__class__ = type(f"SequenceChunked{cls.__name__}", (SequenceChunked, cls), {})
        mod._tailorfx_chunking = (ideal.get(path, 1), num_chunks, min_tokens)
