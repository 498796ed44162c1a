"""Property test: random small HF configs, batch sizes, odd lengths, padding and pass sets. Every
run equals eager (loss and every gradient), and every requested rewrite fired or was reported.

CI runs a short profile (2 examples); `make test-long` runs the long one
(TAILORFX_PROPERTY_EXAMPLES=200).
"""
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tailorfx
from harness import compare_with_eager
from models import hf_family

EXAMPLES = int(os.environ.get("TAILORFX_PROPERTY_EXAMPLES", "2"))
KIND = {"attention": "attention", "minisequence": "mlp", "recompute": "block"}


@st.composite
def cases(draw):
    family = draw(st.sampled_from(["llama", "qwen2", "mistral", "gpt2", "phi3"]))
    B = draw(st.integers(1, 4))
    S = draw(st.integers(5, 33))
    pad = draw(st.integers(0, min(4, S - 2)))
    use_mask = draw(st.booleans())
    passes = draw(st.lists(st.sampled_from(sorted(KIND)), min_size=1, max_size=3, unique=True))
    seed = draw(st.integers(0, 2 ** 16))
    return family, B, S, pad, use_mask, sorted(passes), seed


def _inputs(B, S, pad, use_mask, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 512, (B, S), generator=g)
    labels = ids.clone()
    batch = {"input_ids": ids, "labels": labels}
    if pad:
        labels[:, S - pad:] = -100
        if use_mask:   # right padding, as a collator makes it
            mask = torch.ones(B, S, dtype=torch.long)
            mask[:, S - pad:] = 0
            batch["attention_mask"] = mask
    return batch


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_random_models_equal_eager_and_report_every_request(case):
    family, B, S, pad, use_mask, passes, seed = case
    holder = {}

    def wrap(m):
        holder["opt"] = tailorfx.optimize(m, passes=passes)
        return holder["opt"]
    compare_with_eager(hf_family(family, seed=seed % 7), _inputs(B, S, pad, use_mask, seed), wrap)
    opt = holder["opt"]
    for g in opt.graph_records:
        if g.failed:   # the graph ran as captured: the report says so
            assert g.warnings
            continue
        assert len(g.regions.of_kind("block")) == 2, [r.path for r in g.regions.regions]
        for rec in g.records:
            kinds = [KIND[rec.name]] + (["lm_head_loss"] if rec.name == "minisequence" else [])
            said = {t.split(" ")[0] for t in rec.touched} | {s.split(":")[0] for s in rec.skipped} | set(rec.stats)
            for kind in kinds:
                for region in g.regions.of_kind(kind):
                    assert region.path in said, (rec.name, region.path, rec.touched, rec.skipped)
