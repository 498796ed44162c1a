"""The kernels pass (kernels="triton"): norms, gated activations, attention and the fused LM head
of HF models become calls of the runtime's Triton kernels, run here by Triton's CPU interpreter.
Each test proves the regions were replaced and that loss and every gradient equal eager's."""
import os
import re

import pytest
import torch

import tailorfx
from harness import check_exact, compare_with_eager, float64_reference, peak_of_step, step_values
from models import batch, hf_family, tiny_llama
from tailorfx.rewrite import match
from tailorfx.rewrite.capture import node_value
from tailorfx.runtime import triton_ops

GOLDEN = os.path.join(os.path.dirname(__file__), "goldens", "kernels_diff.txt")


def kernels_record(opt):
    recs = [r for g in opt.session.graphs for r in g.records if r.name == "kernels"]
    assert len(recs) == 1
    return recs[0]


def run_triton(family, passes=(), S=12, overrides=None, **kw):
    holder = {}

    def wrap(m):
        holder["opt"] = tailorfx.optimize(m, passes=list(passes), kernels="triton", example_inputs=batch(S=S, pad=3), **kw)
        return holder["opt"]
    model = hf_family(family, num_layers=1, **(overrides or {}))
    compare_with_eager(model, batch(S=S, pad=3), wrap)
    return holder["opt"]


def norm_paths(opt):
    return sorted(r.path for r in opt.regions if r.kind == "norm")


