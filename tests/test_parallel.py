"""Tensor parallel read off the graph: the inferred plan against the one transformers ships for
its own TP (an oracle nobody here wrote), the reasons regions stay replicated, clear errors, and,
under torchrun with gloo, loss and every gradient equal to one process."""
import json
import os
import subprocess
import sys

import pytest
import torch

from models import hf_family
from tailorfx.attention import SlidingWindow
from tailorfx.parallel.plan import plan_tensor_parallel, tp_styles
from tailorfx.parallel.spec import ParallelSpec

HERE = os.path.dirname(os.path.abspath(__file__))


def plan_of(family, **overrides):
    model = hf_family(family, vocab_size=512, **overrides)
    ids = torch.randint(0, 512, (1, 32))
    plan, blocks = plan_tensor_parallel(model, (), dict(input_ids=ids, labels=ids))
    return model, plan, blocks


def hf_styles(model) -> dict:
    """transformers' own `base_model_tp_plan`, expanded to this model's module names."""
    prefix = model.base_model_prefix
    out = {}
    for pattern, style in type(model.config).base_model_tp_plan.items():
        for i in range(model.config.num_hidden_layers):
            out[f"{prefix}.{pattern.replace('*', str(i))}"] = style
    return out


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "starcoder2", "cohere"])
def test_plan_matches_transformers_own(family):
    model, plan, blocks = plan_of(family)
    hf = hf_styles(model)
    mine = {k: v for k, v in plan.styles.items() if k in hf}
    expect = {k: ("sharded_input" if v == "replicated_with_grad_allreduce" else v) for k, v in hf.items()}
    assert {k: v.split(":")[0] for k, v in mine.items()} == expect
    assert blocks == [f"{model.base_model_prefix}.layers.{i}" for i in range(model.config.num_hidden_layers)]
    # sp="megatron" from the same graph: every norm between the groups computes on sequence shards,
    # each group's module gathers the sequence on entry, its row-parallel linears reduce-scatter
    sp = plan.sequence
    assert plan.sequence_error is None and sp["model.embed_tokens"] == "embedding_to_sequence:1"
    norms = [f for f, m in model.named_modules() if "norm" in type(m).__name__.lower() and "self_attn" not in f]
    assert norms and all(sp[f] == "sequence_parallel:1" for f in norms)
    for f, st in hf.items():
        if st == "rowwise":
            assert sp[f] == "rowwise_to_sequence:1" and sp[f.rsplit(".", 1)[0]] == "gather_sequence"
    tied = model.config.tie_word_embeddings
    assert sp["lm_head"] == ("gather_sequence" if tied else "colwise_vocab_parallel_from_sequence:1")


def test_the_plan_is_read_at_a_length_no_size_of_the_model_shares():
    """plan_tensor_parallel captures with static shapes at a prime length that divides no
    parameter, buffer or batch size (the sequence dim is then told apart by its size alone), the
    inputs cut to it; symbolic when there is none."""
    from tailorfx.rewrite.capture import distinct_length_inputs
    ids = torch.zeros(2, 64, dtype=torch.long)
    mask = torch.ones(2, 64, dtype=torch.long)
    length, args, kw = distinct_length_inputs(hf_family("llama", vocab_size=512), (), dict(input_ids=ids, attention_mask=mask))
    assert length == 17 and args == () and kw["input_ids"].shape == kw["attention_mask"].shape == (2, 17)
    # hidden 136 = 8 x 17: 17 divides a size of the model, 19 does not; 19 rows rule out 19 too
    wide = hf_family("llama", vocab_size=512, hidden_size=136, intermediate_size=272)
    assert distinct_length_inputs(wide, (), dict(input_ids=ids))[0] == 19
    assert distinct_length_inputs(wide, (), dict(input_ids=torch.zeros(19, 64, dtype=torch.long)))[0] == 23
    assert distinct_length_inputs(wide, (), dict(input_ids=torch.zeros(2, 16, dtype=torch.long))) is None
    # the length also sizes another dim of an input (a 64 x 64 batch): no cut
    assert distinct_length_inputs(wide, (), dict(input_ids=torch.zeros(64, 64, dtype=torch.long))) is None


def test_head_is_vocab_parallel_unless_tied():
    _, plan, _ = plan_of("llama")
    assert plan.styles["lm_head"] == "colwise_vocab_parallel"     # it feeds the loss: logits stay split
    assert plan.head_loss == (None, None)       # and its loss is fused with it, nothing in between
    assert plan.styles["model.embed_tokens"] == "rowwise_embedding"     # the embedding split by vocabulary too
    assert tp_styles(plan, 2, "sequence")["model.embed_tokens"] == "rowwise_embedding_to_sequence:1"
    _, plan, _ = plan_of("llama", tie_word_embeddings=True)
    assert "lm_head" not in plan.styles and "model.embed_tokens" not in plan.styles
    assert "tied to model.embed_tokens.weight" in plan.replicated["lm_head"]
    assert isinstance(plan.head_loss, str)      # not vocab-parallel: nothing to fuse, and the plan says so


def test_head_loss_fusion_reads_the_logit_transform_off_the_graph():
    # what the vocab-parallel head's fused loss must apply between the head and cross_entropy
    assert plan_of("gemma2", tie_word_embeddings=False)[1].head_loss == (30.0, None)   # c * tanh(z / c)
    assert plan_of("cohere", tie_word_embeddings=False)[1].head_loss == (None, 0.5)   # logit_scale * z
    assert plan_of("granite", tie_word_embeddings=False)[1].head_loss == (None, 0.125)   # z / logits_scaling


