"""Memory model: predicted peak of a training step vs the allocator's measured peak."""

import pytest
import torch

import tailorfx
from models import batch
from tailorfx.models import LlamaConfig, LlamaLM
from tailorfx.rewrite.memory import trace_step


def mid_llama():
    return LlamaLM(LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=688,
                               num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2))


def measured_step(opt, model, inputs) -> int:
    def step():
        model.zero_grad(set_to_none=True)
        out = opt(**inputs)     # held through backward, as a training loop holds it
        out.loss.backward()
    step()   # compile outside the measurement
    model.zero_grad(set_to_none=True)
    return tailorfx.measure_peak(step)


@pytest.mark.slow
def test_prediction_within_3_percent_at_three_lengths():
    """The claim of docs/memory.md: within 3% of the measured peak, and never more than 2% below it."""
    model = mid_llama()
    opt = tailorfx.optimize(model, passes=[], example_inputs=batch(B=1, S=64))
    rows = []
    for S in (256, 512, 1024):
        measured = measured_step(opt, model, batch(B=1, S=S))
        predicted = opt.predict_memory(seq_len=S).forward_backward_peak_bytes
        rows.append((S, predicted, measured))
        assert abs(predicted - measured) / measured <= 0.03 and predicted >= 0.98 * measured, rows
    assert len(opt.session.graphs) == 1
    # peak grows with S: the model really depends on the length, not a constant
    assert rows[2][2] > 1.8 * rows[0][2]


def test_static_parts_match_parameter_arithmetic():
    model = mid_llama()
    opt = tailorfx.optimize(model, passes=[], example_inputs=batch(B=1, S=32))
    est = opt.predict_memory(optimizer="adamw")
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert est.param_bytes == nbytes + buffers
    assert est.grad_bytes == nbytes
    assert est.optimizer_bytes == 2 * nbytes        # AdamW: two states per parameter, none for buffers
    assert est.static_bytes == nbytes + buffers + 2 * nbytes


@pytest.mark.slow   # make test stays under 10 minutes; make test-slow (CI) runs it
def test_one_symbolic_trace_equals_a_fresh_trace_at_that_length():
    model = mid_llama()
    opt_a = tailorfx.optimize(model, passes=[], example_inputs=batch(B=1, S=48))
    opt_b = tailorfx.optimize(model, passes=[], example_inputs=batch(B=1, S=300))
    assert opt_a.predict_memory(seq_len=300).peak_bytes == opt_b.predict_memory().peak_bytes


