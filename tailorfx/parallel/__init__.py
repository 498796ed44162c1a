"""Layouts across ranks: tensor, sequence, pipeline and data parallelism (docs/parallel.md).

The modules import one way, each only those above it in this list (tests/test_layers.py):

    spec           ParallelSpec: the layout (tp, dp, pp, sp, schedule, ...), checked when made
    shapes         where a sharded dim lands through views, transposes and indexing
    tp_plan        the tensor-parallel plan read off a captured graph (TPPlan)
    sequence_plan  Megatron's sequence parallelism on top of it
    stages         where to cut the blocks into pipeline stages
    plan           the plan read off a model, the styles each layout's LM head takes, the step's rewrites
    shard          tensor parallelism applied to a module (the rank's, or a fake copy)
    trace          one rank's step graph on fake tensors, each node tagged by part of the model
    profile        the memory model's simulation of that step, live bytes per part
    compose        that simulation composed under FSDP2 and a pipeline schedule
    memory         per-rank memory of a layout (predict_rank_memory, RankMemory, RankPrediction)
    fit            the rewrites each rank takes under optimize(budget=..., parallel=...)
    devices        the device classes the step-time model reads (H100, H200, A100, or one measured)
    steptime       a layout's predicted step time on a device class (predict_step_time), or a
                   single process's plan's (plan_step_time)
    calibrate      a device class measured on this machine's process group (gloo)
    world          the layout a world of devices should use under a budget (plan_world)
    apply          optimize(parallel=...) inside torchrun: each parallelism applied (parallelize)
    entry          optimize(parallel=...)'s entry: the layout given, or "auto" (the fastest that fits)

Nothing here imports tailorfx.api or tailorfx.sizing.
"""
from tailorfx.parallel.apply import ParallelPlan, parallelize
from tailorfx.parallel.memory import RankMemory, StageMemory, predict_rank_memory
from tailorfx.parallel.plan import plan_tensor_parallel
from tailorfx.parallel.spec import ParallelSpec, describe_layout
from tailorfx.parallel.devices import DEVICE_CLASSES, DeviceClass
from tailorfx.parallel.steptime import StepTime, plan_step_time, predict_step_time
from tailorfx.parallel.world import WorldCandidate, plan_world, preference

__all__ = ["DEVICE_CLASSES", "DeviceClass", "ParallelPlan", "ParallelSpec", "RankMemory", "StageMemory", "StepTime",
           "WorldCandidate", "describe_layout", "parallelize", "plan_tensor_parallel", "plan_world",
           "plan_step_time", "predict_rank_memory", "predict_step_time", "preference"]
