"""The memory section: the CUDA allocator's history of one training step, summarised (peak above
the step's start, what is live there, the largest allocations, each with its Python frames)."""
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
