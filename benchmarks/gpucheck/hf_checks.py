"""The hf section: HF Llama under optimize() configurations: loss and gradients against eager,
the measured peak of a steady-state step against opt.predict_memory(), step time beside eager's."""
from __future__ import annotations

import copy
import statistics
import time

from gpucheck.llama import optimizer_of, trained
from gpucheck.record import Run, describe

PREDICTION_COVERS = (
    "peak_bytes = static (weights, master weights, optimizer state) + the simulated step's peak above "
    "it (gradients, saved activations, transients of forward, backward and the optimizer step), "
    "traced from the graphs that run (rewrite/memory.py). Not covered: the CUDA context, the "
    "caching allocator's reserve and fragmentation (max_memory_reserved), cuBLAS/cuDNN workspaces, "
    "Inductor/Triton autotuning buffers, the input batch.")


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
    from common import cuda_peak
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
        res["dynamic_peak"] = cuda_peak(step)
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


def device_preset() -> "str | None":
    """The budget preset of this GPU (H100 -> 'H100-80GB'), None for one without."""
    import torch
    from tailorfx.budget import PRESETS
    name = torch.cuda.get_device_name().upper()
    return next((p for p in PRESETS if p.split("-")[0] in name), None)


def cuda_modelled(opt, entry: dict, preset: "str | None"):
    """opt.predict_memory() with the preset's CUDA costs (what a budget of that preset plans with)."""
    if preset is None:
        return None
    from tailorfx.budget import Budget
    from tailorfx.setup import with_device_costs
    batch = entry["shape"].get("batch", 1)
    return opt.predict_memory(setup=with_device_costs(opt.setup, Budget.parse(preset), opt.model, batch))


def measure(run: Run, entry: dict, reps: int) -> dict:
    """One steady-state step (optimizer state exists): peak allocated/reserved vs the prediction, and
    the median step time over `reps` more."""
    import torch
    opt = entry["opt"]
    optimizer_of(entry)
    step = entry["step"]
    step()   # the optimizer state is allocated in the first step
    res = {"setup": opt.setup.name, "lowerings": [g.lowering for g in opt.session.graphs],
           "passes_changed": sorted({r.name for g in opt.session.graphs for r in g.records if r.changed}),
           "warnings": [w[:300] for w in opt.session.warnings[:5]],
           "graphs_failed": [w[:300] for g in opt.session.graphs if g.failed for w in g.warnings],
           "attention_kernels": sorted({st["kernel"] for g in opt.session.graphs for r in g.records
                                        if r.name == "attention" for st in r.stats.values()
                                        if isinstance(st, dict) and "kernel" in st})}
    est = None
    try:
        est = opt.predict_memory()
        res.update(predicted=est.summary(), predicted_forward_backward_peak=est.forward_backward_peak_bytes,
                   predicted_peak_at=f"{est.peak_phase}: {est.peak_node}")
    except Exception as e:   # noqa: BLE001  (the measurement below still counts)
        res["prediction_error"] = describe(e)
    est_cuda = None
    try:   # the same step modelled for CUDA (budget.CudaCosts), as a device preset budget plans it
        est_cuda = cuda_modelled(opt, entry, "H100-80GB" if not run.cuda else device_preset())
        if est_cuda is not None:
            res["predicted_cuda_modelled"] = {"peak": est_cuda.peak_bytes, "cuda_workspaces": est_cuda.device_bytes,
                                              "terms": est_cuda.setup.device.terms(entry["shape"]["seq"]),
                                              "allocator_headroom": est_cuda.setup.device.allocator_headroom}
    except Exception as e:   # noqa: BLE001
        res["cuda_modelled_error"] = describe(e)
    if run.cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()   # max_memory_reserved then shows this step's own fragmentation
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
        if est_cuda is not None:
            res.setdefault("predicted_over_measured", {})["peak_cuda_modelled"] = est_cuda.peak_bytes / peak
        res["measured"]["reserved_over_allocated"] = reserved / max(peak, 1)   # vs allocator_headroom
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
    # a graph that ran as captured is exact and rewrites nothing: the variant did not run
    res["rewritten"] = not res.get("graphs_failed") and ("kernels" not in kw or "kernels" in res.get("passes_changed", ()))
    res["ok"] = res.get("loss_rel", 0.0) <= loss_tol and res.get("grad_rel", 0.0) <= grad_tol and res["rewritten"]
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
        # checkpoints in pinned host memory (tailorfx::offload / reload on a copy stream, prefetched): not
        # yet measured on a GPU, so before the variants earlier runs measured (11-28: the time
        # budget ran out before these)
        ("fp32/lowering=eager/offload=checkpoints", "fp32-offload", "float32", 2048,
         {"lowering": "eager", "recompute": "full", "offload": "checkpoints"}, 60),
        ("fp32/lowering=inductor/offload=checkpoints", "fp32-offload-inductor", "float32", 2048,
         {"lowering": "inductor", "recompute": "full", "offload": "checkpoints"}, 60),
        ("bf16/lowering=eager", "bf16-eager", "bfloat16", 2048, {"lowering": "eager"}, 30),
        ("bf16/kernels=triton", "bf16-triton", "bfloat16", 2048, {"kernels": "triton"}, 60),
        ("bf16/setup=pure-bf16-fused-optimizer", "bf16-fused", "bfloat16", 2048,
         {"setup": "pure-bf16-fused-optimizer"}, 60),
        ("fp32/default", "fp32-default", "float32", 2048, {}, 60),
        ("bf16/default/S=8192", "bf16-default-8192", "bfloat16", 8192, {}, 75),
        # Mistral's sliding window (a quarter of the sequence): the attention pass times the Triton
        # flash kernel against FlexAttention and runs the faster (attention_kernel="auto"), or the one named
        ("bf16/mistral-window/default", "mistral-bf16-auto", "bfloat16", 2048, {}, 90),
        ("bf16/mistral-window/attention_kernel=flex", "mistral-bf16-flex", "bfloat16", 2048,
         {"attention_kernel": "flex"}, 60),
        ("bf16/mistral-window/attention_kernel=triton", "mistral-bf16-triton", "bfloat16", 2048,
         {"attention_kernel": "triton"}, 60),
    ]
    for name, key, dt, seq, kw, need in plan:
        if run.args.variant and name not in run.args.variant:
            sec["checks"].append({"name": name, "status": "skipped", "reason": "not among --variant"})
            continue
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
