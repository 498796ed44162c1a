"""tailorfx on one CUDA GPU, section by section, written to JSON as each section ends.

    PYTHONPATH=. python3 benchmarks/gpu_check.py                    # every section, ~4 min on an H100
    PYTHONPATH=. python3 benchmarks/gpu_check.py --section kernels --section nccl
    python benchmarks/gpu_check.py --dry-run                        # CPU, tiny shapes, < 1 min (CI)

Sections (default: all, in this order):
  kernels  each Triton kernel family of tailorfx/runtime/triton_ops.py (RMSNorm/LayerNorm,
           SwiGLU/GeGLU, RoPE, attention: causal, sliding window, documents; the fused LM head
           + cross-entropy) against torch, forward and backward, fp32 and bf16: relative error
           ||out - ref|| / ||ref|| against an fp64 reference on the same rounded inputs (torch's
           own error in the same dtype beside it), pass/fail per tolerance, median ms vs eager.
  memory   the CUDA allocator's history of one training step (HF Llama, bf16, optimize()
           default): its peak and largest allocations with their Python frames, not the snapshot.
  nccl     a world-size-1 NCCL process group (file:// store): all_reduce, a DeviceMesh; then one
           training step under torch.cuda.set_sync_debug_mode ("warn": every sync and where;
           "error": the first one raises, recorded, not fatal).
  hf       HF LlamaForCausalLM from a config (hidden 1024, 4 layers, vocab 32000; random
           weights) at 2048 tokens under optimize() default (lowering "auto": Inductor on CUDA),
           lowering="eager", kernels="triton", fp32, setup="pure-bf16-fused-optimizer", and 8192
           tokens while time is left: loss and gradients vs eager, the measured peak of one
           steady-state step vs opt.predict_memory(), step time.

The run keeps to --budget-s (optional variants are skipped, and say so, past it). Every check
catches its own exception (type, message, traceback tail in the JSON) so one failure hides no
other. --dry-run runs every set-up and a tiny version of the work on CPU, Triton kernels through
its interpreter; CUDA-only measurements are listed under "skipped". Needs no install: the repo
root is put on sys.path.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from typing import Callable, Optional

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
SECTIONS = ("kernels", "memory", "nccl", "hf")
# relative error ||out - ref|| / ||ref|| against fp64 on the same inputs: fp32 arithmetic leaves
# ~1e-6; bf16 outputs carry one rounding (2^-9 relative) plus bf16 inputs of later ops
TOL = {"float32": 1e-4, "bfloat16": 2e-2}
PREDICTION_COVERS = (
    "peak_bytes = static (weights, master weights, optimizer state) + the simulated step's peak above "
    "it (gradients, saved activations, transients of forward, backward and the optimizer step), "
    "traced from the graphs that run (rewrite/memory.py). Not covered: the CUDA context, the "
    "caching allocator's reserve and fragmentation (max_memory_reserved), cuBLAS/cuDNN workspaces, "
    "Inductor/Triton autotuning buffers, the input batch.")


class Skip(Exception):
    """A check that cannot run here (the reason is recorded, the section stays ok)."""


# ---- recording -------------------------------------------------------------------------------

def describe(e: BaseException) -> dict:
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    return {"type": type(e).__name__, "message": str(e)[:2000], "traceback": "".join(tb)[-3000:]}


def error_chain_text(e: BaseException) -> str:
    seen, parts = set(), []
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return "\n".join(parts)


class Run:
    """The results so far (written after every check) and what the sections share."""

    def __init__(self, args, device: str):
        self.args, self.dry, self.device = args, args.dry_run, device
        self.cuda = device == "cuda"
        self.start = time.time()
        self.shared: dict = {}   # trained models the sections reuse (compiling costs most of the time)
        self.data = {"meta": {"argv": sys.argv[1:], "started": time.strftime("%Y-%m-%d %H:%M:%S")},
                     "sections": {}}
        self._interp: Optional[str] = None

    def left(self) -> float:
        return self.args.budget_s - (time.time() - self.start)

    def save(self) -> None:
        path = self.args.out
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, path)

    def check(self, section: dict, name: str, fn: Callable[[], Optional[dict]]) -> dict:
        """Run one check; its dict (optionally with "ok") goes in the section, an exception too."""
        t0 = time.time()
        try:
            res = dict(fn() or {})
            status = "pass" if res.pop("ok", True) else "fail"
        except Skip as s:
            res, status = {"reason": str(s)}, "skipped"
        except Exception as e:   # noqa: BLE001  (recorded: one failure must not hide the others)
            reason = self.interpreter_limit(e)
            res, status = ({"reason": reason}, "skipped") if reason else ({"error": describe(e)}, "error")
        entry = {"name": name, "status": status, "seconds": round(time.time() - t0, 2), **res}
        section["checks"].append(entry)
        self.free()
        self.save()
        return entry

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            import torch
            torch.cuda.empty_cache()

    def interpreter_limit(self, e: BaseException) -> Optional[str]:
        """The reason, when `e` is Triton's interpreter failing on a runtime loop bound (see probe)."""
        if "only 0-dimensional arrays can be converted" not in error_chain_text(e):
            return None
        if self._interp is None:
            self._interp = interpreter_probe() or ""
        return self._interp or None


