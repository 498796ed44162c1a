"""Precision pass: golden graph diff, must-not-fire cases, numerics vs fp32, measured memory at
S=4096, composition with mini-sequence, and fp16 loss scaling through a planted overflow.

Tolerances (bf16 has an 8-bit mantissa: one rounding is up to 0.4%, relative):
  loss            |loss_bf16 - loss_fp32| / loss_fp32 < 0.5%
  gradients       |g_bf16 - g_fp32| / |g_fp32| < 3% per parameter (relative norm); random-init
                  models sit near 1-1.5% (torch.autocast's bf16 gives the same), trained ones
                  lower. The LM-head weight at S=4096 (issue 7): see test_acceptance_lm_head_grad.
  fp32 precision  exact (the graph is not touched)
"""
import copy
import os
import re

import pytest
import torch
import torch.fx as fx

import tailorfx
from models import batch, hf_family, hf_llama, tiny_llama
from tailorfx.models import LlamaConfig, LlamaLM
from tailorfx.models.llama import Attention
from tailorfx.passes.precision import NAME, POLICY, Precision, cleanup, resolve_policy
from tailorfx.rewrite import match
from tailorfx.rewrite.capture import capture_graphs
from tailorfx.rewrite.passes import PASS_META, PassContext, verify
from tailorfx.rewrite.regions import find_regions, module_paths
from tailorfx.runtime.train import Trainer, make_scaler

GOLDEN = os.path.join(os.path.dirname(__file__), "goldens", "precision_diff.txt")


pytestmark = pytest.mark.usefixtures("one_thread")


def lowered(model, precision="bf16", passes=("precision",), S=37, pad=5):
    return tailorfx.optimize(model, passes=list(passes), precision=precision, example_inputs=batch(S=S, pad=pad))


def record(opt, name=NAME):
    (rec,) = [r for g in opt.graph_records for r in g.records if r.name == name]
    return rec


def run_pass(model, options, S=37):
    """The pass alone on a captured graph (options the public API does not pass yet)."""
    (c,), _ = capture_graphs(model, (), batch(S=S))
    return c.gm, Precision(options).run(c.gm, PassContext(find_regions(c.gm, c.seq), c.seq, options))


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def grads_vs_eager(model, wrap, inputs):
    """(loss rel err, {param: grad rel-norm err}) of wrap(copy) against eager fp32 `model`."""
    test = copy.deepcopy(model)
    opt = wrap(test)
    loss_ref = model(**inputs).loss
    loss_ref.backward()
    loss = opt(**inputs).loss
    loss.backward()
    ref = dict(model.named_parameters())
    errs = {}
    for name, p in test.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name   # fp32 master weights
        errs[name] = rel(p.grad, ref[name].grad)
    return abs(loss.item() - loss_ref.item()) / loss_ref.item(), errs, opt


# ---- golden -------------------------------------------------------------------------------


def test_golden_graph_diff():
    opt = lowered(tiny_llama(num_layers=1))
    diff = opt.diff(NAME)
    got = "\n".join(l for l in diff.splitlines() if not l.lstrip("+- ").startswith("#")) + "\n"
    got = re.sub(r"\bs\d+\b", "s<n>", got)   # symbol numbers depend on what the process compiled before
    if os.environ.get("TAILORFX_UPDATE_GOLDENS"):
        with open(GOLDEN, "w") as f:
            f.write(got)
    with open(GOLDEN) as f:
        assert got == f.read()
    rec = record(opt)
    assert rec.touched == ("model.layers.0.self_attn (bf16 matmuls)", "model.layers.0.mlp (bf16)",
                           "model.layers.0.input_layernorm (fp32, output bf16)",
                           "model.layers.0.post_attention_layernorm (fp32, output bf16)")
    assert rec.stats["regions"]["model.layers.0.input_layernorm"] == "fp32"
    assert rec.stats["regions"]["lm_head"] == "fp32"
    # every cast names the pass and sits inside the region it serves (mini-sequence chunks it there)
    made = [n for n in rec.gm.graph.nodes if n.meta.get(PASS_META) == NAME]
    assert len(made) == rec.stats["num_casts"] == 13
    regions = {"model.layers.0.self_attn", "model.layers.0.mlp"}
    assert all(regions & set(module_paths(n)) for n in made)
    verify(rec.gm)


