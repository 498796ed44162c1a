"""Sparse and packed attention on one CUDA GPU: the Triton flash kernel where the runtime's tile engine ran.

    PYTHONPATH=. python3 benchmarks/gpu_attention.py [--out DIR]     # ~2 min on an H200; CUDA only

Writes DIR/gpu_attention.json (default benchmarks/out/) after each check, and prints each:
  compile/*        triton_attention (window, documents, BigBird, exact) inside torch.compile (Inductor
                   traces the triton_op) against the same op eager, bf16, forward + backward
  llama_window/*   HF Llama (hidden 1024, 4 layers, vocab 32000, 2048 tokens) under
                   optimize(attention=SlidingWindow(256)): what the attention pass put in the graph on
                   CUDA (the Triton kernel) against the tile engine forced, loss and gradients (fp32)
                   and the median step time (5 steps)
Each check catches its own exception (type, message, traceback in the JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402

import tailorfx  # noqa: E402
from tailorfx import attention  # noqa: E402
from tailorfx.runtime import triton_ops as ops  # noqa: E402

DEV = "cuda"
B, NH, NKV, S, D = 1, 16, 4, 2048, 128


def qkv(dt, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randn(B, n, S, D, device=DEV, generator=g).to(dt).requires_grad_() for n in (NH, NKV, NKV)]


def doc_ids():
    """Three documents of unequal lengths, packed in one row."""
    cuts = [0, S // 5, S // 2, S]
    return torch.cat([torch.full((b - a,), i, device=DEV) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))])[None]


def fwd_bwd(f, dt):
    q, k, v = qkv(dt)
    out = f(q, k, v)
    out.backward(torch.randn_like(out, generator=torch.Generator(device=DEV).manual_seed(9)))
    return [out.detach().double(), q.grad.double(), k.grad.double(), v.grad.double()]


def rel(got, ref) -> float:
    return max(((x - y).norm() / y.norm()).item() for x, y in zip(got, ref))


def compiled_vs_eager(spec, documents: bool) -> dict:
    kind, params = attention.spec_params(spec)
    doc = doc_ids() if documents else None

    def f(q, k, v):
        return ops.triton_attention(q, k, v, kind=kind, params=params, causal=True, scale=D ** -0.5,
                                    document_ids=doc)
    eager, compiled = fwd_bwd(f, torch.bfloat16), fwd_bwd(torch.compile(f, fullgraph=True), torch.bfloat16)
    return {"compiled_vs_eager_rel": rel(compiled, eager),
            "finite": all(bool(torch.isfinite(t).all()) for t in compiled)}


def llama_window(dt: str, tiles: bool) -> dict:
    """One optimize(attention=SlidingWindow(256)) of HF Llama; tiles: the tile engine forced."""
    from common import hf_llama_model, lm_batch
    from tailorfx.passes.attention import rewrite
    model = hf_llama_model(vocab=32000, hidden=1024, layers=4, heads=16, kv_heads=4).to(DEV, getattr(torch, dt))
    batch = {k: v.to(DEV) for k, v in lm_batch(S, 32000).items()}
    on_cuda = rewrite._on_cuda
    if tiles:
        rewrite._on_cuda = lambda t: False
    try:
        opt = tailorfx.optimize(model.train(), example_inputs=batch, attention=attention.SlidingWindow(256))
        loss = opt(**batch).loss
        loss.backward()
        torch.cuda.synchronize()
    finally:
        rewrite._on_cuda = on_cuda
    graphs = opt.session.graphs
    names = {getattr(n.target, "__name__", str(n.target)) for g in graphs for n in g.rewritten.graph.nodes}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    times = []
    for _ in range(5):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt(**batch).loss.backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"loss": loss.item(), "grads": grads, "step_ms": sorted(times)[2] * 1e3,
            "attention_targets": sorted(x for x in names if "attention" in x),
            "failed": [w for g in graphs if g.failed for w in g.warnings]}


def window_pair(dt: str) -> dict:
    a, b = llama_window(dt, tiles=False), llama_window(dt, tiles=True)
    num = sum((a["grads"][n].double() - b["grads"][n].double()).norm() ** 2 for n in a["grads"]).sqrt().item()
    den = sum(b["grads"][n].double().norm() ** 2 for n in b["grads"]).sqrt().item()
    a.pop("grads"), b.pop("grads")
    return {"triton": a, "tiles": b, "loss_rel": abs(a["loss"] - b["loss"]) / abs(b["loss"]), "grad_rel": num / den}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "out"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    res = {}

    def case(name, fn):
        t0 = time.time()
        try:
            r = dict(fn(), status="pass")
        except Exception as e:   # noqa: BLE001  (recorded; the next check still runs)
            r = {"status": "error", "type": type(e).__name__, "msg": str(e)[-2500:], "tb": traceback.format_exc()[-5000:]}
        r["s"] = round(time.time() - t0, 1)
        res[name] = r
        with open(os.path.join(args.out, "gpu_attention.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(name, {k: v for k, v in r.items() if k != "tb"}, flush=True)
    bigbird = attention.BigBird(block=64, window=3, num_global=1, num_random=2)
    for name, spec, docs in [("window", attention.SlidingWindow(256), False), ("documents", attention.Exact(), True),
                             ("bigbird", bigbird, False), ("exact", attention.Exact(), False)]:
        case(f"compile/{name}", lambda spec=spec, docs=docs: compiled_vs_eager(spec, docs))
    for dt in ("float32", "bfloat16"):
        case(f"llama_window/{dt}", lambda dt=dt: window_pair(dt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