def interpreter_probe() -> Optional[str]:
    """Why Triton's CPU interpreter cannot run a loop whose bound is a runtime value here, or None.
    Triton 3.6's interpreter takes int() of a 1-element array, which NumPy >= 2.4 refuses (Triton
    3.9 squeezes it first); compiled for a GPU the same kernels are fine."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    import numpy
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def count(n_ptr, out_ptr):
        n = tl.load(n_ptr)
        acc = 0.0
        for _ in range(0, n):
            acc += 1.0
        tl.store(out_ptr, acc)
    out = torch.zeros(1)
    try:
        count[(1,)](torch.tensor([3], dtype=torch.int32), out)
    except Exception as e:   # noqa: BLE001
        return (f"Triton {triton.__version__}'s interpreter cannot run a loop with a runtime bound under NumPy "
                f"{numpy.__version__} ({type(e).__name__}: {str(e)[:120]}): the kernels with such loops (attention, "
                f"the LM head, norm backward) are skipped under the interpreter here; on a GPU they compile")
    return None


def new_section() -> dict:
    return {"status": "running", "checks": [], "skipped": [], "notes": []}


def finish(section: dict, t0: float) -> None:
    statuses = {c["status"] for c in section["checks"]}
    section["status"] = ("error" if "error" in statuses or "error" in section else
                         "fail" if "fail" in statuses else "ok")
    section["seconds"] = round(time.time() - t0, 1)


def rel_err(got, ref) -> dict:
    """||got - ref|| / ||ref|| and max |got - ref| in fp64."""
    got, ref = got.detach().double(), ref.detach().double()
    diff = (got - ref)
    denom = ref.norm().item()
    return {"rel": diff.norm().item() / denom if denom else diff.norm().item(), "max_abs": diff.abs().max().item()}


def versions(run: Run) -> dict:
    import numpy
    import torch
    import transformers
    import triton
    import tailorfx
    v = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
         "triton": triton.__version__, "transformers": transformers.__version__, "numpy": numpy.__version__,
         "cuda": torch.version.cuda, "tailorfx": os.path.dirname(tailorfx.__file__), "dry_run": run.dry,
         "device": run.device, "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
         "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32, "budget_s": run.args.budget_s}
    if run.cuda:
        p = torch.cuda.get_device_properties(0)
        v.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_bytes=p.total_memory,
                 num_sms=p.multi_processor_count)
        try:
            nccl = torch.cuda.nccl.version()
            v["nccl"] = ".".join(str(x) for x in nccl) if isinstance(nccl, tuple) else str(nccl)
        except Exception as e:   # noqa: BLE001
            v["nccl"] = f"unknown ({type(e).__name__})"
    return v


# ---- kernels -----------------------------------------------------------------------------------

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

    def head(dt):
        from tailorfx.codegen.triton.linear_cross_entropy import default_chunk
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
    if run.cuda:
        sys.path.insert(0, BENCH_DIR)
        from kernels import bench, fwd_bwd   # benchmarks/kernels.py: do_bench median of fwd+bwd
        res["ms"] = bench(fwd_bwd(ours, inputs, dout), warmup=5, rep=25)
        res["torch_ms"] = bench(fwd_bwd(torch_fn, inputs, dout), warmup=5, rep=25)
        res["speedup"] = res["torch_ms"] / res["ms"]
    return res


def section_kernels(run: Run, sec: dict) -> None:
    if not run.cuda:
        sec["skipped"].append("timings (triton.testing.do_bench needs CUDA)")
    for name, dtypes, make in kernel_cases(run):
        for dt in dtypes:
            run.check(sec, f"{name}/{dt}", lambda make=make, dt=dt: kernel_check(run, make, dt))


# ---- a trained HF Llama the hf, memory and nccl sections share ----------------------------------

def llama_shape(run: Run, seq: int) -> dict:
    if run.dry:
        return dict(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, seq=32)
    return dict(vocab=32000, hidden=1024, layers=4, heads=16, kv_heads=4, seq=seq)


def make_llama(run: Run, dtype_name: str, seq: int):
    import torch
    sys.path.insert(0, BENCH_DIR)
    from common import hf_llama_model, lm_batch
    shape = llama_shape(run, seq)
    model = hf_llama_model(vocab=shape["vocab"], hidden=shape["hidden"], layers=shape["layers"],
                           heads=shape["heads"], kv_heads=shape["kv_heads"])
    model = model.to(device=run.device, dtype=getattr(torch, dtype_name)).train()
    batch = {k: v.to(run.device) for k, v in lm_batch(shape["seq"], shape["vocab"]).items()}
    return model, batch, shape


def trained(run: Run, key: str, dtype_name: str = "bfloat16", seq: int = 2048, **optimize_kw) -> dict:
    """optimize() of a fresh Llama (cached under `key`): model, opt, batch, optimizer, step(), timings."""
    if key in run.shared:
        return run.shared[key]
    import torch
    import tailorfx
    from tailorfx import compat
    model, batch, shape = make_llama(run, dtype_name, seq)
    eager = copy.deepcopy(model)   # the reference, with the same weights
    compat.reset_dynamo()
    t0 = time.time()
    opt = tailorfx.optimize(model, example_inputs=batch, **optimize_kw)
    entry = {"model": model, "opt": opt, "batch": batch, "eager": eager, "shape": shape, "dtype": dtype_name,
             "optimize_s": time.time() - t0, "kw": optimize_kw, "optimizer": None}
    if opt.setup.optimizer_in_backward:   # the updates run inside backward: registered before it runs
        entry["optimizer"] = tailorfx.SetupOptimizer(model.parameters(), opt.setup)

    def step():
        out = opt(**batch)   # held through backward and the step, as a training loop holds it
        out.loss.backward()
        if entry["optimizer"] is not None:
            entry["optimizer"].step()
            entry["optimizer"].zero_grad()
        return out.loss.detach()
    entry["step"] = step
    run.shared[key] = entry
    if run.cuda:
        torch.cuda.synchronize()
    return entry


def agreement(run: Run, entry: dict) -> dict:
    """Loss and gradients of one step against eager on a copy with the same weights (its time
    includes compiling the backward when no earlier section trained this model)."""
    import torch
    model, opt, batch, eager = entry["model"], entry["opt"], entry["batch"], entry["eager"]
    eager.load_state_dict(model.state_dict())
    for m in (model, eager):
        m.zero_grad(set_to_none=True)
    ref_loss = eager(**batch).loss
    ref_loss.backward()
    t0 = time.time()
    loss = opt(**batch).loss
    loss.backward()
    if run.cuda:
        torch.cuda.synchronize()
    res = {"agreement_step_s": time.time() - t0, "loss": loss.item(), "eager_loss": ref_loss.item(),
           "loss_rel": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())}
    pairs = [(n, p.grad, r.grad) for (n, p), r in zip(model.named_parameters(), eager.parameters())]
    if entry["opt"].setup.optimizer_in_backward:
        res["grads"] = "not compared: the optimizer consumed them inside backward"
    elif any(g is None for _, g, _ in pairs):
        res["grads_missing"] = [n for n, g, _ in pairs if g is None][:10]
    else:
        num = sum((g.double() - r.double()).norm() ** 2 for _, g, r in pairs).sqrt().item()
        den = sum(r.double().norm() ** 2 for _, _, r in pairs).sqrt().item()
        per = {n: (g.double() - r.double()).norm().item() / max(r.double().norm().item(), 1e-30) for n, g, r in pairs}
        worst = max(per, key=per.get)
        res.update(grad_rel=num / den, worst_param=worst, worst_param_rel=per[worst])
    for m in (model, eager):
        m.zero_grad(set_to_none=True)
    return res


def eager_baseline(run: Run, entry: dict, reps: int) -> dict:
    """The same steady-state step run by the unmodified model (its copy), for the peak and time
    to compare against: its peak above what was allocated before the step, and the median time."""
    import torch
    import tailorfx
    eager, batch = entry["eager"], entry["batch"]
    o = tailorfx.SetupOptimizer(eager.parameters(), entry["opt"].setup.with_(optimizer_in_backward=False))

    def step():
        out = eager(**batch)
        out.loss.backward()
        o.step()
        o.zero_grad()
    step()
    res = {}
    if run.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        res["dynamic_peak"] = torch.cuda.max_memory_allocated() - before
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        if run.cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    res["step_ms"] = 1e3 * statistics.median(times)
    o.close()
    return res


def discard_eager(entry: dict) -> None:
    """Free the reference copy: its memory must not count in the measured steps."""
    if entry["eager"] is not None:
        entry["eager"].to("meta")
        entry["eager"] = None


def noise_floor(run: Run, entry: dict) -> dict:
    """bf16 eager against fp32 eager on the same weights: how far bf16 itself moves the loss and grads."""
    import torch
    model, batch = entry["model"], entry["batch"]
    out = {}
    grads = {}
    for dt in (torch.float32, model.dtype):
        m = copy.deepcopy(model).to(dt)
        m.zero_grad(set_to_none=True)
        loss = m(**batch).loss
        loss.backward()
        grads[dt] = [p.grad.double() for p in m.parameters()]
        out[str(dt)] = loss.item()
        del m
    g32, g16 = grads[torch.float32], grads[model.dtype]
    num = sum((a - b).norm() ** 2 for a, b in zip(g16, g32)).sqrt().item()
    den = sum(b.norm() ** 2 for b in g32).sqrt().item()
    vals = list(out.values())
    return {"bf16_vs_fp32_loss_rel": abs(vals[1] - vals[0]) / abs(vals[0]), "bf16_vs_fp32_grad_rel": num / den}


def measure(run: Run, entry: dict, reps: int) -> dict:
    """One steady-state step (optimizer state exists): peak allocated/reserved vs the prediction, and
    the median step time over `reps` more."""
    import torch
    import tailorfx
    opt = entry["opt"]
    if entry["optimizer"] is None:
        entry["optimizer"] = tailorfx.SetupOptimizer(entry["model"].parameters(), opt.setup)
    step = entry["step"]
    step()   # the optimizer state is allocated in the first step
    res = {"setup": opt.setup.name, "lowerings": [g.lowering for g in opt.session.graphs],
           "passes_changed": sorted({r.name for g in opt.session.graphs for r in g.records if r.changed}),
           "warnings": [w[:300] for w in opt.session.warnings[:5]]}
    est = None
    try:
        est = opt.predict_memory()
        res.update(predicted=est.summary(), predicted_forward_backward_peak=est.forward_backward_peak_bytes,
                   predicted_peak_at=f"{est.peak_phase}: {est.peak_node}")
    except Exception as e:   # noqa: BLE001  (the measurement below still counts)
        res["prediction_error"] = describe(e)
    if run.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        res["measured"] = {"allocated_before_step": before, "max_allocated": peak, "max_reserved": reserved,
                           "dynamic_peak": peak - before}
        if est is not None:
            res["predicted_over_measured"] = {"peak": est.peak_bytes / peak, "static": est.static_bytes / before,
                                              "dynamic_peak": est.dynamic_peak_bytes / max(peak - before, 1)}
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        res["step_ms"] = 1e3 * statistics.median(times)
        tokens = entry["shape"]["seq"]
        res["tokens_per_s"] = tokens / statistics.median(times)
    else:
        res["measured"] = "skipped: torch.cuda.max_memory_allocated/reserved need CUDA"
    return res


def variant(run: Run, key: str, dtype_name: str, seq: int, reps: int, floor: bool = False, **kw) -> dict:
    """One optimize() configuration: agreement with eager (bf16: beside bf16's own distance from
    fp32), then memory and time of steady-state steps. Passes when the loss (and gradients, where
    the optimizer leaves them) are within fp32's 1e-4 / 1e-3, or for bf16 within 2e-2 / 5e-2 or 4x
    bf16's own distance from fp32, whichever is larger."""
    entry = trained(run, key, dtype_name, seq, **kw)
    res = {"optimize_kwargs": {k: str(v) for k, v in kw.items()}, "dtype": dtype_name, "tokens": entry["shape"]["seq"],
           "optimize_s": entry["optimize_s"]}
    if entry["eager"] is not None:
        res.update(agreement(run, entry))
        if floor and dtype_name != "float32":
            res["noise_floor"] = noise_floor(run, entry)
            res["report"] = str(entry["opt"].report())[:4000]
        if not kw:   # the plain optimize() of this dtype and length: the eager model beside it
            res["eager"] = eager_baseline(run, entry, reps)
        discard_eager(entry)
    res.update(measure(run, entry, reps))
    if "dynamic_peak" in res.get("eager", {}) and isinstance(res.get("measured"), dict):
        res["vs_eager"] = {"dynamic_peak": res["measured"]["dynamic_peak"] / res["eager"]["dynamic_peak"],
                           "step_time": res["step_ms"] / res["eager"]["step_ms"]}
    floor_of = res.get("noise_floor", {})
    if dtype_name == "float32":
        loss_tol, grad_tol = 1e-4, 1e-3
    else:
        loss_tol = max(2e-2, 4 * floor_of.get("bf16_vs_fp32_loss_rel", 0.0))
        grad_tol = max(5e-2, 4 * floor_of.get("bf16_vs_fp32_grad_rel", 0.0))
    res["tol"] = {"loss_rel": loss_tol, "grad_rel": grad_tol}
    res["ok"] = res.get("loss_rel", 0.0) <= loss_tol and res.get("grad_rel", 0.0) <= grad_tol
    return res


