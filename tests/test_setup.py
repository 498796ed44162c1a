"""TrainingSetup: the memory model per setup against measured full steps, the optimizer in
backward against a normal step, and the errors a wrong setup gets.

Measured full step = bytes of the parameters, buffers, optimizer state and master weights that
exist (summed from the real tensors) + tailorfx.measure_peak (allocator events) of forward,
backward and optimizer step on the second step, when the optimizer state already exists.
"""
import copy

import pytest
import torch

import tailorfx
from models import batch
from tailorfx.budget import format_bytes
from tailorfx.models import LlamaConfig, LlamaLM
from tailorfx.setup import PRESETS, TrainingSetup

CPU_PRESETS = ["fp32", "amp-bf16", "pure-bf16", "pure-bf16-fused-optimizer"]


def reference(dtype=torch.float32, vocab=4096):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaLM(cfg).to(dtype)


def lm(S, vocab=4096, seed=1, B=1):
    ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def measured_full_step(setup, S, passes=(), accum=1, lowering="auto"):
    """(measured, predicted MemoryEstimate) of one steady-state step under `setup`."""
    m = reference(setup.param_dtype)
    b = lm(S)
    opt = tailorfx.optimize(m, setup=setup, passes=list(passes), example_inputs=b, lowering=lowering)
    o = tailorfx.SetupOptimizer(m.parameters(), setup, lr=1e-3)

    def step():   # each output held through its backward and the step, as a training loop holds it
        for _ in range(accum):
            out = opt(**b)
            out.loss.backward()
        o.step()
        o.zero_grad()
        return out

    def last_micro_batch_and_step():   # the accumulated gradients exist already
        out = opt(**b)
        out.loss.backward()
        o.step()
        o.zero_grad()
        return out

    step()
    held = sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers())) + o.state_bytes()
    if accum > 1:
        for _ in range(accum - 1):
            opt(**b).loss.backward()
        held += sum(t.grad.numel() * t.grad.element_size()   # accumulated so far (fp32: in the masters)
                    for t in [*m.parameters(), *o.master.values()] if t.grad is not None)
        return held + tailorfx.measure_peak(last_micro_batch_and_step), opt.predict_memory(S)
    return held + tailorfx.measure_peak(step), opt.predict_memory(S)


def test_presets_bytes_per_parameter():
    """The issue's arithmetic: 16 B/param with fp32 master + fp32 AdamW (amp-bf16, like fp32),
    8 with everything bf16, 6 when gradients are not held (optimizer in backward)."""
    per = {name: s.bytes_per_param() for name, s in PRESETS.items()}
    assert per == {"fp32": 16, "amp-bf16": 16, "pure-bf16": 8, "pure-bf16-fused-optimizer": 6}
    eight = TrainingSetup(param_dtype=torch.bfloat16, optimizer="adamw8bit")
    assert 6 < eight.bytes_per_param() < 6.01   # 2 weights + 2 grads + 2x1 state + block scales
    assert "fp32 master weights" in PRESETS["amp-bf16"].describe()


