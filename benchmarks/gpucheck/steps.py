"""One training step as gpu_scale measures it on the run's device: its FLOPs and MFU, its time,
its peak against tailorfx's prediction, its gradients compared with eager's by parameter name."""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

from gpucheck.record import Run

PEAK_TFLOPS = 989.0            # H100 SXM and H200 dense bf16 (NVIDIA's data sheets)


def counted_params(model) -> int:
    """The weights MFU counts: every one but the input embedding (a lookup)."""
    emb = model.get_input_embeddings().weight
    return sum(p.numel() for p in model.parameters() if p is not emb)


def config_params(cfg) -> int:
    """counted_params of a Llama config's model, without building it (for estimates)."""
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    attention = 2 * h * head_dim * (cfg.num_attention_heads + cfg.num_key_value_heads)
    return L * (attention + 3 * h * cfg.intermediate_size + 2 * h) + h + h * cfg.vocab_size


def step_flops(cfg, num_params: int, S: int) -> float:
    """The MFU numerator: the dense matmuls' FLOPs and causal attention's, forward and backward."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 6 * num_params * S + 6 * cfg.num_hidden_layers * S * S * cfg.num_attention_heads * head_dim


def mfu(model, S: int, seconds: float) -> float:
    """A step of S tokens in `seconds` as a fraction of PEAK_TFLOPS."""
    return step_flops(model.config, counted_params(model), S) / seconds / (PEAK_TFLOPS * 1e12)


def sync(run: Run) -> None:
    if run.cuda:
        import torch
        torch.cuda.synchronize()


@contextlib.contextmanager
def stepper(run: Run, module, model, inputs: dict, setup: str, optimizer=None):
    """(step, optimizer): one training step of `module` (the model as a provider wraps it), the
    optimizer of `setup` fused into backward through `optimizer`'s hooks on `model`'s parameters
    (default tailorfx.SetupOptimizer). The hooks and the optimizer's entry in tailorfx's registry hold
    the model and its AdamW state until close(), so close() runs however the block ends."""
    import tailorfx
    optim = (optimizer or tailorfx.SetupOptimizer)(model.parameters(), setup)

    def step():
        out = module(**inputs)
        loss = out.loss
        loss.backward()
        optim.step()          # a no-op for hooked parameters; steps the rest
        optim.zero_grad()
        sync(run)
        return out
    try:
        yield step, optim
    finally:
        optim.close()


def first_step(run: Run, step) -> tuple[float, Any]:
    """(seconds, output) of the first step: Triton's compiles and the allocator's first growth."""
    sync(run)   # optimize()'s example forward may still be queued
    t0 = time.time()
    out = step()
    return round(time.time() - t0, 1), out


def median_step_s(step, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()   # ends in a synchronize
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_of(run: Run, step) -> dict:
    """The peak of one steady step: allocated bytes on the GPU (static included), on the CPU
    tailorfx.measure_peak's bytes above what was live before it (dynamic)."""
    import torch
    import tailorfx
    if run.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        return {"before": before, "peak": torch.cuda.max_memory_allocated(),
                "reserved": torch.cuda.max_memory_reserved()}
    return {"dynamic_peak": tailorfx.measure_peak(step)}


def against_prediction(measured: dict, est) -> dict:
    """(predicted - measured) / measured: the whole peak on a GPU, the dynamic peak on the CPU."""
    if "peak" in measured:
        pred, meas = est.peak_bytes, measured["peak"]
    else:
        pred, meas = est.forward_backward_peak_bytes, measured["dynamic_peak"]
    return {"predicted": pred, "measured": meas, "error": (pred - meas) / meas,
            "within_-2%..+3%": -0.02 <= (pred - meas) / meas <= 0.03,
            "parts": est.summary()}   # what the prediction counted (a GPU run's figures read later on a CPU)


@contextlib.contextmanager
def capped(run: Run, cap: int):
    """The caching allocator capped at `cap` bytes (an 80 GB GPU emulated on a larger one)."""
    if not run.cuda:
        yield None
        return
    import torch
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    try:
        yield cap
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def grad_norms(model, names: dict) -> dict:
    """Each gradient's norm under its parameter's name in the unwrapped model (`names`: id -> name,
    taken before a provider wrapped modules: ALST's `mlp.mlp.*` is eager's `mlp.*`)."""
    out = {}
    for p in model.parameters():
        if p.grad is not None:
            if id(p) not in names:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is not the model's: the provider made it")
            out[names[id(p)]] = p.grad.float().norm().item()
    return out


