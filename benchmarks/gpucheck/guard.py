"""The time budget gpu_scale's sections and checks run under: a check starts only when its estimated
time fits what is left of --budget-s and with nothing left on the GPU from an earlier check; a
watchdog thread writes the JSON (and kills run_child's subprocess) before the caller's hard wall."""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from typing import Callable, Optional

from gpucheck.record import Run, Skip, describe, finish, new_section
from gpucheck.steps import config_params, step_flops

# What a check is estimated to take on the GPU, so that it starts only when it can finish. Measured on
# the H200 on 2026-12-04 (Llama-3-8B, one step at 32K tokens in 8.0 s, at 79,360 in 27.5 s: about 300
# TFLOP/s): the model made in 0.3 s, the first step 1-2 s over a steady one, a budgeted optimize() in
# 45 s at 32K and 60 s at 79K tokens; the constants keep a margin over those, and a run replaces PLAN_S
# by its first optimize()'s time.
ESTIMATE_TFLOPS = 350.0        # what a step is assumed to reach (about a third of the peak; slowdown below)
OFFLOAD_SLOWDOWN = 1.6         # a step with host copies the compute does not hide, over its FLOPs' time
STEP_OVERHEAD_S = 1.0          # launches and 291 single-tensor AdamW updates a step
BUILD_S = 5.0                  # an 8B model made on the GPU, random weights
FIRST_STEP_S = 5.0             # the first step's extra: Triton's compiles, the allocator's growth
PLAN_S = 90.0                  # a budgeted optimize(): capture and the planner's traces
KERNEL_CHOICE_S = 90.0         # kernels="triton": each norm, SwiGLU, rotary and attention form timed, its Triton
                               # kernels and Inductor's code for it alone compiled first (not yet measured on a GPU)
INDUCTOR_S = 180.0             # lowering "auto" on CUDA: Inductor's compile of the 32-block step, the hinted plan
                               # checked on its code (until 2026-12-07 on a trace of its own before it; 69 s a
                               # compile on this project's 2-core CPU; not yet measured on a GPU)
PREDICT_S = 30.0               # one predict_memory(), or max_seq_len / plan_for_budget on a shallow capture
TRACE_S = 60.0                 # optimize() with fixed passes and one prediction: capture, one trace
PYTHON_S = 30.0                # a fresh interpreter's imports (the probe's subprocess)
SECTION_MIN_S = 30.0           # less time than this left: a section is skipped
WATCHDOG_MARGIN_S = 25.0       # after --budget-s: the JSON is written and the process ends
LEAK_BYTES = 1 << 30           # allocated at a check's start: an earlier check's model or AdamW state


def estimate_s(run: Run, cfg, S: int, steps: int, plan: bool = False, builds: int = 1,
               slowdown: float = 4 / 3) -> float:
    """Seconds a check should take on the GPU: `builds` models of Llama config `cfg` made, with `plan`
    a budgeted optimize() (its example forward, the planner, one prediction), the first step's extra,
    and `steps` steps of S tokens at ESTIMATE_TFLOPS (`slowdown`: recompute's extra forward, copies)."""
    step = step_flops(cfg, config_params(cfg), S) * slowdown / (ESTIMATE_TFLOPS * 1e12) + STEP_OVERHEAD_S
    planning = run.shared.get("plan_s", PLAN_S) + PREDICT_S + step / 3 if plan else 0.0
    return builds * BUILD_S + planning + FIRST_STEP_S + steps * step


def allocated(run: Run) -> int:
    """Bytes allocated on the GPU now (0 on the CPU): what an earlier check may have left."""
    if not run.cuda:
        return 0
    import torch
    return torch.cuda.memory_allocated()


