"""A deep config predicted from a shallow capture (rewrite/depth.py): the composed step equals the
whole model's, to the byte, at every point of its timeline."""
import re

import pytest
import torch

from tailorfx import sizing
from tailorfx.configs import load_config
from tailorfx.rewrite import depth

SMALL = ["hidden_size=128", "intermediate_size=256", "num_attention_heads=4", "num_key_value_heads=2",
         "vocab_size=512"]
PLANS = {
    "segments+full": dict(passes=["attention", "minisequence", "recompute"], recompute="full", minisequence="segments"),
    "recompute": dict(passes=["recompute"], recompute="full"),
    "none": dict(passes=[]),
    "offload": dict(passes=["attention", "minisequence", "recompute"], recompute="full", minisequence="segments",
                    offload="checkpoints"),
}


def config(family: str, layers: int, *extra: str):
    head = [] if family == "qwen2" else ["head_dim=32"]
    return load_config(family, SMALL + head + [f"num_hidden_layers={layers}", *extra])


# a window shorter than the lengths predicted; no KV cache, as a training step runs (with one,
# transformers keeps a tensor per sliding layer outside the layers, and the capture is whole)
SLIDING = ("sliding_window=128", "use_cache=False")


def levels(est) -> list[tuple[int, int]]:
    """(live bytes, gradient bytes) after each op that changes them: views and other ops that
    allocate nothing are left out (the whole model has a few more of those outside its blocks)."""
    out = []
    for (_, _, b), g in zip(est.timeline.points, est.timeline.grads):
        if not out or out[-1] != (b, g):
            out.append((b, g))
    return out


def predicted(cfg, shallow: bool, setup: str, plan: dict, lengths):
    dtype = torch.float32 if setup == "fp32" else torch.bfloat16
    with sizing._prediction_model(cfg, dtype, shallow) as (model, d):
        opt = sizing._capture(model, plan["passes"], 256, 1, setup=setup,
                              **{k: v for k, v in plan.items() if k != "passes"})
    if "lowering" in plan:   # predicted from that lowering's graphs (Inductor's kernels), not eager's
        assert opt.session.graphs[0].lowering == plan["lowering"]
    return d, [opt.predict_memory(S) for S in lengths], opt.bound_at(True)


def kind(node: str) -> str:
    """An op's or kernel's name without the number that tells it from others of its kind
    (mm_12, buf220: the whole model numbers them past the shallow one)."""
    return re.sub(r"[\d_]+$", "", node)


def check_composed_equals_whole(family: str, layers: int, setup: str, plan: str, *extra: str, lowering=None):
    cfg = config(family, layers, *extra)
    # one length past the captured 256 and the window: each prediction at a new length is seconds of
    # sympy on a 2-core CPU, and the composition is of the symbolic timeline, the same at any length
    lengths = (2048,)
    kw = dict(PLANS[plan], **({"lowering": lowering} if lowering else {}))
    d, shallow, bound_shallow = predicted(cfg, True, setup, kw, lengths)
    assert d is not None and d.captured < layers and d.repeats > 0     # the capture was shallow
    whole_d, whole, bound_whole = predicted(cfg, False, setup, kw, lengths)
    assert whole_d is None
    for S, a, b in zip(lengths, shallow, whole):
        assert a.summary() == b.summary(), S
        assert (a.peak_phase, kind(a.peak_node)) == (b.peak_phase, kind(b.peak_node))
        assert levels(a) == levels(b), S
        assert bound_shallow(S) == bound_whole(S)


def test_a_shallow_llama_is_the_whole_one_to_the_byte():
    check_composed_equals_whole("llama", 8, "pure-bf16", "segments+full")


FAMILIES = ("llama", "qwen3")
SETUPS = ("pure-bf16", "pure-bf16-fused-optimizer")
# every plan with every setup, each family with every plan and every setup (a pairwise cover: 8
# cases where the full product is 16, 40-120 s each on a 2-core CPU). Qwen2's shallow captures are
# held to the byte by tests/test_sizing_figures.py (Qwen2-7B); fp32 weights change the bytes of the
# tensors a period repeats, not which ones it repeats
PAIRWISE = [(FAMILIES[(i + j) % 2], setup, plan) for i, plan in enumerate(sorted(PLANS)) for j, setup in enumerate(SETUPS)]


@pytest.mark.slow
@pytest.mark.parametrize("family,setup,plan", PAIRWISE)
def test_shallow_captures_are_the_whole_model_to_the_byte(family, setup, plan):
    check_composed_equals_whole(family, 9, setup, plan)