def test_vocab_parallel_cross_entropy_equals_torch_on_one_rank():
    # the op's math (chunks, ignored labels, sum/mean, soft-cap, scale, gradients) on a one-rank
    # group; the torchrun tests below split the vocabulary over two ranks
    import torch.distributed as dist
    import torch.nn.functional as F
    from tailorfx.runtime.vocab_parallel import register_group, vocab_parallel_cross_entropy
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        name = register_group(dist.group.WORLD)
        for softcap, scale, reduction, fp32 in [(None, None, "mean", False), (3.0, None, "sum", False),
                                                (None, 0.5, "mean", False), (None, None, "mean", True)]:
            g = torch.Generator().manual_seed(0)
            h = torch.randn(40, 16, generator=g, requires_grad=True)
            w = torch.randn(64, 16, generator=g, requires_grad=True)
            y = torch.randint(0, 64, (40,), generator=g)
            y[::7] = -100
            loss = vocab_parallel_cross_entropy(h, w, y, vocab_start=0, group_name=name, reduction=reduction,
                                                num_chunks=3, logit_softcap=softcap, logit_scale=scale,
                                                grad_weight_fp32=fp32)
            got = [loss.detach(), *torch.autograd.grad(loss, (h, w))]
            z = F.linear(h, w) * (scale or 1.0)
            if softcap:
                z = softcap * torch.tanh(z / softcap)
            ref = F.cross_entropy(z, y, ignore_index=-100, reduction=reduction)
            want = [ref.detach(), *torch.autograd.grad(ref, (h, w))]
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


def test_bad_vocab_loss_names_the_choices():
    with pytest.raises(ValueError, match="'fused'.*'loss_parallel'"):
        ParallelSpec.parse(dict(tp=2, vocab_loss="chunked"))


@pytest.mark.parametrize("family, module, reason", [
    # qkv in one projection, split after it: its column shards would mix q, k and v
    ("phi3", "model.layers.0.self_attn.qkv_proj", "fused projection"),
    # GPT-2's Conv1D is an addmm on a transposed weight: DTensor's styles shard nn.Linear only
    ("gpt2", "transformer.h.0.attn.c_attn (Conv1D)", "not an nn.Linear"),
    # OLMo-2 normalises q and k over all heads at once: a rank holding half the heads cannot
    ("olmo2", "model.layers.0.self_attn.q_proj", "reduces over the sharded features"),
    # a top-k router is a parameter matmul, not an nn.Linear, and its softmax spans the experts
    ("mixtral", "model.layers.0.mlp.gate (MixtralTopKRouter)", "not an nn.Linear"),
])
def test_unshardable_groups_stay_replicated_with_the_reason(family, module, reason):
    _, plan, _ = plan_of(family)
    assert reason in plan.replicated[module]
    assert module.split(" ")[0] not in plan.styles
    # a replicated region on the stream would need the whole sequence: sp="megatron" is refused, naming it
    assert not plan.sequence and "drop sp='megatron'" in plan.sequence_error
    assert f"{module.split(' ')[0]} computes with parameters on the residual stream" in plan.sequence_error


def test_tp_must_divide_the_heads_read_off_the_graph():
    _, plan, _ = plan_of("llama")      # 4 query heads, 2 key/value heads
    plan.check(2)
    with pytest.raises(ValueError, match=r"tp=4 does not divide the 2 heads of model.layers.0.self_attn.k_proj.*"
                                         r"choose tp in \[1, 2\]"):
        plan.check(4)