# ---- must not fire ------------------------------------------------------------------------


def test_model_already_in_bf16_is_left_alone():
    """Must not fire: its parameters are bf16, so there are no fp32 master weights to keep, and
    upcasting its norms would change a model its author runs in bf16."""
    model = tiny_llama(num_layers=1).to(torch.bfloat16)
    opt = lowered(model)
    rec = record(opt)
    assert not rec.changed and rec.before == rec.after
    assert any(s.startswith("model.layers.0.mlp: parameter") and "not fp32" in s for s in rec.skipped)


class FourierAttention(Attention):
    """Attention plus FNet-style token mixing: the real part of an FFT along the sequence."""

    def forward(self, x, cos, sin):
        return super().forward(x, cos, sin) + torch.fft.fft(x, dim=1).real


def _fourier_llama():
    model = tiny_llama(num_layers=1)
    mixer = FourierAttention(model.config)
    mixer.load_state_dict(model.model.layers[0].self_attn.state_dict())
    model.model.layers[0].self_attn = mixer
    return model


def test_fft_mixing_attention_stays_fp32_when_the_region_computes_low():
    """Must not fire on the attention with matmul_output="low" (the whole region in bf16):
    torch.fft has no bf16 kernels ("Unsupported dtype BFloat16"), so lowering it would fail at run
    time; the MLP next to it is still lowered."""
    def wrap(m):
        return tailorfx.optimize(m, passes=["precision"], precision="bf16", example_inputs=batch(S=37, pad=5),
                                 precision_policy={"matmul_output": "low"})
    loss_err, errs, opt = grads_vs_eager(_fourier_llama(), wrap, batch(S=37, pad=5))
    rec = record(opt)
    assert rec.touched == ("model.layers.0.mlp (bf16)", "model.layers.0.post_attention_layernorm (fp32, output bf16)")
    assert any(s.startswith("model.layers.0.self_attn: ") and "Unsupported dtype BFloat16" in s
               for s in rec.skipped), rec.skipped
    assert loss_err < 5e-3 and max(errs.values()) < 3e-2


def test_fft_mixing_attention_is_lowered_around_the_fft_by_default():
    """By default attention runs only its matmuls in bf16 (matmul_output "auto"): the FFT is
    between them, so it stays fp32 and the region is lowered."""
    loss_err, errs, opt = grads_vs_eager(_fourier_llama(), lowered, batch(S=37, pad=5))
    rec = record(opt)
    assert "model.layers.0.self_attn (bf16 matmuls)" in rec.touched and rec.skipped == (), rec.skipped
    fft = next(n for n in rec.gm.graph.nodes if "fft" in match.op_name(n))
    assert fft.meta["example_value"].dtype == torch.complex64
    assert loss_err < 5e-3 and max(errs.values()) < 3e-2


# ---- numerics -----------------------------------------------------------------------------


def test_fp32_precision_leaves_graph_unchanged_and_exact():
    model = tiny_llama(num_layers=2)
    loss_err, errs, opt = grads_vs_eager(model, lambda m: lowered(m, precision="fp32"), batch(S=37, pad=5))
    rec = record(opt)
    assert not rec.changed and rec.before == rec.after and rec.touched == ()
    assert loss_err == 0.0 and max(errs.values()) == 0.0