# Per family, what the kernels pass must replace (one run each: norms, gated MLPs, rotary embeddings
# and attention together). Norms: RMSNorm (offset 1: Gemma's `1 + w`), LayerNorm with bias (GPT-2's
# Conv1D model, GPT-NeoX), LayerNorm without bias written by hand (Cohere). Gated MLPs: SwiGLU
# (Phi-3 splits one fused gate_up projection), GeGLU with the tanh GELU (Gemma-2) and with the
# exact erf GELU (a Llama config with hidden_act="gelu"). Rotary: transformers' rotate_half (Qwen3
# after its q/k norms, Phi-3 after a fused qkv, GPT-NeoX's partial rotary: a quarter of each head);
# Cohere rotates interleaved pairs, another formula, left as it is. Attention: whatever the
# attention pass rewrote (Gemma-2's one layer here is a sliding one: its window of 4096 keys, as
# proved, soft-capped; its global layers' soft-capped attention is in the test below).
RMS, LAYER_BIAS = ("rms", 0.0, False), ("layer", 0.0, True)
EXPECTED = {
    "llama": dict(norms={RMS}, act="silu", rope=1, attention=True),
    "llama-gelu": dict(norms={RMS}, act="gelu", rope=1, attention=True),
    "qwen3": dict(norms={RMS}, act="silu", rope=1, attention=True),
    "phi3": dict(norms={RMS}, act="silu", rope=1, attention=True),
    "gemma2": dict(norms={("rms", 1.0, False)}, act="gelu_tanh", rope=1, attention="SlidingWindow"),
    "gpt2": dict(norms={LAYER_BIAS}, act=None, rope=None, attention=True),
    "gpt_neox": dict(norms={LAYER_BIAS}, act=None, rope=0.25, attention=True),
    "cohere": dict(norms={("layer", 0.0, False)}, act="silu", rope=None, attention=True),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_region_of_a_family_becomes_its_kernel(name):
    want = EXPECTED[name]
    family, overrides = (name.split("-")[0], {"hidden_act": "gelu"}) if "-" in name else (name, {})
    opt = run_triton(family, **({"overrides": overrides} if overrides else {}))
    rec = kernels_record(opt)
    nodes = list(rec.gm.graph.nodes)
    calls = lambda op: [n for n in nodes if n.target is op]   # noqa: E731
    regions = lambda kind: sorted(r.path for r in opt.regions if r.kind == kind)   # noqa: E731
    norms, mlps, attn = regions("norm"), regions("mlp"), regions("attention")
    assert norms and set(norms) <= set(rec.touched)
    got = {(n.kwargs["kind"], n.kwargs["offset"], n.args[2] is not None) for n in calls(triton_ops.triton_norm)}
    assert len(calls(triton_ops.triton_norm)) == len(norms) and got == want["norms"]
    if want["act"]:
        assert mlps and set(mlps) <= set(rec.touched)
        assert {n.kwargs["act"] for n in calls(triton_ops.triton_glu)} == {want["act"]}
        assert len(calls(triton_ops.triton_glu)) == len(mlps)
        assert not [n for n in nodes if match.op_name(n) in ("silu", "gelu")]
    else:
        assert not calls(triton_ops.triton_glu)
    ropes = calls(triton_ops.triton_rope) + calls(triton_ops.triton_rope_qk)
    if want["rope"]:
        assert len(calls(triton_ops.triton_rope_qk)) == len(attn) and not calls(triton_ops.triton_rope)  # q and k at once
        assert not [n for n in nodes if match.op_name(n) == "neg"]   # no rotate_half left
        head_dim = opt.model.config.hidden_size // opt.model.config.num_attention_heads
        assert {int(node_value(n.args[0]).shape[-1]) for n in ropes} == {int(head_dim * want["rope"])}
    else:
        assert not ropes
    flash = calls(triton_ops.triton_attention)
    if want["attention"]:
        assert attn and set(attn) <= set(rec.touched)
        kind = want["attention"] if isinstance(want["attention"], str) else "Exact"
        assert len(flash) == len(attn) and all(n.kwargs["kind"] == kind and n.kwargs["causal"] for n in flash)
    else:
        assert not flash
    families = {k.spec.family for k in opt.kernels().values()}
    assert families == ({"norm"} | ({"glu"} if want["act"] else set()) | ({"rope"} if want["rope"] else set())
                        | ({"flash_attention"} if want["attention"] else set()))


def sparse_step(spec):
    """The loss of a step with `spec`'s attention on the runtime's own sparse kernel (no kernels=):
    the reference of a sparse spec, which eager attention does not compute."""
    def loss_fn(model, data):
        return tailorfx.optimize(model, attention=spec, passes=["attention"], example_inputs=data)(**data).loss
    return loss_fn


@pytest.mark.slow   # make test stays under 10 minutes; make test-slow (CI) runs it
def test_sparse_attention_spec_runs_on_the_flash_kernel():
    """A sliding window asked for by the user: the kernel's window mask, against the runtime's own
    sparse kernel (tailorfx.attention.SlidingWindow without kernels=), both against that kernel's
    float64 step."""
    from tailorfx.attention import SlidingWindow
    import copy
    spec = SlidingWindow(4, global_tokens=1)
    a = hf_family("llama", num_layers=1)
    b = copy.deepcopy(a)
    data = batch(S=12, pad=3)
    truth = float64_reference(a, data, sparse_step(spec))
    ref = tailorfx.optimize(a, attention=spec, passes=["attention"], example_inputs=data)
    opt = tailorfx.optimize(b, attention=spec, passes=["attention"], kernels="triton", example_inputs=data)
    calls = [n for n in kernels_record(opt).gm.graph.nodes if n.target is triton_ops.triton_attention]
    assert len(calls) == 1 and calls[0].kwargs["kind"] == "SlidingWindow"
    loss_ref, loss = ref(**data).loss, opt(**data).loss
    loss_ref.backward()
    loss.backward()
    check_exact(step_values(b, loss), step_values(a, loss_ref), truth)


@pytest.mark.slow   # make test stays under 10 minutes; make test-slow (CI) runs it
def test_on_cuda_a_sparse_spec_and_packed_documents_take_the_flash_kernel(monkeypatch):
    """On CUDA the attention pass puts a sparse spec (and packed documents) on the Triton flash
    kernel without kernels=, never on the runtime's tile engine (a Python loop per tile, host
    copies); exact attention stays torch's SDPA. CUDA is stood in for by the pass's device check,
    Triton's interpreter runs the kernel: loss and every gradient equal the tile engine's, and a
    packed batch's equal eager's."""
    import copy
    from tailorfx.attention import SlidingWindow, attention_call
    from tailorfx.passes.attention import rewrite
    from tailorfx.runtime.packing import PackingCollator
    spec = SlidingWindow(4, global_tokens=1)
    a = hf_family("llama", num_layers=1)
    b, c = copy.deepcopy(a), copy.deepcopy(a)
    data = batch(S=12, pad=3)
    truth = float64_reference(a, data, sparse_step(spec))
    ref = tailorfx.optimize(a, attention=spec, passes=["attention"], example_inputs=data)
    monkeypatch.setattr(rewrite, "_on_cuda", lambda t: True)
    opt = tailorfx.optimize(b, attention=spec, passes=["attention"], example_inputs=data)
    graph = opt.graphs["attention"].graph
    calls = [n for n in graph.nodes if n.target is triton_ops.triton_attention]
    assert len(calls) == 1 and calls[0].kwargs["kind"] == "SlidingWindow"
    assert not [n for n in graph.nodes if n.target is attention_call]
    loss_ref, loss = ref(**data).loss, opt(**data).loss
    loss_ref.backward()
    loss.backward()
    check_exact(step_values(b, loss), step_values(a, loss_ref), truth)
    exact = tailorfx.optimize(c, passes=["attention"], example_inputs=data).graphs["attention"].graph
    assert [n.kwargs["kind"] for n in exact.nodes if n.target is attention_call] == ["Exact"]
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 100, (n,), generator=g).tolist() for n in (7, 13, 5, 20, 9, 1, 11)]
    packed = {k: v for k, v in PackingCollator(seq_len=24)(docs).items() if k != "document_ids"}
    holder = {}

    def wrap(m):
        holder["opt"] = tailorfx.optimize(m, passes=["attention"], example_inputs=packed)
        return holder["opt"]
    compare_with_eager(hf_family("llama", num_layers=1), packed, wrap)
    calls = [n for n in holder["opt"].graphs["attention"].graph.nodes if n.target is triton_ops.triton_attention]
    assert calls and all(n.kwargs.get("document_ids") is not None for n in calls)


