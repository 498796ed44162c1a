"""BigBird's block pattern (Zaheer et al. 2020): the key blocks each query block attends, as the
Triton kernel's host tables and the torch tile engine (runtime/attention_tiles.py) both read it.
Pure functions of the pattern's integers, so the kernels' layer needs nothing above it."""
from __future__ import annotations

import functools
import random

import torch
from torch import Tensor


@functools.lru_cache(maxsize=64)
def random_blocks(
    num_blocks: int, window: int, num_global: int, num_random: int, seed: int, causal: bool
) -> Tensor:
    """(num_blocks, num_random) int64 random key blocks per query block, -1 where none is left.

    Drawn without replacement from the blocks a query block could still gain: not global, not in
    its window, and (causal) not in its future, so every random block is a real extra block.
    """
    rng = random.Random(seed)
    table = torch.full((num_blocks, max(num_random, 0)), -1, dtype=torch.int64)
    for qb in range(num_blocks):
        lo, hi = max(num_global, qb - window), qb + window  # excluded window [lo, hi]
        limit = qb if causal else num_blocks - 1  # last eligible block
        before = max(0, min(lo, limit + 1) - num_global)  # candidates g .. lo-1
        after = max(0, limit - max(hi, num_global - 1))  # candidates after the window .. limit
        picks = rng.sample(range(before + after), min(num_random, before + after))
        right = max(hi, num_global - 1) + 1  # first candidate after the window
        blocks = [num_global + c if c < before else right + c - before for c in picks]
        table[qb, : len(blocks)] = torch.tensor(sorted(blocks), dtype=torch.int64)
    return table


def block_rows(params: tuple, causal: bool, qb0: int, qb1: int, num_blocks: int) -> Tensor:
    """Bool (qb1-qb0, num_blocks): the key blocks query blocks qb0..qb1-1 attend under BigBird
    params (block, window, num_global, num_random, seed): the window band, the global blocks
    (rows and columns) and each row's random blocks; causality is applied by the caller."""
    _, w, g, r, seed = params
    qb = torch.arange(qb0, qb1)[:, None]
    kb = torch.arange(num_blocks)[None, :]
    sel = ((kb - qb).abs() <= w) | (kb < g) | (qb < g)
    rand = random_blocks(num_blocks, w, g, r, seed, causal)[qb0:qb1]
    hits = torch.zeros(qb1 - qb0, num_blocks + 1, dtype=torch.bool)
    hits.scatter_(1, torch.where(rand < 0, num_blocks, rand), True)  # -1 pads land in a spare column
    return sel | hits[:, :num_blocks]