def guarded(run: Run, sec: dict, name: str, need_s: float, fn: Callable[[], Optional[dict]]) -> dict:
    """run.check(sec, name, fn) if `need_s` (estimate_s's) fits the time left, else an entry
    skipped for time; the check fails at once if more than LEAK_BYTES are still allocated on the
    GPU (an earlier check's leak would fail it for the wrong reason). The dry run skips nothing for
    time (the estimates are a GPU's)."""
    need = 0.0 if run.dry else need_s
    print(f"[{time.time() - run.start:5.0f} s] {name}: {run.left():.0f} s left, about {need_s:.0f} s needed",
          flush=True)
    if run.left() < need:
        entry = {"name": name, "status": "skipped", "estimate_s": round(need_s),
                 "reason": f"time budget: {run.left():.0f} s left, about {need_s:.0f} s needed"}
        sec["checks"].append(entry)
        run.save()
        return entry

    def body():
        before = allocated(run)
        if before > LEAK_BYTES:
            return {"ok": False, "allocated_before": before,
                    "reason": f"{before / 2**30:.1f} GiB still allocated on the GPU from an earlier check (a leak)"}
        res = dict(fn() or {})
        return {**res, "allocated_before": before} if run.cuda else res
    entry = run.check(sec, name, body)
    entry["estimate_s"] = round(need_s)
    print(f"    {entry['status']} in {entry['seconds']} s", flush=True)
    return entry


def run_child(run: Run, cmd: list, timeout: float) -> tuple[str, str, Optional[int]]:
    """(stdout, stderr, exit status) of `cmd` in a subprocess that the watchdog kills too; the status
    is None when it ran past `timeout` seconds and was killed."""
    child = run.shared["child"] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = child.communicate(timeout=timeout)
        return out, err, child.returncode
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        return out, err, None
    finally:
        run.shared.pop("child", None)


def start_watchdog(run: Run, margin_s: float) -> threading.Timer:
    """A timer thread that, `margin_s` after --budget-s runs out, writes the JSON (a check still
    running marked "timeout") and ends the process with status 3, killing run_child's subprocess:
    the caller's hard wall then never finds the run without its JSON. A thread, not SIGALRM: it
    fires while the main thread waits in CUDA or on a subprocess."""
    def fire():
        now = time.time() - run.start
        for sec in list(run.data["sections"].values()):
            for c in sec["checks"]:
                if c.get("status") == "running":
                    c.update(status="timeout", seconds=round(now - c["at_s"], 1))
            if sec.get("status") == "running":
                sec["status"] = "timeout"
        run.data["meta"]["watchdog"] = (f"stopped at {now:.0f} s (--budget-s {run.args.budget_s:.0f} "
                                        f"+ {margin_s:.0f} s)")
        if (child := run.shared.get("child")) is not None:
            child.kill()
        text = None
        for _ in range(5):   # the main thread may change a dict while it is dumped
            try:
                text = json.dumps(run.data, indent=1, default=str)
                break
            except RuntimeError:
                time.sleep(0.1)
        if text is not None:   # else the JSON the last check saved stands
            tmp = f"{run.args.out}.watchdog"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, run.args.out)
        print(f"[watchdog] {run.data['meta']['watchdog']}; wrote {run.args.out}", flush=True)
        os._exit(3)
    timer = threading.Timer(max(0.0, run.left()) + margin_s, fire)
    timer.daemon = True
    timer.start()
    return timer


def run_sections(run: Run, runners: dict) -> None:
    """Each of run.sections by its runner (name -> fn(run, section)), saved as it ends: one that would
    start with less than SECTION_MIN_S left is skipped; its Skip or exception ends that section only."""
    for name in run.sections:
        sec = run.data["sections"][name] = new_section()
        t0 = time.time()
        if run.left() < (0.0 if run.dry else SECTION_MIN_S):
            sec["skipped"].append(f"time budget: {run.left():.0f} s left")
        else:
            run.save()
            try:
                runners[name](run, sec)
            except Skip as s:
                sec["skipped"].append(str(s))
            except Exception as e:   # noqa: BLE001  (recorded; the next section still runs)
                sec["error"] = describe(e)
        finish(sec, t0)
        run.save()
        print(f"[{name}] {sec['status']} {sec['seconds']} s: " + ", ".join(f"{c['name']} {c['status']}" for c in sec["checks"]),
              flush=True)