def test_all_fp32_policy_leaves_graph_unchanged():
    """A policy that keeps every region fp32 has nothing to do, whatever the precision."""
    policy = {k: "fp32" for k in POLICY}
    gm, res = run_pass(tiny_llama(num_layers=1), {"precision": "bf16", "precision_policy": policy})
    assert not res.changed and res.gm is gm and res.touched == ()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_numerics_against_fp32(precision):
    loss_err, errs, opt = grads_vs_eager(tiny_llama(num_layers=2), lambda m: lowered(m, precision),
                                         batch(S=37, pad=5))
    assert loss_err < 5e-3, loss_err
    assert max(errs.values()) < 3e-2, errs
    assert max(errs.values()) > 1e-5, "the low precision did not run"
    dtypes = {str(n.meta["example_value"].dtype) for n in record(opt).gm.graph.nodes
              if n.op == "call_function" and getattr(n.target, "__name__", "") == "linear"}
    assert dtypes == {f"torch.{'bfloat16' if precision == 'bf16' else 'float16'}", "torch.float32"}


@pytest.mark.parametrize("matmul_output", ["low", "auto"])
def test_hf_eager_attention_keeps_softmax_fp32(matmul_output):
    """low: HF's softmax(..., dtype=float32).to(query.dtype) and its KV-cache factories follow the
    region's dtype; the softmax itself stays fp32 (policy), casts around that one op. auto (the
    default): only the matmuls are zones of their own, in bf16; the softmax between them is fp32."""
    holder = {}

    def wrap(m):
        holder["opt"] = tailorfx.optimize(m, passes=["precision"], precision="bf16", example_inputs=batch(S=37, pad=5),
                                          precision_policy={"matmul_output": matmul_output})
        return holder["opt"]
    loss_err, errs, _ = grads_vs_eager(hf_llama(num_layers=1, attn="eager"), wrap, batch(S=37, pad=5))
    rec = record(holder["opt"])
    assert len(rec.touched) == 4 and rec.skipped == ()
    if matmul_output == "low":
        assert rec.stats["op_zones"] == {"softmax": "fp32"}
    else:
        zones = {n: match.op_name(next(m for m in rec.gm.graph.nodes if m.name == n)) for n in rec.stats["op_zones"]}
        assert set(rec.stats["op_zones"].values()) == {"bf16"}
        assert set(zones.values()) == {"linear_fp32_out", "matmul"}, zones   # q, k, v, o; QK^T, PV
    soft = next(n for n in rec.gm.graph.nodes if n.name == "softmax")
    assert soft.meta["example_value"].dtype == torch.float32
    assert soft.args[0].meta["example_value"].dtype == torch.float32
    assert loss_err < 5e-3 and max(errs.values()) < 3e-2


def test_policy_override():
    _, res = run_pass(tiny_llama(num_layers=1), {"precision": "bf16", "precision_policy": {"mlp": "fp32"}})
    assert res.touched[0] == "model.layers.0.self_attn (bf16 matmuls)"
    assert res.stats["norm_outputs"] == {"model.layers.0.input_layernorm": "bf16"}   # MLP reads fp32
    assert res.stats["regions"]["model.layers.0.mlp"] == "fp32"
    with pytest.raises(ValueError, match="precision_policy\\['mlp'\\]"):
        resolve_policy("bf16", {"mlp": "int8"})


def test_policy_override_through_optimize():
    opt = tailorfx.optimize(tiny_llama(num_layers=1), passes=["precision"], precision="bf16",
                            precision_policy={"mlp": "fp32"}, example_inputs=batch(S=37))
    stats = record(opt).stats
    assert stats["regions"]["model.layers.0.mlp"] == "fp32"
    assert stats["regions"]["model.layers.0.self_attn"] == "bf16"
    with pytest.raises(ValueError, match="precision_policy\\['mlp'\\]"):
        tailorfx.optimize(tiny_llama(num_layers=1), precision="bf16", precision_policy={"mlp": "int8"})
    with pytest.raises(ValueError, match="pass precision too"):
        tailorfx.optimize(tiny_llama(num_layers=1), precision_policy={"mlp": "fp32"})


