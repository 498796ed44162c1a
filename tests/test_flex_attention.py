"""FlexAttention as the attention pass's kernel for masked forms (tailorfx/runtime/flex.py): the
block mask computed from the proved form bounds the mask (never skips a kept pair, never calls a
tile full that is not), the mods compute each form forward and backward, HF families run exact on it
through optimize(attention_kernel="flex"), and the choice between it and the Triton kernel by
measurement (a timer stands in for the GPU, whose times are benchmarks/kernel_speed.py's)."""
import copy
import uuid

import pytest
import torch

import tailorfx
from tailorfx.attention import Exact, SlidingWindow
from tailorfx.kernels import tuning
from tailorfx.runtime.flex import flex_attention, flex_supports, tile_classes

from harness import compare_with_eager
from models import batch, hf_family

DOCS = torch.tensor([[0] * 100 + [1] * 60 + [2] * 140, [0] * 290 + [1] * 10])   # (2, 300)
SHUFFLED = torch.tensor([[i % 3 for i in range(300)], [0] * 150 + [1] * 150])     # not contiguous
FORMS = [  # (spec, attention_call's kind and params)
    (Exact(causal=True), ("Exact", ())),
    (Exact(causal=False), ("Exact", ())),
    (SlidingWindow(50), ("SlidingWindow", (("window", 50),))),
    (SlidingWindow(50, global_tokens=3), ("SlidingWindow", (("window", 50), ("global_tokens", 3)))),
    (SlidingWindow(40, causal=False), ("SlidingWindow", (("window", 40),))),
    (Exact(causal=True, softcap=5.0), ("Exact", (("softcap", 5.0),))),
]
IDS = ["causal", "bidirectional", "window", "window+global", "window-bidirectional", "softcap"]


