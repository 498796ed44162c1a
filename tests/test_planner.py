"""Budget planner: plans that fit (measured on real steps), BudgetError, max_seq_len."""
import copy

import pytest
import torch

import tailorfx
from harness import step_total
from tailorfx.models import LlamaConfig, LlamaLM
from tailorfx.budget import format_bytes
from tailorfx.planner import HEADROOM

VOCAB = 8000


def model():
    """HF LlamaForCausalLM (it returns logits with the loss), random weights, train mode."""
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(HFConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                     num_attention_heads=8, num_key_value_heads=2)).train()


def lm(S):
    ids = torch.randint(0, VOCAB, (1, S), generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, "labels": ids.clone()}


def steady_state_total(opt, m, inputs) -> int:
    """Parameters + optimizer state + the measured peak of a second full step (forward, backward,
    step), trained as the plan says (tailorfx.SetupOptimizer: the step in backward if it moved)."""
    setup = getattr(opt, "setup", None)
    o = tailorfx.SetupOptimizer(m.parameters(), setup, lr=1e-4) if setup is not None else \
        torch.optim.AdamW(m.parameters(), lr=1e-4)
    return step_total(opt, m, inputs, o)


@pytest.mark.slow
def test_planner_meets_a_loose_budget_and_the_one_budget_error_suggests():
    """A loose budget: only the LM head is fused with the loss (it recomputes nothing and never
    materialises the logits), and the measured step is within the planner's headroom of its
    prediction. An infeasible budget: BudgetError suggests one below eager's measured step, and
    the plan chosen for it is met when measured (trained as the plan says)."""
    S = 1024
    base = model()
    m = copy.deepcopy(base)
    loose = tailorfx.optimize(m, budget="100GB", example_inputs=lm(S))
    plan = loose.plan[0]
    # everything fits: nothing that recomputes, and (GQA on the CPU) the faster attention backward
    assert plan.chosen.label == "fused LM head + attention backward on repeated k, v"
    # a plan that recomputes nothing fits, so none that recomputes was traced
    assert [c.label for c in plan.runners_up] == ["fused LM head", "no memory rewrite"], str(plan)
    stats = {k: v for r in loose.session.graphs[0].records if r.changed and r.name == "minisequence"
             for k, v in r.stats.items()}
    assert {v["kind"] for v in stats.values()} == {"lm_head_loss"}, stats   # the head, not the MLPs
    assert steady_state_total(loose, m, lm(S)) <= plan.chosen.peak / (1 - HEADROOM)
    smallest = min([plan.chosen.peak] + [c.peak for c in plan.runners_up])
    with pytest.raises(tailorfx.BudgetError) as e:
        tailorfx.optimize(copy.deepcopy(base), budget=smallest // 2, example_inputs=lm(S))
    msg = str(e.value)
    assert "cannot be met" in msg and "Use a budget of at least" in msg and format_bytes(e.value.suggested_bytes) in msg
    assert e.value.dominant in ("weights", "master weights", "optimizer state", "gradients", "activations and transients")
    assert e.value.smallest_bytes <= smallest       # the full search reaches at least the probe's smallest
    eager = copy.deepcopy(base)
    suggested = e.value.suggested_bytes
    assert e.value.smallest_bytes < suggested < steady_state_total(eager, eager, lm(S))
    m = copy.deepcopy(base)
    opt = tailorfx.optimize(m, budget=suggested, example_inputs=lm(S))
    assert opt.plan[0].passes
    measured = steady_state_total(opt, m, lm(S))
    assert measured <= suggested, (measured, suggested, str(opt.plan[0]))


@pytest.mark.slow
def test_max_seq_len_orders_the_plans():
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2)
    lens = {tuple(p): tailorfx.max_seq_len(cfg, "1GiB", passes=p)
            for p in ([], ["recompute"], ["minisequence", "recompute"])}
    assert lens[()] < lens[("recompute",)] < lens[("minisequence", "recompute")]
    # the default: every block's token-wise segments chunked as well
    assert tailorfx.max_seq_len(cfg, "1GiB") > lens[("minisequence", "recompute")]


