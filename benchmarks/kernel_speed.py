"""Each generated Triton kernel against the best of torch and the anchors, at Llama-3-8B shapes, forward + backward.

    python benchmarks/kernel_speed.py                  # one CUDA GPU: prints a table, writes benchmarks/out/kernels.json
    python benchmarks/kernel_speed.py --only attention # the cases whose kernel name contains this
    python benchmarks/kernel_speed.py --dry-run        # CPU, tiny shapes, Triton's interpreter (CI)

Cases, at Llama-3-8B per-GPU shapes (hidden 4096, MLP 14336, 32 heads / 8 KV heads of 128, vocab
128256, bf16, batch 1): RMSNorm at 8K, 16K and 32K tokens, LayerNorm at 8K; SwiGLU at 8K x 14336;
RoPE on q and k at 8K and 16K; attention at 8K and 16K tokens, causal, a 4096-token sliding window,
packed documents (8 of unequal lengths) and ALiBi (causal, one slope per head); the LM head with
cross-entropy at 8K and 16K tokens.

Providers, in one interleaved run (every provider of a case runs before the next case):
- `torch eager`: ATen (F.rms_norm, F.layer_norm, silu * up, HF's rotate_half RoPE, the head as
  F.linear then F.cross_entropy on fp32 logits; attention: SDPA with a dense mask);
- `inductor`: torch.compile of the eager code;
- `sdpa flash`, `sdpa cudnn`: SDPA under sdpa_kernel(FLASH_ATTENTION) and under
  sdpa_kernel(CUDNN_ATTENTION) (dense causal, bf16; on Hopper cuDNN's kernel may beat FlashAttention-2's,
  which the flash backend runs: the row says by how much, or why cuDNN refused the shape);
- `flex`: FlexAttention (torch.compile'd) with the mask as a BlockMask, ALiBi as a score_mod;
- `liger`: Liger-Kernel's functional ops (liger_rms_norm, liger_layer_norm, liger_swiglu,
  liger_rope, liger_fused_linear_cross_entropy), when installed (`make gpu-wheels` on the GPU);
- `liger fp32 sum`, `tailorfx fp32 sum`: the head with its weight's gradient summed over the chunks in
  fp32 (Liger's accum_dtype=torch.float32; tailorfx's TrainingSetup(head_grad_dtype="fp32"));
- `tailorfx`: tailorfx.runtime.triton_ops (what the kernels pass emits, and on CUDA the attention
  pass for masks, documents and ALiBi where the Triton kernel is timed faster);
- `tailorfx inductor`: the eager code as the kernels pass runs a region on Inductor's code alone under
  the eager lowering (tailorfx.runtime.inductor_region: one opaque op each way, the backward
  recomputing the forward; what the pass runs where that is timed fastest);
- `tailorfx flex`: tailorfx.runtime.flex, compiled: FlexAttention with the block mask the attention
  pass builds from the proved form in the graph, each call (what the pass runs where FlexAttention
  is timed faster, or with attention_kernel="flex").

tailorfx's attention picks each kernel's tiles (forward, dq, dk/dv), and its RoPE its heads a
program, by timing the candidates the first time a shape bucket is seen (tailorfx/kernels/flash_tiles.py,
rope.py::layouts); the warm-up call of the interleaved run pays for it, and the JSON's meta.tuned
lists what each key chose.

Per provider: device time (the CUDA kernels' own time per call, from the profiler, so host
overheads do not count), wall time of an eager call (triton.testing.do_bench: host launch costs
included), the wall time of the same function under torch.compile, GB/s (memory-bound ops: the bytes
each must read and write once) or TFLOP/s (attention: the visible (q, k) pairs' matmuls, forward
2 and backward 5 of them; the head: 3 GEMMs), peak memory above the inputs, and agreement with
torch eager (relative error of the output and every gradient; bf16's 2e-2).

--dry-run runs every case on CPU at tiny shapes: the providers that need CUDA (inductor's timing,
sdpa flash, flex, liger) say why they are skipped; eager and tailorfx (Triton's interpreter) run
and must agree.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(BENCH_DIR), BENCH_DIR]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

AGREE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


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


def device_ms(fn, reps: int = 10) -> float:
    """Milliseconds the GPU spends in kernels (and copies) per call of fn, from the profiler."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
                   for e in prof.key_averages())
    return total_us / reps / 1e3


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