def section_hf(run: Run, sec: dict) -> None:
    sec["notes"].append("optimize()'s default lowering is 'auto' (Inductor on CUDA, eager on CPU): the 'default' "
                        "variants are the lowering='auto' case")
    sec["prediction_covers"] = PREDICTION_COVERS
    if not run.cuda:
        sec["skipped"].append("measured memory and step time (CUDA allocator statistics)")
    reps = 1 if run.dry else 3
    plan = [  # (name, key, dtype, seq, kwargs, seconds it needs left)
        ("bf16/default", "bf16-default", "bfloat16", 2048, {}, 0),
        ("bf16/lowering=eager", "bf16-eager", "bfloat16", 2048, {"lowering": "eager"}, 30),
        ("bf16/kernels=triton", "bf16-triton", "bfloat16", 2048, {"kernels": "triton"}, 60),
        ("bf16/setup=pure-bf16-fused-optimizer", "bf16-fused", "bfloat16", 2048,
         {"setup": "pure-bf16-fused-optimizer"}, 60),
        ("fp32/default", "fp32-default", "float32", 2048, {}, 60),
        ("bf16/default/S=8192", "bf16-default-8192", "bfloat16", 8192, {}, 75),
    ]
    for name, key, dt, seq, kw, need in plan:
        if run.dry and seq != 2048:
            sec["checks"].append({"name": name, "status": "skipped", "reason": "dry run: bf16/default's code path"})
            continue
        if not run.dry and run.left() < need:
            sec["checks"].append({"name": name, "status": "skipped", "reason": f"time budget ({run.left():.0f} s left)"})
            continue
        run.check(sec, name, lambda key=key, dt=dt, seq=seq, kw=kw: variant(run, key, dt, seq, reps,
                                                                             floor=key == "bf16-default", **kw))
        # no later check reuses it: its weights and optimizer state must not count in the next peak
        run.shared.pop(key, None)
        run.free()


