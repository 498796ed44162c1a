"""Dynamo, its fake tensors and symbolic shapes: capture, specialization, guards, isolation."""
from __future__ import annotations

import contextlib
import functools
import itertools
import re
import types
from typing import Iterator, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor


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


def guards_suppressed(fake_mode) -> contextlib.AbstractContextManager:
    """Fake ops run without adding guards to `fake_mode`'s shapes (a value recomputed for its dtype:
    torch 2.11's CPU linear on 16-bit inputs reads its sizes as ints, which would pin a symbol)."""
    env = getattr(fake_mode, "shape_env", None)
    return env.suppress_guards() if env is not None else contextlib.nullcontext()


def compile_isolation() -> dict:
    """torch.compile keywords that keep one compiled module's recompiles apart from every other
    compile of the same code (torch 2.13's `isolate_recompiles`; nothing on torch 2.11)."""
    return {"isolate_recompiles": True} if _compile_isolates() else {}


def compile_apart(model, **kwargs):
    """torch.compile(model, **kwargs) in a compile region of its own, so that its frames never count
    against the recompile limit a user's own compile of the same model class meets: torch 2.13's
    `isolate_recompiles`; on torch 2.11 each call goes through a code object made for this compile
    (Dynamo keeps its caches and that limit per code object, and every model's call shares one of
    torch's or transformers')."""
    if _compile_isolates():
        return torch.compile(model, isolate_recompiles=True, **kwargs)
    compiled: dict = {}

    def call(*args, **kw):
        frame, args, kw = _as_forward_frame(model, args, kw)
        if frame not in compiled:
            template = _calling(*frame)
            own = types.FunctionType(template.__code__.replace(co_name=f"{template.__name__}_{next(_APART)}"),
                                     template.__globals__)
            compiled[frame] = torch.compile(own, **kwargs)
        return compiled[frame](model, *args, **kw)
    return call


_APART = itertools.count(1)   # names each compile's code object: _CALL_<n>
_CALL = "tailorfx_call"
_APART_NAME = re.compile(rf"\b{_CALL}_\d+\b")


def without_apart_numbers(stack_trace: str) -> str:
    """A graph node's stack trace with compile_apart's frame named alike for every compile
    (`tailorfx_call_<n>`: the number tells compiles apart, not what the graph computes)."""
    return _APART_NAME.sub(_CALL, stack_trace)


def _as_forward_frame(model, args: tuple, kw: dict) -> tuple[tuple, tuple, dict]:
    """The parameters of the frame Dynamo traces first when it compiles the module (its `forward`,
    or the decorator around it), and the call's arguments bound to them: a graph's inputs are named
    by the parameter they came through (`l_input_ids_`, `l_kwargs_position_ids_`), so the frame made
    for compile_apart takes each as that frame does. Returns ((self, named, varargs, varkw), args, kw)."""
    forward = getattr(model, "forward", None)
    func = getattr(forward, "__func__", None)
    me, positional, names, varargs, varkw = _frame_of(func) if func is not None else _GENERIC
    if len(args) > len(positional) or set(positional[:len(args)]) & set(kw) or me in kw:
        me, positional, names, varargs, varkw = _GENERIC    # named as a frame (self, *args, **kwargs) names them
    else:
        kw, args = {**dict(zip(positional, args)), **kw}, ()
    return (me, tuple(k for k in kw if k in names), varargs, varkw), args, kw


_GENERIC = ("self", (), frozenset(), "args", "kwargs")


@functools.lru_cache(maxsize=None)
def _frame_of(func) -> tuple[str, tuple, frozenset, str, str]:
    """(self, positional-or-keyword names, named parameters, *varargs, **varkw) of a method."""
    import inspect
    try:
        params = list(inspect.signature(func, follow_wrapped=False).parameters.values())
    except (TypeError, ValueError):
        return _GENERIC
    kinds = inspect.Parameter
    if not params or params[0].kind is not kinds.POSITIONAL_OR_KEYWORD \
            or any(p.kind is kinds.POSITIONAL_ONLY for p in params):
        return _GENERIC
    var = {p.kind: p.name for p in params if p.kind in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)}
    return (params[0].name, tuple(p.name for p in params[1:] if p.kind is kinds.POSITIONAL_OR_KEYWORD),
            frozenset(p.name for p in params[1:] if p.kind not in var),
            var.get(kinds.VAR_POSITIONAL, "args"), var.get(kinds.VAR_KEYWORD, "kwargs"))


