"""Every private PyTorch API tailorfx touches, in one place, so a torch upgrade breaks here first."""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional

import torch
from torch._dynamo import maybe_mark_dynamic  # noqa: F401
from torch._dynamo.exc import FailOnRecompileLimitHit  # noqa: F401  (checked on torch 2.13)
from torch._functorch.aot_autograd import aot_module_simplified  # noqa: F401
from torch._functorch.aot_autograd import make_boxed_func  # noqa: F401
try:  # fx's codegen for the boxed calling convention (torch >= 2.6; what Inductor's wrapper does)
    from torch.fx.graph import _BoxedCodeGen
except ImportError:
    _BoxedCodeGen = None
try:  # torch >= 2.13: a guardless attribute that only carries dynamism across graph breaks
    from torch._functorch._aot_autograd.runtime_wrappers import (  # noqa: F401
        mark_dynamo_propagated_dynamic_indices)
except ImportError:  # torch 2.11: AOTAutograd's own output stamp, `_dynamo_weak_dynamic_indices`
    from torch._functorch._aot_autograd.runtime_wrappers import (  # noqa: F401
        maybe_mark_dynamic_helper as mark_dynamo_propagated_dynamic_indices)
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition  # noqa: F401
from torch._guards import detect_fake_mode  # noqa: F401
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (checked on torch 2.13)
from torch.utils._pytree import tree_leaves, tree_map  # noqa: F401  (checked on torch 2.13)


def args_clearing_func(g: "torch.fx.GraphModule"):
    """A boxed callable running `g` whose code empties its argument list once unpacked, so each
    input dies at its last use in the graph instead of when the call returns (AOTAutograd clears
    autograd's saved tensors before calling a backward: the list is then their last holder).
    Rewrites `g`'s code in place; make_boxed_func where fx lacks the boxed codegen."""
    if _BoxedCodeGen is None:
        return make_boxed_func(g.forward)
    g.graph.set_codegen(_BoxedCodeGen())
    g.recompile()
    forward = g.forward

    def run(args: list):
        return forward(args)
    run._boxed_call = True
    return run


# ---- operator overloads (checked on torch 2.13) --------------------------------------------------
def is_op_overload(t) -> bool:
    """An ATen/custom operator overload (torch.ops.ns.op.overload)."""
    return isinstance(t, torch._ops.OpOverload)


def op_short_name(t) -> Optional[str]:
    """'softmax' for torch.ops.aten._softmax.default or its packet (namespace and overload
    dropped); None for anything else."""
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name.split("::")[-1]
    return None


def op_is_mutable(t) -> bool:
    """The overload writes one of its inputs (its schema says so)."""
    return isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable


def op_returns_alias(t) -> bool:
    """An overload whose output shares an input's storage (a view or an in-place op)."""
    return isinstance(t, torch._ops.OpOverload) and any(r.alias_info is not None for r in t._schema.returns)


def tailorfx_op_name(t) -> Optional[str]:
    """'token_chunked' for torch.ops.tailorfx.token_chunked.default; None for other targets."""
    if isinstance(t, torch._ops.OpOverload) and t.namespace == "tailorfx":
        return t._opname
    return None


def op_qualified_name(t) -> Optional[str]:
    """'transformers::grouped_mm_fallback' for a custom op (packet or overload) in a graph; None
    for other targets."""
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return t._qualified_op_name
    return None


# ---- Dynamo (checked on torch 2.13) --------------------------------------------------------------
def dynamo_backend_failed() -> type:
    """The error Dynamo raises when a backend's compile fails (the backend's own error inside)."""
    return torch._dynamo.exc.BackendCompilerFailed


def dynamo_unsupported() -> tuple[type, ...]:
    """Errors of a model Dynamo cannot trace: the model then runs eagerly."""
    return torch._dynamo.exc.Unsupported, torch._dynamo.exc.TorchRuntimeError


def tensorified_float_names(placeholders) -> list[str]:
    """Names of the SymFloats behind graph inputs that Dynamo made of Python floats (a module's
    `rms_norm_eps`, a scale): a Python scalar passed as a 0-d float64 tensor (its GraphArg says so)
    whose `.item()` the graph calls. Dynamo does so when the same code object (transformers'
    shared forward wrappers) saw another value before, or under dynamic=True."""
    names = []
    for node in placeholders:
        arg = node.meta.get("grapharg")
        v = node.meta.get("example_value", node.meta.get("val"))
        memo = getattr(v, "item_memo", None) if isinstance(v, FakeTensor) else None
        if (arg is not None and arg.pass_arg_as_tensor and not arg.is_tensor and memo is not None
                and hasattr(memo.node._expr, "name")):
            names.append(memo.node._expr.name)
    return names