# ---- memory ------------------------------------------------------------------------------------

def short_frames(frames: list, n: int = 4) -> list[str]:
    """The innermost `n` frames outside torch itself, as file:line:function."""
    def mine(f):
        name = f.get("filename", "")
        return not any(s in name for s in ("/torch/", "torch/_", "<frozen", "/contextlib.py"))
    chosen = [f for f in frames if mine(f)] or frames
    return [f"{os.path.basename(f.get('filename', '?'))}:{f.get('line', 0)}:{f.get('name', '?')}" for f in chosen[:n]]


def summarize_trace(events: list, top: int = 12) -> dict:
    """Peak of live bytes over an allocator trace (above its start), the allocations live at that
    peak and the largest allocations, each with its frames."""
    live: dict = {}
    cur = peak = 0
    peak_index = -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
            cur -= e["size"]
        if cur > peak:
            peak, peak_index = cur, i
    at_peak: dict = {}
    for e in events[:peak_index + 1]:   # replay to the peak: what was live there
        if e["action"] == "alloc":
            at_peak[e["addr"]] = e
        elif e["action"] == "free_completed":
            at_peak.pop(e["addr"], None)
    allocs = [e for e in events if e["action"] == "alloc"]

    def rows(es):
        return [{"bytes": e["size"], "frames": short_frames(e.get("frames", []))}
                for e in sorted(es, key=lambda e: -e["size"])[:top]]
    return {"num_events": len(events), "num_allocs": len(allocs), "peak_above_start_bytes": peak,
            "allocated_bytes_total": sum(e["size"] for e in allocs), "live_at_peak_top": rows(at_peak.values()),
            "largest_allocations": rows(allocs)}


