"""Sparse and packed attention on one CUDA GPU: the Triton flash kernel where the runtime's tile engine ran.

    PYTHONPATH=. python3 benchmarks/gpu_attention.py [--out DIR]     # ~2 min on an H200; CUDA only

Writes DIR/gpu_attention.json (default benchmarks/out/) after each check, and prints each:
  compile/*        triton_attention (window, documents, BigBird, exact) inside torch.compile (Inductor
                   traces the triton_op) against the same op eager, bf16, forward + backward
  attention_dots   bf16 attention: 16-bit dot operands (what a GPU compiles) against tf32 dots (the
                   interpreter's variant), error against the fp32 kernel on the same values, and
                   forward + backward milliseconds (do_bench), SDPA's flash kernel beside
  llama_window/*   HF Llama (hidden 1024, 4 layers, vocab 32000, 2048 tokens) under
                   optimize(attention=SlidingWindow(256)): what the attention pass put in the graph on
                   CUDA (the Triton kernel) against the tile engine forced, loss and gradients (fp32)
                   and the median step time (5 steps)
"""
import copy, json, os, sys, time, traceback
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import torch
OUT = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
os.makedirs(OUT, exist_ok=True)
res = {}
def save():
    json.dump(res, open(os.path.join(OUT, "gpu_attention.json"), "w"), indent=1, default=str)
def case(name, fn):
    t0 = time.time()
    try:
        r = fn(); r = r if isinstance(r, dict) else {"value": r}; r["status"] = "pass"
    except Exception as e:
        r = {"status": "error", "type": type(e).__name__, "msg": str(e)[-2500:], "tb": traceback.format_exc()[-5000:]}
    r["s"] = round(time.time() - t0, 1); res[name] = r; save()
    print(name, {k: v for k, v in r.items() if k not in ("tb",)}, flush=True)
import tailorfx
import tailorfx.codegen.triton as tt
from tailorfx import attention
from tailorfx.codegen.triton import flash_attention as fa
from tailorfx.runtime import triton_ops as ops
from triton.testing import do_bench
dev = "cuda"
B, NH, NKV, S, D = 1, 16, 4, 2048, 128
def qkv(dt, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    return [(torch.randn(B, n, S, D, device=dev, generator=g)).to(dt).requires_grad_() for n in (NH, NKV, NKV)]
def doc_ids():
    cuts = [0, S // 5, S // 2, S]
    return torch.cat([torch.full((b - a,), i, device=dev) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))])[None]
def fwd_bwd(f, dt, seed=0, compute=None):
    q, k, v = qkv(dt, seed)
    if compute is not None:   # the same rounded values, as leaves in another dtype
        q, k, v = (t.detach().to(compute).requires_grad_() for t in (q, k, v))
    o = f(q, k, v)
    g = torch.randn_like(o, generator=torch.Generator(device=dev).manual_seed(9))
    o.backward(g)
    return [o.detach().double(), q.grad.double(), k.grad.double(), v.grad.double()]
def rel(a, b): return max(((x - y).norm() / y.norm()).item() for x, y in zip(a, b))
def compiled_vs_eager(spec, documents, dt=torch.bfloat16):
    kind, params = attention.spec_params(spec); doc = doc_ids() if documents else None
    f = lambda q, k, v: ops.triton_attention(q, k, v, kind=kind, params=params, causal=True, scale=D ** -0.5, document_ids=doc)
    e = fwd_bwd(f, dt); c = fwd_bwd(torch.compile(f, fullgraph=True), dt)
    return {"compiled_vs_eager_rel": rel(c, e), "finite": all(bool(torch.isfinite(t).all()) for t in c)}
for nm, spec, docs in [("window", attention.SlidingWindow(256), False), ("documents", attention.Exact(), True),
                       ("bigbird", attention.BigBird(block=64, window=3, num_global=1, num_random=2), False),
                       ("exact", attention.Exact(), False)]:
    case(f"compile/{nm}", lambda spec=spec, docs=docs: compiled_vs_eager(spec, docs))
