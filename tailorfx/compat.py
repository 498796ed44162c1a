"""Every private PyTorch API tailorfx touches, in one place, so a torch upgrade breaks here first."""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch._dynamo import maybe_mark_dynamic  # noqa: F401
from torch._functorch.aot_autograd import aot_module_simplified  # noqa: F401
from torch._functorch.aot_autograd import make_boxed_func  # noqa: F401
from torch._functorch._aot_autograd.runtime_wrappers import (  # noqa: F401  (checked on torch 2.13)
    mark_dynamo_propagated_dynamic_indices)
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition  # noqa: F401
from torch._guards import detect_fake_mode  # noqa: F401
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (checked on torch 2.13)
from torch.utils._pytree import tree_leaves  # noqa: F401  (checked on torch 2.13)


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


# ---- Dynamo (checked on torch 2.13) --------------------------------------------------------------
def dynamo_backend_failed() -> type:
    """The error Dynamo raises when a backend's compile fails (the backend's own error inside)."""
    return torch._dynamo.exc.BackendCompilerFailed


def dynamo_unsupported() -> tuple[type, ...]:
    """Errors of a model Dynamo cannot trace: the model then runs eagerly."""
    return torch._dynamo.exc.Unsupported, torch._dynamo.exc.TorchRuntimeError


def reset_dynamo() -> None:
    """Forget every compiled frame (a capture of our own that must not reuse another's)."""
    torch._dynamo.reset()


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
    """Dynamo settings for one optimize()d call (checked on torch 2.13).

    Every optimize() is a new backend, and Dynamo caches them all on the model class's forward,
    compiling no more past recompile_limit (8): raise it. `transformers`' `logger.warning_once`
    (an lru_cache) breaks the graph, which splits GPT-2's LM head from its loss: trace through it
    as a no-op (the warning is not printed under compile).
    """
    import logging
    ignored = set(torch._dynamo.config.ignore_logging_functions)
    if hasattr(logging.Logger, "warning_once"):
        ignored.add(logging.Logger.warning_once)
    limit = max(torch._dynamo.config.recompile_limit, 64)
    with torch._dynamo.config.patch(recompile_limit=limit, ignore_logging_functions=ignored):
        yield


@contextlib.contextmanager
def isolated_tracing(example_inputs) -> Iterator[None]:
    """A TracingContext of our own for AOTAutograd traces made only to predict memory, so they
    cannot leave state (parameters, forward metadata) in the one Dynamo is compiling with."""
    from torch._guards import TracingContext, tracing
    with tracing(TracingContext(detect_fake_mode(list(example_inputs)))):
        yield