@pytest.mark.slow
@pytest.mark.parametrize("family,layers,plan", [("gemma2", 13, "offload"), ("mistral", 9, "segments+full")])
def test_sliding_window_families_compose_to_the_byte(family, layers, plan):
    """Gemma-2 alternates sliding and full layers (a period of two blocks); Mistral slides in each.
    Gemma-2 under the plan whose rewrites are every other plan's and more (segments, full recompute,
    checkpoints offloaded): each plan on its own is composed on the period-one families above, and
    Gemma-2's four plans took 16 minutes of a 2-core CPU's worker time."""
    check_composed_equals_whole(family, layers, "pure-bf16", plan, *SLIDING)


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["recompute", "segments+full"])   # with "none", 6 minutes more of a 2-core CPU
def test_inductor_schedules_compose_to_the_byte(plan):
    """Under lowering="inductor" the timeline is Inductor's kernels: periods are cut at the kernels
    whose fx nodes are one block's (CPU's fused C++ kernels name none, and repeat by name)."""
    check_composed_equals_whole("llama", 9, "pure-bf16", plan, lowering="inductor")


@pytest.mark.slow
def test_an_inductor_step_that_offloads_is_predicted_whole():
    """Inductor fuses the shallow graph's first kernels otherwise when activations go to host (the
    host bytes composed were 655,360 of 1,179,648): sizing captures such a step whole."""
    cfg = config("llama", 9)
    plan = dict(PLANS["offload"], lowering="inductor")
    with pytest.raises(depth.NotComposable, match="offloaded to host"):
        predicted(cfg, True, "pure-bf16", plan, (512,))


@pytest.mark.slow
def test_max_seq_len_from_a_shallow_capture_is_the_whole_ones():
    cfg = config("llama", 8)
    kw = dict(setup="pure-bf16-fused-optimizer", granularity=16, passes=["recompute"])
    assert sizing.max_seq_len.__wrapped__(cfg, "48MB", shallow=True, **kw) == \
        sizing.max_seq_len.__wrapped__(cfg, "48MB", shallow=False, **kw)


def test_layer_types_keep_their_period_in_the_shallow_config():
    cfg = config("qwen2", 42)
    cfg.layer_types = ["sliding_attention", "full_attention"] * 21
    small, d = depth.reduced(cfg)
    assert (d.period, d.start, d.captured, d.times) == (2, 1, 8, (17,))
    assert small.layer_types == cfg.layer_types[:7] + cfg.layer_types[-1:]
    assert d.start + d.period * (3 + d.repeats) + 1 == 42
    assert depth.reduced(config("llama", 5)) is None              # already shallow
    assert depth.reduced(load_config("gpt2", ["n_layer=32"])) is None                 # a family not proven alike
    assert depth.reduced(config("gemma2", 42)) is None            # a cache's tensor per sliding layer outside them
    assert depth.reduced(config("mistral", 32)) is None
    assert depth.reduced(config("gemma2", 42, *SLIDING))[1].period == 2
    assert depth.reduced(config("mistral", 32, *SLIDING))[1].period == 1


def composed(steps, tags, d):
    pts = [("forward[0]", f"n{i}", 0) for i in range(len(steps))]
    total, out = 0, []
    for (ph, nd, _), s in zip(pts, steps):
        total += s
        out.append((ph, nd, total))
    n = len(out)
    c = depth.compose(out, [0] * n, [0] * n, [0] * n, {("forward[0]", f"n{i}"): t for i, t in enumerate(tags)
                                                       if t is not None}, d)
    return None if c is None else [b for _, _, b in c.points]


def test_compose_repeats_the_middle_period_and_refuses_periods_unalike():
    d = depth.Depth(layers=7, captured=5, start=1, period=1, times=(2,), blocks_path="layers")
    # prefix, block 0, three periods of +2 then -1, the last block, the head
    steps = [1, 5, 2, -1, 2, -1, 2, -1, 3, -2, 4]
    tags = [None, 0, 1, 1, 2, 2, 3, 3, 4, 4, None]
    got = composed(steps, tags, d)
    want = [1, 6, 8, 7, 9, 8, 10, 9, 11, 10, 12, 11, 14, 12, 16]
    assert got == want
    unalike = [1, 5, 2, -1, 3, -1, 4, -1, 3, -2, 4]        # each period differs from its neighbours
    assert composed(unalike, tags, d) is None
    out_of_order = [None, 0, 2, 2, 1, 1, 3, 3, 4, 4, None]
    assert composed(steps, out_of_order, d) is None


