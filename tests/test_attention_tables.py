"""Masks and biases built once at a maximum length and sliced to the sequence (the hand-written
forms of tests/table_models.py; MPT's ALiBi): the attention pass proves them as the model builds
them, at lengths up to the table's, and swaps the attention; the result is exact."""
from __future__ import annotations

import pytest
import torch

import tailorfx
from harness import compare_with_eager
from models import batch
from table_models import FORMS, TableLM
from tailorfx.rewrite import match


def optimized(model, S=48):
    """The default plan on `model`, checked against eager (loss and every gradient): the plan."""
    holder = {}

    def wrap(m):
        holder["opt"] = tailorfx.optimize(m, example_inputs=batch(S=S), predict=False)
        return holder["opt"]
    compare_with_eager(model, batch(S=S), wrap)
    return holder["opt"]


def records(opt):
    return {r.name: r for r in opt.graph_records[0].records}


@pytest.mark.parametrize("form", FORMS)
def test_a_table_sliced_to_the_length_is_proved_and_swapped(form):
    opt = optimized(TableLM(form=form))
    rec = records(opt)
    assert rec["attention"].touched == ("blocks.0.attn", "blocks.1.attn"), rec["attention"].skipped
    st = rec["attention"].stats["blocks.0.attn"]
    # evaluated as built: the 256-long tables sliced to each length checked
    assert st["causal"] and "(tables of 256 sliced to each)" in st["mask"], st
    assert ("key bias" in st["mask"]) == (form == "alibi"), st
    assert not {match.op_name(n) for n in opt.graphs["attention"].graph.nodes} & {"softmax", "matmul", "masked_fill"}
    assert any(t.startswith("lm_head") for t in rec["minisequence"].touched)   # the rest of the plan applies


def test_a_table_sliced_off_the_diagonal_is_left():
    """The same M x M table sliced one row down lets query i see key i + 1: refused, and said why."""
    opt = tailorfx.optimize(TableLM(form="shifted"), example_inputs=batch(S=48), predict=False)
    att = records(opt)["attention"]
    assert att.touched == () and len(att.skipped) == 2
    assert "lets queries see later keys at S=2" in att.skipped[0], att.skipped


@pytest.mark.slow   # make test keeps the hand-written forms; make test-slow (CI) runs the family
def test_mpts_alibi_table_is_a_key_bias():
    """MPT builds its ALiBi at max_seq_len and slices the last s keys (Max(0, 4096 - s) onwards):
    under the graph's guard s <= 4096 that is one bias per key, swapped in as one."""
    from transformers import MptConfig, MptForCausalLM
    torch.manual_seed(0)
    cfg = MptConfig(d_model=64, n_heads=4, n_layers=2, vocab_size=512, max_seq_len=4096,
                    attn_config={"alibi": True}, use_cache=False)
    opt = optimized(MptForCausalLM(cfg))
    att = records(opt)["attention"]
    assert att.touched == ("transformer.blocks.0.attn", "transformer.blocks.1.attn"), att.skipped
    assert "key bias" in att.stats["transformer.blocks.0.attn"]["mask"]
