"""The memory section: the CUDA allocator's history of one training step, summarised (peak above
the step's start, what is live there, the largest allocations, each with its Python frames); and
exact attention's SDPA call on grouped k, v in fp32 against SDPA's own enable_gqa (its math kernel
on CUDA): peak, kernels and agreement."""
from __future__ import annotations

import os

from gpucheck.llama import optimizer_of, trained
from gpucheck.record import Run


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
        optimizer_of(entry)
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
    run.check(sec, "grouped k, v in fp32: grouped_sdpa against SDPA's enable_gqa", lambda: grouped_fp32(run))


def grouped_fp32(run: Run) -> dict:
    """Forward and backward of causal attention with Llama's 16 query and 4 kv heads (head dim 64,
    fp32, 8192 tokens; 256 on the CPU) through runtime.flash_cpu.grouped_sdpa (on CUDA: k, v repeated,
    the memory-efficient kernel) and through SDPA with enable_gqa (on CUDA: the math kernel, (B, H,
    S, S) scores): each one's peak above its start and its attention kernels, and the largest
    relative difference of output and gradients. ok: they agree to 1e-5 and, on CUDA,
    grouped_sdpa's peak is under one fp32 (B, H, S, S) score tensor's bytes / 8."""
    import torch
    import torch.nn.functional as F
    from common import cuda_peak
    from tailorfx.runtime.flash_cpu import grouped_sdpa
    dev = "cuda" if run.cuda else "cpu"
    S, H, Hkv, D = (8192 if run.cuda else 256), 16, 4, 64
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, h, S, D, device=dev, generator=g, requires_grad=True) for h in (H, Hkv, Hkv))
    dout = torch.randn(1, H, S, D, device=dev, generator=g)
    calls = {"grouped_sdpa": lambda: grouped_sdpa(q, k, v, is_causal=True, scale=None),
             "enable_gqa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)}
    res, grads = {"shape": [1, H, Hkv, S, D]}, {}
    def profiled(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = fn()
            out.backward(dout)
        return prof, out.detach()

    for name, fn in calls.items():
        for t in (q, k, v):
            t.grad = None
        peak, (prof, out) = cuda_peak(lambda: profiled(fn), return_result=True) if run.cuda else (None, profiled(fn))
        grads[name] = [out, q.grad, k.grad, v.grad]
        res[name] = {"kernels": sorted({e.key for e in prof.key_averages() if "attention" in e.key})}
        if peak is not None:
            res[name]["peak_above_start_bytes"] = peak
    rel = max(((a - b).norm() / b.norm()).item() for a, b in zip(grads["grouped_sdpa"], grads["enable_gqa"]))
    res["max_rel_diff"] = rel
    res["ok"] = rel <= 1e-5
    if run.cuda:
        scores = 4 * H * S * S
        res["ok"] = res["ok"] and res["grouped_sdpa"]["peak_above_start_bytes"] < scores / 8
    return res