def test_a_spec_is_checked_when_made_and_reads_as_written():
    import dataclasses
    spec = ParallelSpec.parse(dict(pp=2, schedule="interleaved_1f1b"))
    assert (spec.microbatches, spec.virtual, spec.num_stages) == (2, 2, 4)     # microbatches: pp by default
    assert str(spec) == "dict(pp=2, schedule='interleaved_1f1b')"
    assert ParallelSpec.parse(spec) is spec
    with pytest.raises(ValueError, match=r"parallel=dict\(tp=0\): tp=0 is not valid: a positive int"):
        ParallelSpec(tp=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.tp = 2


@pytest.mark.parametrize("bad, msg", [
    (dict(tp=0), "tp=0 is not valid"),
    (dict(dp=2, pp=2, sp="ulysses"), "without tp/pp"),
    (dict(pp=2, schedule="zb"), r"schedule='zb' is not valid: one of \['gpipe', '1f1b', 'interleaved_1f1b', 'zb_h1'\]"),
    (dict(sp="ulysses"), "splits the sequence over the dp ranks: give dp>=2"),
    (dict(dp=2, sp="ring"), "sp=.ring. is not valid"),
    (dict(dp=2, sp="megatron"), "splits the sequence over the tp ranks .*give tp>=2"),
    (dict(tp=2, pp=2, sp="megatron"), "without pp"),
    (dict(tq=2), "unknown parallel option"),
    ([2], "give a dict"),
])
def test_bad_parallel_options_name_the_problem(bad, msg):
    with pytest.raises(ValueError, match=msg):
        ParallelSpec.parse(bad)


@pytest.mark.parametrize("kw, msg", [
    (dict(parallel=ParallelSpec(tp=2), passes=["recompute", "attention"]),
     r"parallel=dict\(tp=2\) takes \['minisequence', 'recompute'\] only, not \['attention'\]"),
    (dict(parallel=dict(pp=2), passes=["minisequence", "attention"]),
     r"pipeline stages take \['minisequence', 'recompute'\] only.*not \['attention'\].*joint graph"),
    (dict(parallel=dict(pp=2, schedule="zb_h1"), passes=["recompute"]), r"zero-bubble schedule splits each backward"),
    (dict(parallel=dict(pp=2), budget="1GB"), "plans each rank at its example batch: give example_inputs"),
    (dict(parallel=dict(tp=2, sp="megatron"), passes=["recompute"]), r"takes no single-device rewrite under sp"),
    (dict(parallel=dict(dp=2), passes=["attention"]),
     r"takes \['minisequence', 'recompute'\] only, not \['attention'\]"),
    (dict(parallel=dict(dp=2), passes=["recompute"], recompute="selective"), r"blocks are checkpointed whole"),
    (dict(parallel=dict(dp=2), passes=["recompute"], offload="checkpoints"),
     r"offload='checkpoints' under parallel=dict\(dp=2\).*nothing would be offloaded"),
    (dict(parallel="auto", budget="H100-80GB", offload="checkpoints"), r"offload='checkpoints' under parallel='auto'"),
    (dict(parallel=dict(tp=2), attention=SlidingWindow(16)),
     r"attention=SlidingWindow\(.*under parallel=dict\(tp=2\): the layouts run the model's own attention"),
    (dict(parallel=dict(dp=2), precision="bf16"), r"precision='bf16' under parallel=dict\(dp=2\)"),
    (dict(parallel=dict(pp=2), kernels="triton"), r"kernels='triton' under parallel=dict\(pp=2\)"),
])
def test_passes_and_budgets_under_parallel_say_what_runs(kw, msg):
    # refused before anything is captured or launched
    import tailorfx
    with pytest.raises(ValueError, match=msg):
        tailorfx.optimize(hf_family("llama", vocab_size=512), **kw)


def test_checkpointed_blocks_run_without_a_kv_cache():
    """A checkpointed block runs its forward again in backward: a KV cache would take its keys twice."""
    from tailorfx.parallel.apply import ParallelRuntime
    model = hf_family("llama", vocab_size=512)
    runtime = ParallelRuntime(ParallelSpec(dp=2), passes=("recompute",))
    assert runtime._without_cache(model, {"input_ids": 1})["use_cache"] is False
    with pytest.raises(ValueError, match="use_cache=True in training with recompute"):
        runtime._without_cache(model, {"use_cache": True})
    assert "use_cache" not in runtime._without_cache(model.eval(), {})          # eval: no backward
    assert "use_cache" not in ParallelRuntime(ParallelSpec(dp=2))._without_cache(model.train(), {})   # no recompute


def test_zero_bubble_is_refused_where_torchs_pipelining_loses_a_custom_ops_backward():
    """schedule="zb_h1" splits each stage's backward in two, input gradients then weight gradients
    (torch's stage_backward_input and stage_backward_weight). Torch 2.11's loses a custom op's
    backward node between the two, once the stage's outputs are gone (a tailorfx stage crashed
    inside the schedule: "'_input_metadata' is invalid for this instance of _C._FunctionBase");
    optimize() then refuses the schedule for stages with tailorfx's ops, naming them and the fix.
    The probe agrees with the split run on one of tailorfx's ops (make test: torch 2.13; make
    test-torch211: 2.11)."""
    import torch.fx as fx
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    from tailorfx import compat
    from tailorfx.parallel.apply import check_zero_bubble
    from tailorfx.runtime.linear_ops import linear_fp32_out_op
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(3, 8, dtype=torch.bfloat16))
    out = linear_fp32_out_op(x, w, None).sum()
    _, groups = stage_backward_input([out], None, [x], iter([w]))
    del out
    try:
        stage_backward_weight(iter([w]), groups)
        split = w.grad is not None and torch.allclose(w.grad.float(), x.detach().float().sum(0).expand(3, 8), rtol=1e-2)
    except RuntimeError as e:
        assert "_input_metadata" in str(e)
        split = False
    assert compat.pipelining_splits_custom_op_backward() == split
    spec = ParallelSpec(pp=2, schedule="zb_h1")
    g = fx.Graph()
    a, b = g.placeholder("x"), g.placeholder("w")
    g.output(g.call_function(linear_fp32_out_op, (a, b, None)))
    with pytest.raises(ValueError, match=r"schedule='zb_h1'.* tailorfx's linear_fp32_out .*use schedule='1f1b'"):
        check_zero_bubble(fx.GraphModule({}, g), spec, splits=False)
    check_zero_bubble(fx.GraphModule({}, g), spec, splits=True)
    plain = fx.Graph()
    a, b = plain.placeholder("x"), plain.placeholder("w")
    plain.output(plain.call_function(torch.nn.functional.linear, (a, b)))
    check_zero_bubble(fx.GraphModule({}, plain), spec, splits=False)     # no custom op: torch's split holds


def test_parallel_outside_torchrun_says_how_to_launch(monkeypatch):
    import tailorfx
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = hf_family("llama", vocab_size=512)
    ids = torch.randint(0, 512, (1, 16))
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node 2"):
        tailorfx.optimize(model, example_inputs=dict(input_ids=ids, labels=ids), parallel=dict(tp=2))


def test_each_rank_takes_its_own_device():
    """On CUDA, rank r of a node runs on cuda:LOCAL_RANK (not GPU 0), and every batch given to the
    sharded model is moved there; without CUDA, the CPU. (CUDA itself: benchmarks/gpu_check.py.)"""
    from tailorfx.parallel.apply import ParallelRuntime
    from tailorfx.runtime.tensor_parallel import on_device, rank_device
    assert rank_device({"LOCAL_RANK": "3"}, cuda_available=True) == torch.device("cuda", 3)
    assert rank_device({}, cuda_available=True) == torch.device("cuda", 0)
    assert rank_device({"LOCAL_RANK": "3"}, cuda_available=False) == torch.device("cpu")
    batch = {"input_ids": torch.ones(1, 4, dtype=torch.long), "n": 2}
    moved = on_device(((), batch), torch.device("meta"))     # any other device does: this one needs none
    assert moved[1]["input_ids"].device.type == "meta" and moved[1]["n"] == 2
    seen = {}
    ParallelRuntime(ParallelSpec(), device=torch.device("meta")).run(lambda *a, **kw: seen.update(kw), (), batch)
    assert seen["input_ids"].device.type == "meta"