def _source_name(node) -> Optional[str]:
    """Where Dynamo read a graph input from (its source recorded on the placeholder), as
    Dynamo names it ("L['self']._modules['lm_head']._parameters['weight']"), or None."""
    source = getattr(node, "_dynamo_source", None)
    if source is None and node.meta.get("grapharg") is not None:
        source = node.meta["grapharg"].source
    if source is None:
        return None
    return source.name() if callable(source.name) else source.name


def is_size_input(node) -> bool:
    """A SymInt graph input that is a size or stride of another input (Dynamo passes those apart),
    not an int passed in the call."""
    name = _source_name(node) or ""
    return ".size()" in name or ".stride()" in name


def marked_dynamic(t) -> set:
    """The dims of a tensor marked dynamic with (maybe_)mark_dynamic."""
    return set(getattr(t, "_dynamo_weak_dynamic_indices", ())) | set(getattr(t, "_dynamo_dynamic_indices", ()))


def restart_tracing() -> None:
    """Make Dynamo trace the frame being compiled again (from a backend: the one restart Dynamo
    lets through its backend call), e.g. after marking one of its input tensors dynamic."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    raise TensorifyScalarRestartAnalysis


def is_model_state_input(node) -> bool:
    """A Dynamo graph input read off the model (a parameter, buffer or module attribute), not
    passed in the call: its source (recorded on the placeholder) goes through a module."""
    name = _source_name(node)
    if name is None:
        return False
    return "._modules[" in name or "._parameters[" in name or "._buffers[" in name or name.startswith("L['self']")


def restart_with_floats_specialized(names: list[str]) -> None:
    """Ask Dynamo to trace the frame again with these SymFloats as constants (guarded), as its own
    tensorify pass does when it cannot keep a float symbolic (checked on torch 2.11 and 2.13).
    Returns without asking when every name was asked for before (Dynamo kept them anyway: a
    second restart would trace the frame again for nothing)."""
    from torch._dynamo.symbolic_convert import TensorifyState
    new = [name for name in names if not TensorifyState.should_specialize(name)]
    if not new:
        return
    for name in new:
        TensorifyState.specialize(name)
    restart_tracing()


def specialize_symint(x) -> int:
    """A backed SymInt pinned to its traced value with a guard in Dynamo's ShapeEnv (as Inductor
    specializes a size): the compiled graph then serves that size only, and its sizes simplify."""
    from torch.fx.experimental.symbolic_shapes import guard_int
    return guard_int(x)


def specialize_equal(sizes: list) -> None:
    """Guard backed sizes with equal values equal (Dynamo's ShapeEnv then replaces one symbol by
    the other everywhere), as duck sizing does for dims of equal size."""
    from torch.fx.experimental.symbolic_shapes import guard_bool
    syms = [x for x in sizes if isinstance(x, torch.SymInt) and x.node.hint is not None]
    for a, b in zip(syms, syms[1:]):
        if a.node.hint == b.node.hint and a.node.expr != b.node.expr:
            guard_bool(a == b)


def compile_isolation() -> dict:
    """torch.compile keywords that keep one compiled module's recompiles apart from every other
    compile of the same code (torch 2.13's `isolate_recompiles`; nothing on torch 2.11)."""
    return {"isolate_recompiles": True} if _compile_isolates() else {}


@functools.lru_cache(maxsize=None)
def _compile_isolates() -> bool:
    import inspect
    return "isolate_recompiles" in inspect.signature(torch.compile).parameters


def compiled_no_frames(e: BaseException) -> bool:
    """Dynamo's error for a fullgraph=True call that ran without compiling or finding a frame (the
    default region runs a frame eagerly once a compile there hit its recompile limit)."""
    return "found no compiled frames" in str(e)


def fail_on_recompile_limit():
    """A context in which a frame past Dynamo's recompile limit raises FailOnRecompileLimitHit
    instead of running eagerly unseen (a recording capture then has no graph to return)."""
    return torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)


def compile_fx():
    """Inductor's whole-graph compiler (imported lazily: importing Inductor costs seconds)."""
    from torch._inductor.compile_fx import compile_fx as fx_compile
    return fx_compile


# FakeTensorMode logs a failed op with a traceback under this logger's name
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"


def compile_fx_inner():
    """Inductor's per-graph compiler (imported lazily: importing Inductor costs seconds)."""
    from torch._inductor.compile_fx import compile_fx_inner as inner
    return inner