def _true_tiles(mask: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, all) kept per (query tile, key tile) of a (B, 1, S, S) bool mask; a tile cut by S's end
    counts as not all."""
    B, S = mask.shape[0], mask.shape[-1]
    n = -(-S // block)
    pad = n * block - S
    m = torch.nn.functional.pad(mask[:, 0], (0, pad, 0, pad))
    inside = torch.nn.functional.pad(torch.ones(S, S, dtype=torch.bool), (0, pad, 0, pad))
    tiles = m.view(B, n, block, n, block).transpose(2, 3)
    whole = inside.view(n, block, n, block).transpose(1, 2).all(-1).all(-1)
    return tiles.any(-1).any(-1), tiles.all(-1).all(-1) & whole


@pytest.mark.parametrize("seq", [256, 300])
@pytest.mark.parametrize("docs", [None, DOCS, SHUFFLED], ids=["no-docs", "docs", "shuffled-docs"])
@pytest.mark.parametrize("form", FORMS, ids=IDS)
def test_tiles_bound_the_mask(form, docs, seq):
    """Tiles of 16 at 256 and 300 tokens: every kept pair is in a visited tile, a tile called full
    keeps every pair; without documents the classes are the mask's exactly (nothing visited that
    the mask skips, nothing evaluated that is full), and documents skip tiles."""
    spec, _ = form
    window = getattr(spec, "window", 0)
    glob = getattr(spec, "global_tokens", 0)
    doc = None if docs is None else docs[:, :seq]
    some, every = tile_classes(seq, spec.causal, window, glob, doc, block=16)
    true_any, true_all = _true_tiles(spec.dense_mask(seq, 1, doc), 16)
    assert not (true_any & ~some).any(), "a tile holding a kept pair would be skipped"
    assert not (every & ~true_all).any(), "a tile called full masks a pair"
    if doc is None:
        assert torch.equal(some, true_any) and torch.equal(every, true_all)
    else:
        alone, _ = tile_classes(seq, spec.causal, window, glob, None, block=16)
        assert some.sum() < alone.expand_as(some).sum()


def _inputs(dtype=torch.float64, B=2, H=4, H_kv=2, S=300, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, S, D, generator=g, dtype=dtype).requires_grad_() for h in (H, H_kv, H_kv)]


@pytest.mark.parametrize("docs", [None, DOCS], ids=["no-docs", "docs"])
@pytest.mark.parametrize("form", FORMS, ids=IDS)
def test_each_form_matches_its_spec_forward_and_backward(form, docs):
    """fp64, 4 query heads on 2 kv heads, 300 tokens (not a multiple of the tile): the output and
    dq, dk, dv of FlexAttention's operator (torch's reference on the CPU) against the spec's own
    dense reference (the tiles, for a soft-cap)."""
    spec, (kind, params) = form
    q, k, v = _inputs()
    scale = 16 ** -0.5
    out = flex_attention(q, k, v, kind=kind, params=params, causal=spec.causal, scale=scale, document_ids=docs)
    want = spec.reference(q, k, v, docs) if spec.softcap is None else spec(q, k, v, document_ids=docs)
    grad = torch.randn_like(out)
    got_g, want_g = (torch.autograd.grad(o, (q, k, v), grad) for o in (out, want))
    assert (out - want).abs().max() < 1e-12
    for name, a, b in zip("qkv", got_g, want_g):
        assert (a - b).abs().max() < 1e-12, name


def test_a_per_key_bias_is_added_after_the_soft_cap():
    """ALiBi's per-key bias (B, H, 1, S) on soft-capped scores, causal, with documents: the score_mod
    the exact spec runs on the tiles ("key_bias"), forward and backward."""
    q, k, v = _inputs()
    bias = torch.randn(2, 4, 1, 300, dtype=torch.float64)
    kw = dict(kind="Exact", params=(("softcap", 5.0),), causal=True, scale=0.25, document_ids=DOCS)
    out = flex_attention(q, k, v, key_bias=bias, key_bias_scale=0.5, **kw)
    from tailorfx.attention import attention_call
    want = attention_call(q, k, v, key_bias=bias, key_bias_scale=0.5, **kw)
    grad = torch.randn_like(out)
    assert (out - want).abs().max() < 1e-12
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        assert (a - b).abs().max() < 1e-12


@pytest.mark.slow   # Inductor's C++ FlexAttention template compiles for a minute
def test_inductors_flex_kernel_reads_the_tiles_on_the_cpu():
    """Forward only (torch has no CPU FlexAttention backward), through torch.compile: Inductor's
    kernel skips the tiles the block mask leaves out and does not evaluate the mask on full ones, so
    this is where the tiles decide the result. A window with global tokens and documents, fp32."""
    q, k, v = (t.detach().float() for t in _inputs())
    compiled = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    params = (("window", 50), ("global_tokens", 3))
    out = compiled(q, k, v, kind="SlidingWindow", params=params, causal=True, scale=0.25, document_ids=DOCS)
    want = SlidingWindow(50, global_tokens=3, scale=0.25).reference(q, k, v, DOCS)
    assert (out - want).abs().max() < 1e-5


def test_what_flex_runs_and_what_it_refuses():
    """BigBird, dilated and dropout stay on the other kernels, with the reason."""
    assert flex_supports({"kind": "SlidingWindow", "params": (("window", 8), ("softcap", 5.0))}) is None
    assert "BigBird" in flex_supports({"kind": "BigBird", "params": (("block", 16),)})
    assert "dropout" in flex_supports({"kind": "Exact", "params": (("dropout", 0.1),)})
    assert "score_mod" in flex_supports({"kind": "Exact", "params": (("score_mod", "mine"),)})
    bias = torch.zeros(1, 1, 1, 8, requires_grad=True)
    assert "gradient" in flex_supports({"kind": "Exact", "params": (), "key_bias": bias})


def _attention_record(opt):
    (graph,) = opt.graph_records
    (rec,) = [r for r in graph.records if r.name == "attention"]
    return rec


@pytest.mark.parametrize("family", ["mistral", "gemma2", "bloom"])
def test_hf_families_train_exact_on_flex_when_asked(family):
    """attention_kernel="flex" on the CPU: Mistral's window (8 of 48 tokens), Gemma-2's soft-capped
    window and global layers, Bloom's ALiBi become FlexAttention calls; loss and every gradient as
    eager's (fp32)."""
    holder = {}

    def wrap(m):
        holder["opt"] = tailorfx.optimize(m, example_inputs=inputs, attention_kernel="flex")
        return holder["opt"]
    inputs = batch(S=48, pad=5)
    compare_with_eager(hf_family(family, **({} if family == "bloom" else {"sliding_window": 8})), inputs, wrap)
    rec = _attention_record(holder["opt"])
    assert len(rec.touched) == 2
    assert all(rec.stats[p]["kernel"].startswith("FlexAttention (asked)") for p in rec.touched), rec.stats
    code = holder["opt"].session.graphs[0].rewritten.code
    assert code.count("flex_attention(") == 2 and "attention_call(" not in code
    assert "FlexAttention (asked)" in str(holder["opt"].report())


def test_packed_documents_train_exact_on_flex():
    """Llama on a packed batch (restarting position_ids): the document ids computed in the graph are
    FlexAttention's mask buffer; exact against eager on the same packed batch."""
    from tailorfx.runtime.packing import PackingCollator
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (30, 50, 20, 64, 36)]
    inputs = {k: v for k, v in PackingCollator(seq_len=64)(docs).items() if k != "document_ids"}
    holder = {}

    def wrap(m):
        holder["opt"] = tailorfx.optimize(m, example_inputs=inputs, attention_kernel="flex")
        return holder["opt"]
    compare_with_eager(hf_family("llama"), inputs, wrap)
    rec = _attention_record(holder["opt"])
    assert all("document_ids" in rec.stats[p] and rec.stats[p]["kernel"].startswith("FlexAttention")
               for p in rec.touched) and len(rec.touched) == 2, rec.stats


