"""The fused LM head's weight gradient summed in fp32 (`TrainingSetup(head_grad_dtype="fp32")`, as
Liger-Kernel's `accum_dtype=torch.float32`): rounded once, as eager's bf16 head rounds it, not once
per chunk; on both implementations of the head, counted by the memory model, and asked for by the
mini-sequence pass from the setup."""
import pytest
import torch
import torch.nn.functional as F

import tailorfx
from tailorfx.kernels import linear_cross_entropy as lce
from tailorfx.models import LlamaConfig, LlamaLM
from tailorfx.runtime import linear_ops, ops, triton_ops
from tailorfx.setup import PRESETS

CHUNKS = 32


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    n, hid, vocab = 512, 64, 1000
    h = torch.randn(n, hid, generator=g).bfloat16()
    w = (torch.randn(vocab, hid, generator=g) * 0.05).bfloat16()
    y = torch.randint(0, vocab, (n,), generator=g)
    y[::7] = -100
    return h, w, y


def _head(impl: str, h, w, y, fp32: bool):
    """(grad_hidden, grad_weight) of the CUDA path (GEMMs in bf16), forced on CPU."""
    if impl == "torch":
        _, gh, gw, _ = linear_ops.lce_chunks(h, w, None, y, -100, "mean", CHUNKS, None, None, True, True, False,
                                             in_weight_dtype=True, grad_weight_fp32=fp32)
    else:
        _, gh, gw, _ = lce.forward(h, w, None, y, chunk=h.shape[0] // CHUNKS, in_weight_dtype=True,
                                   grad_weight_fp32=fp32)
    return gh, gw


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("seed", [0, 1])
def test_an_fp32_sum_rounds_the_head_weight_gradient_once(impl, seed):
    """Against fp64: the fp32 sum over 32 chunks is as close as eager's bf16 head (one GEMM, one
    rounding); the bf16 sum (the default, Liger's) is at least 1.5x further. grad_hidden is the
    same bits either way."""
    h, w, y = _inputs(seed)
    hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
    F.cross_entropy(hr @ wr.t(), y).backward()
    he, we = h.clone().requires_grad_(), w.clone().requires_grad_()
    F.cross_entropy(F.linear(he, we).float(), y).backward()

    def err(gw):
        return ((gw.double() - wr.grad).norm() / wr.grad.norm()).item()

    gh16, gw16 = _head(impl, h, w, y, fp32=False)
    gh32, gw32 = _head(impl, h, w, y, fp32=True)
    assert gw32.dtype == gw16.dtype == torch.bfloat16
    assert torch.equal(gh16, gh32)
    assert err(gw32) <= 1.05 * err(we.grad), (err(gw32), err(we.grad))
    assert err(gw16) >= 1.5 * err(gw32), (err(gw16), err(gw32))


@pytest.mark.parametrize("name", ["chunked_linear_cross_entropy_with_grads", "triton_linear_cross_entropy"])
def test_the_memory_model_counts_the_fp32_sum_where_cuda_makes_it(name):
    """On CUDA a bf16 head's fp32 sum is V x H x 4 bytes more; off CUDA (the weight upcast, its
    gradient already summed in fp32) and without the weight's gradient nothing changes."""
    h, w = torch.empty(1024, 64, dtype=torch.bfloat16), torch.empty(8192, 64, dtype=torch.bfloat16)
    base = [h, w, None, torch.zeros(1024, dtype=torch.long), -100, "mean", 4, None, None, True, True, False]
    for cuda, extra in ((True, 8192 * 64 * 4), (False, 0)):
        plain = linear_ops.transient_bytes(name, base, int, cuda=cuda)
        assert linear_ops.transient_bytes(name, base + [False], int, cuda=cuda) == plain
        assert linear_ops.transient_bytes(name, base + [True], int, cuda=cuda) == plain + extra
    no_weight_grad = base[:10] + [False, False, True]
    assert (linear_ops.transient_bytes(name, no_weight_grad, int, cuda=True)
            == linear_ops.transient_bytes(name, base[:10] + [False, False], int, cuda=True))


def test_the_vocab_parallel_head_passes_the_fp32_sum_to_the_memory_model(monkeypatch):
    """Tensor parallel's fused head (runtime/vocab_parallel.py) takes the same argument after its
    own two flags, and hands it to the one-device head's transient on this rank's rows."""
    from tailorfx.runtime import vocab_parallel
    seen = []
    monkeypatch.setattr(linear_ops, "transient_bytes", lambda name, args, as_int: seen.append(args) or 0)
    h, w = torch.empty(1024, 64, dtype=torch.bfloat16), torch.empty(4096, 64, dtype=torch.bfloat16)
    args = [h, w, torch.zeros(1024, dtype=torch.long), 0, "g", -100, "mean", 4, None, None, True, True]
    vocab_parallel.transient_bytes("vocab_parallel_cross_entropy_with_grads", args + [True], int)
    vocab_parallel.transient_bytes("vocab_parallel_cross_entropy_with_grads", args, int)
    assert seen[0][9:] == [True, True, False, True] and seen[1][9:] == [True, True, False]


def _tiny_bf16_lm():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaLM(cfg).to(torch.bfloat16)


def _model(family: str):
    """A tiny bf16 LM: tailorfx's own Llama, or a Hugging Face family built from its config."""
    if family == "tailorfx-llama":
        return _tiny_bf16_lm()
    from models import hf_family
    return hf_family(family, num_layers=1, vocab_size=512).to(torch.bfloat16)


@pytest.mark.parametrize("family,kernels", [("tailorfx-llama", None), ("tailorfx-llama", "triton"),
                                            ("llama", None), ("qwen2", "triton"), ("gemma2", None)])
def test_the_setup_asks_the_fused_head_for_an_fp32_sum(family, kernels):
    """The mini-sequence pass hands the setup's head_grad_dtype to the fused head it emits (either
    implementation, Hugging Face families and tailorfx's own); the default setup leaves the
    argument out, and the step runs either way."""
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    fn = triton_ops.triton_linear_cross_entropy if kernels == "triton" else ops.chunked_linear_cross_entropy
    seen = {}
    for label, setup in (("default", PRESETS["pure-bf16"]),
                         ("fp32", PRESETS["pure-bf16"].with_(head_grad_dtype="fp32"))):
        opt = tailorfx.optimize(_model(family), passes=["minisequence"], setup=setup, kernels=kernels,
                                example_inputs=batch)
        opt(**batch).loss.backward()
        (head,) = [n for n in opt.graphs["minisequence"].graph.nodes if n.target is fn]
        seen[label] = head.kwargs.get("grad_weight_fp32")
    assert seen == {"default": None, "fp32": True}
    assert "LM head gradient summed in fp32" in PRESETS["pure-bf16"].with_(head_grad_dtype="fp32").describe()
    with pytest.raises(ValueError, match="head_grad_dtype must be fp32 or None"):
        PRESETS["pure-bf16"].with_(head_grad_dtype="bf16")