class Case:
    """One kernel at one shape: inputs (made on demand), the gradient fed back, the work done (bytes
    or FLOPs), and each provider's function of the inputs (or why it does not run)."""

    def __init__(self, kernel: str, shape: str, make, dout, work: tuple, providers: dict):
        self.kernel, self.shape, self.make, self.dout, self.work, self.providers = kernel, shape, make, dout, work, providers


def _gen(dev):
    return torch.Generator(device=dev).manual_seed(0)


def _randn(gen, dev, *shape, dtype, scale=1.0, grad=True):
    t = (torch.randn(*shape, device=dev, generator=gen, dtype=torch.float32) * scale).to(dtype)
    return t.requires_grad_(grad)


def _liger(name: str, cuda: bool, call=None):
    """The provider that calls Liger-Kernel's functional op `name` (through `call(op)` when given),
    or why it cannot run here: Liger not installed, or no CUDA (its kernels need a GPU)."""
    try:
        import liger_kernel.transformers.functional as lf
    except ImportError as e:
        return f"Liger-Kernel is not installed ({e}); carry its wheel (make gpu-wheels)"
    if not cuda:
        return "needs CUDA (dry run on CPU)"
    op = getattr(lf, name)
    return call(op) if call is not None else op


def cases(dev: str, dry: bool) -> list[Case]:
    from tailorfx.runtime import triton_ops as ops
    cuda = dev == "cuda"
    dt = torch.bfloat16
    H, INTER, NH, NKV, D, V = (64, 96, 4, 2, 16, 512) if dry else (4096, 14336, 32, 8, 128, 128256)
    norm_T = (64, 128) if dry else (8192, 16384, 32768)
    seqs = (64,) if dry else (8192, 16384)
    window = 16 if dry else 4096
    gen = _gen(dev)
    rnd = lambda *s, **kw: _randn(gen, dev, *s, **kw)   # noqa: E731
    out = []

    def compiled(f):
        return torch.compile(f) if cuda else "Inductor's timing needs CUDA (dry run on CPU)"

    def alone(f, n: int):
        return inductor_region_of(f, n) if cuda else "Inductor's timing needs CUDA (dry run on CPU)"

    for T in norm_T:
        eager = lambda x, w: F.rms_norm(x, (H,), w, 1e-6)   # noqa: E731
        out.append(Case("rms_norm", f"{T}x{H}", lambda T=T: [rnd(T, H, dtype=dt), rnd(H, dtype=dt)],
                        lambda T=T: rnd(T, H, dtype=dt, grad=False), ("GB", 5 * T * H * 2), {
            "torch eager": eager, "inductor": compiled(eager), "tailorfx inductor": alone(eager, 2),
            "liger": _liger("liger_rms_norm", cuda, lambda op: lambda x, w: op(x, w, 1e-6, in_place=False)),
            "tailorfx": lambda x, w: ops.triton_norm(x, w, None, eps=1e-6, kind="rms")}))
    T = norm_T[0]
    eager = lambda x, w, b: F.layer_norm(x, (H,), w, b, 1e-6)   # noqa: E731
    out.append(Case("layer_norm", f"{T}x{H}", lambda: [rnd(T, H, dtype=dt), rnd(H, dtype=dt), rnd(H, dtype=dt)],
                    lambda: rnd(T, H, dtype=dt, grad=False), ("GB", 5 * T * H * 2), {
        "torch eager": eager, "inductor": compiled(eager), "tailorfx inductor": alone(eager, 3),
        "liger": _liger("liger_layer_norm", cuda, lambda op: lambda x, w, b: op(x, w, b, 1e-6)),
        "tailorfx": lambda x, w, b: ops.triton_norm(x, w, b, eps=1e-6, kind="layer")}))

    eager = lambda g, u: F.silu(g) * u   # noqa: E731
    out.append(Case("swiglu", f"{T}x{INTER}", lambda: [rnd(T, INTER, dtype=dt, scale=2.0), rnd(T, INTER, dtype=dt)],
                    lambda: rnd(T, INTER, dtype=dt, grad=False), ("GB", 8 * T * INTER * 2), {
        "torch eager": eager, "inductor": compiled(eager), "tailorfx inductor": alone(eager, 2),
        "liger": _liger("liger_swiglu", cuda),
        "tailorfx": lambda g, u: ops.triton_glu(g, u, act="silu")}))

    for S in seqs:
        freqs = torch.rand(1, S, D // 2, device=dev, generator=gen) * 3
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos().to(dt), emb.sin().to(dt)

        def hf(q, k, cos=cos, sin=sin):   # transformers' apply_rotary_pos_emb
            c, s = cos.unsqueeze(1), sin.unsqueeze(1)
            rot = lambda x: torch.cat((-x[..., D // 2:], x[..., :D // 2]), -1)   # noqa: E731
            return torch.cat([(q * c + rot(q) * s).flatten(1, 2), (k * c + rot(k) * s).flatten(1, 2)], 1)
        def liger_qk(op, cos=cos, sin=sin):
            def run(q, k):
                q2, k2 = op(q, k, cos, sin)
                return torch.cat([q2.flatten(1, 2), k2.flatten(1, 2)], 1)
            return run

        def ours(q, k, cos=cos, sin=sin):   # what the kernels pass emits: q and k in one launch
            q2, k2 = ops.triton_rope_qk(q, k, cos, sin)
            return torch.cat([q2.flatten(1, 2), k2.flatten(1, 2)], 1)
        qk_bytes = (NH + NKV) * S * D * 2
        out.append(Case("rope", f"q,k {S}x{NH}/{NKV}x{D}",
                        lambda S=S: [rnd(1, NH, S, D, dtype=dt), rnd(1, NKV, S, D, dtype=dt)],
                        lambda S=S: rnd(1, (NH + NKV) * S, D, dtype=dt, grad=False), ("GB", 4 * qk_bytes), {
            "torch eager": hf, "inductor": compiled(hf), "tailorfx inductor": alone(hf, 2),
            "liger": _liger("liger_rope", cuda, liger_qk),
            "tailorfx": ours}))

    for S in seqs:
        out += attention_cases(dev, dry, S, NH, NKV, D, window, rnd, compiled)

    for T in seqs:
        labels = torch.randint(0, V, (T,), device=dev, generator=gen)
        from tailorfx.kernels.linear_cross_entropy import default_chunk
        chunks = -(-T // default_chunk(T, H, V))
        eager = lambda h, w, labels=labels: F.cross_entropy(F.linear(h, w).float(), labels)   # noqa: E731
        out.append(Case("linear_cross_entropy", f"{T}x{H}x{V}",
                        lambda T=T: [rnd(T, H, dtype=dt), rnd(V, H, dtype=dt, scale=H ** -0.5)], None,
                        ("TFLOP", 6 * T * H * V), {
            "torch eager": eager, "inductor": compiled(eager),
            "liger": _liger("liger_fused_linear_cross_entropy", cuda,
                            lambda op, labels=labels: lambda h, w: op(h, w, labels)),
            "tailorfx": lambda h, w, labels=labels, chunks=chunks: ops.triton_linear_cross_entropy(
                h, w, None, labels, num_chunks=chunks),
            # grad_W summed in fp32 over the chunks (Liger's accum_dtype, tailorfx's setup head_grad_dtype)
            "liger fp32 sum": _liger("liger_fused_linear_cross_entropy", cuda,
                                     lambda op, labels=labels: lambda h, w: op(h, w, labels,
                                                                               accum_dtype=torch.float32)),
            "tailorfx fp32 sum": lambda h, w, labels=labels, chunks=chunks: ops.triton_linear_cross_entropy(
                h, w, None, labels, num_chunks=chunks, grad_weight_fp32=True)}))
    return out


def inductor_region_of(f, n: int):
    """`f` of `n` (2 or 3) tensors as one region on Inductor's code alone (runtime/inductor_region.py),
    its graph traced by torch.fx as the capture gives the kernels pass a region's."""
    import torch.fx as fx

    from tailorfx.runtime.inductor_region import inductor_region, register
    root = {2: lambda x0, x1: (f(x0, x1),), 3: lambda x0, x1, x2: (f(x0, x1, x2),)}[n]
    key = register(fx.symbolic_trace(root), (True,) * n)
    return lambda *a: inductor_region(key, *a)


def attention_cases(dev, dry, S, NH, NKV, D, window, rnd, compiled) -> list[Case]:
    """Causal, sliding window, packed documents, ALiBi at S tokens; the FLOPs count only the (q, k)
    pairs each mask keeps."""
    from tailorfx import attention
    from tailorfx.runtime import triton_ops as ops
    cuda, dt, scale = dev == "cuda", torch.bfloat16, D ** -0.5
    i = torch.arange(S, device=dev)
    cuts = torch.tensor([0, 1, 3, 6, 10, 15, 21, 28, 36], device=dev) * S // 36   # 8 documents, lengths 1:2:...:8
    doc = torch.bucketize(i, cuts[1:], right=True)[None]
    masks = {   # name: (keep(q, kv) on index tensors, visible pairs)
        "causal": (lambda q, kv: q >= kv, S * (S + 1) // 2),
        f"window {window}": (lambda q, kv: (q >= kv) & (q - kv < window),
                             sum(min(n + 1, window) for n in range(S))),
        "documents": (lambda q, kv: (q >= kv) & (doc[0][q] == doc[0][kv]),
                      sum(int(n) * (int(n) + 1) // 2 for n in torch.diff(cuts).tolist())),
        "alibi": (lambda q, kv: q >= kv, S * (S + 1) // 2)}
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / NH) for h in range(NH)], device=dev)
    bias = (slopes[:, None] * i)[None].to(dt)   # Bloom's per-key ALiBi, as tailorfx's pass keeps it
    out = []
    for name, (keep, pairs) in masks.items():
        dense = keep(i[:, None], i[None, :])
        if name == "alibi":
            float_mask = (bias[:, :, None, :] + torch.zeros(S, S, device=dev, dtype=dt)
                          .masked_fill(~dense, float("-inf")))
        else:
            float_mask = dense

        def eager(q, k, v, m=float_mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale, enable_gqa=True)
        prov = {"torch eager": eager, "inductor": compiled(eager)}
        if name == "causal":
            for label, backend in (("sdpa flash", "FLASH_ATTENTION"), ("sdpa cudnn", "CUDNN_ATTENTION")):
                prov[label] = sdpa_backend(backend, scale) if cuda else "needs CUDA (dry run on CPU)"
        prov["flex"] = flex_provider(name, keep, bias, S, scale) if cuda else "needs CUDA (dry run on CPU)"
        if name == "alibi":   # attention_call's form of the bias: (B, H, 1, S), as the attention pass passes it
            prov["tailorfx"] = (lambda q, k, v: ops.triton_attention(q, k, v, kind="Exact", params=(), causal=True,
                                                                     scale=scale, key_bias=bias[:, :, None, :]))
        else:
            spec = attention.SlidingWindow(window) if name.startswith("window") else attention.Exact()
            kind, params = attention.spec_params(spec)
            d = doc if name == "documents" else None
            prov["tailorfx"] = (lambda q, k, v, kind=kind, params=params, d=d:
                                ops.triton_attention(q, k, v, kind=kind, params=params, causal=True, scale=scale,
                                                     document_ids=d))
        prov["tailorfx flex"] = (_our_flex(name, window, doc, bias, scale) if cuda
                                 else "needs CUDA (dry run on CPU)")
        out.append(Case(f"attention {name}", f"{S}x{NH}/{NKV}x{D}",
                        lambda: [rnd(1, NH, S, D, dtype=dt), rnd(1, NKV, S, D, dtype=dt), rnd(1, NKV, S, D, dtype=dt)],
                        lambda: rnd(1, NH, S, D, dtype=dt, grad=False),
                        ("TFLOP", 3.5 * 4 * NH * pairs * D), prov))
    return out


def sdpa_backend(backend: str, scale: float):
    """Causal SDPA on one of its CUDA backends (`torch.nn.attention.SDPBackend`'s name), GQA's k, v
    unrepeated; a backend that refuses the shape raises, and the row records why."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return run


def _our_flex(name, window, doc, bias, scale):
    """What the attention pass runs for this form under attention_kernel="flex" (or "auto" where
    FlexAttention was timed faster): tailorfx's block mask built from the form in the graph, each call."""
    from tailorfx.runtime.flex import flex_attention
    kw = {"kind": "Exact", "params": ()}
    if name.startswith("window"):
        kw = {"kind": "SlidingWindow", "params": (("window", window),)}
    elif name == "documents":
        kw["document_ids"] = doc
    elif name == "alibi":
        kw["key_bias"] = bias[:, :, None, :]
    run = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    return lambda q, k, v: run(q, k, v, causal=True, scale=scale, **kw)


def flex_provider(name, keep, bias, S, scale):
    """FlexAttention for one mask: a BlockMask (tiles no query sees are skipped), ALiBi as a score_mod
    reading the same bf16-rounded per-key bias as the others (at 16K keys its rounding is far above
    bf16's noise: every provider must read the same values)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention)
    block = create_block_mask(lambda b, h, q, kv: keep(q, kv), None, None, S, S, device="cuda")
    score_mod = (lambda s, b, h, q, kv: s + bias[0, h, kv].to(s.dtype)) if name == "alibi" else None
    return lambda q, k, v: flex(q, k, v, score_mod=score_mod, block_mask=block, scale=scale, enable_gqa=True)


def agreement(f, ref, inputs, dout) -> float:
    """The largest relative error ||a - b|| / ||b|| of the output and each gradient against ref's."""
    def run(fn):
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        o = fn(*xs)
        o.backward(dout if dout is not None and o.dim() else None)
        return [o.detach().float()] + [x.grad.float() for x in xs]
    got, want = run(f), run(ref)
    return max(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(got, want))


def measure(case: Case, name: str, f, inputs, dout, cuda: bool, reps: int) -> dict:
    res = {"kernel": case.kernel, "shape": case.shape, "provider": name}
    t0 = time.time()
    res["agreement"] = agreement(f, case.providers["torch eager"], inputs, dout)   # compiles, for those that do
    res["first_call_s"] = round(time.time() - t0, 2)
    res["agrees"] = res["agreement"] <= AGREE[inputs[0].dtype]
    step = fwd_bwd(f, inputs, dout)
    if cuda:
        res["device_ms"] = device_ms(step)
        res["wall_ms"] = bench(step, warmup=5, rep=reps)
        res["peak_MiB"] = peak_mib(step)
        if name not in ("inductor", "flex"):   # those are compiled already
            try:
                res["compiled_wall_ms"] = bench(fwd_bwd(torch.compile(f), inputs, dout), warmup=5, rep=reps)
            except Exception as e:   # noqa: BLE001  (a provider torch.compile cannot trace)
                res["compiled_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        unit, amount = case.work
        ms = res["device_ms"]
        res["GB/s" if unit == "GB" else "TFLOP/s"] = amount / ms / (1e6 if unit == "GB" else 1e9)
    else:
        t0 = time.perf_counter()
        step()
        res["wall_ms"] = (time.perf_counter() - t0) * 1e3
    return res


def run_all(dev: str, dry: bool, only: str | None, reps: int, budget_s: float | None = None,
            saved=lambda rows: None) -> list[dict]:
    """Every case (or those `only` names), `saved(rows)` after each. A case starts only while
    `budget_s` leaves the time the longest case so far took; a case it cannot start is a row per
    provider, skipped with both figures (a GPU call has a hard wall: what ran is kept)."""
    rows: list[dict] = []
    start, longest = time.time(), 0.0
    for case in cases(dev, dry):
        if only and only not in case.kernel:
            continue
        left = None if budget_s is None else budget_s - (time.time() - start)
        if left is not None and left < longest:
            why = f"time budget: {left:.1f} s left, the longest case so far took {longest:.1f} s"
            rows += [{"kernel": case.kernel, "shape": case.shape, "provider": name, "skipped": why}
                     for name in case.providers]
            print(table_line(rows[-1]), flush=True)
        else:
            t0 = time.time()
            rows += run_case(case, dev, reps)
            longest = max(longest, time.time() - t0)
        saved(rows)
    return rows


def run_case(case: Case, dev: str, reps: int) -> list[dict]:
    """Every provider of one case, interleaved: one row each (measured, skipped, or its error)."""
    rows = []
    inputs = case.make()
    dout = case.dout() if case.dout is not None else None
    for name, f in case.providers.items():
        if isinstance(f, str):
            rows.append({"kernel": case.kernel, "shape": case.shape, "provider": name, "skipped": f})
            print(table_line(rows[-1]), flush=True)
            continue
        try:
            rows.append(measure(case, name, f, inputs, dout, dev == "cuda", reps))
        except Exception as e:   # noqa: BLE001  (recorded: one provider's failure hides no other)
            rows.append({"kernel": case.kernel, "shape": case.shape, "provider": name,
                         "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(table_line(rows[-1]), flush=True)
    del inputs, dout
    if dev == "cuda":
        torch.cuda.empty_cache()
    return rows


def table_line(r: dict) -> str:
    head = f"{r['kernel']:<24} {r['shape']:<22} {r['provider']:<17}"
    if "skipped" in r or "error" in r:
        return f"{head} {r.get('skipped') or r.get('error')}"
    rate = next((f"{r[k]:8.1f} {k}" for k in ("GB/s", "TFLOP/s") if k in r), "")
    dev = f"{r['device_ms']:9.3f} ms dev" if "device_ms" in r else ""
    comp = f"{r['compiled_wall_ms']:9.3f} ms compiled" if "compiled_wall_ms" in r else ""
    return (f"{head} {dev} {r['wall_ms']:9.3f} ms wall {comp} {rate} "
            f"err {r['agreement']:.1e}{'' if r['agrees'] else ' DISAGREES'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton's interpreter")
    ap.add_argument("--only", help="the cases whose kernel name contains this")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--out", default=os.path.join(BENCH_DIR, "out", "kernels.json"))
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds: a case starts only while the longest case so far fits what is left "
                         "(default 480 on a GPU, none with --dry-run); the JSON is written after every case")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("benchmarks/kernel_speed.py needs a CUDA GPU; on CPU run it with --dry-run", file=sys.stderr)
        return 1
    dev = "cpu" if args.dry_run else "cuda"
    budget_s = args.budget_s if args.budget_s or args.dry_run else 480.0
    from tailorfx.kernels import tuning
    meta = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
            "dry_run": args.dry_run, "budget_s": budget_s}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def saved(rows: list[dict]) -> None:
        meta["tuned"] = tuning.choices()   # the tiles (layouts) each key chose on this GPU, every candidate's time
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        os.replace(tmp, args.out)
    saved([])   # the meta from the start: a call killed in its first case still says what it was
    run_all(dev, args.dry_run, args.only, args.reps, budget_s, saved)
    for key, choice in meta["tuned"].items():
        print(f"tuned {key}: {choice.get('tiles', choice.get('pick'))}")   # tiles, or `pick`'s implementation
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