def launch(nproc: int, script: str, *args, results=None, timeout: int = 400) -> subprocess.CompletedProcess:
    """tests/dist/SCRIPT on `nproc` gloo processes under torchrun."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.join(HERE, "dist", script), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"TAILORFX_RESULTS": str(results)} if results else {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def within(r: dict, low: float, high: float) -> bool:
    """Whether a rank's prediction is within low..high of one of its steps' true peak, which lies
    between the step's measured peak less the bytes it freed unseen and its measured peak (the
    profiler misses the frees gloo's worker thread makes: tests/dist/results.py)."""
    return any((1 + low) * (peak - gone) <= r["predicted"] <= (1 + high) * peak
               for peak, gone in zip(r["measured_steps"], r["unseen"]))


def torchrun(tmp_path, nproc: int, script: str, *args, runs: int = 1, timeout: int = 400) -> dict:
    """Run tests/dist/SCRIPT (one launch, several models: each process start costs seconds);
    {(rank, run): result} from the JSON file each rank writes per run, all `runs` of every rank
    there and each equal to one process."""
    out = launch(nproc, script, *args, results=tmp_path, timeout=timeout)
    rows = {tuple(p.stem.split("_", 1)): json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))}
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert len(rows) == nproc * runs, sorted(rows)
    for r in rows.values():
        assert r["ok"], r
    return rows


# Gemma-2 and Cohere with their own heads (soft-capped, scaled logits: the fused vocab-parallel loss
# takes both); Gemma-3's head is tied (replicated); Llama once more with DTensor's loss_parallel.
# Memory (a capture of the sharded model per run) on Llama, Gemma-2 (eager attention: its dropout,
# p=0, is no copy in the run, and none in the prediction) and loss_parallel
TP_FAMILIES = ["llama", "gemma2-untied", "gemma3_text:nomem", "cohere-untied:nomem", "llama:loss_parallel"]
# the fused vocab-parallel head (always under tp) computing no logits (mini-sequence), each MLP module in
# 2 sequence chunks, each block checkpointed on its tp shards (Llama, Qwen3, Gemma-2 at 256 tokens); then
# the chunks alone; then the planner under 60% of the layout's peak without rewrites: 4 blocks of Llama
# (it takes recompute). Qwen2 and Llama at 2 x 1,024 tokens, vocabulary 8192, hidden 256 (issue 66:
# the logits shard dominated, and the rewrites lowered a rank's peak by 4%; they take mini-sequence and
# recompute) are planned on the 2 x 2 mesh, its tp dimension of 2 (a third launch here took minutes)
BUDGET_RUNS = ["qwen2:budget60:v8192:s1024:h256", "llama:budget60:v8192:s1024:h256"]
TP_REWRITES = ["llama:ms:recompute:s256", "qwen3:ms:recompute:s256", "gemma2-untied:ms:recompute:s256",
               "qwen3:ms:s256", "llama:budget60:v512:s256:l4"]
SP_FAMILIES = ["llama"]     # sp="megatron": the same launch (Qwen3 runs it on the 2 x 2 mesh below)


