"""Recompute pass: tags honoured by the partitioner; exact numerics; measured memory."""
import copy
import warnings

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

import tailorfx
from harness import compare_with_eager, flops_run, peak_of_step
from models import VOCAB, batch, hf_family, hf_llama, tiny_llama
from tailorfx.passes.recompute import Recompute
from tailorfx.planner import HEADROOM
from tailorfx.rewrite import match
from tailorfx.rewrite.capture import capture_graphs
from tailorfx.rewrite.passes import PassContext
from tailorfx.rewrite.regions import find_regions


@pytest.mark.parametrize("policy", ["full", "full-except-attention", "selective"])
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


def _attention_forwards(opt, model, inputs) -> int:
    """The attention forward kernels one training step runs (the profiler's count of ATen calls)."""
    from torch.profiler import profile
    with profile() as prof:
        opt(**inputs).loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(e.count for e in prof.key_averages()
               if e.key.startswith("aten::_scaled_dot_product_flash_attention") and not e.key.endswith("_backward"))


def test_full_except_attention_runs_each_attention_forward_once():
    """Policy "full-except-attention" (the planner's second ladder): each block's attention is saved,
    every other op recomputed, so a step runs each attention's forward once where "full" runs it
    again in backward, and it saves each attention's output and statistics more than "full", less
    than "selective" (HF Llama, 3 blocks, 256 tokens: the counts by the profiler, the bytes saved at
    the forward's end by the memory model, against their closed form)."""
    ids = torch.randint(0, VOCAB, (1, 256), generator=torch.Generator().manual_seed(0))
    inputs, rows = {"input_ids": ids, "labels": ids.clone()}, {}
    for policy in ("full", "full-except-attention", "selective"):
        m = hf_llama(num_layers=3)
        opt = tailorfx.optimize(m, passes=["recompute"], recompute=policy, example_inputs=inputs)
        g = opt.graphs["recompute"]
        tags = {(match.op_name(n), n.meta["recompute"]) for n in g.graph.nodes if "recompute" in n.meta}
        rows[policy] = (_attention_forwards(opt, m, inputs), opt.predict_memory().saved_bytes, tags)
    R, S = CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.MUST_SAVE
    assert [rows[p][0] for p in rows] == [6, 3, 3], rows   # full: 3 blocks' attention again in backward
    tags = rows["full-except-attention"][2]
    assert ("scaled_dot_product_attention", S) in tags and ("scaled_dot_product_attention", R) not in tags
    assert ("linear", R) in tags and ("linear", S) not in tags and ("rsqrt", R) in tags
    # more saved than "full": per block the fp32 attention output (T x hidden) and its log-sum-exp (heads x T)
    T, hidden, heads = 256, m.config.hidden_size, m.config.num_attention_heads
    assert rows["full-except-attention"][1] - rows["full"][1] == 3 * 4 * (T * hidden + heads * T), rows
    assert rows["full-except-attention"][1] < rows["selective"][1], rows