def variants():
    out = {}
    spec = attention.SlidingWindow(256); kind, params = attention.spec_params(spec)
    mask, mp = ops.attention_params(kind, dict(params))
    for label, interp in (("bf16_dots", False), ("tf32_dots", True)):
        orig = tt.interpreted
        tt.interpreted = (lambda: True) if interp else orig
        try:
            for m, p in (("full", ()), ("window", mp)):
                f = lambda q, k, v: fa.attention(q, k, v, mask=m, params=p, causal=True, scale=D ** -0.5)[0]
                got = fwd_bwd(f, torch.bfloat16)
                q, k, v = qkv(torch.bfloat16)
                ref = fwd_bwd(f, torch.bfloat16, compute=torch.float32)   # the fp32 (ieee) kernel on the same values
                g = torch.randn(B, NH, S, D, device=dev, dtype=torch.bfloat16)
                def step():
                    o = f(q, k, v); o.backward(g)
                ms = do_bench(step, warmup=5, rep=30)
                spec_ = fa.spec_for(q, k, mask=m, params=p, causal=True)
                out[f"{label}/{m}"] = {"rel_vs_fp32_kernel": rel(got, ref), "ms": ms, "precision": spec_.get("precision", "default")}
        finally:
            tt.interpreted = orig
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    q, k, v = qkv(torch.bfloat16); g = torch.randn(B, NH, S, D, device=dev, dtype=torch.bfloat16)
    def st():
        o = sdpa(q, k, v, is_causal=True, enable_gqa=True); o.backward(g)
    out["sdpa_flash/full_ms"] = do_bench(st, warmup=5, rep=30)
    return out
case("attention_dots", variants)
from common import hf_llama_model, lm_batch
from tailorfx.passes.attention import rewrite
def llama_window(dt, tiles, seq=2048):
    model = hf_llama_model(vocab=32000, hidden=1024, layers=4, heads=16, kv_heads=4).to(dev, getattr(torch, dt)).train()
    batch = {k: v.to(dev) for k, v in lm_batch(seq, 32000).items()}
    orig = rewrite._on_cuda
    if tiles:
        rewrite._on_cuda = lambda t: False
    try:
        opt = tailorfx.optimize(model, example_inputs=batch, attention=attention.SlidingWindow(256))
        l = opt(**batch).loss; l.backward(); torch.cuda.synchronize()
    finally:
        rewrite._on_cuda = orig
    graphs = [g for g in opt.session.graphs]
    targets = sorted({str(getattr(n.target, "__name__", n.target)) for g in graphs for n in g.gm.graph.nodes
                      if "attention" in str(getattr(n.target, "__name__", n.target))})
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    times = []
    for _ in range(5):
        model.zero_grad(set_to_none=True); torch.cuda.synchronize(); t = time.perf_counter()
        opt(**batch).loss.backward(); torch.cuda.synchronize(); times.append(time.perf_counter() - t)
    return {"loss": l.item(), "grads": grads, "step_ms": sorted(times)[2] * 1e3, "attention_targets": targets,
            "failed": [w for g in graphs if g.failed for w in g.warnings]}
def window_pair(dt):
    a = llama_window(dt, tiles=False); b = llama_window(dt, tiles=True)
    num = sum((a["grads"][n].double() - b["grads"][n].double()).norm() ** 2 for n in a["grads"]).sqrt().item()
    den = sum(b["grads"][n].double().norm() ** 2 for n in b["grads"]).sqrt().item()
    drop = lambda r: {k: v for k, v in r.items() if k != "grads"}
    return {"triton": drop(a), "tiles": drop(b), "loss_rel": abs(a["loss"] - b["loss"]) / abs(b["loss"]), "grad_rel": num / den}
case("llama_window/fp32", lambda: window_pair("float32"))
case("llama_window/bf16", lambda: window_pair("bfloat16"))