@pytest.mark.multiprocess
def test_tp2_and_megatron_sp_equal_one_process(tmp_path):
    # the rewrites run in a launch of their own: after some captures of sharded models in one process
    # torch 2.13 makes the mesh a graph input, and a prediction refuses it (PredictionError, docs/parallel.md)
    runs = TP_FAMILIES + [f"{f}+megatron" for f in SP_FAMILIES]
    rows = torchrun(tmp_path, 2, "parallel_check.py", 2, 1, *runs, runs=len(runs))
    (tmp_path / "recompute").mkdir()
    rows |= torchrun(tmp_path / "recompute", 2, "parallel_check.py", 2, 1, *TP_REWRITES, runs=len(TP_REWRITES))
    runs += TP_REWRITES
    assert sorted(rows) == sorted((f"rank{r}", f) for r in range(2) for f in runs)
    for (_, run), r in rows.items():
        styles = r["styles"]
        assert r["sharded_params"] > 0 and "colwise" in styles.values()
        assert (r["measured"] is None) == run.endswith(":nomem")
        if styles.get("lm_head", "").startswith("colwise_vocab_parallel"):
            if run.startswith("llama:loss_parallel"):
                assert r["fused_calls"] == 0 and "loss_parallel" in r["head"], r
            else:   # proof the fused vocab-parallel loss ran, every call (two training steps, more with
                # memory measured), not the model's own on the logits, and the report's row for the head says so
                assert r["fused_calls"] >= 2 and r["unfused_calls"] == 0 and "loss fused with it" in r["head"], r
                # under mini-sequence the head built no logits shard: logits=None in training with labels, as
                # on one device; without it the model returns its logits shard
                skipped = "minisequence" in r["rewrites"]
                assert r["logits_none"] == [skipped] * 2 and ("no logits shard built" in r["head"]) == skipped, r
            if run.startswith(("gemma2", "cohere")):   # the head's output before its soft-cap or scale is
                # not kept to the loss (one logits shard more per rank)
                assert r["head_output_held_at_loss"] == [False, False], r
        else:
            assert run.startswith("gemma3_text") and "lm_head" not in styles   # tied to the embedding: replicated
        if r["sp"]:
            # proof the stream is split: every norm computes on sequence shards, every group's module
            # gathers on entry and its row-parallel linears reduce-scatter back, the head reads shards
            for i in range(2):
                p = f"model.layers.{i}"
                assert styles[f"{p}.input_layernorm"] == styles[f"{p}.post_attention_layernorm"] == "sequence_parallel:1"
                assert styles[f"{p}.self_attn"] == styles[f"{p}.mlp"] == "gather_sequence"
                assert styles[f"{p}.self_attn.o_proj"] == styles[f"{p}.mlp.down_proj"] == "rowwise_to_sequence:1"
            assert styles["model.embed_tokens"] == "rowwise_embedding_to_sequence:1"   # split by vocabulary
            assert styles["model.norm"] == "sequence_parallel:1"
            assert styles["lm_head"] == "colwise_vocab_parallel_from_sequence:1"
            # within 5% of a measured step (the memory model on the sharded graph)
            assert within(r, -0.05, 0.05), r
            continue
        assert "rowwise" in styles.values()
        # the token embedding split by vocabulary where the head is
        assert (styles.get("model.embed_tokens") == "rowwise_embedding") == styles.get("lm_head", "").startswith("colwise")
        if run in TP_REWRITES:
            # every block checkpointed (what the planner chose under the budget), every MLP in chunks,
            # below the layout's peak without rewrites, and under the budget when measured
            blocks = [f"model.layers.{i}" for i in range(4 if ":l4" in run else 2)]
            assert r["checkpointed"] == (blocks if ":recompute" in run or ":budget60" in run else []), r
            chunked = [f"{b}.mlp" for b in blocks] if "minisequence" in r["rewrites"] else []
            assert [w.split(":")[0] for w in r["rewritten"]] == chunked, r
            assert r["resident"] + r["measured"] < r["plain_peak"], r
            if ":budget60" in run:
                assert r["rewrites"] == (["recompute"] if ":l4" in run else ["minisequence", "recompute"]), r
                assert r["resident"] + r["measured"] <= r["budget"], r
            # each block's forward run again in its backward, on the sharded graph: within 3% of this
            # rank's measured peak, never 2% under
            assert within(r, -0.02, 0.03), r
            continue
        # the memory model on the sharded graph: within 5% of this rank's measured peak, never 2% under
        assert r["measured"] is None or within(r, -0.02, 0.05), r
    for rank in range(2):     # the fused loss keeps no logits-sized tensor: below loss_parallel's peak
        fused, lp = rows[(f"rank{rank}", "llama")], rows[(f"rank{rank}", "llama:loss_parallel")]
        assert fused["measured"] < 0.8 * lp["measured"], (fused, lp)


DP_RUNS = ["mistral:recompute", "llama:s96:ms:recompute", "qwen3:s96:ms:recompute", "llama:s96:budget60"]


@pytest.mark.multiprocess
def test_fsdp2_dp2_equals_one_process(tmp_path):
    # Mistral with recompute: each block checkpointed inside its FSDP unit; Llama under 60% of its
    # peak without rewrites: the planner takes what fits, and each rank is within it. Llama and Qwen3 with the LM head fused
    # with its loss, the MLPs in 2 chunks and each block recomputed: the step graph rewritten and
    # run as a chain of its blocks (96 tokens: a static graph's MLP chunks where no other dim has
    # the sequence's size)
    rows = torchrun(tmp_path, 2, "parallel_check.py", 1, 2, *DP_RUNS, runs=len(DP_RUNS))
    for (rank, run), r in rows.items():
        assert r["sharded_params"] == r["num_params"]    # every parameter is a DTensor shard
        assert r["rewrites"] == (["recompute"] if run == "mistral:recompute" else ["minisequence", "recompute"]
                                 if run.endswith("ms:recompute") else r["rewrites"] if ":budget" in run else []), r
        assert r["checkpointed"] == (["model.layers.0", "model.layers.1"] if "recompute" in r["rewrites"] else [])
        if ":budget" in run:
            assert r["rewrites"] and r["resident"] + r["measured"] <= r["budget"], r
        if ":ms" in run:     # the rewrites happened: the head fused, each MLP in 2 chunks
            assert r["rewritten"] == [f"model.layers.{i}.mlp: minisequence: 2 chunk(s) along the sequence, "
                                      f"intermediates recomputed per chunk in backward" for i in range(2)] + [
                "lm_head: minisequence: fused with its loss, 2 chunk(s), no logits kept for backward"], r
        if r["plain_peak"] is not None:     # below the layout's predicted peak without rewrites: 60% with
            # mini-sequence and recompute, 90% with recompute alone (Mistral, 128 tokens: the logits dominate)
            assert r["resident"] + r["measured"] <= (0.6 if ":ms" in run else 0.9) * r["plain_peak"], r
        # the per-rank prediction (FSDP2's gathers, prefetch and reduce-scatter buffers composed on the
        # memory model, the blocks' ops recomputed under recompute): within 3% of this rank's
        # measured peak, never 2% under; on a loaded machine gloo holds one block's all-gather output
        # past FSDP2's free in every step of a chain's (the smallest step is then that much higher)
        late = r["measured"] - r["block_bytes"]
        assert any(-0.02 <= (r["predicted"] - m) / m <= 0.03 for m in (r["measured"], late)), r


@pytest.mark.multiprocess
def test_parallel_auto_lays_out_a_world_and_equals_one_process(tmp_path):
    # optimize(parallel="auto", budget=...): every rank given the same global batch, the fastest
    # layout that fits chosen on this machine's calibration, the same on both ranks
    rows = torchrun(tmp_path, 2, "auto_check.py", "1GB", "qwen3", runs=1)
    for (_, run), r in rows.items():
        assert r["notes_agree"] and r["note"].startswith("parallel='auto': ") and "fastest of" in r["note"], r
        tp, pp, dp, sp = r["layout"]
        assert tp * pp * dp == 2 and r["note"].split(": ")[1].startswith(("dp2", "tp2", "pp2")), r