@pytest.mark.slow
def test_max_seq_len_is_what_fits_when_measured():
    """The predicted longest length really fits, measured on a real step (vanilla plan)."""
    base = model()
    S = tailorfx.max_seq_len(copy.deepcopy(base), "300MiB", passes=[])
    assert 256 < S
    m = copy.deepcopy(base)
    opt = tailorfx.optimize(m, passes=[], example_inputs=lm(64))
    assert steady_state_total(opt, m, lm(S)) <= 300 * 2**20
    # and, past the planner's headroom for prediction error, 256 more does not
    assert steady_state_total(opt, m, lm(int(S / (1 - HEADROOM)) + 256)) > 300 * 2**20


@pytest.mark.slow
def test_max_seq_len_and_the_bound_plan_for_the_device_the_planner_plans_for(monkeypatch):
    """Planned for a GPU (a model on one, without a budget preset: this CPU plays it by
    planner.plans_for_cpu answering False), max_seq_len predicts without the CPU's blocked
    attention backward, which the planner does not offer there, so optimize() fits its length;
    and the bound lets checkpoints wait in host memory, as the planner's last candidate there does."""
    from models import hf_family
    base = hf_family("qwen2", vocab_size=2048, hidden_size=128, intermediate_size=344, num_attention_heads=2,
                     num_key_value_heads=1, max_position_embeddings=1 << 16)
    budget = 4 * sum(p.numel() * 4 for p in base.parameters()) + (40 << 20)
    cpu = tailorfx.max_seq_len(copy.deepcopy(base), budget, granularity=256)
    cpu_bound = tailorfx.sequence_bound(copy.deepcopy(base), budget, granularity=256).seq_len
    monkeypatch.setattr(tailorfx.planner, "plans_for_cpu", lambda device, setup: False)
    gpu = tailorfx.max_seq_len(copy.deepcopy(base), budget, granularity=256)
    assert gpu < cpu   # the full-length fp32 accumulator of the unblocked backward
    ids = torch.randint(0, 2048, (1, gpu))
    opt = tailorfx.optimize(copy.deepcopy(base), budget=budget, optimizer="adamw", verify=False,
                            example_inputs={"input_ids": ids, "labels": ids.clone(), "use_cache": False})
    assert "attention backward in blocks" not in str(opt.plan[0]) and opt.plan[0].chosen is not None, str(opt.plan[0])
    gpu_bound = tailorfx.sequence_bound(copy.deepcopy(base), budget, granularity=256)
    assert gpu_bound.seq_len > cpu_bound == tailorfx.sequence_bound(base, budget, granularity=256, offload=False).seq_len


def test_static_part_too_large_is_a_clear_error():
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=4)
    with pytest.raises(tailorfx.BudgetError, match="before any activation"):
        tailorfx.max_seq_len(cfg, "100MiB")


def test_the_blocked_attention_backward_is_tried_last():
    """Its cost is speed the FLOP count does not show: evaluated only when no other plan fits,
    and then chosen; never when the user gave an attention spec of their own."""
    from dataclasses import replace

    from tailorfx.attention import SlidingWindow
    from tailorfx.planner import Plan, budget_candidates, last_resort, search
    cands = budget_candidates(Plan(("attention",)), num_blocks=2, has_head=True)
    assert [last_resort(c) for c in cands] == [False] * (len(cands) - 1) + [True]
    assert not any(map(last_resort, budget_candidates(Plan(("attention",), {"attention": SlidingWindow(64)}), 2)))

    def chosen_and_tried(fitting: set) -> tuple:
        tried = []

        def evaluate(c):
            tried.append(c.label)
            return replace(c, peak=1 if c.label in fitting else 10, fits=c.label in fitting, added_flops=0), None
        return search(cands, evaluate, 5, "5 B", lambda _: {"activations": 10})[0].label, tried
    label, tried = chosen_and_tried({cands[-2].label, cands[-1].label})
    assert label == cands[-2].label and cands[-1].label not in tried
    label, tried = chosen_and_tried({cands[-1].label})
    assert label == cands[-1].label == tried[-1]


