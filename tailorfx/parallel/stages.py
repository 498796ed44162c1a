"""Pipeline stages: where to cut the block sequence so that stages cost the same.

Costs come from the graph: each block's forward FLOPs (`rewrite/cost.py`) and the bytes its
outputs take (what a stage holds per in-flight microbatch); the embedding rides with the first
stage, the LM head and loss with the last. A dynamic program over the block sequence minimises
the slowest stage's FLOPs, then the largest stage's bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.fx as fx

from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.cost import node_flops
from tailorfx.rewrite.regions import RegionMap


@dataclass(frozen=True)
class StageCosts:
    """Per block FLOPs and activation bytes, and the extras outside blocks (first/last stage)."""
    blocks: list[str]
    flops: list[int]
    bytes: list[int]
    first_flops: int = 0
    last_flops: int = 0


def block_costs(gm: fx.GraphModule, regions: RegionMap, as_int=int) -> StageCosts:
    """FLOPs and output bytes of each block region; what lies before the first block is the first
    stage's extra, what lies after the last one the last stage's."""
    blocks = regions.of_kind("block")
    owner = {name: i for i, b in enumerate(blocks) for name in b.nodes}
    flops, nbytes = [0] * len(blocks), [0] * len(blocks)
    first = last = 0
    seen_block = False
    for n in gm.graph.nodes:
        f = node_flops(n, as_int) if n.op in ("call_function", "call_method") else 0
        if n.name in owner:
            seen_block = True
            flops[owner[n.name]] += f
            v = node_value(n)
            if isinstance(v, torch.Tensor):
                nbytes[owner[n.name]] += as_int(v.numel()) * v.element_size()
        elif seen_block:
            last += f
        else:
            first += f
    return StageCosts([b.path for b in blocks], flops, nbytes, first, last)


def split_points(flops: Sequence[float], num_stages: int, nbytes: Optional[Sequence[float]] = None,
                 first: float = 0, last: float = 0) -> list[int]:
    """Index of the first block of each stage (stage s runs blocks [cut[s], cut[s+1])): the cut
    that minimises (slowest stage's FLOPs, largest stage's bytes), lexicographically."""
    n = len(flops)
    if num_stages < 1 or num_stages > n:
        raise ValueError(f"cannot split {n} blocks into {num_stages} pipeline stages: use 1 to {n} stages")
    nbytes = list(nbytes) if nbytes is not None else [0] * n
    pf, pb = [0.0], [0.0]
    for f, b in zip(flops, nbytes):
        pf.append(pf[-1] + f)
        pb.append(pb[-1] + b)

    def stage_flops(i: int, j: int) -> float:
        return pf[j] - pf[i] + (first if i == 0 else 0) + (last if j == n else 0)

    # two bottleneck programs: the least slowest-stage FLOPs, then under it the least stage bytes
    slowest, _ = _bottleneck(n, num_stages, stage_flops)
    _, starts = _bottleneck(n, num_stages, lambda i, j: pb[j] - pb[i] if stage_flops(i, j) <= slowest else float("inf"))
    return starts


def stage_blocks(costs: StageCosts, num_stages: int) -> list[list[str]]:
    """The blocks of each of `num_stages` pipeline stages, cut where split_points says."""
    bounds = [*split_points(costs.flops, num_stages, costs.bytes, costs.first_flops, costs.last_flops),
              len(costs.blocks)]
    return [costs.blocks[a:b] for a, b in zip(bounds, bounds[1:])]


def _bottleneck(n: int, num_stages: int, cost) -> tuple[float, list[int]]:
    """min over cuts of max over stages of cost(i, j); returns it and the stages' first blocks."""
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            for i in range(k - 1, j):
                cand = max(best[k - 1][i], cost(i, j))
                if cand < best[k][j]:
                    best[k][j], cut[k][j] = cand, i
    starts, j = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][j]
        starts.append(j)
    return best[num_stages][n], starts[::-1]
