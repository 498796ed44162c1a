"""Pipeline split points (tailorfx/parallel/stages.py): the dynamic program against brute force,
and on an HF model's graph."""
import itertools
import random

import pytest
import torch

from models import hf_family
from tailorfx.parallel.stages import block_costs, split_points, stage_blocks
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
    assert stage_blocks(c, 2) == [c.blocks[:starts[1]], c.blocks[starts[1]:]]


def takes_own_parameters(inputs: list, model, other) -> bool:
    """A reused graph's recorded inputs hold every parameter of `model` and none of `other`'s."""
    ids = {id(t) for t in inputs if isinstance(t, torch.Tensor)}
    return {id(p) for p in model.parameters()} <= ids and not ids & {id(p) for p in other.parameters()}


def test_a_static_capture_is_reused_for_a_model_dynamos_guards_find_the_same(monkeypatch):
    """capture_static: another instance of one config (another schedule's run) gets the same graph
    without tracing again, with its own parameters as the inputs; a model that differs in what
    the trace read is traced afresh, and so is one past Dynamo's recompile limit, with no reset."""
    from tailorfx.codegen.pipeline import capture_static
    ids = torch.randint(0, 512, (2, 24))
    batch = dict(input_ids=ids, labels=ids)
    a, b = hf_family("llama", vocab_size=512), hf_family("llama", vocab_size=512)
    gm_a, ex_a, _ = capture_static(a, batch)
    gm_b, ex_b, _ = capture_static(b, batch)
    assert gm_b is gm_a and takes_own_parameters(ex_b, b, a)
    other = hf_family("llama", vocab_size=512, rms_norm_eps=1e-3)      # a value the forward reads
    assert capture_static(other, batch)[0] is not gm_a
    assert capture_static(a, dict(input_ids=ids[:, :16], labels=ids[:, :16]))[0] is not gm_a
    from tailorfx import compat
    # past Dynamo's recompile limit: traced afresh with a backend of its own, nothing reset
    monkeypatch.setattr(compat, "capture_config", lambda: torch._dynamo.config.patch(recompile_limit=1))
    gm_c, ex_c, _ = capture_static(hf_family("llama", vocab_size=512, rms_norm_eps=1e-4), batch)
    assert gm_c is not gm_a and len(ex_c) == len(ex_a)
    monkeypatch.undo()
    assert capture_static(b, batch)[0] is gm_a      # the frames compiled before are all still there


def test_the_tensor_parallel_plans_static_capture_keeps_the_users_compiled_frames():
    """capture_graphs(static=True), the tensor-parallel plan's capture, resets nothing: a frame the
    user compiled before still runs without a new compile, and another instance of one config
    gets the same graphs, with its own parameters as their inputs."""
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    users = torch.compile(lambda x: x.sin() + 1, backend=counting)
    x = torch.randn(8)
    users(x)
    ids = torch.randint(0, 512, (2, 64))
    a, b = hf_family("llama", vocab_size=512), hf_family("llama", vocab_size=512)
    (ca,), _ = capture_graphs(a, (), dict(input_ids=ids, labels=ids), static=True)
    (cb,), _ = capture_graphs(b, (), dict(input_ids=ids, labels=ids), static=True)
    assert cb.gm is ca.gm and ca.seq.length == cb.seq.length < 64      # the cut length, found again
    assert takes_own_parameters(cb.example_inputs, b, a)
    torch.testing.assert_close(users(x), x.sin() + 1)
    assert len(compiles) == 1          # the user's frame was not dropped
