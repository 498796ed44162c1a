"""Every private PyTorch API tailorfx touches, in one package, so a torch upgrade breaks here first:
graph.py (operator overloads, fx codegen), dynamo.py (capture, fake tensors, symbolic shapes),
inductor.py (generated code, joint passes, caches), runtime.py (CUDA allocator history, pipelining
schedule IR, fake process group). The rest of tailorfx imports `tailorfx.compat` only."""
from __future__ import annotations

from torch._dynamo import maybe_mark_dynamic  # noqa: F401
from torch._dynamo.exc import FailOnRecompileLimitHit  # noqa: F401
from torch._functorch.aot_autograd import aot_module_simplified  # noqa: F401
from torch._functorch.aot_autograd import make_boxed_func  # noqa: F401
from torch._functorch.partitioners import default_partition  # noqa: F401
from torch._functorch.partitioners import min_cut_rematerialization_partition  # noqa: F401
from torch._guards import detect_fake_mode  # noqa: F401
from torch._subclasses.fake_tensor import FakeTensor  # noqa: F401
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401
from torch.utils._pytree import tree_leaves  # noqa: F401
from torch.utils._pytree import tree_map  # noqa: F401
try:  # torch >= 2.13: a guardless attribute that only carries dynamism across graph breaks
    from torch._functorch._aot_autograd.runtime_wrappers import (  # noqa: F401
        mark_dynamo_propagated_dynamic_indices)
except ImportError:  # torch 2.11: AOTAutograd's own output stamp, `_dynamo_weak_dynamic_indices`
    from torch._functorch._aot_autograd.runtime_wrappers import (  # noqa: F401
        maybe_mark_dynamic_helper as mark_dynamo_propagated_dynamic_indices)

from tailorfx.compat.graph import (  # noqa: F401
    args_clearing_func, autocast_context_role, flex_attention_role, is_autocast_context, is_op_overload,
    op_argument, op_is_mutable, op_qualified_name, op_returns_alias, op_short_name, tailorfx_op_name)
from tailorfx.compat.dynamo import (  # noqa: F401
    FAKE_TENSOR_LOGGER, active_ddp, aot_without_cse, autograd_enabled, capture_config, compile_fx, compile_fx_inner,
    compiled_original, compile_apart, compile_isolation, compiled_no_frames, ddp_splits_graphs, dynamo_backend_failed,
    dynamo_unsupported, fail_on_recompile_limit, guards_hold, is_model_state_input, is_size_input, marked_dynamic,
    guards_suppressed, profiler_memory_events,
    restart_tracing, restart_with_floats_specialized, shape_env_hints, shape_guard_count, size_hint, specialize_equal,
    specialize_symint, sym_equal, sym_expr, tensorified_float_names, untraced_real_tensors, without_apart_numbers)
from tailorfx.compat.inductor import (  # noqa: F401
    autograd_cache_off, backward_compiled_with_forward, compile_caches_off, extern_kernel_op, generated_kernels,
    inductor_generated, inductor_joint_pass, inductor_modules, inductor_partitioner, isolated_tracing,
    on_generated_code, own_fake_mode, real_tensors)
from tailorfx.compat.runtime import (  # noqa: F401
    all_gather_single, backward_pass_id, collective_waited, cpu_packs_16bit_matmuls, cuda_memory_history, init_fake_process_group, profiler_running, reduce_scatter_single, pipelining_action, pipelining_format, pipelining_load,
    pipelining_reference_order, pipelining_runtime, pipelining_simulate, pipelining_splits_custom_op_backward)
