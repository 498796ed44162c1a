"""Checkpoint offload (rewrite/offload.py): each recomputed block's saved input waits for the backward
in host memory. On the CPU the host copy lives outside torch's allocator (runtime/offload.py), so
the measured device peak falls by what the memory model counts as host bytes. Under the eager
lowering and under Inductor."""
import copy

import pytest
import torch

import tailorfx
from tailorfx.budget import format_bytes
from harness import compare_with_eager, peak_of_step, tailorfx_ops
from models import batch, hf_family

FAMILIES = ["llama", "qwen2", "gemma2", "phi3", "gpt2"]
PASSES = ["attention", "minisequence", "recompute"]


@pytest.mark.parametrize("family,lowering", [(f, "eager") for f in FAMILIES] + [("llama", "inductor"),
                                                                                  ("qwen2", "inductor")])
def test_checkpoint_offload_is_exact_and_fires(family, lowering):
    """Under either lowering (Inductor: its own partitioner's graphs, offloaded after it partitions)."""
    holder = {}

    def wrap(m):
        holder["opt"] = tailorfx.optimize(m, passes=PASSES, recompute="full", offload="checkpoints",
                                          lowering=lowering, example_inputs=batch(pad=4))
        return holder["opt"]
    inputs = batch(pad=4)
    compare_with_eager(hf_family(family), inputs, wrap, steps=2)
    opt = holder["opt"]
    rec = next(r for r in opt.graph_records[0].records if r.name == "recompute")
    assert rec.stats["offloaded"] == 2 and all("offloaded to host" in t for t in rec.touched), rec
    ops = tailorfx_ops(lambda: opt(**inputs).loss.backward())
    # a copy out per block's checkpoint in the forward, one back in the backward; the first block's
    # (the embedding's output) only where the partitioner saves it rather than looking it up again
    assert ops["tailorfx::offload"] == ops["tailorfx::reload"] in (1, 2), ops


def test_each_reload_is_prefetched_one_block_ahead_and_counted():
    """The backward issues each block's reload when the block after it starts its backward (all
    but the first reload, which has no block before it), waits for it (`reloaded`) just before its
    first reader, and the memory model holds the prefetched checkpoint from its issue: its timeline
    rises by one checkpoint, batch x tokens x hidden fp32, at each reload."""
    from tailorfx.runtime.offload import RELOAD, RELOADED
    inputs = batch(pad=4)
    opt = tailorfx.optimize(hf_family("llama", num_layers=3), passes=PASSES, recompute="full",
                            offload="checkpoints", example_inputs=inputs)
    opt(**inputs).loss.backward()
    bw = opt.graph_records[0].step.bw.graph
    order = {n: i for i, n in enumerate(bw.nodes)}
    reloads = sorted((n for n in bw.nodes if n.target is RELOAD), key=order.__getitem__)
    assert len(reloads) == 3, bw

    def wait_and_readers(r):
        waits = [u for u in r.users if u.target is RELOADED]
        readers = sorted((u for u in r.users if u.target is not RELOADED), key=order.__getitem__)
        assert len(waits) == 1 and order[waits[0]] < order[readers[0]], (r, r.users)
        return waits[0], readers
    for prev, r in zip(reloads, reloads[1:]):
        prev_wait, prev_readers = wait_and_readers(prev)
        wait, _ = wait_and_readers(r)
        # issued before the previous block's recompute and backward, waited for after them
        assert order[prev_wait] < order[r] < order[prev_readers[0]] < order[prev_readers[-1]] < order[wait]
        matmuls = [n for n in bw.nodes if order[r] < order[n] < order[wait] and n.target is torch.ops.aten.mm.default]
        assert len(matmuls) >= 7, matmuls   # the block's q, k, v, o, gate, up, down projections at least
    checkpoint = 2 * 40 * 64 * 4
    points = opt.predict_memory().timeline.points
    at = {name: k for k, (phase, name, _) in enumerate(points) if phase.startswith("backward")}
    for r in reloads:
        k = at[r.name]
        assert points[k][2] - points[k - 1][2] == checkpoint, points[k - 1:k + 1]