@pytest.mark.parametrize("kwargs, match", [
    (dict(optimizer_in_backward=True, grad_accum_steps=2), "cannot be accumulated"),
    (dict(param_dtype=torch.bfloat16, grad_dtype=torch.float32), "need master_weights=True"),
    (dict(master_weights=True), "already are the fp32 master"),
    (dict(optimizer="lion"), "optimizer must be one of"),
    (dict(optimizer=None, optimizer_in_backward=True), "needs an optimizer"),
    (dict(headroom=1.5), "headroom"),
    (dict(ddp=True, optimizer_in_backward=True), "before DDP averages it over the ranks"),
])
def test_invalid_setups_say_why(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainingSetup(**kwargs)


def test_optimize_refuses_a_setup_the_model_is_not_in():
    with pytest.raises(ValueError, match=r"call model.to\(torch.bfloat16\) first"):
        tailorfx.optimize(reference(), setup="pure-bf16")
    with pytest.raises(ValueError, match="unknown training setup 'bf16'; presets: fp32, amp-bf16"):
        tailorfx.optimize(reference(), setup="bf16")
    with pytest.raises(ValueError, match="bitsandbytes"):
        tailorfx.SetupOptimizer(reference(torch.bfloat16).parameters(),
                                TrainingSetup(param_dtype=torch.bfloat16, optimizer="adamw8bit"))


def test_ddp_buckets_are_a_static_copy_of_the_trained_gradients():
    """setup.ddp (optimize() sets it inside DistributedDataParallel) adds DDP's gradient buckets, one
    copy of every trained parameter's gradient in its dtype, to the static part and to nothing else;
    frozen parameters get no bucket. The buckets against DDP's real ones: tests/dist/ddp_memory_check.py."""
    m = reference()
    m.model.embed_tokens.weight.requires_grad_(False)
    b = lm(64)
    opt = tailorfx.optimize(m, passes=[], example_inputs=b)
    opt(**b).loss.backward()
    plain = opt.predict_memory()
    ddp = opt.predict_memory(setup=opt.setup.with_(ddp=True))
    trained = sum(p.numel() * p.element_size() for p in m.parameters() if p.requires_grad)
    assert trained < sum(p.numel() * p.element_size() for p in m.parameters())
    assert (plain.bucket_bytes, ddp.bucket_bytes) == (0, trained)
    assert ddp.static_bytes - plain.static_bytes == trained
    assert ddp.peak_bytes - plain.peak_bytes == trained
    assert ddp.dynamic_peak_bytes == plain.dynamic_peak_bytes
    assert ddp.breakdown()["DDP gradient buckets"] == trained and sum(ddp.breakdown().values()) == ddp.peak_bytes
    assert PRESETS["fp32"].with_(ddp=True).bytes_per_param() == 20
    assert "DDP gradient buckets" in opt.setup.with_(ddp=True).describe()


def test_sizing_under_ddp_counts_the_buckets_and_suggests_setups_ddp_can_run():
    """max_seq_len's refusal of a static part that alone overflows names the buckets, and the setups
    it suggests are those that fit with buckets, not stepping in backward (refused inside DDP)."""
    m = reference()
    params = sum(p.numel() * p.element_size() for p in m.parameters())
    budget = int(1.2 * params * 16 / 4 / 0.96)   # fp32 AdamW's 16 B/param fits, its 20 with buckets do not
    assert tailorfx.max_seq_len(m, budget, setup="fp32", limit=256) > 0
    with pytest.raises(tailorfx.BudgetError) as e:
        tailorfx.max_seq_len(m, budget, setup=PRESETS["fp32"].with_(ddp=True), limit=256)
    msg = str(e.value)
    assert f"DDP gradient buckets {format_bytes(params)}" in msg and "fp32 (" not in msg.split("Setups")[1], msg
    assert "pure-bf16 (" in msg and "fused-optimizer" not in msg, msg


@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_PRESETS)
@pytest.mark.parametrize("S, passes", [(16, ()), (512, ("minisequence",))])
def test_full_step_prediction_within_3_percent(name, S, passes):
    """S=16: the optimizer step and the gradients make the peak; S=512 with mini-sequence: the
    fused head and chunked regions with their transients (the logits peak of S=256 without it:
    test_fp32_gradients_of_bf16_weights_are_predicted)."""
    measured, est = measured_full_step(PRESETS[name], S, passes)
    assert -0.02 <= (est.peak_bytes - measured) / measured <= 0.03, (name, S, est.peak_bytes, measured, est.peak_node)


@pytest.mark.slow   # make test stays under 10 minutes; make test-slow (CI) runs it
def test_optimizer_in_backward_lowers_the_measured_peak():
    """Where the step is the peak (short sequences), updating in backward frees each gradient:
    the measured peak drops by about one set of gradients, as predicted."""
    plain, est_plain = measured_full_step(PRESETS["pure-bf16"], 16)
    fused, est_fused = measured_full_step(PRESETS["pure-bf16-fused-optimizer"], 16)
    assert fused < plain
    assert est_fused.grad_bytes == 0 and est_plain.grad_bytes > 0
    assert abs((plain - fused) - (est_plain.peak_bytes - est_fused.peak_bytes)) < 0.1 * (plain - fused)


