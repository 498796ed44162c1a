"""Each generated Triton kernel against torch's own, forward + backward, on a CUDA GPU.

    python benchmarks/kernels.py            # prints a table, writes benchmarks/out/kernels.json

Per kernel family, at Llama-3-8B-like shapes (hidden 4096, MLP 14336, head dim 128, 32 heads /
8 KV heads, vocab 128256, bf16): the median time of forward + backward (triton.testing.do_bench),
and the achieved bandwidth (memory-bound kernels: bytes the op must read and write, once) or
TFLOP/s (attention, the LM head; the head also its peak memory above its inputs), next to torch's: eager ATen (SDPA's flash kernel for attention,
`F.cross_entropy` on materialised fp32 logits for the head) and Inductor's generated kernels
(`torch.compile` of the same eager code). Needs a GPU; on CPU it says so and exits 1 (the
kernels are verified on CPU by the tests, under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import OUT_DIR, cuda_peak  # noqa: E402


def bench(fn, warmup=10, rep=50) -> float:
    """Median milliseconds of fn() (forward + backward), from triton.testing.do_bench."""
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def fwd_bwd(f, inputs, grad_out=None):
    def run():
        for t in inputs:
            t.grad = None
        out = f(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad_out if grad_out is not None and out.dim() else None)
    return run


def rows(args) -> list[dict]:
    from tailorfx.runtime import triton_ops
    dev, dt = "cuda", torch.bfloat16
    out = []

    # RMSNorm: (tokens, hidden) bf16 -> read x, w, write y; backward reads x, dy, writes dx (+ dw)
    T, H = args.tokens, 4096
    x = torch.randn(T, H, device=dev, dtype=dt, requires_grad=True)
    w = torch.randn(H, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(T, H, device=dev, dtype=dt)
    eager = lambda x, w: F.rms_norm(x, (H,), w, 1e-6)   # noqa: E731
    cands = {"tailorfx triton": lambda x, w: triton_ops.triton_norm(x, w, None, eps=1e-6, kind="rms"),
             "torch eager": eager, "inductor": torch.compile(eager)}
    moved = (3 + 3) * T * H * x.element_size()
    for name, f in cands.items():
        ms = bench(fwd_bwd(f, [x, w], dy))
        out.append({"kernel": "rms_norm", "impl": name, "ms": ms, "GB/s": moved / ms / 1e6})

    # SwiGLU: gate, up (tokens, 14336) -> read 2, write 1; backward reads dout, gate, up, writes 2
    inter = 14336
    g = torch.randn(T, inter, device=dev, dtype=dt, requires_grad=True)
    u = torch.randn(T, inter, device=dev, dtype=dt, requires_grad=True)
    dout = torch.randn(T, inter, device=dev, dtype=dt)
    eager = lambda g, u: F.silu(g) * u   # noqa: E731
    cands = {"tailorfx triton": lambda g, u: triton_ops.triton_glu(g, u, act="silu"),
             "torch eager": eager, "inductor": torch.compile(eager)}
    moved = (3 + 5) * T * inter * g.element_size()
    for name, f in cands.items():
        ms = bench(fwd_bwd(f, [g, u], dout))
        out.append({"kernel": "swiglu", "impl": name, "ms": ms, "GB/s": moved / ms / 1e6})
    del g, u, dout

    # LM head + cross-entropy, vocab 128256: 3 matmuls of 2*T*H*V FLOPs (logits, grad_h, grad_W)
    from tailorfx.codegen.triton.linear_cross_entropy import default_chunk
    V = 128256
    h = torch.randn(T, H, device=dev, dtype=dt, requires_grad=True)
    wv = (torch.randn(V, H, device=dev, dtype=dt) * H ** -0.5).requires_grad_()
    labels = torch.randint(0, V, (T,), device=dev)
    chunks = -(-T // default_chunk(T, H, V))
    eager = lambda h, w: F.cross_entropy(F.linear(h, w).float(), labels)   # noqa: E731
    cands = {"tailorfx triton": lambda h, w: triton_ops.triton_linear_cross_entropy(h, w, None, labels,
                                                                                   num_chunks=chunks),
             "torch eager": eager, "inductor": torch.compile(eager)}
    for name, f in cands.items():
        ms = bench(fwd_bwd(f, [h, wv]))
        peak = cuda_peak(fwd_bwd(f, [h, wv])) / 2**20
        out.append({"kernel": "linear_cross_entropy", "impl": name, "ms": ms, "TFLOP/s": 6 * T * H * V / ms / 1e9,
                    "peak_MiB": peak})
    del h, wv

    # causal attention, GQA 32/8 heads, head dim 128
    B, S = 1, args.seq
    q = torch.randn(B, 32, S, 128, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(B, 8, S, 128, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(B, 8, S, 128, device=dev, dtype=dt, requires_grad=True)
    do = torch.randn_like(q)
    flops = 3.5 * 4 * B * 32 * S * S * 128 / 2   # fwd 2 matmuls + bwd 5, causal half
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    cands = {"tailorfx triton": lambda q, k, v: triton_ops.triton_attention(q, k, v, kind="Exact", params=(),
                                                                            causal=True, scale=128 ** -0.5),
             "torch SDPA (flash)": sdpa}
    for name, f in cands.items():
        ms = bench(fwd_bwd(f, [q, k, v], do))
        out.append({"kernel": "flash_attention", "impl": name, "ms": ms, "TFLOP/s": flops / ms / 1e9})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=4096)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU (Triton kernels compile for it); on CPU the kernels are "
                 "checked by the tests under TRITON_INTERPRET=1")
    res = rows(args)
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}, bf16, tokens {args.tokens}, seq {args.seq}")
    print(f"{'kernel':<22} {'implementation':<20} {'ms (fwd+bwd)':>13} {'GB/s or TFLOP/s':>16} {'peak MiB':>10}")
    for r in res:
        rate = r.get("GB/s", r.get("TFLOP/s"))
        peak = f"{r['peak_MiB']:.0f}" if "peak_MiB" in r else ""
        print(f"{r['kernel']:<22} {r['impl']:<20} {r['ms']:>13.3f} {rate:>16.1f} {peak:>10}")
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(os.path.join(OUT_DIR, "kernels.json"), "w") as f:
        json.dump({"gpu": gpu, "rows": res}, f, indent=1)


if __name__ == "__main__":
    main()