def _lm(S, vocab):
    ids = torch.randint(0, vocab, (1, S), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.slow   # make test stays under 10 minutes; make test-slow (CI) runs it
def test_offload_lowers_the_measured_device_peak_as_predicted(lowering):
    """Measured fwd+bwd peak of the device (torch's allocator) with and without offload, each
    within the memory model's -2%/+3%; the host holds every block's output, hidden-sized fp32
    (the first block's input, the embedding's output, is not a checkpoint: it stays). Under
    Inductor the prediction reads the offload's buffers off its generated code."""
    L, S = 6, 4096
    base = hf_family("llama", num_layers=L, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                     num_key_value_heads=1, use_cache=False)
    rows = {}
    for name, kw in (("full", {}), ("offload", {"offload": "checkpoints"})):
        m = copy.deepcopy(base)
        # Inductor compiled at the length it runs (a training loop's static shapes: one compile)
        opt = tailorfx.optimize(m, passes=PASSES, minisequence="segments", recompute="full", lowering=lowering,
                                example_inputs=_lm(64 if lowering == "eager" else S, base.config.vocab_size), **kw)
        measured = peak_of_step(opt, m, _lm(S, base.config.vocab_size))
        est = opt.predict_memory(S)
        rows[name] = (measured, est)
        assert -0.02 <= (est.forward_backward_peak_bytes - measured) / measured <= 0.03, (name, measured, est.summary())
    checkpoint = S * base.config.hidden_size * 4
    assert rows["full"][1].host_bytes == 0 and rows["offload"][1].host_bytes == L * checkpoint
    assert rows["full"][0] - rows["offload"][0] >= checkpoint, (rows["full"][0], rows["offload"][0])


def test_offload_option_is_checked():
    with pytest.raises(ValueError, match="offload='all' is not valid: 'checkpoints'"):
        tailorfx.optimize(hf_family("llama"), offload="all")


@pytest.mark.slow
def test_the_planner_offloads_on_a_gpu_budget_no_device_only_plan_meets():
    """An 8-layer Llama on fake tensors at 8192 tokens under a GPU budget (CUDA's costs modelled):
    the smallest budget any plan meets (BudgetError's suggestion) is met only by offloading
    checkpoints, the planner's last candidate; every device-only plan is over it. The host then
    holds each block's output, bf16."""
    from models import hf_config
    from tailorfx.budget import Budget
    from tailorfx.sizing import plan_for_budget
    L, S = 8, 8192
    cfg = hf_config("llama", num_layers=L, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                    num_key_value_heads=1, use_cache=False)
    with pytest.raises(tailorfx.BudgetError, match="checkpoints offloaded to host") as err:
        plan_for_budget(cfg, Budget(50 << 20, "50 MiB GPU", "sm90"), S, setup="pure-bf16")
    opt = plan_for_budget(cfg, Budget(err.value.suggested_bytes, "GPU", "sm90"), S, setup="pure-bf16")
    plan = opt.plan[0]
    assert plan.chosen.label.endswith("checkpoints offloaded to host"), plan
    assert plan.runners_up and all(not c.fits for c in plan.runners_up), plan
    assert opt.predict_memory().host_bytes == L * S * 256 * 2


def test_the_report_shows_the_host_bytes():
    opt = tailorfx.optimize(hf_family("llama"), passes=["recompute"], offload="checkpoints", example_inputs=batch())
    text = " ".join(str(opt.report()).split())   # the report wraps its lines at the console's width
    est = opt.predict_memory()
    assert est.host_bytes == 2 * 2 * 40 * 64 * 4   # 2 blocks' outputs, batch 2 x 40 tokens x hidden 64, fp32
    assert f"host memory {format_bytes(est.host_bytes)} (offloaded checkpoints)" in text, text