def test_under_inductor_a_gradient_no_step_takes_reaches_autograd_whole():
    """A setup with the step in backward and no SetupOptimizer to take it (yet): each grad_ready
    op inside Inductor's backward leaves its gradient, which the backward hands to autograd as
    eager autograd computes it (a buffer Inductor reused after the op would corrupt it)."""
    base = reference(torch.float32, vocab=512)
    m = copy.deepcopy(base)
    run = tailorfx.optimize(m, setup=TrainingSetup(optimizer_in_backward=True), passes=[], lowering="inductor")
    b = batch(B=2, S=48, seed=0)
    assert grad_ready_calls(lambda: run(**b).loss.backward()) > 0
    base(**b).loss.backward()
    for (k, p), ref in zip(m.named_parameters(), base.parameters()):
        torch.testing.assert_close(p.grad, ref.grad, rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.slow
def test_under_inductor_the_steps_in_backward_lower_the_measured_peak_as_predicted():
    """lowering="inductor": the steps inside Inductor's backward free each gradient as it is made
    (until 2026-12-05 they ran from hooks after it and the fused setup's peak was the plain one's),
    and the memory model, which traces Inductor's code with the steps in, predicts both peaks within
    -2%..+3%, the fused one after the plain one's trace of the same graph in this process."""
    plain, est_plain = measured_full_step(PRESETS["pure-bf16"], 16, lowering="inductor")
    fused, est_fused = measured_full_step(PRESETS["pure-bf16-fused-optimizer"], 16, lowering="inductor")
    for measured, est in ((plain, est_plain), (fused, est_fused)):
        assert -0.02 <= (est.peak_bytes - measured) / measured <= 0.03, (est.peak_bytes, measured, est.peak_node)
    assert fused < plain and est_fused.grad_bytes == 0 and est_plain.grad_bytes > 0
    assert abs((plain - fused) - (est_plain.peak_bytes - est_fused.peak_bytes)) < 0.1 * (plain - fused)


FP32_GRADS = TrainingSetup(param_dtype=torch.bfloat16, master_weights=True, grad_dtype=torch.float32,
                           name="bf16 weights, fp32 gradients in the masters")


@pytest.mark.parametrize("setup", [PRESETS["fp32"], FP32_GRADS], ids=["fp32", "bf16-fp32-grads"])
def test_gradient_accumulation_is_predicted_for_the_last_micro_batch(setup):
    """fp32 with no rewrite runs under eager autograd (the "dynamo" lowering), where the model
    over-predicts the accumulating step by 4.1%: docs/memory.md states 5% for that case."""
    setup = setup.with_(grad_accum_steps=2)
    measured, est = measured_full_step(setup, 64, accum=2)
    assert est.grad_bytes == sum(p.numel() * 4 for p in reference().parameters())   # fp32 either way
    over = 0.05 if setup.param_dtype == torch.float32 else 0.03
    assert -0.02 <= (est.peak_bytes - measured) / measured <= over, (est.peak_bytes, measured)


@pytest.mark.parametrize("S", [16, 256])
def test_fp32_gradients_of_bf16_weights_are_predicted(S):
    """Each bf16 gradient is moved into its fp32 master's .grad (a post-accumulate hook) and freed."""
    measured, est = measured_full_step(FP32_GRADS, S)
    assert -0.02 <= (est.peak_bytes - measured) / measured <= 0.03, (est.peak_bytes, measured)


def train(model, step_fn, steps=3, S=48):
    for i in range(steps):
        step_fn(batch(B=2, S=S, seed=i))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_in_backward_trains_to_the_same_weights(dtype):
    """Compiled by tailorfx with the update inside the backward graph vs the same compiled
    model with a normal step (torch.optim.AdamW); and eagerly, post-accumulate-grad hooks vs
    torch.optim.AdamW. fp32: identical; bf16: identical too (same ops, same order per
    parameter; only when each update runs differs)."""
    fused_setup = TrainingSetup(param_dtype=dtype, optimizer_in_backward=True, name="fused")
    plain_setup = fused_setup.with_(optimizer_in_backward=False)
    base = reference(dtype, vocab=512)
    results = {}
    for label, compiled, setup in [("compiled fused", True, fused_setup), ("compiled normal", True, plain_setup),
                                   ("eager hooks", False, fused_setup), ("eager normal", False, plain_setup)]:
        m = copy.deepcopy(base)
        run = tailorfx.optimize(m, setup=setup, passes=[]) if compiled else m
        if "normal" in label:
            o = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
        else:
            o = tailorfx.SetupOptimizer(m.parameters(), setup, lr=1e-2)

        def step(b):
            run(**b).loss.backward()
            o.step()
            o.zero_grad(set_to_none=True)
        results[label] = train(m, step)
        if label == "compiled fused":
            assert o.num_updates == 3 * len(list(m.parameters()))
            assert all(p.grad is None for p in m.parameters())   # no gradient outlived its update
            (g,) = run.graph_records
            assert sum(n.name.startswith("grad_ready") for n in g.step.bw.graph.nodes) == len(list(m.parameters()))
    start = base.state_dict()
    for a, b in [("compiled fused", "compiled normal"), ("eager hooks", "eager normal")]:
        for k in start:
            assert torch.equal(results[a][k], results[b][k]), (a, b, k)
    moved = max((results["compiled fused"][k].float() - start[k].float()).abs().max().item() for k in start)
    assert moved > 1e-3   # it trained


def grad_ready_calls(fn) -> int:
    """How many times `fn()` called the tailorfx::grad_ready op (an optimizer step inside Inductor's code)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name == "tailorfx::grad_ready" for e in prof.events())


@pytest.mark.slow
def test_under_inductor_the_steps_run_inside_the_compiled_backward():
    """lowering="inductor": each parameter's update is a tailorfx::grad_ready op inside the code
    Inductor generates for the backward (not a hook after it), and trains to the same fp32 weights
    as torch.optim.AdamW after the same compiled step; in bf16, one SGD step's updates are the
    plain step's to within bf16's rounding of two compiled backwards (a weight read after its own
    update would move the gradients that read it by the whole update)."""
    fused_setup = TrainingSetup(optimizer_in_backward=True, name="fused")
    base = reference(torch.float32, vocab=512)
    results, n = {}, len(list(base.parameters()))
    for label, setup in [("fused", fused_setup), ("normal", fused_setup.with_(optimizer_in_backward=False))]:
        m = copy.deepcopy(base)
        run = tailorfx.optimize(m, setup=setup, passes=[], lowering="inductor")
        o = tailorfx.SetupOptimizer(m.parameters(), setup, lr=1e-2) if label == "fused" else \
            torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
        calls = []

        def step(b):
            calls.append(grad_ready_calls(lambda: run(**b).loss.backward()))
            o.step()
            o.zero_grad(set_to_none=True)
        results[label] = train(m, step)
        if label == "fused":
            assert o.num_updates == 3 * n and all(p.grad is None for p in m.parameters())
        # the first backward compiles, and the compiler's runs of the op on fake tensors are profiled too
        assert calls[1:] == ([n] * 2 if label == "fused" else [0] * 2), (label, calls)
    for k in base.state_dict():
        assert torch.equal(results["fused"][k], results["normal"][k]), k
    bf16 = reference(torch.bfloat16, vocab=512)
    before = {k: v.float() for k, v in bf16.state_dict().items()}
    moved = {}
    for label, in_backward in [("fused", True), ("normal", False)]:
        setup = TrainingSetup(param_dtype=torch.bfloat16, optimizer="sgd", optimizer_in_backward=in_backward)
        m = copy.deepcopy(bf16)
        run = tailorfx.optimize(m, setup=setup, passes=[], lowering="inductor")
        o = tailorfx.SetupOptimizer(m.parameters(), setup, lr=100.0)   # updates far above bf16's rounding
        run(**batch(B=2, S=48, seed=0)).loss.backward()
        o.step()
        moved[label] = {k: v.float() - before[k] for k, v in m.state_dict().items()}
    worst = max(((moved["fused"][k] - moved["normal"][k]).norm() / moved["normal"][k].norm()).item()
                for k in before if moved["normal"][k].norm() > 0)
    assert worst < 0.02, worst   # 0.8% measured (the eager lowering's plain step: 2.4% from either)


def inductor_sgd_step(model, in_backward: bool, b: dict, lr: float = 100.0):
    """(grad_ready calls in a second backward, {name: what one fp32 SGD step at `lr` moved}) of a
    copy of `model` under lowering="inductor". An update far above the weights makes a weight read
    after its own update move every gradient computed from it by a large part of the update."""
    m = copy.deepcopy(model)
    setup = TrainingSetup(optimizer="sgd", optimizer_in_backward=in_backward)
    run = tailorfx.optimize(m, setup=setup, passes=[], lowering="inductor")
    o = tailorfx.SetupOptimizer(m.parameters(), setup, lr=lr)
    run(**b).loss.backward()
    o.step()
    moved = {k: v - model.state_dict()[k] for k, v in m.state_dict().items()}
    calls = grad_ready_calls(lambda: run(**b).loss.backward())   # its values do not matter
    return calls, moved


@pytest.mark.parametrize("family", ["gemma2", "mixtral"] + [pytest.param(f, marks=pytest.mark.slow) for f in (
    "qwen2_moe", "bloom", "gpt2", "phi3", "cohere")])
def test_under_inductor_no_kernel_recomputes_a_read_of_a_weight_after_its_update(family):
    """One fp32 SGD step with the steps inside Inductor's backward moves every weight as the plain
    step does. Until 2026-12-05 two reads ran after the update: Gemma-2's norms scale by
    (1 + weight), which Inductor inlined into a kernel after it, and Mixtral's router gradient
    `add(x, mm(y, w))` became an `addmm` after it; every earlier weight's update was 2-61% off."""
    from models import hf_family
    model = hf_family(family, num_layers=1)
    b = batch(B=2, S=32, seed=0)
    calls, fused = inductor_sgd_step(model, True, b)
    _, plain = inductor_sgd_step(model, False, b)
    assert calls == len(list(model.parameters())), calls
    for k in plain:
        torch.testing.assert_close(fused[k], plain[k], rtol=1e-5, atol=1e-5, msg=k)


def test_tied_weights_are_updated_once():
    """A tied embedding/head weight is one parameter read twice: one update per step."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    base = LlamaLM(cfg)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    setup = TrainingSetup(optimizer_in_backward=True)
    run = tailorfx.optimize(a, setup=setup, passes=[])
    oa = tailorfx.SetupOptimizer(a.parameters(), setup, lr=1e-2)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2, foreach=False)
    for i in range(2):
        run(**batch(S=32, seed=i)).loss.backward()
        b(**batch(S=32, seed=i)).loss.backward()
        ob.step()
        ob.zero_grad()
    assert oa.num_updates == 2 * len(list(a.parameters()))
    for (k, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa, pb, rtol=1e-4, atol=1e-5), k


def test_the_step_in_backward_waits_for_a_gradient_ready_says_is_complete():
    """`ready=` holds the update of a gradient accumulated over several backward calls (one per
    shard) until the last: one update with the whole gradient, as one backward would give."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, 8)
    whole, sharded = torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False)
    sharded.load_state_dict(whole.state_dict())
    before = whole.weight.detach().clone()
    setup = TrainingSetup(optimizer_in_backward=True)
    ow = tailorfx.SetupOptimizer(whole.parameters(), setup, lr=1e-2)
    last = [False]
    os_ = tailorfx.SetupOptimizer(sharded.parameters(), setup, lr=1e-2, ready=lambda p: last[0])
    try:
        whole(x.reshape(12, 8)).pow(2).sum().backward()
        for i, shard in enumerate(x):
            last[0] = i == len(x) - 1
            sharded(shard).pow(2).sum().backward()
    finally:
        ow.close()
        os_.close()
    assert ow.num_updates == os_.num_updates == 1 and sharded.weight.grad is None
    assert not torch.equal(whole.weight, before)
    torch.testing.assert_close(sharded.weight, whole.weight, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_max_seq_len_names_setups_whose_static_part_fits():
    """amp-bf16 Llama-3-8B: 16 B/param = 120 GiB before any activation, over an A100-80GB."""
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8)
    with pytest.raises(tailorfx.BudgetError) as e:
        tailorfx.max_seq_len(cfg, "A100-80GB", passes=[], setup="amp-bf16")
    msg = str(e.value)
    n = 8_030_261_248   # Llama-3-8B's published parameter count
    f = tailorfx.budget.format_bytes
    assert "the static part alone does not fit A100-80GB" in msg
    assert f"master weights {f(4 * n)}" in msg and f"optimizer state {f(8 * n)}" in msg
    assert f"Setups whose static part fits: pure-bf16 ({f(8 * n)}), pure-bf16-fused-optimizer ({f(6 * n)})" in msg
    assert 0 <= e.value.smallest_bytes - 16 * n <= 4096   # + the RoPE frequency buffer


