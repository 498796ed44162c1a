"""What runs a step: the CUDA allocator's history, torch.distributed.pipelining's schedule IR, the fake process group."""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
import torch.distributed as dist


# ---- the CUDA caching allocator's history (checked on torch 2.11 and 2.13) -----------------------
@contextlib.contextmanager
def cuda_memory_history(max_entries: int = 200_000) -> Iterator[dict]:
    """Record the CUDA allocator's alloc/free events, each with its Python stack, inside the block;
    the dict it yields then holds torch's snapshot under "snapshot" ("segments", "device_traces")."""
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=max_entries)
    out: dict = {}
    try:
        yield out
        torch.cuda.synchronize()
        out["snapshot"] = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


# ---- torch.distributed.pipelining schedule IR (checked on torch 2.13) ----------------------------
# A pipeline schedule's `pipeline_order` maps rank -> [_Action | None]; _Action, _ComputationType
# and the runtime's validation/lowering passes are private, so codegen/schedule.py and its tests
# reach them only through these functions. Torch's schedule classes take stage objects but, until
# step(), read only the fields the stand-ins below carry, so no process group is needed.
def pipelining_action(kind: str, stage: int, microbatch: int):
    """torch's schedule-IR entry `_Action(stage, _ComputationType(kind), microbatch)` for kind
    'F', 'B', 'I' or 'W' (checked on torch 2.13)."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType
    return _Action(stage, _ComputationType(kind), microbatch)


def _pipelining_stand_in_stages(num_ranks: int, num_virtual: int, rank: int = 0) -> list:
    """The fields of rank `rank`'s looped stages (s % num_ranks == rank) that torch's schedule
    constructors read before step() (checked on torch 2.13)."""
    from types import SimpleNamespace
    n = num_ranks * num_virtual
    return [SimpleNamespace(num_stages=n, group_size=num_ranks, group_rank=rank, stage_index=s, submod=None,
                            is_first=s == 0, is_last=s == n - 1) for s in range(rank, n, num_ranks)]


def pipelining_reference_order(schedule_class: type, *, num_ranks: int, num_virtual: int,
                               num_microbatches: int) -> dict[int, list]:
    """`pipeline_order` of one of torch's own schedule classes (ScheduleGPipe, Schedule1F1B take one
    stage, the multi-stage ones a list), to compare ours against (checked on torch 2.13)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle
    stages = _pipelining_stand_in_stages(num_ranks, num_virtual)
    if issubclass(schedule_class, PipelineScheduleSingle):
        return schedule_class(stages[0], num_microbatches).pipeline_order
    return schedule_class(stages, num_microbatches).pipeline_order


def pipelining_load(order: dict, *, num_ranks: int, num_virtual: int, num_microbatches: int) -> dict[int, list]:
    """Load a compute-only `order` into torch's `_PipelineScheduleRuntime` as its `_load_csv` does:
    `_validate_schedule` (counts, F before I/B before W, one rank per stage), then lowering with
    UNSHARD/RESHARD, REDUCE_GRAD and SEND/RECV; returns `pipeline_order_with_comms` (checked on
    torch 2.13)."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    runtime = _PipelineScheduleRuntime(_pipelining_stand_in_stages(num_ranks, num_virtual), num_microbatches)
    runtime._prepare_schedule_with_comms({r: list(actions) for r, actions in order.items()})
    return runtime.pipeline_order_with_comms


def pipelining_simulate(order: dict, *, num_ranks: int, num_stages: int) -> dict[int, list]:
    """torch's dry run of a compute-only `order` under looped placement: `_add_send_recv` (which
    raises AssertionError "can't schedule sends/recvs" on a deadlock) then `_simulate_comms_compute`
    (ValueError "Schedule is not progressing"); returns the per-rank steps, idle ones None (checked
    on torch 2.13)."""
    from torch.distributed.pipelining.schedules import _add_send_recv, _simulate_comms_compute

    def stage_to_rank(stage: int) -> int:
        return stage % num_ranks
    with_comms = _add_send_recv({r: list(actions) for r, actions in order.items()}, stage_to_rank, num_stages)
    return _simulate_comms_compute(with_comms, stage_to_rank, num_stages)


def pipelining_format(order: dict) -> str:
    """torch's step x rank table of a `pipeline_order`, for failure messages (checked on torch 2.13)."""
    from torch.distributed.pipelining.schedules import _format_pipeline_order
    return _format_pipeline_order({r: list(actions) for r, actions in order.items()})