# everything at once on three families: norms, gated MLPs (chunked by the mini-sequence pass, the
# kernel inside each chunk), flash attention and the fused LM head + loss on the Triton kernel,
# with Gemma-2's soft-capped logits and Cohere's logit scale inside it
@pytest.mark.parametrize("family,head", [("llama", {}), ("gemma2", {"logit_softcap": 30.0}),
                                         ("cohere", {"logit_scale": 0.5})])
def test_a_training_step_on_every_kernel_equals_eager(family, head):
    # Gemma-2's layer a global one: soft-capped attention scores, the soft-cap handed to the kernel
    overrides = {"layer_types": ["full_attention"]} if family == "gemma2" else None
    opt = run_triton(family, passes=["attention", "minisequence"], minisequence_chunks=2, overrides=overrides)
    graph = opt.graphs["minisequence"].graph
    (lce,) = [n for n in graph.nodes if n.target is triton_ops.triton_linear_cross_entropy]
    assert {k: lce.kwargs.get(k) for k in head} == head and lce.kwargs["num_chunks"] == 2
    assert not [n for n in graph.nodes if match.op_name(n) in ("cross_entropy", "chunked_linear_cross_entropy")]
    families = {k.spec.family for k in opt.kernels().values()}
    want = {"norm", "glu", "linear_cross_entropy", "flash_attention"}
    flash = [n for n in opt.graphs["kernels"].graph.nodes if n.target is triton_ops.triton_attention]
    assert len(flash) == 1 and flash[0].kwargs.get("softcap") == (50.0 if family == "gemma2" else None)
    assert dict(flash[0].kwargs["params"]) == {}
    want |= {"rope"} if family != "cohere" else set()   # Cohere rotates interleaved pairs, not halves
    assert families == want, sorted(opt.kernels())


