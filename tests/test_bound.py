"""The lower bound on every plan's peak (rewrite/bound.py, tailorfx.sequence_bound): made of what it
says, and never beaten by a measured plan."""
import copy

import pytest
import torch

import tailorfx
from harness import peak_of_step
from models import hf_family

SIZES = dict(vocab_size=2048, hidden_size=128, intermediate_size=344, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=1 << 16)


def _inputs(S, vocab=2048):
    ids = torch.randint(0, vocab, (1, S))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


@pytest.mark.slow   # make test stays under 10 minutes; make test-slow (CI) runs it
def test_bound_parts_are_the_blocks_inputs_the_residual_gradient_and_the_attention_operands():
    """Qwen2 at 4096 tokens, hidden 128 (2 query heads, 1 KV head of 64): by hand, 2 block inputs
    and a residual gradient of S x 128 fp32, and q, k, v, o (S x 128, S x 64, S x 64, S x 128) and
    their gradients."""
    S, H = 4096, 128
    b = tailorfx.sequence_bound(hf_family("qwen2", **SIZES), None, seq_len=S, optimizer=None)
    assert b.parts == {"block boundaries": 2 * S * H * 4, "residual-stream gradient": S * H * 4,
                       "attention operands and their gradients": 2 * (2 * S * H + 2 * S * 64) * 4}
    assert b.kind == "device-only"
    # checkpoints in host memory: the device holds only the last block's input of the boundaries
    off = tailorfx.sequence_bound(hf_family("qwen2", **SIZES), None, seq_len=S, optimizer=None, offload=True)
    assert off.parts["block boundaries"] == S * H * 4 and off.kind == "host-offload"
    # a tied embedding and head (Gemma-2): the head's share of the weight's gradient waits for the
    # embedding's, through every block's backward
    tied = tailorfx.sequence_bound(hf_family("gemma2", **SIZES, head_dim=64), None, seq_len=S, optimizer=None)
    assert tied.parts["tied weights' gradient"] == 2048 * H * 4


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_no_measured_plan_beats_the_bound(family):
    """The plans that save the most (max_seq_len's: segments, full recompute, the attention
    backward in blocks), and none, measured at 1024 tokens (forward + backward above
    what was live before): none peaks below the bound's dynamic bytes."""
    S = 1024
    base = hf_family(family, **SIZES, **({"head_dim": 64} if family == "gemma2" else {}))
    floor = tailorfx.sequence_bound(base, None, seq_len=S, optimizer=None).dynamic_bytes
    plans = [dict(passes=[]),
             dict(passes=["attention", "minisequence", "recompute"], recompute="full"),
             dict(passes=["attention", "minisequence", "recompute"], recompute="full", minisequence="segments",
                  attention=tailorfx.attention.Exact(backward_blocks=16))]
    for kw in plans:
        m = copy.deepcopy(base)
        opt = tailorfx.optimize(m, example_inputs=_inputs(64), optimizer=None, **kw)
        peak = peak_of_step(opt, m, _inputs(S))
        assert peak >= floor, (kw, peak, floor)


@pytest.mark.slow   # make test stays under 10 minutes; make test-slow (CI) runs it
def test_the_report_states_the_limit():
    """opt.report() next to the chosen plan: the bound at the length seen (the plan's peak is at
    least that), and the longest length the bound fits in the budget (sequence_bound's)."""
    m = hf_family("qwen2", **SIZES)
    budget = 4 * sum(p.numel() * 4 for p in m.parameters()) + (64 << 20)
    opt = tailorfx.optimize(m, budget=budget, example_inputs=_inputs(1024), verify=False)
    text = " ".join(str(opt.report()).split())
    # the plan keeps its checkpoints on the device: the bound it is compared with is the device-only one
    assert "the limit at S=1024 (device-only): no device-only plan of these rewrites peaks below" in text, text[:2000]
    assert float(text.split("this plan's peak is ")[1].split("x that")[0]) >= 1.0
    longest = int(text.split("any device-only plan could fit in ")[1].split(": ")[1].split(" tokens")[0].replace(",", ""))
    assert longest == tailorfx.sequence_bound(hf_family("qwen2", **SIZES), budget).seq_len
