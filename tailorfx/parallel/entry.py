"""optimize(parallel=...)'s entry: the layout given (a dict or ParallelSpec), its rewrites planned
under a budget (fit.py), or parallel="auto": the fastest layout of the torchrun world that fits
(world.plan_world at the global batch, on this machine's device class); then apply.parallelize.

    plan = parallel_plan(model, "auto", (), batch, budget=Budget.parse("H100-80GB"), requested=None,
                         options=opts)
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from tailorfx.budget import Budget
from tailorfx.parallel.apply import ParallelPlan, parallelize
from tailorfx.parallel.calibrate import calibrate
from tailorfx.parallel.devices import DEVICE_CLASSES
from tailorfx.parallel.fit import fit_rewrites
from tailorfx.parallel.spec import ParallelSpec
from tailorfx.parallel.world import plan_world
from tailorfx.runtime.tensor_parallel import device_mesh, rank_device


def parallel_plan(model: nn.Module, parallel: Any, args: tuple, kwargs: dict, *, budget: Optional[Budget],
                  requested: Optional[Sequence[str]], options: dict) -> ParallelPlan:
    """The layout applied to `model` (apply.parallelize), with the rewrites it takes: the
    layout's own (spec.rewrites), or under a budget the first that fits (fit.fit_rewrites); for
    parallel="auto", those of the layout chosen."""
    _refuse_unhonoured(parallel, options)
    if isinstance(parallel, str) and parallel == "auto":
        return _auto_plan(model, args, kwargs, budget=budget, requested=requested, options=options)
    spec = ParallelSpec.parse(parallel)
    policy = options.get("recompute_policy")
    fit = mesh = None
    if budget is None:
        passes = spec.rewrites(requested, policy)   # before any capture
    else:   # each rank's rewrites planned on fake tensors, before the model is sharded
        rows, seq = tokens_of(args, kwargs)
        if spec.pp > 1:     # predict_rank_memory's rows are one micro-batch's
            rows //= spec.microbatches
        # under tp each prediction shards a fake copy on this world's tp ranks: the mesh the model
        # is then sharded on (one set of process groups)
        mesh = device_mesh(tp=spec.tp, dp=spec.dp, pp=spec.pp, device=rank_device()) if spec.tp > 1 else None
        fit = fit_rewrites(model, spec, budget, seq_len=seq, batch_size=rows, setup=options["setup"],
                           requested=requested, recompute_policy=policy, mesh=mesh["tp"] if mesh else None)
        passes = fit.passes
    plan = parallelize(model, spec, args, kwargs, passes=passes, options=options, mesh=mesh)
    if fit is not None:
        plan = dataclasses.replace(plan, report=dataclasses.replace(plan.report, budget=fit.describe()))
    return plan


# optimize()'s options the layouts do not run: given with parallel=, refused rather than ignored
UNHONOURED = {
    "offload": "the layouts checkpoint each block with torch's checkpointing, which keeps its saved input on "
               "the device, so nothing would be offloaded",
    "attention": "the layouts run the model's own attention (pipeline stages and sharded blocks take "
                 "mini-sequence and recompute only)",
    "precision": "the layouts train in the model's own dtypes (call model.to(...) first, or use torch.autocast)",
    "kernels": "the layouts run torch's own ops, not the Triton kernels",
}


def _refuse_unhonoured(parallel: Any, options: dict) -> None:
    given = [k for k in UNHONOURED if options.get(k) is not None]
    if given:
        shown = repr(parallel) if isinstance(parallel, str) else str(ParallelSpec.parse(parallel))
        k = given[0]
        raise ValueError(f"{k}={options[k]!r} under parallel={shown}: {UNHONOURED[k]}; drop {k}=, or run it "
                         f"without parallel=")


def _auto_plan(model: nn.Module, args: tuple, kwargs: dict, *, budget: Optional[Budget],
               requested: Optional[Sequence[str]], options: dict) -> ParallelPlan:
    """parallel="auto": the fastest layout that fits, with its rewrites; every rank is given the
    same global batch."""
    if budget is None:
        raise ValueError("parallel='auto' chooses the fastest layout that fits a budget: give budget= (e.g. "
                         "budget='H100-80GB'), or name the layout with parallel=dict(tp=..., dp=...)")
    if requested is not None:
        raise ValueError("parallel='auto' chooses each rank's rewrites with its layout: drop passes=, or name the "
                         "layout with parallel=dict(...)")
    rows, seq = tokens_of(args, kwargs)
    spec, chosen, fitting = auto_layout(model, budget=budget, seq_len=seq, global_rows=rows, setup=options["setup"])
    plan = parallelize(model, spec, args, kwargs, passes=chosen.passes, options=options, global_batch=True)
    note = (f"parallel='auto': {chosen} (the fastest of {fitting} layouts that fit, predicted on "
            f"{chosen.step.device}); each rank takes its rows of the global batch")
    return dataclasses.replace(plan, report=dataclasses.replace(plan.report, budget=note))


def auto_layout(model: nn.Module, *, budget, seq_len: int, global_rows: int, setup) -> tuple[ParallelSpec, Any, int]:
    """optimize(parallel="auto"): the fastest layout of the torchrun world that fits `budget`
    (plan_world at the global batch, on this machine's device class: a GPU's by name, H100's for
    one without figures of its own, a CPU's measured by calibrate()); rank 0's choice on every
    rank. Returns (its spec, the candidate, the number of layouts that fit)."""
    device = rank_device()
    mesh = device_mesh(dp=_world_size(), device=device)      # the process group, for calibrate and the choice
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        dev = next((k for k in DEVICE_CLASSES if k in name.upper()), "H100")
    else:
        dev = calibrate(repeats=3)
    world, meshes = mesh.size(), {}

    def tp_mesh(tp: int):     # the same meshes on every rank, in the same order (plan_world's)
        if tp not in meshes:
            meshes[tp] = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("rest", "tp"))["tp"]
        return meshes[tp]
    cands = plan_world(model, world=world, budget=budget, seq_len=seq_len, global_rows=global_rows, setup=setup,
                       device=dev, tp_mesh=tp_mesh)
    key = [(cands[0].tp, cands[0].pp, cands[0].dp, cands[0].sp)]
    dist.broadcast_object_list(key, src=0)
    chosen = next(c for c in cands if (c.tp, c.pp, c.dp, c.sp) == key[0])
    m = chosen.memory.microbatches if chosen.pp > 1 else None
    spec = ParallelSpec(tp=chosen.tp, dp=chosen.dp, pp=chosen.pp, sp=chosen.sp, microbatches=m)
    return spec, chosen, sum(c.status == "fits" for c in cands)


def _world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    if "WORLD_SIZE" not in os.environ:
        raise RuntimeError("parallel='auto' lays the model out over a torchrun world: launch with `torchrun "
                           "--nproc-per-node N your_script.py`")
    return int(os.environ["WORLD_SIZE"])


def tokens_of(args: tuple, kwargs: dict) -> tuple[int, int]:
    """(rows, tokens) of the example batch's token ids: what each rank's step is planned at."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("optimize(budget=..., parallel=...) plans each rank at its example batch: give "
                         "example_inputs with input_ids of shape (rows, tokens)")
    return int(ids.shape[0]), int(ids.shape[1])


__all__ = ["auto_layout", "parallel_plan", "tokens_of"]