@pytest.mark.slow   # make test stays under 10 minutes; make test-slow (CI) runs it
def test_planner_moves_the_step_into_backward_when_nothing_else_fits():
    """At 16 tokens the optimizer step (all gradients + state + update temporaries) is the peak:
    no activation rewrite helps, updating in backward does. The budget sits between the two
    predicted peaks (12.8 and 11.6 MiB, less the planner's 4% margin)."""
    m = reference(torch.bfloat16)
    b = lm(16)
    with pytest.warns(UserWarning, match="only with the optimizer step in backward"):
        opt = tailorfx.optimize(m, budget="12.6MiB", setup="pure-bf16", example_inputs=b)
    assert opt.setup.optimizer_in_backward and opt.setup.param_dtype == torch.bfloat16
    assert "SetupOptimizer" in opt.plan[0].reason
    o = tailorfx.SetupOptimizer(m.parameters(), opt.setup, lr=1e-3)

    def step():
        opt(**b).loss.backward()
        o.step()
    step()
    held = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()]) + o.state_bytes()
    assert held + tailorfx.measure_peak(step) <= tailorfx.Budget.parse("12.6MiB").bytes
    # the second search predicted each plan from the first search's trace, its backward given the
    # optimizer steps: the same graph and prediction as a trace made with the step in backward
    from tailorfx.codegen.lower import partition_for
    from tailorfx.planner import predict_graphs
    from tailorfx.rewrite import memory
    from tailorfx.rewrite.trace import with_steps_in_backward
    g = opt.session.graphs[0]
    part, plain = partition_for(g.lowering, g.rewritten), opt.setup.with_(optimizer_in_backward=False)
    derived = with_steps_in_backward(memory.trace_step(g.rewritten, None, part, plain), g.rewritten)
    traced = memory.trace_step(g.rewritten, None, part, opt.setup)
    assert "grad_ready" in derived.bw.code and derived.bw.code == traced.bw.code
    peaks = [predict_graphs([(g.rewritten, g.lowering, st)], [g.seq], setup=opt.setup).peak_bytes for st in (derived, traced)]
    assert peaks[0] == peaks[1]


