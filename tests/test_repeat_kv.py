"""Grouped-query attention's CPU backward on k, v repeated to every query head
(Exact(repeat_kv=True)): exact on HF families, and chosen by the planner only where it fits."""
import copy

import pytest
import torch

import tailorfx
from harness import compare_with_eager, peak_of_step, tailorfx_ops
from models import batch, hf_family
from tailorfx.attention import Exact
from tailorfx.planner import HEADROOM

REPEATED = " + attention backward on repeated k, v"


def _backward_calls(opt, inputs) -> int:
    return tailorfx_ops(lambda: opt(**inputs).loss.backward())["tailorfx::sparse_attention_backward"]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "phi3", "olmo2"])
def test_repeated_kv_backward_is_exact_on_hf_families(family):
    """4 query heads of 2 kv heads: loss and every gradient equal eager's (fp32, rtol 1e-4), and
    every layer's attention backward ran as the custom op (the repeat)."""
    holder, inputs = {}, batch(B=2, S=64)

    def wrap(m):
        holder["opt"] = tailorfx.optimize(m, passes=["attention"], attention=Exact(repeat_kv=True))
        return holder["opt"]
    compare_with_eager(hf_family(family), inputs, wrap)
    opt = holder["opt"]
    specs = {v["spec"] for r in opt.session.graphs[0].records if r.name == "attention" for v in r.stats.values()}
    assert specs == {"Exact(repeat_kv=True)"}, specs
    assert _backward_calls(opt, inputs) == opt.model.config.num_hidden_layers


@pytest.mark.slow   # make test stays under 10 minutes; make test-slow (CI) runs it
def test_the_planner_repeats_kv_only_where_it_fits():
    """Qwen2, 4 query heads of 1 kv head, 1024 tokens, fp32, forward + backward: with room the
    planner adds the repeated backward to the plan it chose (its measured peak within -2%..+3%
    of the prediction); with a budget between the two plans' peaks it keeps the plan without."""
    over = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=1)
    base = hf_family("qwen2", **over)
    ids = torch.randint(0, 4096, (1, 1024), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    m = copy.deepcopy(base)
    roomy = tailorfx.optimize(m, budget="8GB", optimizer=None, example_inputs=inputs)
    plan = roomy.plan[0]
    assert plan.chosen.label.endswith(REPEATED), str(plan)
    without = next(c for c in plan.runners_up if c.label == plan.chosen.label.removesuffix(REPEATED))
    assert without.peak < plan.chosen.peak
    assert _backward_calls(roomy, inputs) == 2
    measured = peak_of_step(roomy, m, inputs)
    predicted = roomy.predict_memory(1024).forward_backward_peak_bytes
    assert -0.02 <= (predicted - measured) / measured <= 0.03, (predicted, measured)
    between = int((without.peak + plan.chosen.peak) / 2 / (1 - HEADROOM))
    tight = tailorfx.optimize(copy.deepcopy(base), budget=between, optimizer=None, example_inputs=inputs)
    assert tight.plan[0].chosen.label == without.label, str(tight.plan[0])
    assert tight.plan[0].runners_up[-1].label == plan.chosen.label   # tried, over