@functools.lru_cache(maxsize=None)
def _calling(me: str, named: tuple, varargs: str, varkw: str) -> types.FunctionType:
    """A function `(me, *varargs, <named>, **varkw)` that calls `me` with what it was given."""
    params = "".join(f", {n}" for n in named)
    passed = "".join(f", {n}={n}" for n in named)
    scope: dict = {}
    source = (f"def {_CALL}({me}, *{varargs}{params}, **{varkw}):\n"
              f"    return {me}(*{varargs}{passed}, **{varkw})\n")
    # named after this file: a function with no source file Dynamo wraps in a frame of its own (`args_0`)
    exec(compile(source, __file__, "exec"), scope)
    return scope[_CALL]


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


def sym_equal(a, b) -> bool:
    """Whether two sizes are equal wherever the graph is valid: the same expression, or equal
    under the ShapeEnv's guards (a table of a fixed length M sliced from Max(0, M - s) is s long
    once the graph guards s <= M). ShapeEnv._maybe_evaluate_static, checked on torch 2.11-2.13;
    it adds no guard."""
    ea, eb = sym_expr(a), sym_expr(b)
    if ea == eb:
        return True
    sym = next((x for x in (a, b) if isinstance(x, torch.SymInt)), None)
    if sym is None:
        return False
    import sympy
    env = sym.node.shape_env
    try:
        return env._maybe_evaluate_static(sympy.Eq(ea, eb)) is sympy.true
    except Exception:   # an expression the ShapeEnv cannot decide: not proved equal
        return False


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
def aot_without_cse() -> Iterator[None]:
    """AOTAutograd tracing without its common-subexpression elimination (functorch's `cse`)."""
    import torch._functorch.config as functorch_config
    with functorch_config.patch(cse=False):
        yield


@contextlib.contextmanager
def untraced_real_tensors() -> Iterator[None]:
    """Real tensors, neither faked nor recorded, while a trace is active (host-side tables a
    triton_op builds from ints while Dynamo or Inductor runs it on fake tensors)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        yield


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
    - Inside DistributedDataParallel (Trainer or accelerate on several processes) Dynamo's
      DDPOptimizer splits the graph at DDP's gradient buckets, which cut MLPs and the causal mask
      apart from what reads them: no split (`optimize_ddp=False`); DDP's reducer then all-reduces
      the gradients as the backward hands them over (docs/usage.md).
    """
    import logging
    cfg = torch._dynamo.config
    ignored = set(cfg.ignore_logging_functions)
    if hasattr(logging.Logger, "warning_once"):
        ignored.add(logging.Logger.warning_once)
    with cfg.patch(recompile_limit=max(cfg.recompile_limit, 64 if compile_isolation() else 1024),
                   accumulated_recompile_limit=max(cfg.accumulated_recompile_limit, 4096),
                   ignore_logging_functions=ignored, specialize_float=True, optimize_ddp=False), \
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


def compiled_original(module: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The module torch.compile wrapped (Dynamo's wrapper's `_orig_mod`); None for any other module."""
    return module._orig_mod if isinstance(module, torch._dynamo.eval_frame.OptimizedModule) else None


def active_ddp() -> Optional[torch.nn.Module]:
    """The DistributedDataParallel module whose forward is running, if any (DDP sets it for
    Dynamo, which compiles a model under it in pieces cut at DDP's gradient buckets)."""
    return torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()


def ddp_splits_graphs() -> bool:
    """Whether Dynamo, compiling now, hands the backend a DDP module's graph in pieces cut at its
    gradient buckets (DDPOptimizer: `torch._dynamo.config.optimize_ddp` True or "ddp_optimizer")."""
    mode = torch._dynamo.config.optimize_ddp
    return active_ddp() is not None and (mode is True or mode == "ddp_optimizer")
