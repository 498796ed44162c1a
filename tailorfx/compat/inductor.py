"""Inductor and AOTAutograd: the generated code, joint-graph passes, caches, tracing on fake tensors."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._guards import detect_fake_mode
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch._subclasses.fake_tensor import FakeTensor


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


@contextlib.contextmanager
def on_generated_code(fn) -> Iterator[None]:
    """Meanwhile each Inductor compile calls `fn(graph)` with its GraphLowering once the wrapper code is
    generated, before it is loaded, under the graph's handlers (GraphLowering's `save_output_code`
    hook, which torch's `run_and_get_code` patches too: one set before is still called; checked on
    torch 2.11 and 2.13). A compile an FX graph cache serves generates nothing: no call."""
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V
    before = GraphLowering.save_output_code

    def hook(code: str) -> None:
        if before is not None:
            before(code)
        if isinstance(V.graph, GraphLowering):   # a cache's load calls it too, outside any graph
            fn(V.graph)
    GraphLowering.save_output_code = hook
    try:
        yield
    finally:
        GraphLowering.save_output_code = before


def inductor_modules():
    """Inductor's IR and wrapper-codegen modules (their buffer layouts and wrapper line classes)."""
    from torch._inductor import ir
    from torch._inductor.codegen import wrapper
    return ir, wrapper


def generated_kernels(graph) -> list:
    """(bytes, origins) of each kernel Inductor generated for `graph` (a GraphLowering after codegen):
    the bytes its scheduler counts the kernel reading and writing (each buffer once, at most its
    size; what a fusion keeps in registers not at all), at the sizes' hints, and the fx nodes it
    runs, not those of an extern kernel (matmuls, attention, custom ops) or template, left out."""
    def origins(node) -> dict:
        return {o: None for n in node.get_nodes() if n.node is not None for o in n.node.get_origins()
                if isinstance(o, torch.fx.Node)}
    def runs(node) -> list:   # the fx nodes an extern kernel runs: its op's (its origins hold its inputs' too)
        op, first = getattr(node.node, "op_overload", None), getattr(node.node, "origin_node", None)
        found = [o for o in origins(node) if op is not None and o.target is op]
        return found or ([first] if first is not None else [o for o in origins(node) if not _pointwise(o)])
    nodes = [n for n in graph.scheduler.nodes if type(n).__name__ != "NopKernelSchedulerNode"]
    extern = {o for n in nodes if n.is_extern() or n.is_template() for o in runs(n)}
    # a kernel reading an extern op's outputs names that op among its origins too: it runs there
    return [(int(n.get_read_write_buffers_sizes()), [o for o in origins(n) if o not in extern])
            for n in nodes if not (n.is_extern() or n.is_template())]


def _pointwise(node) -> bool:
    return torch.Tag.pointwise in getattr(node.target, "tags", ())


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


def inductor_partitioner(after, version: str) -> contextlib.AbstractContextManager:
    """A config patch under which Inductor partitions its joint graph as it does by default
    (min-cut, for Inductor) and then calls `after(fw, bw, num_fwd_outputs)` on the two graphs
    before it compiles them; `after` is a module-level function (the patch is pickled into
    Inductor's cache key) and `version` keys the caches."""
    import torch._inductor.config as inductor_config
    return inductor_config.patch(custom_partitioner_fn=_Partition(after, version))


class _Partition(CustomPartitionerFn):
    """Inductor's default partition, then `after` on its forward and backward (inductor_partitioner)."""

    def __init__(self, after, version: str):
        self.after, self.version = after, version

    def __call__(self, gm, joint_inputs, **kw):
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kw)
        self.after(fw, bw, kw["num_fwd_outputs"])
        return fw, bw

    def uuid(self):
        return self.version


def extern_kernel_op(node):
    """The op an Inductor IR node runs as an extern fallback kernel (a custom op), else None."""
    return getattr(node, "op_overload", None)


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


def compile_caches_off() -> contextlib.AbstractContextManager:
    """AOTAutograd's and Inductor's FX graph caches left out of a compile, so it generates its code
    (a compile the caches serve generates none); the kernels' own caches still serve."""
    import torch._inductor.config as inductor_config
    stack = contextlib.ExitStack()
    stack.enter_context(autograd_cache_off())
    stack.enter_context(inductor_config.patch(fx_graph_cache=False))
    return stack


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