def summarize_snapshot(snapshot: dict, device: int = 0) -> dict:
    segs = [s for s in snapshot.get("segments", []) if s.get("device", device) == device]
    traces = snapshot.get("device_traces", [])
    out = summarize_trace(traces[device] if len(traces) > device else [])
    out["segments"] = {"count": len(segs), "reserved_bytes": sum(s["total_size"] for s in segs),
                       "largest_bytes": max((s["total_size"] for s in segs), default=0)}
    return out


def section_memory(run: Run, sec: dict) -> None:
    def history():
        import torch
        from tailorfx import compat
        entry = trained(run, "bf16-default")
        if entry["optimizer"] is None:
            import tailorfx
            entry["optimizer"] = tailorfx.SetupOptimizer(entry["model"].parameters(), entry["opt"].setup)
        entry["step"]()   # compiled and warm: the optimizer state exists
        est = entry["opt"].predict_memory()
        res = {"predicted_peak_bytes": est.peak_bytes, "predicted_dynamic_peak_bytes": est.dynamic_peak_bytes}
        if not run.cuda:
            events = [{"action": "alloc", "addr": 1, "size": 64, "frames": [{"filename": "a.py", "line": 1, "name": "f"}]},
                      {"action": "alloc", "addr": 2, "size": 32, "frames": []},
                      {"action": "free_completed", "addr": 1, "size": 64},
                      {"action": "alloc", "addr": 3, "size": 16, "frames": []}]
            res["synthetic_trace_summary"] = summarize_trace(events)
            ok = res["synthetic_trace_summary"]["peak_above_start_bytes"] == 96
            return {**res, "ok": ok, "note": "allocator history needs CUDA: the summary ran on a synthetic trace"}
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with compat.cuda_memory_history() as rec:
            entry["step"]()
        res.update(summarize_snapshot(rec["snapshot"], torch.cuda.current_device()))
        res["allocated_before_step"] = before
        res["max_allocated"] = torch.cuda.max_memory_allocated()
        return res
    run.check(sec, "one bf16 training step (optimize() default, HF Llama)", history)