@pytest.mark.multiprocess
def test_tp2_x_dp2_on_four_processes_equals_one_process(tmp_path):
    # Qwen3 on a 2 x 2 mesh with Megatron's sequence parallelism on its tp dimension; then Llama with
    # each MLP in sequence chunks and each block checkpointed inside its FSDP unit on the 2 x 2 mesh;
    # then Qwen2 and Llama planned under 60% of the layout's peak without rewrites (issue 66's
    # configuration; without sp, every rank exact)
    rows = torchrun(tmp_path, 4, "parallel_check.py", 2, 2, "qwen3+megatron", "llama:ms:recompute:s256",
                    *BUDGET_RUNS, runs=2 + len(BUDGET_RUNS), timeout=1200)
    for (_, run), r in rows.items():
        if run in BUDGET_RUNS:
            # mini-sequence (no logits shard, the MLPs in chunks) and recompute, under the budget on every
            # rank, exact (torchrun's check); predicted within -2%..+3% of a step's true peak (within)
            assert r["rewrites"] == ["minisequence", "recompute"] and r["logits_none"] == [True, True], r
            assert r["resident"] + r["measured"] <= r["budget"], r
            assert within(r, -0.02, 0.03), r
            continue
        if run.startswith("llama"):
            assert r["checkpointed"] == ["model.layers.0", "model.layers.1"] and r["sharded_params"] > 0, r
            assert [w.split(":")[0] for w in r["rewritten"]] == ["model.layers.0.mlp", "model.layers.1.mlp"], r
            assert r["resident"] + r["measured"] < r["plain_peak"], r
            late = r["measured"] - r["block_bytes"] // 2     # as below
            assert any(-0.02 <= (r["predicted"] - m) / m <= 0.03 for m in (r["measured"], late)), r
            continue
        assert r["styles"]["model.layers.0.self_attn.q_norm"] == "sharded_input:2"   # per-head norm's grad summed
        assert r["sp"] and r["styles"]["model.layers.0.input_layernorm"] == "sequence_parallel:1"
        # as the dp chain's: on a loaded machine gloo held a block's all-gather output (here its tp
        # shard) past FSDP2's free in every step (rank 0 3.1% over the prediction, 2026-11-27)
        late = r["measured"] - r["block_bytes"] // 2
        assert any(-0.02 <= (r["predicted"] - m) / m <= 0.05 for m in (r["measured"], late)), r


@pytest.mark.multiprocess
def test_a_killed_rank_ends_the_job_with_an_error_not_a_hang():
    import time
    t = time.time()
    out = launch(2, "killed_rank.py", timeout=180)
    elapsed = time.time() - t
    assert out.returncode != 0
    assert "rank 0 step 0" in out.stdout and "rank 0 step 2" not in out.stdout
    assert "exitcode  : 3" in out.stderr          # torchrun names the rank that died and how
    assert elapsed < 60, elapsed      # the whole run, start-up included, inside the 60 s the survivors get


def cut_and_run(family, num_stages, ids, passes=(), options=None, **overrides):
    """The step graph, rewritten by `passes` as optimize(parallel=dict(pp=...)) does, cut into
    stages and run one stage after the other, in one process."""
    from tailorfx.codegen.pipeline import capture_static, cut_stages
    from tailorfx.parallel.plan import rewrite_step
    from tailorfx.parallel.stages import block_costs, stage_blocks
    from tailorfx.rewrite.capture import seq_info
    from tailorfx.rewrite.regions import find_regions
    model = hf_family(family, num_layers=4, vocab_size=512, **overrides)
    gm, example, kw = capture_static(model, dict(input_ids=ids, labels=ids))
    regions = find_regions(gm, seq_info(gm, None))
    stage_of = {b: i for i, blocks in enumerate(stage_blocks(block_costs(gm, regions), num_stages)) for b in blocks}
    gm, _ = rewrite_step(gm, passes, options)
    regions = find_regions(gm, seq_info(gm, None))
    block_stage = {n: stage_of[b.path] for b in regions.of_kind("block") for n in b.nodes}
    stages = cut_stages(gm, example, model, block_stage, num_stages, kw)
    sent = ()
    for stage in stages:
        sent = stage(*sent, **kw)
        sent = sent if isinstance(sent, tuple) else (sent,)
    return model, stages, sent[0]