@pytest.mark.parametrize("family", ["gemma2", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_a_static_trace_predicts_the_captured_length_as_the_symbolic_one(family):
    """The planner compares its candidates on traces at the captured length (static shapes,
    trace.captured_inputs: about 3x faster): they predict what the symbolic trace predicts there,
    to the byte on a dense family; on an MoE one (its routing's data-dependent sizes taken at
    their hints) within 0.1%."""
    from models import hf_family
    from tailorfx.codegen.lower import partition_for
    from tailorfx.planner import predict_graphs
    from tailorfx.rewrite.trace import captured_inputs
    model = hf_family(family)
    ids = torch.randint(0, 512, (2, 48))
    opt = tailorfx.optimize(model, passes=["minisequence", "recompute"], example_inputs=dict(input_ids=ids, labels=ids))
    g = opt.session.graphs[0]
    inputs = captured_inputs(g.rewritten)
    assert inputs is not None and not any(isinstance(d, torch.SymInt) for t in inputs if isinstance(t, torch.Tensor)
                                          for d in t.shape)
    static = trace_step(g.rewritten, inputs, partition_for(g.lowering, g.rewritten), opt.setup)
    assert g.step is not None       # the lowering's symbolic trace, what predict_memory() walks
    peaks = [opt.predict_memory().peak_bytes,
             predict_graphs([(g.rewritten, g.lowering, static)], [g.seq], setup=opt.setup).peak_bytes]
    if family == "mixtral":
        assert abs(peaks[1] - peaks[0]) <= 0.001 * peaks[0], peaks
    else:
        assert peaks[1] == peaks[0]


def test_measure_peak_sees_a_known_allocation():
    def f():
        x = torch.empty(1000, 1000)   # 4,000,000 bytes
        y = torch.empty(500, 1000)    # 2,000,000 more while x is live
        del x, y
    peak = tailorfx.measure_peak(f)
    assert 6_000_000 <= peak < 6_100_000


@pytest.mark.slow   # make test stays under 10 minutes; make test-slow (CI) runs it
def test_measure_peak_sees_inductor_buffers():
    """Compiled code allocates through the same allocator: the profiler sees its buffers."""
    fn = torch.compile(lambda a: torch.mm(a.sin(), a.cos().t()), backend="inductor")
    a = torch.randn(1000, 500)
    fn(a)
    peak = tailorfx.measure_peak(lambda: fn(a))
    # sin(a) and cos(a) (2 x 2 MB, unless fused away) and the 4 MB product
    assert 4_000_000 <= peak <= 8_100_000


@pytest.mark.slow
def test_llama3_8b_prediction_without_allocating_it():
    """One capture of an 8B config under a FakeTensorMode (its time is a benchmark claim:
    benchmarks/memory_model.py): parameter arithmetic, the fused head's peak at 8K, and more than
    32K tokens on an A100-80GB with mini-sequence + recompute (the planner's headroom kept)."""
    from tailorfx.planner import HEADROOM
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8)
    opt = tailorfx.sizing.capture_for_prediction(cfg, ["minisequence", "recompute"], seq_len=1024,
                                              dtype=torch.bfloat16, recompute="full")
    est = opt.predict_memory(seq_len=8192, optimizer="adamw")
    n_params = (2 * cfg.vocab_size * cfg.hidden_size + cfg.num_hidden_layers * (
        2 * cfg.hidden_size * cfg.hidden_size + 2 * cfg.hidden_size * 1024 + 3 * cfg.hidden_size * 14336
        + 2 * cfg.hidden_size) + cfg.hidden_size)
    assert est.grad_bytes == 2 * n_params            # bf16 gradients
    assert est.param_bytes >= 2 * n_params
    # fp32 logits at 8K x 128K are 4 GiB; the fused head never holds them whole
    assert est.dynamic_peak_bytes < est.grad_bytes + 8192 * 128256 * 4
    usable = tailorfx.Budget.parse("A100-80GB").bytes * (1 - HEADROOM)
    assert opt.predict_memory(seq_len=32768, optimizer="adamw").peak_bytes <= usable


def test_live_bytes_on_fake_tensors_equals_the_allocator():
    """memory.LiveBytes counts what eager code (autograd's saves included) holds: on fake tensors
    it gives the allocator's measured peak of the same code on real ones, views of the inputs
    (weight.t()) not counted as new memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from tailorfx.rewrite.memory import LiveBytes

    def make():
        x = torch.randn(300, 64, requires_grad=True)
        w1, w2 = torch.randn(256, 64, requires_grad=True), torch.randn(64, 256, requires_grad=True)
        return x, w1, w2

    def step(x, w1, w2):
        y = torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(x, w1)), w2)
        return torch.autograd.grad(y.square().sum(), [x, w1, w2])
    real = make()
    measured = tailorfx.measure_peak(lambda: step(*real))
    with FakeTensorMode():
        fake = make()
        with LiveBytes() as live:
            step(*fake)
    assert live.peak == measured and measured > 300 * 256 * 4 * 2


@pytest.mark.parametrize("family,positions", [("llama", False), ("qwen2", False), ("llama", True)])
def test_eager_step_predicted_as_eager_runs_it(family, positions):
    """The model without tailorfx, in a loop that keeps the loss only: predicted from the capture as
    eager PyTorch runs it (transformers skips the causal mask it materialises when traced, and leaves
    k, v grouped; the logits die with the forward) within -2%..+3% of its measured peak. As traced,
    the masks and repeated k, v it saves put the prediction over (about +7% on Llama). With
    position_ids (as packed batches pass them) of one document a row, transformers skips the
    document mask it builds when traced as well (make demo's first batch is such a one)."""
    import copy
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(family, vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                               use_cache=False)
    model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 512, (8, 64))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    if positions:   # each row one piece of a document: positions step by one, from where the piece starts
        inputs["position_ids"] = torch.arange(64) + torch.arange(0, 800, 100)[:, None]
    eager = copy.deepcopy(model)

    def step():
        eager(**inputs).loss.backward()
    step()
    eager.zero_grad(set_to_none=True)
    measured = tailorfx.measure_peak(step)
    opt = tailorfx.optimize(model, example_inputs=inputs, optimizer=None)
    traced, as_eager = (opt.predict_memory(rewritten=False, outputs_held=False, as_eager=e).dynamic_peak_bytes
                        for e in (False, True))
    assert -0.02 <= (as_eager - measured) / measured <= 0.03, (as_eager, measured)
    assert traced > as_eager   # the traced graph's masks and repeated k, v were dropped