def pipelining_runtime(stages: list, num_microbatches: int, loss_fn, order: dict):
    """torch's `_PipelineScheduleRuntime` over this rank's PipelineStages, loaded with a
    compute-only `order` (rank -> actions; comms added by torch's lowering); `step()` runs it
    (checked on torch 2.13)."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    runtime = _PipelineScheduleRuntime(stages, num_microbatches, loss_fn=loss_fn)
    runtime._prepare_schedule_with_comms({r: list(actions) for r, actions in order.items()})
    return runtime


@functools.lru_cache(maxsize=None)
def pipelining_splits_custom_op_backward() -> bool:
    """Whether torch's zero-bubble split (`stage_backward_input`, then `stage_backward_weight`)
    reaches the weights through a Python autograd node (a custom op's backward) once the stage's
    outputs are gone: torch 2.11 loses the node between the two ("'_input_metadata' is invalid
    for this instance of _C._FunctionBase"), 2.13 keeps it. Tried on two-element tensors."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    x, w = torch.ones(2, requires_grad=True), torch.nn.Parameter(torch.ones(2))
    out = _Scale.apply(x, w).sum()
    _, groups = stage_backward_input([out], None, [x], iter([w]))
    del out
    try:
        stage_backward_weight(iter([w]), groups)
    except RuntimeError:
        return False
    return bool(torch.equal(w.grad, x.detach()))


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, g * x


# ---- torch.distributed's in-process fake backend (checked on torch 2.13) -------------------------
def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """Initialise the default process group on torch's fake backend: `world_size` ranks in this
    one process, every collective a no-op. With a FakeTensorMode it lets DTensor shard a model
    and Dynamo trace its collectives without devices, peers or memory (torchtitan's memory
    estimation does the same). The fake backend lives in torch's testing package, which
    registers it on import."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def all_gather_single(output, input_) -> None:
    """dist.all_gather_single (torch 2.13; all_gather_into_tensor, deprecated there, before)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input_)


def reduce_scatter_single(output, input_) -> None:
    """dist.reduce_scatter_single (torch 2.13; reduce_scatter_tensor, deprecated there, before)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input_)


def collective_waited(t):
    """`t` with an in-flight functional collective's result waited for (the AsyncCollectiveTensor
    DTensor's redistribute returns), differentiably: a copy, as any op but a view makes (its
    `wait()` would leave autograd's graph). Any other tensor as it is."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    return t.clone() if isinstance(t, AsyncCollectiveTensor) else t


def backward_pass_id() -> int:
    """An id of the autograd backward running now (-1 outside one): which gradients one
    `backward()` accumulates (torch.utils.checkpoint reads the same)."""
    return torch._C._current_graph_task_id()


# ---- FlexAttention's operator (checked on torch 2.11 and 2.13) ------------------------------------
def flex_attention_op(q, k, v, score_mod, block_mask, scale: float, score_buffers: tuple = (),
                      mask_buffers: tuple = ()):
    """FlexAttention's attention output, calling its higher-order op as torch.compile's trace of
    `flex_attention` does, with the tensors the mods read passed explicitly (`score_mod(s, b, h, q,
    kv, *score_buffers)`, the block mask's `mask_mod(b, h, q, kv, *mask_buffers)`). Called inside a
    graph that AOTAutograd traces, it becomes the forward and backward ops Inductor fuses; the public
    function would instead compile itself there, and refuses CPU tensors that need a gradient."""
    from torch._higher_order_ops.flex_attention import flex_attention as hop
    from torch.nn.attention.flex_attention import _apply_kernel_options
    options = _apply_kernel_options(q, k, v, False, None)
    if torch.compiler.is_dynamo_compiling():   # Dynamo lifts the tensors the mods close over itself
        mask_mod = block_mask.as_tuple()[-1]

        def scores(s, b, h, i, j):
            return score_mod(s, b, h, i, j, *score_buffers)

        def keep(b, h, i, j):
            return mask_mod(b, h, i, j, *mask_buffers)
        return hop(q, k, v, scores, (*block_mask.as_tuple()[:-1], keep), scale, options)[0]
    return hop(q, k, v, score_mod, block_mask.as_tuple(), scale, options, tuple(score_buffers),
               tuple(mask_buffers))[0]


def cpu_packs_16bit_matmuls(dtype: torch.dtype) -> bool:
    """Whether ATen's CPU kernels pack `dtype` matmul operands for oneDNN's brgemm (its
    cpublas::need_pack): bf16 on a CPU with AMX, fp16 on one with AMX-FP16 (checked on torch 2.13)."""
    if dtype == torch.bfloat16:
        return bool(torch.cpu._is_amx_tile_supported())
    return dtype == torch.float16 and bool(torch.cpu._is_amx_fp16_supported())


def profiler_running() -> bool:
    """Whether a torch.profiler (autograd profiler or Kineto) session is recording in this process."""
    return bool(torch._C._autograd._profiler_enabled())