def test_the_ladder_that_saves_attention_is_bisected_from_the_full_ladders_smallest_k():
    """Past selective recompute, two ladders of the first k blocks: recomputed whole, or whole but
    their attention (saved: its forward not run again, more bytes a block). Each is bisected for its
    smallest k that fits, the second from the first's (a block of it saves more), and the plan with
    the fewest recomputed FLOPs taken. A model without attention has the first ladder only, as has
    offload="activations" (its ladder offloads, recomputes nothing whole)."""
    import re
    from dataclasses import replace

    from tailorfx.planner import Plan, budget_candidates, search
    cands = budget_candidates(Plan(("attention",)), num_blocks=10, has_head=True)
    full = [c for c in cands if re.search(r"full recompute, \d+/10", c.label)]
    but = [c for c in cands if "full recompute but attention" in c.label]
    assert len(full) == len(but) == 10 and all(dict(c.options)["recompute_policy"] == "full-except-attention" for c in but)
    assert not any("but attention" in c.label for c in budget_candidates(Plan(("attention",)), 10, has_attention=False))
    offloaded = budget_candidates(Plan(("attention",), {"offload": "activations"}), 10)
    assert not any("but attention" in c.label for c in offloaded)
    tried = []

    def evaluate(c):   # peaks: whole 100 - 10k, whole but attention 100 - 8k; FLOPs 10k and 3k
        tried.append(c.label)
        k = dict(c.options).get("recompute_blocks")
        per = (10, 10) if c in full else (8, 3) if c in but else None
        peak, flops = (100 - per[0] * k, per[1] * k) if per else (200 if "recompute" not in c.passes
                                                                    or "selective" in c.label else 10, 99)
        return replace(c, peak=peak, fits=peak <= 60, added_flops=flops), None
    chosen = search(cands, evaluate, 62, "62 B", lambda _: {"activations": 100}, allocator_headroom=0.0)[0]
    assert chosen.label.startswith("minisequence + full recompute but attention, 5/10 blocks"), chosen
    ks = [int(re.search(r"(\d+)/10", t).group(1)) for t in tried if "but attention" in t]
    assert ks and min(ks) >= 4 and len(ks) <= 3, tried   # from the first ladder's k = 4: log2 of 7 rungs


def test_a_hint_that_does_not_fit_is_traced_once():
    """The hinted candidate is tried first; when it is over the budget the search goes on without
    tracing it again, and still finds the plan that fits."""
    from dataclasses import replace

    from tailorfx.planner import Plan, budget_candidates, recomputes_nothing, search
    cands = budget_candidates(Plan(("attention",)), num_blocks=4, has_head=True)
    tried = []

    def evaluate(c):
        tried.append(c.label)
        fits = c is cands[-1]
        return replace(c, peak=1 if fits else 10, fits=fits, added_flops=0), None
    hint = next(c.label for c in cands[:-1] if "recompute" in c.passes)
    chosen = search(cands, evaluate, 5, "5 B", lambda _: {"activations": 10}, hint=hint)[0]
    assert tried[0] == hint and chosen.label == cands[-1].label
    assert len(tried) == len(set(tried)) and hint in tried and len(tried) > 2