# ---- nccl + sync debug ------------------------------------------------------------------------

def process_group_check(run: Run) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    backend = "nccl" if run.cuda else "gloo"
    store = os.path.join(tempfile.mkdtemp(prefix="tailorfx-gpu-check-"), "store")
    t0 = time.time()
    kw = {"device_id": torch.device("cuda", torch.cuda.current_device())} if run.cuda else {}
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1, **kw)
    try:
        res = {"backend": dist.get_backend(), "init_s": time.time() - t0}
        x = torch.full((1 << (10 if run.dry else 22),), 2.0, device=run.device)
        dist.all_reduce(x)
        res["all_reduce_ok"] = bool((x == 2.0).all())
        if run.cuda:
            torch.cuda.synchronize()
            times = []
            for _ in range(5):
                t = time.perf_counter()
                dist.all_reduce(x)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            res["all_reduce_16MiB_ms"] = 1e3 * statistics.median(times)
        mesh = init_device_mesh(run.device, (1,), mesh_dim_names=("dp",))
        y = torch.ones(8, device=run.device)
        dist.all_reduce(y, group=mesh.get_group("dp"))
        res["mesh"] = {"shape": list(mesh.shape), "dims": list(mesh.mesh_dim_names),
                       "group_backend": dist.get_backend(mesh.get_group("dp")), "all_reduce_ok": bool((y == 1).all())}
        res["ok"] = res["all_reduce_ok"] and res["mesh"]["all_reduce_ok"]
        return res
    finally:
        dist.destroy_process_group()