def stage_ops(stage) -> set[str]:
    return {getattr(n.target, "__name__", str(n.target)) for n in stage.gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("family,passes", [("llama", ()), ("qwen3", ()), ("llama", ("minisequence",)),
                                           ("gemma2", ("minisequence",))])
def test_the_step_graph_cut_into_stages_computes_the_step(family, passes):
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    # two chunks: 64 tokens, so the chunks are real (the default takes one per 1,024 tokens)
    untied = {"tie_word_embeddings": False} if family == "gemma2" else {}
    model, stages, loss = cut_and_run(family, 4, ids, passes, {"minisequence_chunks": 2}, **untied)
    # the rewrite happened where it should: the last stage's head is fused with its loss (Gemma-2's
    # soft-cap inside it), no stage computes logits, and every stage's MLPs run in chunks
    fused = [i for i, st in enumerate(stages) if "chunked_linear_cross_entropy" in stage_ops(st)]
    assert fused == ([len(stages) - 1] if passes else [])
    for st in stages:
        ops = stage_ops(st)
        assert ("token_chunked" in str(ops)) == bool(passes), ops
    loss.sum().backward()
    ref = hf_family(family, num_layers=4, vocab_size=512, **untied)
    out = ref(input_ids=ids, labels=ids)
    out.loss.backward()
    assert torch.allclose(loss.sum(), out.loss, rtol=1e-5)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    # each stage holds the model's own parameters, every parameter on exactly one stage
    held = [id(p) for s in stages for p in s.parameters()]
    assert sorted(held) == sorted(id(p) for p in model.parameters())
    assert all(len(list(s.parameters())) > 0 for s in stages)


def test_a_chain_of_block_stages_computes_the_step_at_its_shape_only():
    """dp's chain (apply_chain, in one process): the rewritten step graph cut into a piece per block
    runs as one module; loss and every gradient equal eager's (tied embeddings too: one process
    accumulates the shared weight's two gradients), and a batch of another shape is refused."""
    from tailorfx.codegen.pipeline import StageChain, capture_static, chain_stages, cut_stages, loss_only
    from tailorfx.parallel.plan import describe_rewrites, rewrite_step
    from tailorfx.rewrite.capture import seq_info
    from tailorfx.rewrite.regions import find_regions
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    model, ref = hf_family("gemma2", vocab_size=512), hf_family("gemma2", vocab_size=512)
    gm, example, kw = capture_static(model, dict(input_ids=ids, labels=ids, use_cache=False))
    gm, records = rewrite_step(loss_only(gm), ("minisequence",), {"minisequence_chunks": 2})
    rewritten = dict(describe_rewrites(records))      # the head fused with its loss, each MLP in 2 chunks
    assert rewritten["lm_head"].startswith("minisequence: fused with its loss, 2 chunk(s)")
    assert all(rewritten[f"model.layers.{i}.mlp"].startswith("minisequence: 2 chunk(s)") for i in range(2))
    blocks = find_regions(gm, seq_info(gm, None)).of_kind("block")
    pieces = cut_stages(gm, example, model, chain_stages(gm, [b.nodes for b in blocks]), len(blocks) + 2, kw,
                        shared=True)
    assert len(pieces) == 4 and all(len(list(p.parameters())) for p in pieces)
    chain = StageChain(pieces, {"input_ids": tuple(ids.shape), "labels": tuple(ids.shape)})
    loss = chain(input_ids=ids, labels=ids)
    loss.backward()
    out = ref(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(loss, out.loss, rtol=1e-5, atol=1e-6)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match=r"captured for inputs of shapes .*'input_ids': \(2, 24\).*got .*\(2, 16\)"):
        chain(input_ids=ids[:, :16], labels=ids[:, :16])


def test_tied_weights_across_stages_are_refused_with_the_fix():
    ids = torch.randint(0, 512, (1, 16))
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight = lm_head.weight is read on pipeline stages \[0, 1\].*"
                                         r"tie_word_embeddings=False"):
        cut_and_run("gemma2", 2, ids)


