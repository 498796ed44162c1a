"""Budget planner: plans that fit (measured on real steps), BudgetError, max_seq_len."""
import copy

import pytest
import torch

import tailorfx
from tailorfx.models import LlamaConfig, LlamaLM
from tailorfx.planner import HEADROOM

VOCAB = 8000


def model():
    torch.manual_seed(0)
    return LlamaLM(LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=2))


def lm(S):
    ids = torch.randint(0, VOCAB, (1, S), generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, "labels": ids.clone()}


def steady_state_total(opt, m, inputs) -> int:
    """Parameters + AdamW state + the measured peak of a second full step (forward, backward, step)."""
    o = torch.optim.AdamW(m.parameters(), lr=1e-4)

    def step():
        out = opt(**inputs)     # held through backward and the step, as a training loop holds it
        out.loss.backward()
        o.step()
    step()   # compiles and creates the optimizer state
    for p in m.parameters():
        p.grad = None
    peak = tailorfx.measure_peak(step)
    state = sum(t.numel() * t.element_size() for s in o.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    params = sum(p.numel() * p.element_size() for p in m.parameters())
    return params + state + peak


def test_planner_fits_three_budgets():
    S = 1024
    base = model()
    probe = tailorfx.optimize(copy.deepcopy(base), budget="100GB", example_inputs=lm(S))
    plan = probe.plan[0]
    assert plan.chosen.label == "no memory rewrite"   # everything fits: nothing is rewritten
    peaks = sorted([plan.chosen.peak] + [c.peak for c in plan.runners_up])
    smallest, vanilla = peaks[0], plan.chosen.peak
    budgets = {"loose": int(vanilla * 1.1), "medium": (smallest + vanilla) // 2, "tight": int(smallest * 1.06)}
    for name, budget in budgets.items():
        m = copy.deepcopy(base)
        opt = tailorfx.optimize(m, budget=budget, example_inputs=lm(S))
        chosen = opt.plan[0]
        measured = steady_state_total(opt, m, lm(S))
        assert measured <= budget, (name, measured, budget, str(chosen))
        if name == "loose":
            assert "recompute" not in chosen.passes and chosen.chosen.added_flops == 0
        else:
            assert chosen.passes, name


def test_impossible_budget_names_the_smallest():
    with pytest.raises(tailorfx.BudgetError) as e:
        tailorfx.optimize(model(), budget="1MB", example_inputs=lm(256))
    msg = str(e.value)
    assert "budget 1MB" in msg and "cannot be met" in msg and "Use a budget of at least" in msg
    assert e.value.smallest_bytes > 2 * sum(p.numel() * 4 for p in model().parameters())   # weights + state
    assert e.value.dominant in ("weights", "master weights", "optimizer state", "gradients", "activations and transients")


def test_infeasible_budget_on_an_hf_model_names_one_that_is_met_when_measured():
    """HF Llama (logits returned with the loss): the budget BudgetError suggests is accepted, its
    plan's measured step fits it, and it is below eager's measured step."""
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM
    torch.manual_seed(0)
    base = LlamaForCausalLM(HFConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).train()
    inputs = lm(1024)
    eager = copy.deepcopy(base)
    eager_total = steady_state_total(eager, eager, inputs)
    with pytest.raises(tailorfx.BudgetError) as e:
        tailorfx.optimize(copy.deepcopy(base), budget=eager_total // 20, example_inputs=inputs)
    suggested = e.value.suggested_bytes
    assert e.value.smallest_bytes < suggested < eager_total
    torch._dynamo.reset()
    m = copy.deepcopy(base)
    opt = tailorfx.optimize(m, budget=suggested, example_inputs=inputs)
    assert opt.plan[0].passes                                 # a memory rewrite was needed ...
    assert steady_state_total(opt, m, inputs) <= suggested     # ... and it keeps the promise


def test_max_seq_len_orders_the_plans():
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2)
    lens = {tuple(p): tailorfx.max_seq_len(cfg, "1GiB", passes=p)
            for p in ([], ["recompute"], ["minisequence", "recompute"])}
    assert lens[()] < lens[("recompute",)] < lens[("minisequence", "recompute")]
    assert tailorfx.max_seq_len(cfg, "1GiB") == lens[("minisequence", "recompute")]


def test_max_seq_len_is_what_fits_when_measured():
    """The predicted longest length really fits, measured on a real step (vanilla plan)."""
    base = model()
    S = tailorfx.max_seq_len(copy.deepcopy(base), "300MiB", passes=[])
    assert 256 < S
    torch._dynamo.reset()
    m = copy.deepcopy(base)
    opt = tailorfx.optimize(m, passes=[], example_inputs=lm(64))
    assert steady_state_total(opt, m, lm(S)) <= 300 * 2**20
    # and, past the planner's headroom for prediction error, 256 more does not
    assert steady_state_total(opt, m, lm(int(S / (1 - HEADROOM)) + 256)) > 300 * 2**20


def test_static_part_too_large_is_a_clear_error():
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=4)
    with pytest.raises(tailorfx.BudgetError, match="before any activation"):
        tailorfx.max_seq_len(cfg, "100MiB")


@pytest.mark.slow
def test_max_seq_len_8b_config():
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8)
    S = tailorfx.max_seq_len(cfg, "A100-80GB", passes=["minisequence", "recompute"], dtype=torch.bfloat16)
    assert S > 32768   # vanilla fits under 3K tokens; the time it takes is in benchmarks/paper_table.py