def sync_debug_check(run: Run) -> dict:
    """One warm training step under sync-debug "warn" (every sync, with where it happened), then
    "error" (the first raises: recorded with its phase and stack)."""
    import warnings
    import torch
    entry = trained(run, "bf16-default")
    if entry["optimizer"] is None:
        import tailorfx
        entry["optimizer"] = tailorfx.SetupOptimizer(entry["model"].parameters(), entry["opt"].setup)
    entry["step"]()   # compiled and warm
    if not run.cuda:
        raise Skip("torch.cuda.set_sync_debug_mode needs CUDA (the step above ran on CPU)")
    opt, batch, o = entry["opt"], entry["batch"], entry["optimizer"]
    phase = {"now": ""}

    def phases():
        phase["now"] = "forward"
        out = opt(**batch)
        phase["now"] = "backward"
        out.loss.backward()
        phase["now"] = "optimizer step"
        o.step()
        o.zero_grad()
        torch.cuda.synchronize()  # outside the modes below

    res = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            phases()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs: dict = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            key = f"{os.path.basename(w.filename)}:{w.lineno}"
            syncs[key] = syncs.get(key, 0) + 1
    res["warn_mode_syncs"] = syncs
    torch.cuda.set_sync_debug_mode("error")
    try:
        phases()
        res["error_mode"] = "no synchronizing call"
    except RuntimeError as e:
        frames = traceback.extract_tb(e.__traceback__)
        res["error_mode"] = {"raised_in": phase["now"], "message": str(e)[:500],
                             "stack": [f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in frames[-8:]]}
    finally:
        torch.cuda.set_sync_debug_mode(0)
        o.zero_grad()
    return res