PIPELINES = [(f, s) for f in ("llama", "qwen3", "mistral") for s in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")]
PP_BUDGET = "budget60:s1024:v8192:h256"


@pytest.mark.multiprocess
def test_pipeline_schedules_equal_one_process(tmp_path):
    from tailorfx import simulate_schedule
    # memory on Llama's runs (each rank's prediction captures the model again: seconds per run)
    # then Llama and Qwen3 under 1F1B with the MLPs in 2 chunks and each block recomputed (":rc")
    runs = [f"{f}:{s}" + (":mem" if f == "llama" else "") for f, s in PIPELINES]
    runs += ["llama:1f1b:mem:rc", "qwen3:1f1b:rc", "llama:1f1b:mem:rc:s256"]
    # and Qwen2 planned under a budget at issue 66's configuration (1,024 tokens a micro-batch,
    # vocabulary 8192, hidden 256; Llama's is planned on pp=2 x dp=2, below: each run plans on every
    # rank, a minute of a 2-core CPU)
    runs.append(f"qwen2:1f1b:mem:{PP_BUDGET}")
    rows = torchrun(tmp_path, 2, "pipeline_check.py", 1, 4, *runs, runs=len(runs), timeout=900)
    for (rank, run), r in rows.items():
        # the S x S mask transformers traces without a KV cache, proved causal and dropped from the
        # graph the stages are cut from (each stage held it and sent it on to the next), k and v
        # grouped as the eager forward passes them (traced with the mask, they were repeated)
        assert len(r["sdpa_masks"]) == 4 and set(r["sdpa_masks"]) == {"None/True"}, r["sdpa_masks"]
        if ":budget60" in run:
            # 60% of the layout's predicted peak without rewrites: the default (mini-sequence) does not
            # fit, mini-sequence with each block recomputed does, and each rank's measured step stays within
            assert r["ok"] and r["rewrites"] == ["minisequence", "recompute"], r
            assert r["resident"] + r["measured"] <= r["budget"], r
            assert -0.02 <= (r["predicted"] - r["measured"]) / r["measured"] <= 0.03, r
            continue
        if ":rc" in run:
            # the rewrites happened: 2 chunks, each block checkpointed (its rank keeps less than without)
            assert "fused with its loss, 2 chunk(s)" in r["report"] and "2 chunk(s) along the sequence" in r["report"]
            assert r["report"].count("recompute: activation checkpointing") == 4, r["report"]
            if run.startswith("llama"):
                if ":s256" not in run:
                    assert r["measured"] < 0.9 * rows[(rank, "llama_1f1b_1x1")]["measured"], r
                # each rank's prediction within 3% of its measured peak, never 2% under (32 and 256
                # tokens: the recomputed blocks walked through the schedule)
                assert -0.02 <= (r["predicted"] - r["measured"]) / r["measured"] <= 0.03, r
            continue
        stages = 4 if r["schedule"] == "interleaved_1f1b" else 2
        assert len(r["stages"]) == stages and all(r["stages"])       # the graph was cut, every stage has blocks
        assert r["bubble"] == pytest.approx(float(simulate_schedule(r["schedule"], 2, 4, virtual=stages // 2).bubble))
        assert (r["loss"] is not None) == (rank == "rank1")           # the loss lives on the last stage's rank
        # the default rewrites ran on the step graph before it was cut (the report says where)
        assert "fused with its loss" in r["report"] and "1 chunk(s) along the sequence" in r["report"], r["report"]
        # each rank's memory predicted through the schedule's actions: within -2%/+5% of its measured
        # peak, every schedule and rank (the last stage keeps what its forward leaves, not its logits)
        if r["measured"] is None:
            continue
        assert -0.02 <= (r["predicted"] - r["measured"]) / r["measured"] <= 0.05, r


@pytest.mark.multiprocess
def test_tp2_x_pp2_and_pp2_x_fsdp2_on_four_processes_equal_one_process(tmp_path):
    # one launch, two layouts on the mesh (pp, dp, tp): tp=2 inside each pipeline stage, then
    # dp=2 with each stage one fully_shard unit (each dp rank runs its own rows through the pipeline)
    # then pp=4 alone: the middle stages receive and send, each rank's memory predicted
    # then pp=2 x dp=2 under 60% of the layout's peak without rewrites, issue 66's configuration
    # (Llama; Qwen2's on pp=2 alone, above)
    runs = ["qwen3:zb_h1", "llama:1f1b", "mistral:gpipe", "llama:1f1b:mem@1x2", "llama:1f1b:mem@1x1"]
    runs.append(f"llama:1f1b:mem:{PP_BUDGET}@1x2")
    rows = torchrun(tmp_path, 4, "pipeline_check.py", 2, 4, *runs, runs=len(runs), timeout=1500)
    for (rank, run), r in rows.items():
        if ":budget60" in run:
            # mini-sequence and recompute (the default does not fit), exact (torchrun's check), each
            # rank's parameters plus its measured step within the budget, predicted within -2%..+3%
            assert r["rewrites"] == ["minisequence", "recompute"] and r["dp"] == 2, r
            assert r["resident"] + r["measured"] <= r["budget"], r
            assert -0.02 <= (r["predicted"] - r["measured"]) / r["measured"] <= 0.03, r
            continue
        if run.endswith("1x1"):
            assert len(r["stages"]) == 4 and (r["loss"] is not None) == (rank == "rank3")
            # a middle stage's chunked MLP makes its three weight gradients at once beside the held
            # ones (were 10-12% under before the walk counted that)
            assert -0.02 <= (r["predicted"] - r["measured"]) / r["measured"] <= 0.05, r
            continue
        assert len(r["stages"]) == 2 and (r["loss"] is not None) == (rank in ("rank2", "rank3"))
        if run.endswith("2x1"):
            assert r["sharded"] > 0                               # TP shards inside pipeline stages
            continue
        # the gradients (DTensor shards, full_tensor()) equal one process's
        assert r["dp"] == 2 and r["sharded"] == r["num_params"] > 0
        if r["measured"] is None:
            continue
        # each rank's prediction (the pipeline walk with the stage's gathered parameters and its
        # reduce-scatter input) within -2%/+5% of the smallest of three measured steps; gloo
        # sometimes frees the stage's all-gather output late, one more copy of its parameters
        err = (r["predicted"] - r["measured"]) / r["measured"]
        assert -0.02 <= err <= 0.05, r
        assert max(r["measured_steps"]) <= r["measured"] + r["stage_param_bytes"] * 1.01, r


def test_ulysses_slices_shift_labels_over_the_whole_sequence():
    from tailorfx.runtime.ulysses import shard_batch
    ids = torch.arange(16).reshape(2, 8)
    labels = ids.clone()
    labels[0, 0] = -100
    parts = [shard_batch(dict(input_ids=ids, labels=labels), rank=r, size=2) for r in range(2)]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], 1), ids)
    assert torch.equal(torch.cat([p["position_ids"] for p in parts], 1), torch.arange(8).expand(2, 8))
    shifted = torch.cat([p["shift_labels"] for p in parts], 1)
    assert torch.equal(shifted[:, :-1], labels[:, 1:]) and bool((shifted[:, -1] == -100).all())
    assert int(parts[0]["num_items_in_batch"]) == int(parts[1]["num_items_in_batch"]) == 14
    with pytest.raises(ValueError, match="sequence length divisible by 3"):
        shard_batch(dict(input_ids=ids, labels=labels), rank=0, size=3)


@pytest.mark.parametrize("kw, msg", [(dict(softcap=50.0), "softcap=50.0: use tp/dp/pp"),
                                     (dict(), r"must divide the 2 key/value heads: use dp in \[1, 2\]")])
def test_ulysses_refuses_what_it_cannot_compute_exactly(kw, msg):
    from tailorfx.runtime.ulysses import ulysses_attention
    q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=msg):
        ulysses_attention(None, q, kv, kv, None, group=None, size=4 if not kw else 2, **kw)


@pytest.mark.multiprocess
def test_ulysses_sp2_equals_one_process(tmp_path):
    for r in torchrun(tmp_path, 2, "ulysses_check.py", "llama", "qwen3", "qwen2", runs=3).values():
        assert r["attention"] == "tailorfx_ulysses"      # the model's attention was swapped
        # each rank's prediction within -2%/+5% of the smallest of ten measured steps: gloo holds
        # all-to-all buffers longer on some steps (docs/parallel.md, Per-rank memory)
        assert -0.02 <= (r["predicted"] - r["measured"]) / r["measured"] <= 0.05, r