def profiler_memory_events(prof) -> list[tuple[int, int]]:
    """(start_ns, nbytes) of every CPU allocator event a profiler saw; frees have negative nbytes."""
    events = prof.profiler.kineto_results.events()
    return sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")


def sym_expr(x):
    """The sympy expression behind an int or SymInt."""
    import sympy
    if isinstance(x, torch.SymInt):
        return x.node.expr
    return sympy.Integer(int(x))


def size_hint(x) -> int:
    """An int, or a SymInt's traced value, without adding a guard (int(symint) would specialize
    the shape to it)."""
    if isinstance(x, torch.SymInt):
        from torch.fx.experimental import symbolic_shapes
        # torch 2.11 has no optimization_hint; its size_hint reads the same backed hint
        hint = getattr(symbolic_shapes, "optimization_hint", None) or symbolic_shapes.size_hint
        return int(hint(x))
    return int(x)


def shape_guard_count(fake_mode) -> int:
    """How many shape guards the fake mode's ShapeEnv holds (0 without one)."""
    env = getattr(fake_mode, "shape_env", None)
    return len(env.guards) if env is not None else 0


def guards_hold(fake_mode, placeholders: list, args: list) -> bool:
    """Whether the ShapeEnv's guards hold for `args` bound to the symbolic `placeholders`
    (ShapeEnv.evaluate_guards_for_args, checked on torch 2.13)."""
    env = getattr(fake_mode, "shape_env", None)
    return env is None or bool(env.evaluate_guards_for_args(placeholders, args))


def shape_env_hints(fake_mode) -> dict:
    """Symbol -> the value it had when traced (the 'hint')."""
    env = getattr(fake_mode, "shape_env", None)
    if env is None:
        return {}
    vals = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val
    return dict(vals)


_AUTOGRAD_KEYS = (
    torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
    | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradOther)
    | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradNestedTensor)
)


@contextlib.contextmanager
def autograd_enabled() -> Iterator[None]:
    """Re-enable autograd inside a custom-op kernel (the dispatcher runs kernels below Autograd,
    so `torch.enable_grad()` alone records nothing); used to recompute a chunk in backward."""
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set() - _AUTOGRAD_KEYS
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


@contextlib.contextmanager
def capture_config() -> Iterator[None]:
    """Dynamo settings for every call of ours that can trace (checked on torch 2.11 and 2.13).

    Dynamo reads its config while it traces, so this wraps each such call, not the
    torch.compile(...) that made the wrapper; nothing stays changed after it.
    - transformers wraps every model's forward in the same decorators, so all models share one code
      object and its automatic-dynamic state: after a model with another `rms_norm_eps` Dynamo
      would turn the float into a tensor read with `.item()`. Floats stay constant
      (`specialize_float=True`, as in a process that compiled nothing before); sizes are pinned by
      the backend (rewrite.capture.pin_to_model).
    - Every optimize() is a new backend, and Dynamo caches them all on that shared code,
      compiling no more past recompile_limit (8) or accumulated_recompile_limit (256): raise both.
      Where torch counts each module's recompiles apart (compile_isolation()), 64 a module; where
      it cannot (torch 2.11), every optimize() of the process counts against one limit: 1024.
    - `transformers`' `logger.warning_once` (an lru_cache) breaks the graph, which splits GPT-2's
      LM head from its loss: trace through it as a no-op (the warning is not printed under compile).
    """
    import logging
    cfg = torch._dynamo.config
    ignored = set(cfg.ignore_logging_functions)
    if hasattr(logging.Logger, "warning_once"):
        ignored.add(logging.Logger.warning_once)
    with cfg.patch(recompile_limit=max(cfg.recompile_limit, 64 if compile_isolation() else 1024),
                   accumulated_recompile_limit=max(cfg.accumulated_recompile_limit, 4096),
                   ignore_logging_functions=ignored, specialize_float=True), \
            _quiet_metrics_logging(frozenset(id(f) for f in ignored)):
        yield


_METRICS_LOGGER = "torch._dynamo.metrics_context"


@functools.lru_cache(maxsize=None)
def _metrics_logging_fails(ignored_ids: frozenset) -> bool:
    """torch 2.11's compile-metrics record JSON-encodes Dynamo's config, ignore_logging_functions
    included (2.13 leaves it out): with warning_once in it, every compiled frame logs an ERROR
    and a traceback (torch catches the TypeError; nothing else changes). Cached per set of
    ignored functions (`ignored_ids`), which is what decides it."""
    try:
        torch._dynamo.utils._get_dynamo_config_for_logging()
    except TypeError:
        return True
    except Exception:   # noqa: BLE001  (a torch without this helper: nothing to silence)
        return False
    return False