def test_a_shallow_captures_plan_is_checked_on_the_trace_the_lowering_makes(monkeypatch):
    """optimize(budget=) given a shallow capture's plan (shallow.py's hint; here its CPU variant,
    GQA's backward on repeated k, v) takes it unsearched and predicts it on the trace the lowering
    makes of the rewritten graph: one AOTAutograd trace of the step, not three (the planner's of the
    candidate, of its variant, then the lowering's). A hint over the budget on this graph is dropped
    (one graph recorded) for the search's plan, whose peak the hinted plan's is to the byte."""
    from models import hf_family
    from tailorfx import api, compat
    from tailorfx.shallow import Hint
    base = hf_family("llama", num_layers=2, hidden_size=64, intermediate_size=172, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512)
    ids = torch.randint(0, 512, (1, 256), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    sel = tailorfx.optimize(copy.deepcopy(base), recompute="selective", optimizer=None, example_inputs=inputs)
    budget = int(0.98 * sel.predict_memory(256).peak_bytes / (1 - HEADROOM))   # selective is over

    def planned(hint):
        monkeypatch.setattr(api, "shallow_hint", lambda *a, **kw: hint)
        traces = []
        real = compat.aot_module_simplified
        monkeypatch.setattr(compat, "aot_module_simplified", lambda *a, **kw: traces.append(1) or real(*a, **kw))
        opt = tailorfx.optimize(copy.deepcopy(base), budget=budget, optimizer=None, example_inputs=inputs)
        monkeypatch.setattr(compat, "aot_module_simplified", real)
        return opt, len(traces)
    # before any search: its traces are kept by content (rewrite/trace_cache.py), and would serve the hint's
    hinted, traces = planned(Hint("minisequence + full recompute but attention, 2/2 blocks", False, "2 of 2",
                                  variant=True))
    over, over_traces = planned(Hint("minisequence", False, "2 of 2"))
    searched = over.plan[0]   # the hint dropped: the search's plan, every candidate traced
    assert "shallow capture" not in searched.reason and searched.chosen.fits, str(searched)
    assert "minisequence" in [c.label for c in searched.runners_up if not c.fits], str(searched)
    plan = hinted.plan[0]
    assert searched.chosen.label == "minisequence + full recompute but attention, 2/2 blocks + attention backward " \
                                    "on repeated k, v", str(searched)
    assert traces == 1 and plan.chosen.label == searched.chosen.label and plan.chosen.fits, (traces, str(plan))
    assert (plan.chosen.peak, plan.chosen.added_flops) == (searched.chosen.peak, searched.chosen.added_flops)
    assert "chosen on a shallow capture of its config (2 of 2 blocks), checked on this graph" in plan.reason
    assert len(over.graph_records) == 1 and over_traces > 1


@pytest.mark.slow   # 46 s: four Inductor compiles and a search under Inductor
def test_under_inductor_a_shallow_captures_plan_is_checked_on_the_code_the_lowering_compiles(monkeypatch):
    """Under lowering="inductor" (a CUDA model's default) a shallow capture's plan is taken unsearched
    too, and predicted on the code Inductor generates in the lowering's own compile, read off it
    (inductor_schedule.Recorder): no code generated a second time for the memory model
    (inductor_schedule.trace, which the search runs for every candidate). Its peak is the search's to
    the byte; a hint over the budget is dropped for the search's plan."""
    from models import hf_family
    from tailorfx import api
    from tailorfx.rewrite import inductor_schedule
    from tailorfx.shallow import Hint
    base = hf_family("llama", num_layers=2, hidden_size=64, intermediate_size=172, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512)
    ids = torch.randint(0, 512, (1, 256), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    sel = tailorfx.optimize(copy.deepcopy(base), recompute="selective", optimizer=None, example_inputs=inputs,
                            lowering="inductor")
    budget = int(0.98 * sel.predict_memory(256).peak_bytes / (1 - HEADROOM))   # selective is over
    traces, real = [], inductor_schedule.trace
    monkeypatch.setattr(inductor_schedule, "trace", lambda *a, **kw: traces.append(1) or real(*a, **kw))

    def planned(hint):
        monkeypatch.setattr(api, "shallow_hint", lambda *a, **kw: hint)
        traces.clear()
        opt = tailorfx.optimize(copy.deepcopy(base), budget=budget, optimizer=None, example_inputs=inputs,
                                lowering="inductor")
        return opt, len(traces)
    label = "minisequence + full recompute but attention, 1/2 blocks, selective in the rest"
    hinted, hinted_traces = planned(Hint(label, False, "2 of 2", variant=True))
    over, over_traces = planned(Hint("minisequence", False, "2 of 2"))
    plan, found = hinted.plan[0], over.plan[0]   # the hint over the budget dropped: the search's plan
    assert "shallow capture" not in found.reason and over_traces > 1 and len(over.graph_records) == 1, str(found)
    assert "minisequence" in [c.label for c in found.runners_up if not c.fits], str(found)
    assert found.chosen.label == label + " + attention backward on repeated k, v", str(found)
    assert hinted_traces == 0 and plan.chosen.fits, (hinted_traces, str(plan))
    assert plan.chosen.label == found.chosen.label, str(plan)
    assert "chosen on a shallow capture of its config (2 of 2 blocks), checked on this graph" in plan.reason
    assert (plan.chosen.peak, plan.chosen.added_flops) == (found.chosen.peak, found.chosen.added_flops)
    assert hinted.session.graphs[0].step.bw_schedule is not None   # the lowering's, kept as the graph's trace
    assert torch.allclose(hinted(**inputs).loss, copy.deepcopy(base)(**inputs).loss, rtol=1e-5, atol=0)


def test_the_search_traces_no_plan_that_recomputes_more_than_one_that_fits_and_chooses_as_trying_all():
    """With each candidate's recomputed FLOPs known before it is traced (counted on its rewritten
    graph), no candidate recomputing more than a fitting one already evaluated is evaluated, and
    the plan chosen is the one trying every candidate would choose. A ladder whose peak falls by the
    same bytes a block is searched along the line through two rungs: at most four evaluations of
    32 rungs, where halving takes five or six."""
    import random
    import re
    from dataclasses import replace

    from tailorfx.planner import Plan, budget_candidates, ladders, last_resort, search, usable
    cands = budget_candidates(Plan(("attention",)), num_blocks=32, has_head=True)
    rng = random.Random(0)
    for case in range(40):
        p0, s_full = rng.randrange(600, 1000), rng.randrange(5, 20)
        s_but = rng.randrange(2, s_full)   # a block recomputed but its attention saves less
        fixed = {c.label: (rng.randrange(p0, 2000), rng.randrange(0, 3)) for c in cands}
        budget = rng.randrange(p0 - 31 * s_but, p0)
        fits = lambda peak: peak <= usable(budget)   # noqa: E731  (as planner.with_result decides)

        def model(c):   # (peak, FLOPs)
            k = dict(c.options).get("recompute_blocks")
            if isinstance(k, int):
                full = dict(c.options)["recompute_policy"] == "full"
                return p0 - (s_full if full else s_but) * k, (10 if full else 3) * k + 50
            peak, rank = fixed[c.label]
            if "recompute" not in c.passes:
                return peak, 0
            return (peak if rank else rng.randrange(300, 2 * p0)), 400 + 100 * rank
        results = {c.label: model(c) for c in cands}
        order = []

        def evaluate(c):
            peak, flops = results[c.label]
            order.append((flops, fits(peak)))
            return replace(c, peak=peak, added_flops=flops, fits=fits(peak)), None
        try:
            chosen = search(cands, evaluate, budget, "b", lambda _: {"activations": 1},
                            flops=lambda c: results[c.label][1])[0]
        except tailorfx.BudgetError:
            chosen = None
        fitting = sorted((f, dict(c.options).get("recompute_blocks") or 0, p, c.label) for c in cands
                         for p, f in [results[c.label]] if fits(p) and not last_resort(c))
        fitting = fitting or sorted((f, 0, p, c.label) for c in cands for p, f in [results[c.label]]
                                    if fits(p) and last_resort(c))
        assert (chosen.label if chosen else None) == (fitting[0][3] if fitting else None), case
        for i, (f, _) in enumerate(order):
            assert all(f <= g for g, ok in order[:i] if ok), (case, order)
        ladder_evals = [t for t in order if t[0] >= 50 and t[0] < 400]
        assert len(ladder_evals) <= 2 * 4, (case, len(ladder_evals))
    assert len(ladders([c for c in cands if re.search(r"\d+/32", c.label)])) == 2


def test_the_second_ladders_last_rung_is_tried_when_no_rung_of_the_first_fits():
    """The second ladder (whole blocks but their attention) is searched from the first's smallest k
    that fits, a block of the first saving more; where none of the first fits, the second's last
    rung is still tried: at all blocks a whole block's recompute can peak higher (found on a 2-block
    Llama, where the bisection fell back to a plan recomputing a third more)."""
    from dataclasses import replace

    from tailorfx.planner import Plan, budget_candidates, recomputes_nothing, search
    cands = budget_candidates(Plan(("attention",)), num_blocks=4, has_head=True)
    tried = []

    def evaluate(c):
        tried.append(c.label)
        k = dict(c.options).get("recompute_blocks")
        but = dict(c.options).get("recompute_policy") == "full-except-attention"
        fits = (but and k == 4) or c.label == "minisequence segments"
        flops = 3 * k if isinstance(k, int) else 0 if recomputes_nothing(c) else 99
        return replace(c, peak=1 if fits else 10, fits=fits, added_flops=flops), None
    chosen = search(cands, evaluate, 5, "5 B", lambda _: {"activations": 10})[0]
    assert chosen.label == "minisequence + full recompute but attention, 4/4 blocks", (chosen.label, tried)