@pytest.mark.slow   # make test stays under 10 minutes; make test-slow (CI) runs it
def test_max_seq_len_moves_the_step_into_backward_where_only_that_fits_one_token():
    """pure-bf16 AdamW on a 4-layer Llama: its static part fits 19.2 MiB, but the optimizer step
    beside every gradient peaks over it at one token (18.77 MiB against 19.2 MiB less 4%). With the
    step in backward it fits, as the planner plans it: max_seq_len said "even one token does not
    fit" (and `tailorfx plan` printed that and no plan); it now gives the longest such step, and
    the planner's plan at that length is the step in backward."""
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM
    cfg = HFLlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2)
    longest = tailorfx.max_seq_len(cfg, "19.2MiB", setup="pure-bf16", granularity=16)
    assert longest >= 16
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.randint(0, 64, (1, longest))
    with pytest.warns(UserWarning, match="only with the optimizer step in backward"):
        opt = tailorfx.optimize(model, budget="19.2MiB", setup="pure-bf16", example_inputs=dict(input_ids=ids, labels=ids))
    assert opt.setup.optimizer_in_backward


@pytest.mark.slow   # make test stays under 10 minutes; make test-slow (CI) runs it
def test_headroom_and_micro_batch_shorten_max_seq_len():
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    base = TrainingSetup(name="fp32")
    plain = tailorfx.max_seq_len(cfg, "96MiB", passes=[], setup=base, granularity=16)
    roomy = tailorfx.max_seq_len(cfg, "96MiB", passes=[], setup=base.with_(headroom=0.25), granularity=16)
    double = tailorfx.max_seq_len(cfg, "96MiB", passes=[], setup=base.with_(micro_batch_size=2), granularity=16)
    assert roomy < plain and double < plain
    # the answer with 25% headroom is what fits 72 MiB without any
    assert abs(roomy - tailorfx.max_seq_len(cfg, "72MiB", passes=[], setup=base, granularity=16)) <= 16