@pytest.mark.slow
def test_packed_documents_run_the_flash_kernel_with_document_ids():
    """A packed batch (restarting position_ids): the attention pass proves the document mask, the
    flash kernel takes the document ids, and the step equals eager on the packed batch."""
    from tailorfx.runtime.packing import PackingCollator
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 100, (n,), generator=g).tolist() for n in (7, 13, 5, 20, 9, 1, 11)]
    packed = {k: v for k, v in PackingCollator(seq_len=24)(docs).items() if k != "document_ids"}
    holder = {}

    def wrap(m):
        holder["opt"] = tailorfx.optimize(m, passes=["attention"], kernels="triton", example_inputs=packed)
        return holder["opt"]
    compare_with_eager(hf_family("llama", num_layers=1), packed, wrap)
    calls = [n for n in kernels_record(holder["opt"]).gm.graph.nodes if n.target is triton_ops.triton_attention]
    assert calls and all(n.kwargs.get("document_ids") is not None for n in calls)
    assert any("documents=True" in name for name in holder["opt"].kernels())


@pytest.mark.slow
def test_alibi_runs_the_flash_kernel_with_its_key_bias():
    """Bloom's ALiBi (the attention pass's key bias, one value per key): the flash kernel adds it to
    the scores (no tile engine), the listed kernel is the key-bias one, and the step equals eager."""
    holder = {}
    inputs = batch(S=48, pad=5)

    def wrap(m):
        holder["opt"] = tailorfx.optimize(m, passes=["attention"], kernels="triton", example_inputs=inputs)
        return holder["opt"]
    compare_with_eager(hf_family("bloom"), inputs, wrap)
    nodes = list(kernels_record(holder["opt"]).gm.graph.nodes)
    calls = [n for n in nodes if n.target is triton_ops.triton_attention]
    assert len(calls) == 2 and all(n.kwargs.get("key_bias") is not None for n in calls)
    assert not [n for n in nodes if "attention_call" in str(n.target)]
    assert any("key_bias=True" in name for name in holder["opt"].kernels()), sorted(holder["opt"].kernels())


@pytest.mark.slow   # make test stays under 10 minutes; make test-slow (CI) runs it
def test_kernels_of_the_model_have_source_and_compile():
    opt = run_triton("llama")
    kernels = opt.kernels()
    norm = next(k for name, k in kernels.items() if name.startswith("norm_"))
    assert "@triton.jit" in norm.source and "def norm_fwd" in norm.source and "def norm_bwd" in norm.source
    res = norm.compile(90)
    assert res["n_spills"] == 0 and res["n_regs"] > 0 and set(res["cubin"]) == {"norm_fwd", "norm_bwd"}


def test_golden_graph_diff():
    opt = tailorfx.optimize(hf_family("llama", num_layers=1), passes=[], kernels="triton", example_inputs=batch(S=12))
    diff = opt.diff("kernels")
    got = "\n".join(l for l in diff.splitlines() if not l.lstrip("+- ").startswith("#")) + "\n"
    got = re.sub(r"s\d+", "s<n>", got)
    if os.environ.get("TAILORFX_UPDATE_GOLDENS"):
        with open(GOLDEN, "w") as f:
            f.write(got)
    with open(GOLDEN) as f:
        assert got == f.read()


def test_a_norm_that_is_not_one_is_left_and_reported():
    """Must not fire: a module whose name says norm but that computes x * rsqrt(mean(x^2) + eps)
    * w * 2 is neither RMSNorm nor LayerNorm; the pass leaves it and says why."""
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.Module()
            self.w = torch.nn.Parameter(torch.randn(16))

        def forward(self, x):
            return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w * 2).sum()

    from tailorfx.passes.kernels import _match_norm
    import torch.fx as fx
    from tailorfx.rewrite.regions import Region
    gm = fx.symbolic_trace(Odd())
    from torch.fx.passes.shape_prop import ShapeProp
    ShapeProp(gm).propagate(torch.randn(3, 16))
    for n in gm.graph.nodes:
        n.meta["val"] = n.meta.get("tensor_meta") and torch.empty(n.meta["tensor_meta"].shape)
    names = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")][:-1]
    region = Region("norm", "norm", tuple(names), True, ("x",), ("w",), (names[-1],))
    nodes = {n.name: n for n in gm.graph.nodes}
    why = _match_norm(region, nodes, None)
    assert isinstance(why, str) and "differ from LayerNorm and from RMSNorm" in why


