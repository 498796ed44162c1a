"""The nccl section: a world-size-1 process group (NCCL; gloo in a dry run) with a file:// store,
all_reduce and a DeviceMesh; then one training step under CUDA's sync-debug modes."""
from __future__ import annotations

import os
import statistics
import tempfile
import time
import traceback

from gpucheck.llama import optimizer_of, trained
from gpucheck.record import Run, Skip


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
    optimizer_of(entry)
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