def test_the_default_on_the_cpu_keeps_the_tiles_and_says_so():
    """attention_kernel="auto" (the default) off CUDA: the tiles, named in the stats; a bad value
    is refused naming the three."""
    model = hf_family("mistral", sliding_window=8)
    opt = tailorfx.optimize(copy.deepcopy(model), example_inputs=batch(S=48))
    rec = _attention_record(opt)
    assert {rec.stats[p]["kernel"] for p in rec.touched} == {"tiles"}
    assert "flex_attention(" not in opt.session.graphs[0].rewritten.code
    with pytest.raises(ValueError, match="attention_kernel='fast' is not valid: 'auto'.*'flex' or 'triton'"):
        tailorfx.optimize(model, attention_kernel="fast")


def test_pick_times_each_implementation_once_per_key_and_keeps_the_fastest(tmp_path, monkeypatch):
    """The fastest by the timer is picked, an implementation that raises is not, the choice is
    remembered untimed in the process and read back from disk by a fresh memo."""
    monkeypatch.setenv("TAILORFX_TRITON_CACHE", str(tmp_path))
    key = f"attention_kernel test {uuid.uuid4()}"
    ran = []

    def failing():
        raise RuntimeError("no kernel for this form")
    runs = {"triton": lambda: ran.append("triton"), "flex": lambda: ran.append("flex"), "other": failing}
    times = {"triton": 2.0, "flex": 1.0}

    def timer(fn):
        fn()
        return times[ran[-1]]
    assert tuning.pick(key, runs, timer) == "flex" and ran == ["triton", "flex"]
    assert tuning.pick(key, runs, lambda fn: pytest.fail("timed again")) == "flex"
    assert tuning.choices()[key]["ms"]["other"].startswith("RuntimeError: no kernel")
    del tuning._PICKS[key]
    assert tuning.known_pick(key, ("flex", "triton")) == "flex"   # from tuned.json
    assert tuning.known_pick(key, ("triton",)) is None            # no longer offered
    with pytest.raises(RuntimeError, match="no implementation of"):
        tuning.pick(f"{key} again", {"other": failing}, timer)


@pytest.mark.parametrize("family, S, B", [("mistral", 1024, 1),
                                          pytest.param("gemma2", 768, 2, marks=pytest.mark.slow)])
def test_the_unfused_cpu_path_is_predicted(family, S, B):
    """attention_kernel="flex" on the CPU runs torch's unfused FlexAttention, whose backward holds
    about 29 bytes per score (33 with Gemma-2's tanh soft-cap): the step's peak, at that backward,
    predicted within -2%..+3% (without the term: -85%)."""
    from harness import peak_of_step
    model = hf_family(family, sliding_window=64)
    ids = torch.randint(0, 256, (B, S))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    opt = tailorfx.optimize(model, example_inputs=inputs, attention_kernel="flex")
    measured = peak_of_step(opt, model, inputs)
    pm = opt.predict_memory(S)
    assert pm.peak_node.startswith("flex_attention_backward"), pm.peak_node
    predicted = pm.forward_backward_peak_bytes
    assert -0.02 * measured <= predicted - measured <= 0.03 * measured, (predicted, measured)


def test_flex_under_inductor_on_the_cpu_is_refused_with_the_way_out():
    """Inductor has no CPU FlexAttention backward (its lowering fails, and the graph would run as
    captured, nothing rewritten): training with attention_kernel="flex" and lowering="inductor" on the
    CPU is an error naming the options that work."""
    model = hf_family("mistral", sliding_window=8)
    with pytest.raises(ValueError, match="no CPU FlexAttention backward.*lowering='eager'.*attention_kernel='auto'"):
        tailorfx.optimize(model, example_inputs=batch(S=48), attention_kernel="flex", lowering="inductor")


def test_the_kernels_pass_takes_flexattention_as_attentions_kernel():
    """kernels="triton" with attention_kernel="flex": norms, GLU and RoPE on Triton kernels, the
    attention left on FlexAttention without a "not rewritten" note; exact."""
    holder = {}

    def wrap(m):
        holder["opt"] = tailorfx.optimize(m, example_inputs=inputs, attention_kernel="flex", kernels="triton")
        return holder["opt"]
    inputs = batch(S=48)
    compare_with_eager(hf_family("mistral", sliding_window=8), inputs, wrap)
    (rec,) = [r for g in holder["opt"].session.graphs for r in g.records if r.name == "kernels"]
    assert rec.stats == {"norm": 5, "glu": 2, "rope": 2} and not rec.skipped, (rec.stats, rec.skipped)
    assert holder["opt"].session.graphs[0].rewritten.code.count("flex_attention(") == 2
