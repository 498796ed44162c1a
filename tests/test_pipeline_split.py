"""Pipeline split points: the dynamic program against brute force, and on an HF model's graph."""
import itertools
import random

import pytest
import torch

from models import hf_family
from tailorfx.passes.pipeline_split import block_costs, split_points
from tailorfx.rewrite.capture import capture_graphs
from tailorfx.rewrite.regions import find_regions


def brute_force(flops, stages, nbytes, first, last):
    n, best = len(flops), None
    for inner in itertools.combinations(range(1, n), stages - 1):
        starts = [0, *inner]
        bounds = [*starts, n]
        f = [sum(flops[a:b]) + (first if a == 0 else 0) + (last if b == n else 0) for a, b in zip(bounds, bounds[1:])]
        m = [sum(nbytes[a:b]) for a, b in zip(bounds, bounds[1:])]
        key = (max(f), max(m))
        if best is None or key < best[0]:
            best = (key, starts)
    return best[0]


def cost_of(starts, flops, nbytes, first, last):
    n = len(flops)
    bounds = [*starts, n]
    f = [sum(flops[a:b]) + (first if a == 0 else 0) + (last if b == n else 0) for a, b in zip(bounds, bounds[1:])]
    return (max(f), max(sum(nbytes[a:b]) for a, b in zip(bounds, bounds[1:])))


@pytest.mark.parametrize("seed", range(40))
def test_split_is_as_good_as_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    stages = rng.randint(1, n)
    flops = [rng.randint(1, 20) for _ in range(n)]
    nbytes = [rng.randint(1, 20) for _ in range(n)]
    first, last = rng.randint(0, 30), rng.randint(0, 30)
    starts = split_points(flops, stages, nbytes, first, last)
    assert starts[0] == 0 and starts == sorted(set(starts)) and len(starts) == stages
    assert cost_of(starts, flops, nbytes, first, last) == brute_force(flops, stages, nbytes, first, last)


def test_too_many_stages_names_the_range():
    with pytest.raises(ValueError, match="cannot split 3 blocks into 4 pipeline stages: use 1 to 3"):
        split_points([1, 1, 1], 4)


def test_hf_llama_blocks_cost_alike_and_the_head_shortens_the_last_stage():
    model = hf_family("llama", num_layers=6, vocab_size=8000)
    ids = torch.randint(0, 8000, (1, 64))
    (g,), _ = capture_graphs(model, kwargs=dict(input_ids=ids, labels=ids))
    c = block_costs(g.gm, find_regions(g.gm, g.seq))
    assert c.blocks == [f"model.layers.{i}" for i in range(6)]
    assert len(set(c.flops)) == 1 and min(c.flops) > 0 and min(c.bytes) > 0
    assert c.last_flops > c.flops[0]      # vocab 8000 x hidden 64: the head outweighs a block
    assert split_points(c.flops, 2, c.bytes) == [0, 3]
    starts = split_points(c.flops, 2, c.bytes, c.first_flops, c.last_flops)
    assert starts[1] > 3     # the last stage carries the head: it takes fewer blocks