def _with_generator_input(g, name: str):
    """A copy of `g` with a generator placeholder appended, as AOTAutograd's partitioner appends one
    per recomputed random op on CUDA (apply_graphsafe_rng_functionalization)."""
    import torch.fx as fx
    g = fx.GraphModule(g, copy.deepcopy(g.graph))
    last = [n for n in g.graph.nodes if n.op == "placeholder"][-1]
    with g.graph.inserting_after(last):
        g.graph.placeholder(name).meta["val"] = torch.Generator()
    g.recompile()
    return g


def test_the_generator_inputs_cudas_partitioner_appends_keep_weights_predicted_and_steps_in_backward():
    """On CUDA a recomputed SDPA flash call gets a generator input at the end of AOTAutograd's forward
    (`fwd_rng_state_<i>`). On the 2026-12-04 H200 run that hid Llama-3-8B's 48 GB of weights and AdamW
    state from opt.predict_memory() under full recompute (fwd inputs no longer lined up with Dynamo's),
    and the optimizer steps were not put into the backward. With the generators appended as CUDA's
    partitioner appends them, the step predicts and fuses as without them."""
    from dataclasses import replace
    from tailorfx.rewrite import memory
    from tailorfx.rewrite.optimizer_step import fuse_into_backward
    from tailorfx.rewrite.trace import make_step, trainable_inputs
    from tailorfx.rewrite.trace_cache import traced_step
    model = reference(torch.bfloat16)
    opt = tailorfx.optimize(model, passes=["recompute"], setup="pure-bf16-fused-optimizer", example_inputs=lm(64),
                            lowering="eager")
    g = opt.session.graphs[0]
    assert any(r.changed for r in g.records if r.name == "recompute")
    step = traced_step(g.rewritten, "min_cut", None, static=True)   # the forward and backward the lowering runs
    fw, bw = _with_generator_input(step.fw, "fwd_rng_state_0"), _with_generator_input(step.bw, "bwd_rng_state_0")
    cuda = make_step(g.rewritten, fw, bw, step.num_user_outputs)
    assert cuda.static_inputs == step.static_inputs + [False]
    trained = trainable_inputs(g.rewritten)
    plain_bw = _with_generator_input(step.bw, "unused")   # a copy, fused as the CUDA-like one
    fused = [fuse_into_backward(f, b, step.num_user_outputs, trained, handle=-1) for f, b in ((step.fw, plain_bw), (fw, bw))]
    assert fused[0] == fused[1] == sum(trained) > 0, fused
    setup = PRESETS["pure-bf16-fused-optimizer"]
    plain, on_cuda = (memory.simulate_step([replace(s, bw=b)], g.seq, setup=setup)
                      for s, b in ((step, plain_bw), (cuda, bw)))
    n, buffers = sum(p.numel() for p in model.parameters()), sum(b.nbytes for b in model.buffers())
    assert on_cuda.static_bytes == plain.static_bytes == 6 * n + buffers   # bf16 weights, two bf16 AdamW moments
    assert on_cuda.peak_bytes == plain.peak_bytes
