"""Recompute pass: tags honoured by the partitioner; exact numerics; measured memory."""
import copy

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

import tailorfx
from harness import compare_with_eager
from models import batch, hf_llama, tiny_llama
from tailorfx.rewrite import match


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("make", [tiny_llama, hf_llama], ids=["reference", "hf-llama"])
def test_recompute_is_exact(policy, make):
    holder = {}

    def wrap(m):
        holder["opt"] = tailorfx.optimize(m, passes=["recompute"], recompute=policy, example_inputs=batch(pad=4))
        return holder["opt"]
    compare_with_eager(make(), batch(pad=4), wrap, steps=2)
    rec = holder["opt"].graph_records[0].records[0]
    assert rec.changed and rec.stats["policy"] == policy and rec.stats["blocks"] == 2


def test_policy_tags():
    """What each policy recomputes and saves, on a 1-layer model (the expected sets by hand)."""
    tags = {}
    for policy in ("full", "selective"):
        opt = tailorfx.optimize(tiny_llama(num_layers=1), passes=["recompute"], recompute=policy,
                                example_inputs=batch())
        g = opt.graphs["recompute"]
        tags[policy] = {(match.op_name(n), n.meta["recompute"]) for n in g.graph.nodes if "recompute" in n.meta}
        if policy == "full":   # saved: only the block's output, the residual sum that leaves it
            saved = [n for n in g.graph.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_SAVE]
            assert len(saved) == 1 and all(u.meta.get("recompute") is None for u in saved[0].users), saved
            assert match.op_name(saved[0]) in ("add", "iadd"), saved
    R, S = CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.MUST_SAVE
    assert {p for _, p in tags["full"]} == {R, S}
    assert ("linear", S) in tags["selective"] and ("scaled_dot_product_attention", S) in tags["selective"]
    assert ("rsqrt", R) in tags["selective"] and ("silu", R) in tags["selective"]
    assert ("linear", R) not in tags["selective"]


def test_without_blocks_nothing_is_tagged():
    """Must not fire: recompute works at block granularity; a bare MLP has no block."""
    m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    opt = tailorfx.optimize(m, passes=["recompute"], example_inputs=(torch.randn(2, 16, 8),))
    rec = opt.graph_records[0].records[0]
    assert not rec.changed and rec.skipped == ("(graph): no transformer blocks found",)


def _mem_model():
    from tailorfx.models import LlamaConfig, LlamaLM
    torch.manual_seed(0)
    return LlamaLM(LlamaConfig(vocab_size=4000, hidden_size=256, intermediate_size=688, num_hidden_layers=3,
                               num_attention_heads=8, num_key_value_heads=2))


def _lm(S, vocab=4000):
    ids = torch.randint(0, vocab, (1, S), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def _fwd_bwd_peak(opt, model, inputs):
    def step():
        out = opt(**inputs)    # held through backward, as a training loop holds it
        out.loss.backward()
    step()
    for p in model.parameters():
        p.grad = None
    return tailorfx.measure_peak(step)


@pytest.mark.slow
def test_recompute_lowers_measured_peak_as_predicted():
    base = _mem_model()
    inputs = _lm(1024)
    rows = {}
    for name, kw in (("none", dict(passes=[])), ("full", dict(passes=["recompute"], recompute="full")),
                     ("selective", dict(passes=["recompute"], recompute="selective"))):
        m = copy.deepcopy(base)
        opt = tailorfx.optimize(m, example_inputs=_lm(64), **kw)
        measured = _fwd_bwd_peak(opt, m, inputs)
        predicted = opt.predict_memory(1024).forward_backward_peak_bytes
        rows[name] = (measured, predicted)
        assert -0.02 <= (predicted - measured) / measured <= 0.03, (name, measured, predicted)
    assert rows["full"][0] < rows["selective"][0] < rows["none"][0], rows
