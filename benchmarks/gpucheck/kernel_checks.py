"""The kernels section: each Triton kernel family of tailorfx/runtime/triton_ops.py against torch,
forward and backward, fp32 and bf16, against an fp64 reference on the same rounded inputs; then
the kernel benchmark (benchmarks/kernel_speed.py's cases at Llama-3-8B shapes, every provider
interleaved: device and wall time, GB/s or TFLOP/s, memory, agreement), case by case while time
is left; on the CPU dry run its tiny norm cases, through the interpreter."""
from __future__ import annotations

from gpucheck.record import SECTIONS, Run, bench_module

# relative error ||out - ref|| / ||ref|| against fp64 on the same inputs: fp32 arithmetic leaves
# ~1e-6; bf16 outputs carry one rounding (2^-9 relative) plus bf16 inputs of later ops
TOL = {"float32": 1e-4, "bfloat16": 2e-2}


def rel_err(got, ref) -> dict:
    """||got - ref|| / ||ref|| and max |got - ref| in fp64."""
    got, ref = got.detach().double(), ref.detach().double()
    diff = (got - ref)
    denom = ref.norm().item()
    return {"rel": diff.norm().item() / denom if denom else diff.norm().item(), "max_abs": diff.abs().max().item()}


def kernel_cases(run: Run) -> list:
    """(name, dtypes, make(dtype) -> (ours, torch_fn, inputs, dout)) per kernel family and variant."""
    import torch
    import torch.nn.functional as F
    from tailorfx import attention
    from tailorfx.runtime import triton_ops as ops
    dev, dry = run.device, run.dry
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, dtype, scale=1.0, grad=True):
        t = (torch.randn(*shape, device=dev, generator=gen, dtype=torch.float32) * scale).to(dtype)
        return t.requires_grad_(grad)

    T, H = (6, 32) if dry else (4096, 4096)
    inter = 40 if dry else 8192
    B, NH, NKV, S, D = (1, 2, 1, 24, 16) if dry else (1, 16, 4, 2048, 128)
    N, HID, V = (12, 16, 40) if dry else (4096, 2048, 32000)

    def norm(kind):
        def make(dt):
            x, w = randn(T, H, dtype=dt), randn(H, dtype=dt)
            b = randn(H, dtype=dt) if kind == "layer" else None
            ins = [x, w] + ([b] if b is not None else [])
            ours = lambda x, w, *b: ops.triton_norm(x, w, b[0] if b else None, eps=1e-6, kind=kind)  # noqa: E731
            ref = ((lambda x, w: F.rms_norm(x, (H,), w, 1e-6)) if kind == "rms" else
                   (lambda x, w, b: F.layer_norm(x, (H,), w, b, 1e-6)))
            return ours, ref, ins, randn(T, H, dtype=dt, grad=False)
        return make

    def glu(act):
        f = F.silu if act == "silu" else (lambda g: F.gelu(g, approximate="tanh"))

        def make(dt):
            g, u = randn(T, inter, dtype=dt, scale=2.0), randn(T, inter, dtype=dt)
            return (lambda g, u: ops.triton_glu(g, u, act=act)), (lambda g, u: f(g) * u), [g, u], \
                randn(T, inter, dtype=dt, grad=False)
        return make

    def rope(dt):
        x = randn(B, NH, S, D, dtype=dt)
        freqs = torch.rand(1, S, D // 2, device=dev, generator=gen) * 3
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos().to(dt), emb.sin().to(dt)

        def hf(x, cos, sin):   # transformers' x * cos + rotate_half(x) * sin
            c, s = cos.unsqueeze(1), sin.unsqueeze(1)
            rot = torch.cat((-x[..., D // 2:], x[..., :D // 2]), -1)
            return x * c + rot * s
        return (lambda x, c, s: ops.triton_rope(x, c, s)), hf, [x, cos, sin], randn(B, NH, S, D, dtype=dt, grad=False)

    def attn(spec, documents):
        doc = None
        if documents:   # three documents of unequal lengths, the same in every row
            cuts = [0, S // 5, S // 2, S]
            doc = torch.cat([torch.full((b - a,), i, device=dev) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))])[None]
        kind, params = attention.spec_params(spec)

        def make(dt):
            q, k, v = randn(B, NH, S, D, dtype=dt), randn(B, NKV, S, D, dtype=dt), randn(B, NKV, S, D, dtype=dt)
            scale = D ** -0.5
            ours = lambda q, k, v: ops.triton_attention(q, k, v, kind=kind, params=params, causal=True,  # noqa: E731
                                                        scale=scale, document_ids=doc)
            mask = None if (kind == "Exact" and doc is None) else spec.dense_mask(S, NH, doc, dev)

            def ref(q, k, v):
                if q.dtype == torch.float64:   # dense masked softmax: the runtime's own definition
                    return spec.reference(q, k, v, doc)
                if mask is None:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            return ours, ref, [q, k, v], randn(B, NH, S, D, dtype=dt, grad=False)
        return make

    def alibi(dt):
        """The runtime's own tiles (plain torch on any device) with score_mod "key_bias" (ALiBi's
        per-key bias), what the attention pass puts in Bloom's graph, against SDPA reading the
        bias + causal mask as a dense float mask."""
        q, k, v = randn(B, NH, S, D, dtype=dt), randn(B, NKV, S, D, dtype=dt), randn(B, NKV, S, D, dtype=dt)
        slopes = torch.tensor([2.0 ** (-8 * (h + 1) / NH) for h in range(NH)], device=dev)
        # in the model's dtype, as HF Bloom builds it: ours and the references read the same rounded bias
        bias = (slopes[:, None] * torch.arange(S, device=dev))[None].expand(B, NH, S).to(dt)
        spec = attention.Exact(score_mod="key_bias")
        i = torch.arange(S, device=dev)
        causal = torch.zeros(S, S, device=dev).masked_fill(i[None, :] > i[:, None], float("-inf"))
        ours = lambda q, k, v: spec(q, k, v, score_tensor=bias)  # noqa: E731

        def ref(q, k, v):
            mask = bias[:, :, None, :].to(q.dtype) + causal.to(q.dtype)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return ours, ref, [q, k, v], randn(B, NH, S, D, dtype=dt, grad=False)

    def head(dt):
        from tailorfx.kernels.linear_cross_entropy import default_chunk
        h, w = randn(N, HID, dtype=dt), randn(V, HID, dtype=dt, scale=HID ** -0.5)
        labels = torch.randint(0, V, (N,), device=dev, generator=gen)
        labels[::7] = -100
        chunks = -(-N // default_chunk(N, HID, V))
        ours = lambda h, w: ops.triton_linear_cross_entropy(h, w, None, labels, num_chunks=chunks)  # noqa: E731

        def ref(h, w):   # fp32 logits for 16-bit inputs, as the kernel; fp64 stays fp64
            return F.cross_entropy(F.linear(h, w).to(torch.promote_types(h.dtype, torch.float32)), labels)
        return ours, ref, [h, w], None

    window = 8 if dry else 256
    both, bf16 = ("float32", "bfloat16"), ("bfloat16",)
    return [("rms_norm", both, norm("rms")), ("layer_norm", both, norm("layer")),
            ("swiglu", both, glu("silu")), ("geglu", both, glu("gelu_tanh")), ("rope", both, rope),
            ("attention_causal", both, attn(attention.Exact(), False)),
            ("attention_sliding_window", bf16, attn(attention.SlidingWindow(window), False)),
            ("attention_documents", bf16, attn(attention.Exact(), True)),
            ("attention_alibi_tiles", both, alibi),
            ("linear_cross_entropy", both, head)]


def kernel_check(run: Run, make, dtype_name: str) -> dict:
    import torch
    dt = getattr(torch, dtype_name)
    ours, torch_fn, inputs, dout = make(dt)

    def fwd_bwd_of(f, xs, g):
        xs = [x.detach().clone().requires_grad_(x.requires_grad) for x in xs]
        out = f(*xs)
        out.backward(g if out.dim() else None)
        return [out.detach()] + [x.grad for x in xs if x.requires_grad]

    got = fwd_bwd_of(ours, inputs, dout)
    ref = fwd_bwd_of(torch_fn, [x.double() for x in inputs], dout.double() if dout is not None else None)
    eager = fwd_bwd_of(torch_fn, inputs, dout)
    names = ["out"] + [f"grad{i}" for i, x in enumerate(inputs) if x.requires_grad]
    errs = {n: rel_err(g, r) for n, g, r in zip(names, got, ref)}
    torch_errs = {n: rel_err(e, r)["rel"] for n, e, r in zip(names, eager, ref)}
    worst = max(e["rel"] for e in errs.values())
    finite = all(bool(torch.isfinite(g).all()) for g in got)
    res = {"dtype": dtype_name, "shapes": [list(x.shape) for x in inputs], "rel_err": errs,
           "torch_rel_err": torch_errs, "worst_rel": worst, "tol": TOL[dtype_name],
           "ok": finite and worst <= TOL[dtype_name]}
    del got, ref, eager
    return res


def section_kernels(run: Run, sec: dict) -> None:
    later = [s for s in run.sections if SECTIONS.index(s) > SECTIONS.index("kernels")]
    reserve = 150.0 if later else 0.0   # seconds kept for the model sections (their compile, mostly)

    def skip(name):
        sec["checks"].append({"name": name, "status": "skipped",
                              "reason": f"time budget: {run.left():.0f} s left, {reserve:.0f} s kept for {later}"})
    for name, dtypes, make in kernel_cases(run):
        for dt in dtypes:
            if not run.dry and run.left() < reserve:
                skip(f"{name}/{dt}")
                continue
            run.check(sec, f"{name}/{dt}", lambda make=make, dt=dt: kernel_check(run, make, dt))
    bench = bench_module("kernel_speed")
    reps = 3 if run.dry else 25
    for case in bench.cases(run.device, run.dry):
        if run.dry and "norm" not in case.kernel:   # the dry run: the wiring, on the two tiny norm cases
            continue
        name = f"benchmark {case.kernel} {case.shape}"
        if not run.dry and run.left() < reserve + 60:   # a case at 8B shapes takes up to a minute
            skip(name)
            continue
        run.check(sec, name, lambda case=case: _benchmark_case(bench, case, run.device, reps))


def _benchmark_case(bench, case, device: str, reps: int) -> dict:
    """One case of benchmarks/kernel_speed.py, every provider: its rows; ok when every provider that ran
    agrees with torch eager (a provider that cannot run here says why, as a row)."""
    rows = bench.run_case(case, device, reps)
    ran = [r for r in rows if "skipped" not in r]
    return {"rows": rows, "ok": bool(ran) and all(r.get("agrees", False) for r in ran)}