def worst_grad_rel(ref: dict, got: dict) -> float:
    """The largest relative difference of a gradient norm from eager's. A parameter with a gradient
    on one side only is an error, not a zero: a name that does not match would compare nothing."""
    if set(ref) != set(got):
        raise ValueError(f"gradients of different parameters: eager only {sorted(set(ref) - set(got))[:4]}, "
                         f"provider only {sorted(set(got) - set(ref))[:4]}")
    return max(abs(got[n] - g) / max(g, 1e-30) for n, g in ref.items())


KINDS = (("attention", ("flash", "fmha", "attention", "sdpa")),
         ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm")),
         ("triton", ("triton",)),
         ("copy", ("memcpy", "memset", "aten::copy_", "aten::to")))


def kind_of(name: str) -> str:
    """A kernel's (or, on the CPU, an op's) kind by its name: attention, gemm, triton, copy, other."""
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def step_profile(run: Run, step, top: int = 20) -> dict:
    """Where one step's time goes: the GPU's kernel time by kind (on the CPU, the ops' own time),
    against the step's wall time (the rest: the GPU idle, waiting on the host), the `top` kernels
    by time, and the `top` ops (ATen's, tailorfx's) by the device time of the kernels each launched
    itself (`by_op`): which op an "other" kernel comes from. What an MFU below the goal is made of."""
    from torch.profiler import ProfilerActivity, profile
    sync(run)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()   # ends in a synchronize
        wall = time.perf_counter() - t0
    kernels, ops = profile_rows(prof.key_averages(), run.cuda)
    by_kind: dict = {}
    for name, s, _ in kernels:
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + s
    busy = sum(by_kind.values())

    def listed(rows):
        return [{"name": n[:120], "s": round(s, 4), "count": c} for n, s, c in sorted(rows, key=lambda r: -r[1])[:top]]
    return {"wall_s": round(wall, 4), "kernel_s": round(busy, 4), "kernel_fraction": round(busy / wall, 3),
            "by_kind_s": {k: round(v, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top": listed(kernels), "by_op": listed(ops)}


def profile_rows(events, cuda: bool) -> tuple[list, list]:
    """(kernels, ops) as (name, seconds, count) from a profile's key_averages. On a GPU: the
    device's kernels by their time, and the host's ops by the time of the kernels each launched
    itself (its children's excluded, so the ops' times add up to the kernels'). On the CPU both are
    ATen's ops by their own time."""
    from torch.autograd import DeviceType
    if not cuda:
        rows = [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in events
                if e.key.startswith("aten::") and e.self_cpu_time_total > 0]
        return rows, rows
    timed = [(e, e.self_device_time_total / 1e6) for e in events if e.self_device_time_total > 0]
    return ([(e.key, s, e.count) for e, s in timed if e.device_type != DeviceType.CPU],
            [(e.key, s, e.count) for e, s in timed if e.device_type == DeviceType.CPU])


def weight_grad_sum(device: str) -> dict:
    """The chunked weight-gradient sum (tailorfx/kernels/weight_grad.py) on `device` against fp64,
    bf16 operands into an fp32 sum; `in_place_gemm`: whether this torch's cuBLAS took the one GEMM
    into the sum (addmm.dtype_out, out=the sum) rather than the upcast fallback."""
    import torch
    from tailorfx.kernels.weight_grad import add_weight_grad
    gen = torch.Generator().manual_seed(0)
    g, a = (torch.randn(512, n, generator=gen).to(device, torch.bfloat16) for n in (384, 256))
    acc = torch.randn(384, 256, generator=gen).to(device)
    want = acc.double() + g.double().t() @ a.double()
    add_weight_grad(acc, g, a)
    in_place = False
    if acc.is_cuda:
        try:
            into = acc.clone()
            torch.addmm(into, g.t(), a, out_dtype=torch.float32, out=into)
            in_place = True
        except RuntimeError:
            pass
    return {"rel_err": float((acc.double() - want).abs().max() / want.abs().max()), "in_place_gemm": in_place}
