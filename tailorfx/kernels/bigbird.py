"""BigBird's block pattern (Zaheer et al. 2020): the key blocks each query block attends, as the
Triton kernel's host tables and the torch tile engine (runtime/attention_tiles.py) both read it.
Pure functions of the pattern's integers, so the kernels' layer needs nothing above it; the kernel's
tables are copied to a device once (launch_tables)."""
from __future__ import annotations

import functools
import random

import torch
from torch import Tensor

from tailorfx.kernels import cdiv


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


@functools.lru_cache(maxsize=64)
def bigbird_tables(params: tuple, causal: bool, seq_len: int, block_m: int, block_n: int, by_keys: bool = False):
    """CPU tensors for one BigBird pattern at tile sizes (block_m queries, block_n keys):
    (table int32 (tiles, width), count int32 (tiles,), block_mask int8 (nb, nb)). The table lists,
    per query tile, the key tiles holding a pair `Pattern("bigbird", params, causal,
    seq_len).element_mask` allows (by_keys: per key tile, the query tiles), ascending; block_mask
    is the Pattern's (query block, key block) rows."""
    b = params[0]
    nb = cdiv(seq_len, b)
    blocks = block_rows(tuple(params), causal, 0, nb, nb)
    nqt, nkt = cdiv(seq_len, block_m), cdiv(seq_len, block_n)
    pos = torch.arange(seq_len)
    qa = torch.zeros(nqt, nb)
    qa[pos // block_m, pos // b] = 1.0
    ka = torch.zeros(nkt, nb)
    ka[pos // block_n, pos // b] = 1.0
    tiles = (qa @ blocks.float() @ ka.T) > 0
    if causal:   # a key tile wholly after the query tile's last row is masked
        last = torch.clamp((torch.arange(nqt) + 1) * block_m, max=seq_len) - 1
        tiles &= (torch.arange(nkt) * block_n)[None, :] <= last[:, None]
    if by_keys:
        tiles = tiles.T
    count = tiles.sum(1).to(torch.int32)
    width = max(1, int(count.max()))
    table = torch.argsort((~tiles).to(torch.int8), dim=1, stable=True)[:, :width].to(torch.int32)
    return table.contiguous(), count, blocks.to(torch.int8).contiguous()


@functools.lru_cache(maxsize=64)
def _device_tables(key: tuple, device: torch.device) -> tuple:
    """`bigbird_tables(*key)` on `device`, copied once: a warm eager launch copies no table."""
    return tuple(t.to(device) for t in bigbird_tables(*key))


def launch_tables(params: tuple, causal: bool, seq_len: int, block_m: int, block_n: int, by_keys: bool,
                  device) -> tuple:
    """bigbird_tables on the launch's device: on a real one copied once per pattern, length, tiles
    and device; inside a trace (Inductor tracing the triton_op on fake tensors), where a real tensor
    cannot be copied, built from their values, constants of the traced graph."""
    from tailorfx import compat
    key = (tuple(params), bool(causal), seq_len, block_m, block_n, by_keys)
    fake = compat.detect_fake_mode() is not None
    with compat.untraced_real_tensors():   # real, untraced: Dynamo's fake mode refuses even tolist()
        if not fake:   # the cache holds real tensors, whatever traces the first launch
            return _device_tables(key, torch.device(device))
        host = [(t.tolist(), t.dtype) for t in bigbird_tables(*key)]
    return tuple(torch.tensor(values, dtype=dtype, device=device) for values, dtype in host)