def section_nccl(run: Run, sec: dict) -> None:
    if not run.cuda:
        sec["notes"].append("dry run: the process group is gloo on CPU (NCCL needs CUDA)")
    run.check(sec, "world-size-1 process group, all_reduce, DeviceMesh", lambda: process_group_check(run))
    run.check(sec, "sync-debug training step", lambda: sync_debug_check(run))


# ---- driver ------------------------------------------------------------------------------------

RUNNERS = {"kernels": section_kernels, "memory": section_memory, "nccl": section_nccl, "hf": section_hf}


def table(data: dict) -> str:
    lines = [f"{data['meta'].get('gpu', data['meta'].get('device'))}  torch {data['meta'].get('torch')}  "
             f"triton {data['meta'].get('triton')}  transformers {data['meta'].get('transformers')}"]
    for name, sec in data["sections"].items():
        counts: dict = {}
        for c in sec["checks"]:
            counts[c["status"]] = counts.get(c["status"], 0) + 1
        lines.append(f"[{name}] {sec['status']}  {sec.get('seconds', '?')} s  " +
                     ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
        if "error" in sec:
            lines.append(f"    section error: {sec['error']['type']}: {sec['error']['message'][:150]}")
        for c in sec["checks"]:
            parts = [f"  {c['status']:<7} {c['name']:<42}"]
            if "worst_rel" in c:
                parts.append(f"rel {c['worst_rel']:.1e}")
            if "ms" in c:
                parts.append(f"{c['ms']:.3f} ms vs torch {c['torch_ms']:.3f} ms")
            if "loss_rel" in c:
                parts.append(f"loss rel {c['loss_rel']:.1e}")
            if "grad_rel" in c:
                parts.append(f"grad rel {c['grad_rel']:.1e}")
            if isinstance(c.get("measured"), dict):
                pred = f"{c['predicted']['peak'] / 2**20:.0f}" if "predicted" in c else "failed"
                parts.append(f"peak {c['measured']['max_allocated'] / 2**20:.0f} MiB (predicted {pred})")
            if "step_ms" in c:
                parts.append(f"step {c['step_ms']:.1f} ms")
            if "vs_eager" in c:
                parts.append(f"vs eager: peak x{c['vs_eager']['dynamic_peak']:.2f}, time x{c['vs_eager']['step_time']:.2f}")
            if "error" in c:
                parts.append(f"{c['error']['type']}: {c['error']['message'][:100]}")
            if "reason" in c:
                parts.append(c["reason"][:100])
            lines.append("  ".join(parts))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--section", action="append", choices=SECTIONS, help="repeatable; default: all")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton's interpreter")
    ap.add_argument("--out", default=os.path.join(BENCH_DIR, "out", "gpu_check.json"))
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="seconds: hf variants start only while enough of it is left (a variant takes up to ~1 min)")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"   # before triton or tailorfx is imported
    sys.path.insert(0, REPO)
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check.py needs a CUDA GPU; on CPU run it with --dry-run", file=sys.stderr)
        return 2
    run = Run(args, "cpu" if args.dry_run else "cuda")
    run.data["meta"].update(versions(run))
    run.save()
    for name in [s for s in SECTIONS if s in (args.section or SECTIONS)]:
        sec = run.data["sections"][name] = new_section()
        t0 = time.time()
        try:
            RUNNERS[name](run, sec)
        except Exception as e:   # noqa: BLE001  (recorded; the next section still runs)
            sec["error"] = describe(e)
        finish(sec, t0)
        run.save()
    run.data["meta"]["total_s"] = round(time.time() - run.start, 1)
    run.save()
    print(table(run.data))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