class _DropMetricsFailure:
    """A logging filter dropping only torch's 'Unexpected exception logging compilation (or
    runtime) metrics'."""

    def filter(self, record) -> bool:
        return not str(record.msg).startswith("Unexpected exception logging")


@contextlib.contextmanager
def _quiet_metrics_logging(ignored_ids: frozenset) -> Iterator[None]:
    """Inside capture_config (its config patch active): silence torch 2.11's failed metrics record."""
    import logging
    if not _metrics_logging_fails(ignored_ids):
        yield
        return
    logger, drop = logging.getLogger(_METRICS_LOGGER), _DropMetricsFailure()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


@contextlib.contextmanager
def inductor_generated(g, example_inputs, is_backward: bool, is_inference: bool) -> Iterator:
    """What compile_fx_inner does to one AOTAutograd graph, up to its generated wrapper code, with
    nothing compiled (checked on torch 2.11 and 2.13): post-grad passes, lowering, scheduling and
    code generation. Yields the GraphLowering (`wrapper_code.lines`, `scheduler`) while Inductor's
    handlers for it are active. Lowering an RNG-state op runs it for its real CPU tensor, as a
    compile does, so the fake mode admits that one real tensor meanwhile."""
    from torch._inductor.compile_fx import (_recursive_post_grad_passes, _recursive_record_original_output_strides,
                                            fake_tensor_prop, view_to_reshape)
    from torch._inductor.debug import DebugContext
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V
    view_to_reshape(g)
    with torch.no_grad():
        mode = fake_tensor_prop(g, list(example_inputs))
    _recursive_record_original_output_strides(g)
    allowed = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True
    try:
        with V.set_fake_mode(mode), DebugContext():
            _recursive_post_grad_passes(g, is_inference=is_inference)
            graph = GraphLowering(g, example_inputs=list(example_inputs), shape_env=mode.shape_env,
                                  is_inference=is_inference, is_backward=is_backward)
            with V.set_graph_handler(graph), V.set_extern_kernel_nodes([]):
                graph.run(*example_inputs)
                graph.codegen()   # sources only: in-place reuse and CPU kernel groups are decided here
                yield graph
    finally:
        mode.allow_non_fake_inputs = allowed


def inductor_modules():
    """Inductor's IR and wrapper-codegen modules (their buffer layouts and wrapper line classes)."""
    from torch._inductor import ir
    from torch._inductor.codegen import wrapper
    return ir, wrapper


def inductor_joint_pass(fn, version: str):
    """A config patch giving Inductor `fn(graph)` as its joint-graph custom post pass (run on the
    joint forward+backward graph before it partitions); `version` keys Inductor's caches."""
    import torch._inductor.config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _Pass(CustomGraphPass):
        def __call__(self, graph):
            fn(graph)

        def uuid(self):
            return version
    return inductor_config.patch(joint_custom_post_pass=_Pass())


def backward_compiled_with_forward():
    """AOTAutograd compiles the backward when it compiles the forward, not at the first backward."""
    import torch._functorch.config as functorch_config
    return functorch_config.patch(force_non_lazy_backward_lowering=True)


def autograd_cache_off():
    """AOTAutograd's cache left out of a compile: its key is the graph's code, which does not show
    the recompute tags the partitioner follows (measured: a tagged graph loaded the untagged one's
    artifact, saving everything). Inductor's FX graph cache still serves the partitioned graphs."""
    import torch._functorch.config as functorch_config
    return functorch_config.patch(enable_autograd_cache=False)


@contextlib.contextmanager
def isolated_tracing(example_inputs) -> Iterator[None]:
    """A TracingContext of our own for AOTAutograd traces made only to predict memory, so they
    cannot leave state (parameters, forward metadata) in the one Dynamo is compiling with."""
    from torch._guards import TracingContext, tracing
    # the inputs' own fake mode: detect_fake_mode prefers the active TracingContext's (Dynamo's, while it
    # compiles), whose ShapeEnv would take the trace's guards and make a static trace's ints symbols
    with tracing(TracingContext(own_fake_mode(example_inputs))):
        yield


def own_fake_mode(values):
    """The fake mode the values' fake tensors belong to, not the active one (detect_fake_mode
    asserts they are the same; a graph Dynamo reused carries the mode it was traced in); None
    for real tensors and no active mode."""
    values = list(values)
    return next((t.fake_mode for t in values if isinstance(t, FakeTensor)), None) or detect_fake_mode(values)


def real_tensors():
    """A context in which new tensors are real even under an active FakeTensorMode (a pass that
    proves a region on small random inputs while a model built on fake tensors is captured)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    return unset_fake_temporarily()


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