def test_two_sites_repeat_each_middle_period_its_own_number_of_times():
    d = depth.Depth(layers=12, captured=8, start=1, period=1, times=(3, 1), blocks_path="layers")
    # block 0, site one (blocks 1-3: +2), site two (blocks 4-6: +1), the last block
    steps = [1, 2, 2, 2, 1, 1, 1, 5]
    tags = [0, 1, 2, 3, 4, 5, 6, 7]
    assert composed(steps, tags, d) == [1, 3, 5, 7, 9, 11, 13, 14, 15, 16, 17, 22]
    k, dk = d.for_recompute(6)          # the real model's first 6 blocks: 1 + 3 captured + 2 repeats
    assert (k, dk.times) == (4, (2, 2))
    assert d.for_recompute(None)[1].times == (4, 0)
    assert d.for_recompute(2) == (2, depth.Depth(**{**d.__dict__, "times": (0, 4)}))
    assert d.for_recompute(12)[0] == 8


@pytest.mark.slow
def test_the_planners_ladder_from_a_shallow_capture_is_the_whole_ones():
    """Every plan the planner tries, full recompute of the first k blocks with selective recompute
    in the rest among them, predicted from a shallow capture (two sites) as from the whole model,
    under a budget whose bisection tries k within the first site's blocks and past them."""
    import tailorfx
    from tailorfx.planner import HEADROOM
    cfg = config("llama", 10, "use_cache=False")
    S, setup = 1024, "pure-bf16-fused-optimizer"

    def tried(budget, shallow: bool = True) -> list:
        opt = sizing.plan_for_budget.__wrapped__(cfg, budget, S, setup=setup, shallow=shallow)
        gp = opt.plan[0]
        return [(c.label, c.peak, c.added_flops, c.fits) for c in (gp.chosen, *gp.runners_up)]
    with pytest.raises(tailorfx.BudgetError, match="static part") as static:
        sizing.plan_for_budget(cfg, 1 << 20, S, setup=setup)
    beside = int(static.value.suggested_bytes / (1 - HEADROOM)) + (1 << 16)   # no plan's activations fit beside it
    with pytest.raises(tailorfx.BudgetError, match="cannot be met") as err:
        sizing.plan_for_budget(cfg, beside, S, setup=setup)
    five = next(peak for label, peak, *_ in tried(err.value.suggested_bytes) if label.startswith(
        "minisequence + full recompute, 5/10 blocks"))   # the bisection's first k
    budget = int(five / (1 - HEADROOM)) + 1   # it fits: the bisection goes on to smaller k
    shallow = tried(budget)
    ks = sorted(int(re.search(r"(\d+)/10 blocks, selective", label).group(1)) for label, *_ in shallow
                if "selective in the rest" in label)
    assert ks[0] < 4 < ks[-1], shallow   # the first site holds blocks 1-3 of the capture
    assert shallow == tried(budget, shallow=False)


@pytest.mark.slow
def test_the_activation_offload_ladder_from_a_shallow_capture_is_the_whole_ones():
    """offload="activations": every plan the planner tries, the first k blocks' saved tensors in host
    memory with selective recompute everywhere among them, predicted from a shallow capture (two
    sites) as from the whole model, under a budget whose bisection tries k on both sides of the
    first site's blocks."""
    cfg = config("llama", 10, "use_cache=False")
    S, setup = 1024, "pure-bf16-fused-optimizer"

    def tried(budget, shallow: bool = True) -> list:
        opt = sizing.plan_for_budget.__wrapped__(cfg, budget, S, setup=setup, shallow=shallow, offload="activations")
        gp = opt.plan[0]
        return [(c.label, c.peak, c.added_flops, c.fits, opt.predict_memory().host_bytes if c is gp.chosen else None)
                for c in (gp.chosen, *gp.runners_up)]
    from tailorfx.planner import HEADROOM
    budget = int(25.5 * (1 << 20) / (1 - HEADROOM))   # under selective recompute's peak (about 27 MiB)
    whole = tried(budget, shallow=False)
    assert "blocks offloaded to host" in whole[0][0] and whole[0][4] > 0, whole   # the ladder's, chosen
    ks = sorted(int(re.search(r"of (\d+)/10 blocks offloaded", label).group(1)) for label, *_ in whole
                if "offloaded to host" in label)
    assert ks[0] < 4 < ks[-1], whole   # the first site holds blocks 1-3 of the capture
    assert tried(budget) == whole