@pytest.mark.parametrize("family,minisequence", [("llama", "mlp"), ("gemma2", "mlp"), ("llama", "segments")])
def test_the_recompute_flops_planned_are_the_matmuls_a_step_runs_again(family, minisequence):
    """The planner's added FLOPs (cost.recompute_flops) of whole blocks recomputed around their
    chunked MLPs are the matmul FLOPs a step runs more, by the profiler. Llama: the MLP's output is
    read in backward only where it is saved (the block's output, after the residual add), so its
    region's forward is not run again, only its tail in its own backward (until 2026-12-06 its
    whole forward was counted, down_proj's too). Gemma-2: a norm reads it, so it runs again. A block's
    token-wise segments chunked (minisequence="segments"): each is read, so each runs again, then its
    chunks' forward in its own backward (until 2026-12-06 counted once)."""
    from tailorfx import compat
    from tailorfx.rewrite import cost
    inputs, runs, planned = batch(), [], []
    for passes in (["minisequence"], ["minisequence", "recompute"]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = tailorfx.optimize(hf_family(family), passes=passes, recompute="full", minisequence=minisequence,
                                    example_inputs=inputs)
        g = opt.graph_records[0].rewritten
        op = "token_segment" if minisequence == "segments" else "token_chunked"
        assert sum(op in str(n.target) for n in g.graph.nodes) >= 2   # a region of each block replaced
        runs.append(flops_run(opt, inputs, attention=True))
        planned.append(cost.recompute_flops(g, compat.size_hint, matmuls_only=True))
    assert planned[0] > 0 and planned[1] - planned[0] == runs[1] - runs[0] > 0, (planned, runs)


def test_full_except_attention_says_where_no_attention_op_is_saved():
    """Must not fire where it cannot: Gemma-2's soft-capped attention, captured as matmuls and a
    softmax (only the recompute pass asked for), has no attention op to save; its blocks are
    recomputed whole and the pass says so for each. HF Llama's SDPA is saved, nothing said."""
    for family, unsaved in (("gemma2", 2), ("llama", 0)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = tailorfx.optimize(hf_family(family), passes=["recompute"], recompute="full-except-attention",
                                    example_inputs=batch())
        rec = opt.graph_records[0].records[0]
        assert rec.changed and len(rec.skipped) == unsaved, rec.skipped
        assert all("no attention op to save" in line for line in rec.skipped), rec.skipped


@pytest.mark.slow
def test_full_except_attention_is_exact_under_inductor():
    """The CUDA default's lowering: HF Llama (2 blocks) under mini-sequence and policy
    "full-except-attention" compiled by Inductor, exact against eager (loss and every gradient, two
    steps), each attention's forward run once a step."""
    holder = {}

    def wrap(m):
        holder["opt"] = tailorfx.optimize(m, passes=["minisequence", "recompute"], recompute="full-except-attention",
                                          lowering="inductor", example_inputs=batch(pad=4))
        holder["model"] = m
        return holder["opt"]
    compare_with_eager(hf_llama(), batch(pad=4), wrap, steps=2)
    rec = next(r for r in holder["opt"].graph_records[0].records if r.name == "recompute")
    assert rec.changed and rec.stats["policy"] == "full-except-attention" and rec.stats["blocks"] == 2, rec.stats
    assert _attention_forwards(holder["opt"], holder["model"], batch(pad=4)) == 2


def _linear_tags(gm) -> dict:
    """{block path: the set of tags its linear ops carry}."""
    from tailorfx.rewrite.regions import module_paths
    out: dict = {}
    for n in gm.graph.nodes:
        if match.op_name(n) == "linear" and "recompute" in n.meta:
            block = next(p for p in module_paths(n) if p.split(".")[-1].isdigit())
            out.setdefault(block, set()).add(n.meta["recompute"])
    return out


def test_full_in_the_first_blocks_selective_in_the_rest():
    """The planner's ladder past selective recompute: the first k blocks recomputed whole (their
    linears recomputed), the rest selectively (their linears saved); each block its own graph id."""
    (c,), _ = capture_graphs(tiny_llama(num_layers=3), (), batch())
    ctx = PassContext(find_regions(c.gm, c.seq), c.seq)
    res = Recompute({"recompute_policy": "full", "recompute_blocks": 1, "recompute_rest": "selective"}).run(c.gm, ctx)
    assert res.stats["blocks"] == 1 and res.stats["rest"] == {"policy": "selective", "blocks": 2}, res.stats
    tags = _linear_tags(res.gm)
    R, S = CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.MUST_SAVE
    assert [tags[b] for b in sorted(tags)] == [{R}, {S}, {S}], tags
    ids = {n.meta["ac_graph_id"] for n in res.gm.graph.nodes if "ac_graph_id" in n.meta}
    assert ids == {1, 2, 3}
    assert [line.split(" (")[1] for line in res.touched] == ["full)", "selective)", "selective)"], res.touched
    with pytest.raises(ValueError, match="recompute_rest must be one of"):
        Recompute({"recompute_rest": "full"})


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama"])   # Qwen2 too took 3-5 more minutes of a 2-core CPU
def test_the_planner_recomputes_whole_blocks_only_where_selective_recompute_is_over(family):
    """An HF Llama (4 blocks, 1,024 tokens) under a budget 2% under selective recompute of every
    block's peak, which the ladder's rungs the search tried are below: the chosen plan recomputes k blocks whole
    but their attention (at 1,024 tokens of hidden 128 the attention's forward outweighs the
    projections of a block more) and the rest selectively, fewer FLOPs than any other plan that
    fits, the ladder recomputing attention too among them; exact against eager (loss and every
    gradient, two steps), and its measured peak predicted within -2%..+3%."""
    S = 1024
    base = hf_family(family, num_layers=4, hidden_size=128, intermediate_size=344, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=2048)
    ids = torch.randint(0, 2048, (1, S), generator=torch.Generator().manual_seed(3))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    with pytest.raises(tailorfx.BudgetError) as err:   # the smallest budget a plan meets: the search tries the ladder
        tailorfx.optimize(copy.deepcopy(base), budget=1 << 20, optimizer=None, example_inputs=inputs,
                          verify=False)
    tight = tailorfx.optimize(copy.deepcopy(base), budget=err.value.suggested_bytes, optimizer=None,
                              example_inputs=inputs, verify=False)
    tried = {c.label: c for c in (tight.plan[0].chosen, *tight.plan[0].runners_up)}
    selective = tried["minisequence + selective recompute, all blocks"]
    ladder = [c for label, c in tried.items() if label.endswith("selective in the rest")]
    assert ladder and all(c.peak < selective.peak for c in ladder), tried
    budget = int(0.98 * selective.peak / (1 - HEADROOM))   # selective recompute of every block just over it

    m = copy.deepcopy(base)
    opt = tailorfx.optimize(m, budget=budget, optimizer=None, example_inputs=inputs)
    chosen = opt.plan[0].chosen
    assert "full recompute but attention" in chosen.label and "selective in the rest" in chosen.label, str(opt.plan[0])
    assert all(chosen.added_flops < c.added_flops for c in opt.plan[0].runners_up if c.fits), str(opt.plan[0])
    assert any(c.fits and "full recompute, " in c.label for c in opt.plan[0].runners_up), str(opt.plan[0])
    rec = next(r for r in opt.graph_records[0].records if r.name == "recompute")
    k = rec.stats["blocks"]
    assert rec.stats["policy"] == "full-except-attention", rec.stats
    assert 0 < k < 4 and rec.stats["rest"] == {"policy": "selective", "blocks": 4 - k}, rec.stats
    measured = peak_of_step(opt, m, inputs)
    predicted = opt.predict_memory(S).forward_backward_peak_bytes
    assert -0.02 <= (predicted - measured) / measured <= 0.03, (measured, predicted)

    def wrap(model):
        return tailorfx.optimize(model, budget=budget, optimizer=None, example_inputs=inputs)
    compare_with_eager(copy.deepcopy(base), inputs, wrap, steps=2)


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


@pytest.mark.parametrize("passes", [None, ("minisequence", "recompute")], ids=["default", "named"])
def test_a_forward_without_grad_under_checkpointing_is_rewritten_without_recompute(passes):
    """A forward under torch.no_grad in train mode with checkpointing on (KTO's KL term, a reference
    forward): no backward, so the plan leaves recompute out (AOTAutograd's inference path refused
    its tags around SDPA, an op it counts as random, and the graph ran as captured, nothing
    rewritten, with a warning); the other rewrites run, exact, and the training step recomputes."""
    import warnings
    from tailorfx.planner import NO_BACKWARD
    model, inputs = hf_llama(2), batch(2, 64)
    with torch.no_grad():
        want = copy.deepcopy(model)(**inputs).loss
    opt = tailorfx.optimize(model, passes=passes, strict=passes is not None)
    opt.gradient_checkpointing_enable()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(passes failed|requested rewrites not applied)")
        with torch.no_grad():
            got = opt(**inputs).loss
    rec = opt.session.graphs[-1]
    assert not rec.failed and "recompute" not in rec.plan.passes, (rec.failed, rec.plan)
    assert passes is None or rec.plan.reason.endswith(NO_BACKWARD)
    assert any(r.name == "minisequence" and r.changed for r in rec.records)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    opt(**inputs).loss.backward()
    assert "recompute" in opt.session.graphs[-1].plan.passes