def test_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs Triton's CPU interpreter: set TRITON_INTERPRET=1"):
        tailorfx.optimize(tiny_llama(num_layers=1), kernels="triton")


def test_a_model_of_fake_tensors_is_planned_with_triton_kernels_where_a_gpu_can_trace_them(monkeypatch):
    """The shallow capture of a CUDA model's config (shallow.py) is a CPU model of fake tensors:
    nothing runs on it, so with a GPU's Triton driver at hand kernels="triton" takes it without the
    interpreter; a real CPU model is still refused there, and a fake one without a GPU."""
    from tailorfx.kernels import check_triton
    from tailorfx.models.build import fake_copy
    monkeypatch.delenv("TRITON_INTERPRET")
    model = tiny_llama(num_layers=1)
    fake = fake_copy(model)
    with pytest.raises(ValueError, match="needs Triton's CPU interpreter"):
        check_triton(fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_triton(fake)
    with pytest.raises(ValueError, match="on a cpu model needs Triton's CPU interpreter"):
        check_triton(model)


@pytest.mark.slow   # a minute in a process of its own
def test_a_gpu_machine_plans_triton_kernels_on_a_shallow_capture():
    """optimize(kernels="triton", budget=) of a 17-layer HF Llama as a GPU machine runs it (no
    interpreter, Triton's driver for sm90: tests/gpu_view_hint.py) gets the plan of a shallow
    capture of its config: a memory rewrite meeting three quarters of the unrewritten step's peak,
    chosen on fake CPU tensors with every Triton kernel in the graph."""
    import json
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_view_hint.py")
    r = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["hint"] is not None and got["hint"]["layers"] == "8 of 17", got
    assert got["hint"]["label"] != "no memory rewrite" and got["budget"] < got["unrewritten_peak"], got
    assert "kernels" in got["passes"] and got["fake"], got
    for kind in ("norm", "glu", "rope", "flash_attention", "linear_cross_entropy"):
        assert any(name.startswith(kind + "_") for name in got["launches"]), (kind, got["launches"])


def test_unknown_kernels_value():
    with pytest.raises(ValueError, match="kernels='cuda' is not valid"):
        tailorfx.optimize(tiny_llama(num_layers=1), kernels="cuda")


def stand_in_timer(monkeypatch, tmp_path, ms) -> list:
    """kernel_choice timed on the CPU as on a GPU, each implementation really run (forward and
    backward) and given `ms(key, name)`; returns the (kernel, implementation) runs as they happen."""
    from tailorfx.kernels import tuning
    from tailorfx.passes import kernel_choice
    monkeypatch.setenv("TAILORFX_TRITON_CACHE", str(tmp_path))
    for memo in ("_PICKS", "_TIMES"):
        monkeypatch.setattr(tuning, memo, {})
    monkeypatch.setattr(tuning, "_MISSED", set())
    monkeypatch.setattr(kernel_choice, "TIMED_ON", ("cuda", "cpu"))
    ran, pick = [], tuning.pick

    def keyed(key, runs, timer=None):
        def timed(fn):
            fn()
            ran.append((key.split()[0], fn.__name__))
            return ms(key, fn.__name__)
        return pick(key, runs, timed)
    monkeypatch.setattr(tuning, "pick", keyed)
    return ran


@pytest.mark.parametrize("lowering", ["inductor", "eager"])
def test_a_region_whose_own_code_is_faster_is_left_as_it_was(lowering, monkeypatch, tmp_path):
    """kernels="triton": each norm, gated activation, rotary and attention region is timed both ways (here on
    the CPU, as on a GPU: the Triton op by the interpreter, the region's own nodes forward and
    backward as the lowering runs them: compiled by Inductor inside the capture, or as its ATen ops)
    and left as it was where its own code was faster (a stand-in timer: norms), with the key in the
    report; the step stays exact, and a second model reuses the choices untimed."""
    from tailorfx.passes import kernel_choice
    ran = stand_in_timer(monkeypatch, tmp_path,
                         lambda key, name: 1.0 if (name == lowering) == key.startswith("kernels.norm") else 2.0)
    opt = run_triton("llama", lowering=lowering)
    # under the eager lowering a norm is also timed on torch's fused kernel, and a norm, gated
    # activation or rotary region compiled by Inductor alone (the tests below)
    fused = {"torch"} if lowering == "eager" else set()
    alone = {"inductor"} if lowering == "eager" else set()
    assert sorted(set(ran)) == sorted((k, n) for k in ("kernels.glu", "kernels.norm", "kernels.rope", "kernels.flash_attention")
                                      for n in {lowering, "triton"} | (fused if k == "kernels.norm" else set())
                                      | (alone if k != "kernels.flash_attention" else set()))
    rec = kernels_record(opt)
    assert "norm" not in rec.stats and rec.stats["glu"] == 1 and rec.stats["rope"] == 1, rec.stats
    assert rec.stats["flash_attention"] == 1, rec.stats
    left = [s for s in rec.skipped if f"{kernel_choice.LEFT_TO[lowering]} (kernels.norm cpu" in s]
    assert len(left) == 3 and all(s.endswith(f"{lowering})") for s in left), rec.skipped
    code = opt.session.graphs[0].rewritten.code
    assert "triton_norm" not in code and "triton_glu" in code and "rsqrt" in code
    ran.clear()
    again = run_triton("llama", lowering=lowering)
    assert not ran and kernels_record(again).stats == rec.stats


def test_a_norm_is_lowered_to_torchs_fused_kernel_where_that_is_fastest(monkeypatch, tmp_path):
    """Under the eager lowering a norm is timed three ways: the Triton op, its own ATen ops and
    torch's fused kernel (F.rms_norm: one CUDA kernel each way where HF's RMSNorm runs eight or more
    forward); where the fused kernel is fastest (a stand-in timer) the norm is lowered to it, the
    report counts it, and the step stays exact. A gated activation has no such candidate."""
    ran = stand_in_timer(monkeypatch, tmp_path, lambda key, name: {"torch": 1.0, "triton": 2.0}.get(name, 3.0))
    opt = run_triton("llama", lowering="eager")
    assert {n for k, n in ran if k == "kernels.norm"} == {"torch", "triton", "inductor", "eager"}
    assert {n for k, n in ran if k in ("kernels.glu", "kernels.rope")} == {"triton", "inductor", "eager"}
    rec = kernels_record(opt)
    assert rec.stats.get("torch_norm") == 3 and "norm" not in rec.stats and rec.stats["glu"] == 1, rec.stats
    code = opt.session.graphs[0].rewritten.code
    assert code.count("torch_norm(") == 3 and "triton_norm" not in code and "rsqrt" not in code
    assert not [s for s in rec.skipped if "measured" in s], rec.skipped


def test_a_region_is_lowered_to_inductors_code_alone_where_that_is_fastest(monkeypatch, tmp_path):
    """Under the eager lowering a norm, gated activation and rotary region is also timed as Inductor
    compiles it alone (one opaque op each way, the backward recomputing the forward); where that is
    fastest (a stand-in timer) the region becomes that op, the report counts it, the layers' norms
    share one compiled forward and backward, and the step stays exact (loss and every gradient)."""
    from tailorfx.runtime import inductor_region
    ran = stand_in_timer(monkeypatch, tmp_path, lambda key, name: 1.0 if name == "inductor" else 2.0)
    opt = run_triton("llama", lowering="eager")
    assert {k for k, n in ran if n == "inductor"} == {"kernels.norm", "kernels.glu", "kernels.rope"}
    rec = kernels_record(opt)
    assert rec.stats.get("inductor_region") == 5 and not {"norm", "glu", "rope"} & set(rec.stats), rec.stats
    assert rec.stats["flash_attention"] == 1, rec.stats
    code = opt.session.graphs[0].rewritten.code
    assert code.count("inductor_region(") == 5 and "rsqrt" not in code and "silu" not in code, code
    keys = {n.args[0] for n in opt.session.graphs[0].rewritten.graph.nodes
            if n.target is inductor_region.inductor_region}
    assert len(keys) == 3, keys   # one norm form for the layer's two norms and the last
    assert all(inductor_region.region_of(k).compiled.get("bw") is not None for k in keys)


@pytest.mark.parametrize("family, want", [("gemma2", 7), ("gpt_neox", 4)])
def test_other_families_regions_go_to_inductors_code_alone_exactly(family, want, monkeypatch, tmp_path):
    """The same on other forms, one layer each: Gemma-2's four `1 + w` RMSNorms, the last one, its
    GeGLU (tanh GELU) and rotary (7); GPT-NeoX's two biased LayerNorms, the last one and its partial
    rotary, a quarter of each head (4). Each becomes the op, and the step is exact against eager."""
    from tailorfx.runtime import inductor_region
    stand_in_timer(monkeypatch, tmp_path, lambda key, name: 1.0 if name == "inductor" else 2.0)
    opt = run_triton(family, lowering="eager")
    rec = kernels_record(opt)
    assert rec.stats.get("inductor_region") == want and not {"norm", "glu", "rope"} & set(rec.stats), rec.stats
    targets = [n.target for n in opt.session.graphs[0].rewritten.graph.nodes]
    assert targets.count(inductor_region.inductor_region) == want


def test_a_step_with_regions_on_inductors_code_alone_is_predicted(monkeypatch, tmp_path):
    """The memory model sees each region on Inductor's code alone as its one opaque op each way, the
    backward saving only the region's inputs: a 2-layer HF Llama's step with its nine norms, gated
    activations and rotaries there (attention left to its own code, so no Triton launch: the
    interpreter holds a launch's arguments, docs/kernels.md) is predicted within 0.04%, the README's
    figure for the default plan on every family (benchmarks/families.py)."""
    stand_in_timer(monkeypatch, tmp_path,
                   lambda key, name: 1.0 if name == ("eager" if "attention" in key else "inductor") else 2.0)
    model, inputs = hf_family("llama", num_layers=2), batch(S=64)
    opt = tailorfx.optimize(model, passes=[], kernels="triton", lowering="eager", example_inputs=inputs)
    measured = peak_of_step(opt, model, inputs)
    assert kernels_record(opt).stats == {"inductor_region": 9}
    assert abs(opt.predict_memory().dynamic_peak_bytes / measured - 1) <= 4e-4


def test_an_attention_is_left_on_its_own_kernel_where_that_is_faster(monkeypatch, tmp_path):
    """kernels="triton" times an exact attention too: the Triton flash kernel against the region's
    own code (on a GPU SDPA's flash kernel; here its CPU path), forward and backward, and leaves it
    where that is faster (a stand-in timer), with the key in the report; the step stays exact."""
    from tailorfx.passes import kernel_choice
    ran = stand_in_timer(monkeypatch, tmp_path,
                         lambda key, name: 1.0 if (name == "eager") == key.startswith("kernels.flash_attention") else 2.0)
    opt = run_triton("llama", passes=["attention"], lowering="eager")
    assert {n for k, n in ran if k == "kernels.flash_attention"} == {"triton", "eager"}
    rec = kernels_record(opt)
    assert "flash_attention" not in rec.stats and rec.stats["norm"] == 3, rec.stats
    left = [s for s in rec.skipped if f"{kernel_choice.LEFT_TO['eager']} (kernels.flash_attention cpu" in s]
    assert len(left) == 1, rec.skipped
    code = opt.session.graphs[0].rewritten.code
    assert "triton_attention" not in code and "attention_call" in code and "triton_norm" in code