def deep_llama_under_selective(S: int = 256, **options):
    """An HF Llama of 17 layers (more than twice the 8 a shallow capture keeps), example input_ids
    and labels of S tokens, and a budget 2% under selective recompute's predicted peak (with
    `options`, as optimize() takes them)."""
    import copy
    import tailorfx
    from models import hf_family
    from tailorfx.planner import HEADROOM
    base = hf_family("llama", num_layers=17, hidden_size=64, intermediate_size=172, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512)
    ids = torch.randint(0, 512, (1, S), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    sel = tailorfx.optimize(copy.deepcopy(base), recompute="selective", optimizer=None, example_inputs=inputs,
                            **options)
    return base, inputs, int(0.98 * sel.predict_memory(S).peak_bytes / (1 - HEADROOM))


@pytest.mark.slow
def test_a_deep_model_is_planned_on_a_shallow_capture_of_its_config():
    """optimize(budget=) of an HF Llama of 17 layers (more than twice the 8 a shallow capture keeps)
    with example input_ids and labels, under a budget selective recompute is over: the planner
    traces the model's own step for one candidate, the plan a shallow capture of its config chose,
    and says so, and its measured peak is predicted within -2%..+3%. That the shallow capture
    predicts every candidate as the whole model does is the ladder tests' above (the search over
    this model's whole graph, every candidate traced, chose the same plan: 4-7 minutes of a 2-core
    CPU, checked until 2026-12-01)."""
    import copy
    import tailorfx
    from harness import peak_of_step
    S = 256
    base, inputs, budget = deep_llama_under_selective(S)
    m = copy.deepcopy(base)
    hinted = tailorfx.optimize(m, budget=budget, optimizer=None, example_inputs=inputs)
    plan = hinted.plan[0]
    assert "chosen on a shallow capture of its config (8 of 17 blocks), checked on this graph" in plan.reason, str(plan)
    assert all(c.label == plan.chosen.label or plan.chosen.label.startswith(c.label + " + ") for c in plan.runners_up), str(plan)
    assert "blocks, selective in the rest" in plan.chosen.label, str(plan)   # a rung of the ladder, not a free plan
    measured = peak_of_step(hinted, m, inputs)
    predicted = hinted.predict_memory(S).forward_backward_peak_bytes
    assert -0.02 <= (predicted - measured) / measured <= 0.03, (measured, predicted)


@pytest.mark.slow
def test_triton_kernels_are_planned_on_a_shallow_capture_too():
    """optimize(kernels="triton", budget=) of the 17-layer HF Llama under a budget selective
    recompute (with the kernels) is over: the plan of a shallow capture with the kernels, checked
    on the model's own graph, whose Triton kernels it keeps (tests/test_kernels_pass.py's GPU-machine
    test makes the same capture without the interpreter)."""
    import copy
    import tailorfx
    base, inputs, budget = deep_llama_under_selective(kernels="triton")
    hinted = tailorfx.optimize(copy.deepcopy(base), budget=budget, optimizer=None, example_inputs=inputs,
                               kernels="triton")
    plan = hinted.plan[0]
    assert "chosen on a shallow capture of its config (8 of 17 blocks), checked on this graph" in plan.reason, str(plan)
    assert all(c.label == plan.chosen.label or plan.chosen.label.startswith(c.label + " + ") for c in plan.runners_up), str(plan)
    assert "kernels" in plan.passes and plan.chosen.fits and plan.chosen.peak <= budget, str(plan)
    for kind in ("norm", "glu", "rope", "flash_attention", "linear_cross_entropy"):
        assert any(name.startswith(kind + "_") for name in hinted.kernel_launches()), (kind, hinted.kernel_launches())


class _HubFunction(torch.nn.Module):
    """As transformers' hub-kernel wrapper (`kernels` installed) makes of apply_rotary_pos_emb: a
    function in a module reached through a global, called inside each block."""
    def forward(self, x):
        return torch.cat((-x[..., 1:], x[..., :1]), dim=-1) * 2


_ROTATE = _HubFunction()


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + _ROTATE(self.proj(x))


class _Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_function_wrapped_as_a_global_module_is_placed_in_the_block_that_calls_it():
    """Ops inside a global module (transformers 5.25's hub-kernel wrappers) belong to the block that
    calls it: a shallow capture weights them by that block's repeats (with `kernels` installed, a
    10-layer Llama's recompute FLOPs from a shallow capture fell 2,293,760 short of the whole
    model's), and module paths name no module of the model for them."""
    from tailorfx.rewrite.regions import module_paths
    graphs = []
    model = torch.compile(_Blocks(), backend=lambda gm, _: graphs.append(gm) or gm, fullgraph=True)
    model(torch.randn(2, 8))
    d = depth.Depth(layers=3, captured=3, start=0, period=1, times=(0,), blocks_path="layers")
    inside = [n for n in graphs[0].graph.nodes if any("_ROTATE" in p for p, _ in (n.meta.get("nn_module_stack") or {}).values())]
    assert [n.target for n in inside].count(torch.cat) == 3, [n.format_node() for n in inside]
    for n in inside:
        paths = module_paths(n)
        assert d.block_of(n) == int(paths[-1].rsplit(".", 1)[-1]) and paths[-1].startswith("layers."), (n, paths)