def test_cleanup_rules():
    """The three rules on casts the pass made; the model's own cast is never touched."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    def f(x):
        a = x.to(torch.bfloat16).to(torch.float32)          # round trip of ours: removed
        b = x.to(torch.float32)                             # cast to its own dtype: removed
        c = x.to(torch.bfloat16) * 2                        # duplicate of the first inner cast
        d = x.to(torch.bfloat16) * 3
        return a + b, c + d, x.float().to(torch.bfloat16)   # the model's .float(): kept
    gm = fx.symbolic_trace(f)
    FakeTensorProp(gm).propagate(torch.randn(4))
    for n in gm.graph.nodes:
        n.meta["example_value"] = n.meta["val"]
        if n.op == "call_method" and n.target == "to":
            n.meta[PASS_META] = NAME
    fired, stop = cleanup(gm)
    gm.recompile()
    assert stop == "fixpoint"
    assert fired == {"cast_to_own_dtype": 1, "cast_round_trip": 1, "duplicate_cast": 2}
    x = torch.randn(4)
    torch.testing.assert_close(gm(x)[0], x + x)
    assert gm.code.count(".to(") == 2 and ".float()" in gm.code


# ---- memory and mini-sequence at S=4096 ---------------------------------------------------


@pytest.fixture(scope="module")
def runs_4096():
    """One fwd+bwd at S=4096 per variant: measured peak (allocator events, grads freed first),
    predicted peak, and gradients. A small Llama (vocab 256, hidden 128, 2 layers) keeps it fast."""
    torch.manual_seed(0)
    base = LlamaLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2))
    ids = torch.randint(0, 256, (1, 4096), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    out = {}
    for name, kw in {"fp32": dict(passes=[]), "bf16": dict(passes=["precision"], precision="bf16"),
                     "bf16+ms": dict(passes=["precision", "minisequence"], precision="bf16"),
                     "bf16 fp32 out": dict(passes=["precision"], precision="bf16",
                                           precision_policy={"matmul_output": "fp32"})}.items():
        model = copy.deepcopy(base)
        # captured at 4096: compiled at the sizes it runs (a capture at another length would add
        # a symbolic compile per variant; test_numerics covers that path)
        opt = tailorfx.optimize(model, **kw, example_inputs=inputs)
        def step():   # the output held through backward, as a training loop holds it
            o = opt(**inputs)
            o.loss.backward()
            return o
        model.zero_grad(set_to_none=True)
        peak = tailorfx.measure_peak(step)
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        peak = min(peak, tailorfx.measure_peak(step))
        out[name] = dict(peak=peak, predicted=opt.predict_memory(seq_len=4096).forward_backward_peak_bytes,
                         grads=grads, opt=opt)
    return out


@pytest.mark.slow
def test_measured_memory_at_4096_drops_20_percent(runs_4096):
    """Against fp32 run as captured (the unchanged graph runs under eager autograd: eager's peak)."""
    fp32, bf16 = runs_4096["fp32"]["peak"], runs_4096["bf16"]["peak"]
    assert [g.lowering for g in runs_4096["fp32"]["opt"].session.graphs] == ["dynamo"]
    assert bf16 < 0.8 * fp32, (bf16, fp32)
    predicted = runs_4096["bf16"]["predicted"]
    assert -0.02 <= (predicted - bf16) / bf16 <= 0.03, (predicted, bf16)


@pytest.mark.slow   # make test stays under 10 minutes; make test-slow (CI) runs it
def test_with_minisequence_chunked_ops_accumulate_in_fp32(runs_4096):
    opt = runs_4096["bf16+ms"]["opt"]
    gm = record(opt, "minisequence").gm
    chunked = [n for n in gm.graph.nodes if n.target is torch.ops.tailorfx.token_chunked.default]
    fused = [n for n in gm.graph.nodes if "chunked_linear_cross_entropy" in str(n.target)]
    assert len(chunked) == 2 and len(fused) == 1, "mini-sequence must still chunk what precision lowered"
    from tailorfx.runtime import ops
    for n in chunked:   # the region computes in bf16 inside; the weights it gets are fp32 masters,
        assert "torch.bfloat16" in ops.get_region(n.args[0]).code   # so grads accumulate in fp32
        assert all(w.meta["example_value"].dtype == torch.float32 for w in n.args[2])
    assert runs_4096["bf16+ms"]["peak"] < runs_4096["bf16"]["peak"]
    # under mini-sequence the MLP runs only its matmuls in bf16 ("auto"), as "fp32 out" does whole
    ms, plain, low, ref = (runs_4096[k]["grads"] for k in ("bf16+ms", "bf16 fp32 out", "bf16", "fp32"))
    head = "lm_head.weight"
    assert rel(ms[head], plain[head]) < 1e-4          # chunking adds nothing to bf16's error
    assert rel(ms[head], ref[head]) < 0.9 * rel(low[head], ref[head]) < 1e-2   # fp32 glue: less error
    assert max(rel(ms[k], plain[k]) for k in ms if ".mlp." in k) < 2e-2


@pytest.mark.slow   # make test stays under 10 minutes; make test-slow (CI) runs it
def test_fp32_glue_saves_for_backward_in_bf16(runs_4096):
    """matmul_output="fp32" without mini-sequence: SiLU and the gating run in fp32, but what they
    save for backward crosses in bf16 (rewrite/saved_dtype.py), so the saved activations cost what
    they do when the MLP computes in bf16; the extra is backward transients."""
    from tailorfx.rewrite.trace import trace_step
    opt = runs_4096["bf16 fp32 out"]["opt"]
    g = opt.session.graphs[-1]
    step = trace_step(g.rewritten, None, "default")
    out = next(n for n in step.fw.graph.nodes if n.op == "output").args[0]
    saved = [n.meta["val"] for n in out[step.num_user_outputs:] if isinstance(n.meta.get("val"), torch.Tensor)]
    wide = [v for v in saved if v.dim() == 3 and v.shape[-1] == 344]   # S x intermediate
    assert wide and all(v.dtype == torch.bfloat16 for v in wide), [v.dtype for v in wide]
    assert runs_4096["bf16 fp32 out"]["peak"] < runs_4096["fp32"]["peak"]
    pred, peak = runs_4096["bf16 fp32 out"]["predicted"], runs_4096["bf16 fp32 out"]["peak"]
    assert -0.02 <= (pred - peak) / peak <= 0.03, (pred, peak)



@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_hf_models_in_bf16_keep_their_sequence_symbol_for_mini_sequence(family):
    """precision="bf16" then mini-sequence on HF models: the precision pass recomputes each node's
    fake value, and torch 2.11's CPU linear on bf16 inputs reads its sizes as ints, which pinned the
    sequence length (the repo's Llama, the test below) or left the head's input without its symbol
    (HF Gemma-2, failing here before): the MLPs and the fused head were then left unrewritten
    ("sequence dim of the LM head input not found")."""
    inputs = batch(S=37, pad=5)
    wrap = lambda m: tailorfx.optimize(m, passes=["precision", "minisequence"], precision="bf16",  # noqa: E731
                                       example_inputs=inputs)
    loss_err, errs, opt = grads_vs_eager(hf_family(family, num_layers=1), wrap, inputs)
    ms = record(opt, "minisequence")
    assert ms.touched and all(t.endswith("//512))))") for t in ms.touched) and not ms.skipped, (ms.touched, ms.skipped)
    assert {t.split(" ")[0] for t in ms.touched} == {"model.layers.0.mlp", "lm_head"}
    assert opt(**inputs).logits is None          # the fused head ran
    assert loss_err < 5e-3 and max(errs.values()) < 3e-2, (loss_err, errs)


@pytest.mark.parametrize("matmul_output", ["auto", "fp32"])   # fp32: the head is a linear_fp32_out
def test_bf16_head_is_fused_with_its_fp32_master_weight(matmul_output):
    """With precision_policy={"lm_head_loss": "low"} the head reads W.to(bf16); mini-sequence's
    fused head + loss must still see the parameter through that cast, take the fp32 master (no
    V x H bf16 copy), compute in fp32 and return an fp32 loss. Before, the cast hid the parameter
    and the head stayed unfused with its S x V logits (reference model at S=4096: 90.0 MiB peak,
    fused 82.2 MiB)."""
    def wrap(m):
        return tailorfx.optimize(m, passes=["precision", "minisequence"], precision="bf16",
                                 precision_policy={"lm_head_loss": "low", "matmul_output": matmul_output},
                                 example_inputs=batch(S=37, pad=5))
    loss_err, errs, opt = grads_vs_eager(tiny_llama(num_layers=1), wrap, batch(S=37, pad=5))
    assert any(t.startswith("lm_head (bf16") for t in record(opt).touched)
    rec = record(opt, "minisequence")
    (fused,) = [n for n in rec.gm.graph.nodes if "chunked_linear_cross_entropy" in str(n.target)]
    hidden, weight = fused.args[0], fused.args[1]
    assert weight.op == "placeholder" and weight.meta["example_value"].dtype == torch.float32
    assert hidden.meta["example_value"].dtype == torch.bfloat16
    assert fused.meta["example_value"].dtype == torch.float32
    assert not [u for u in weight.users if u is not fused], "a cast copy of the head weight survived"
    assert loss_err < 5e-3 and max(errs.values()) < 3e-2, (loss_err, errs)
    assert errs["lm_head.weight"] > 1e-5, "the head's input was not bf16"

# ---- training: bf16 needs no scaler, fp16 survives an overflow ----------------------------


class PlantedLoss(torch.nn.Module):
    """Returns the loss times `factor`: a huge factor on one step overflows fp16 gradients."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.factor = 1.0

    def forward(self, **batch):
        return self.inner(**batch).loss * self.factor


def test_fp16_scaler_skips_overflowing_step_and_training_continues():
    assert make_scaler("bf16") is None and make_scaler("fp32") is None
    model = tiny_llama(num_layers=1)
    ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids, "labels": ids}
    planted = PlantedLoss(lowered(model, "fp16"))
    trainer = Trainer(planted, torch.optim.AdamW(model.parameters(), lr=3e-3), precision="fp16")
    results = [trainer.step(data) for _ in range(3)]
    scale = trainer.scaler.get_scale()
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    planted.factor = 1e8   # 1e8 x scale 65536: activation gradients overflow fp16's 65504
    overflow = trainer.step(data)
    assert overflow.skipped and overflow.scale == scale / 2
    assert all(torch.equal(p, before[k]) for k, p in model.named_parameters()), "a skipped step moved weights"
    planted.factor = 1.0
    results += [trainer.step(data) for _ in range(6)]
    assert not any(r.skipped for r in results) and trainer.num_skipped == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert results[-1].loss < results[0].loss - 0.1, [r.loss for r in results]


# ---- issue 7 acceptance: LM-head weight gradient at S=4096 on the reference model ----------

# benchmarks/precision.py's reference_model(): what the figures are measured on.
REFERENCE = dict(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2)


@pytest.mark.slow
def test_acceptance_lm_head_grad_at_4096_reference_model():
    """Issue 7: with mini-sequence on, bf16 LM-head weight gradients within 1% (relative norm) of
    fp32 on the reference model at S=4096 (initial weights, the harder case; see
    benchmarks/precision.py section 3 for the trained weights).

    The LM-head gradient depends only on forward values (logits and the final hidden state), so its
    error is the bf16 body's forward error. Rounding every op of attention and MLP to bf16 (policy
    matmul_output="low", as torch.autocast) gives 1.08% here; the default runs only the matmuls
    and attention kernels in bf16 and keeps their fp32 accumulators and the ops between them in
    fp32 (0.88%). With mini-sequence that costs the MLP little: its glue lives one chunk at a time.
    """
    torch.manual_seed(0)
    base = LlamaLM(LlamaConfig(**REFERENCE))
    ids = torch.randint(0, REFERENCE["vocab_size"], (1, 4096), generator=torch.Generator().manual_seed(2))
    inputs = {"input_ids": ids, "labels": ids}

    def head_grad(passes=(), policy=None, autocast=False):
        model = copy.deepcopy(base)
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**inputs).loss
        else:
            kw = dict(precision="bf16", precision_policy=policy) if "precision" in passes else {}
            run = tailorfx.optimize(model, passes=list(passes), example_inputs=inputs, **kw) if passes else model
            loss = run(**inputs).loss
        loss.backward()
        return model.lm_head.weight.grad

    ref = head_grad()   # chunking adding nothing to bf16's error: test_with_minisequence_chunked_ops...
    ms = head_grad(["precision", "minisequence"])
    ms_low = head_grad(["precision", "minisequence"], {"matmul_output": "low"})
    autocast = head_grad(autocast=True)
    assert rel(ms, ref) < 0.95e-2                     # acceptance, with margin: 0.88% measured
    assert rel(ms, ref) > 1e-3, "bf16 did not run"
    assert rel(ms_low, ref) < 1.02 * rel(autocast, ref)   # all-bf16 regions: no worse than autocast
    assert rel(ms, ref) < 0.9 * rel(autocast, ref)


@pytest.mark.parametrize("family,seed", [("mixtral", 0), ("qwen2_moe", 0), ("olmoe", 2)])
def test_moe_router_is_an_fp32_island(family, seed):
    """The router (found from the graph: a weight matmul reaching a topk) reads the fp32 hidden
    state and computes its logits, softmax, top-k and routing weights in fp32; the experts run in
    bf16. One layer, attention kept fp32, so the router sees eager's input: the gradients are then
    as close as a dense family's. With the router in bf16 (policy "router": "low") these seeds
    route tokens to other experts and the router's gradient is 11-25% off."""
    from models import hf_family
    model = hf_family(family, num_layers=1, seed=seed)
    policy = {"attention": "fp32"}
    loss_err, errs, opt = grads_vs_eager(model, lambda m: tailorfx.optimize(
        m, passes=["precision"], precision="bf16", precision_policy=policy), batch(S=64))
    assert loss_err < 5e-3 and max(errs.values()) < 2e-2, (loss_err, max(errs.items(), key=lambda kv: kv[1]))
    gm = record(opt).gm
    dtypes = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and match.op_name(n) in match.MATMUL_OPS | {"topk"}:
            reads_gate = any("mlp_modules_gate_parameters_weight" in a.name for a in n.all_input_nodes)
            kind = "router" if reads_gate else match.op_name(n)
            v = n.meta.get("val", n.meta.get("example_value"))
            dtypes.setdefault(kind, set()).add((v[0] if isinstance(v, tuple) else v).dtype)
    assert dtypes["router"] == {torch.float32} and dtypes["topk"] == {torch.float32}, dtypes
    assert torch.bfloat16 in set().union(*(d for k, d in dtypes.items() if k not in ("router", "topk"))), dtypes
    if family == "mixtral":   # the island is what keeps it close
        model.zero_grad(set_to_none=True)
        _, errs_low, _ = grads_vs_eager(model, lambda m: tailorfx.optimize(
            m, passes=["precision"], precision="bf16", precision_policy={**policy, "router": "low"}), batch(S=64))
        assert errs_low["model.layers.0.mlp.gate.weight"] > 5e-2, errs_low["model.layers.0.mlp.gate.weight"]
