"""The memory model under lowering="inductor": the forward and backward graphs Inductor compiles and
the memory events of the code it generates for them, on fake tensors, with nothing compiled.

A Dynamo graph goes through Inductor's own `compile_fx` (its decompositions, joint-graph passes and
min-cut partition) with an inner compiler that stops once the wrapper code is generated: post-grad
passes, lowering, the Scheduler (fusion, `reorder_for_peak_memory`'s order) and code generation,
which decides in-place reuse and, on CPU, which scheduler nodes share one C++ kernel. The
wrapper's lines are then read in order as allocations, reuses and frees between kernel calls,
with sizes kept as expressions in the sequence length, so one schedule serves every length. The
tensors a graph receives (weights, saved activations, tangents) and returns (saved tensors,
gradients) stay the memory model's to hold (rewrite/memory.py), told when the code drops each.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import sympy
import torch
import torch.fx as fx

from tailorfx import compat
from tailorfx.rewrite import offload, saved_dtype
from tailorfx.rewrite.optimizer_step import STEPS_NOT_FUSED, fuse_into_backward


@dataclass
class Schedule:
    """One graph as Inductor's generated code runs it: per kernel call, the bytes allocated before
    it and freed after it (sympy, in the graph's size symbols), and what each output is."""
    gm: Optional[fx.GraphModule]                         # the post-grad graph Inductor lowered
    names: list[str] = field(default_factory=list)       # per step: the kernel's name
    allocs: list[sympy.Expr] = field(default_factory=list)
    frees: list[sympy.Expr] = field(default_factory=list)
    origins: list[list[fx.Node]] = field(default_factory=list)   # per step: the fx nodes it runs
    # per output: ("input", placeholder index), ("buffer", bytes), ("host", bytes): a buffer in host
    # memory (an offloaded activation, not in allocs), or None (not a tensor)
    outputs: list[Optional[tuple[str, object]]] = field(default_factory=list)
    output_keys: list[Optional[str]] = field(default_factory=list)   # the buffer behind each output
    output_steps: list[Optional[int]] = field(default_factory=list)  # the step allocating each output's buffer
    # per step: the inputs (placeholder indices) the generated code drops after it (it clears its
    # boxed argument list; a saved activation then lives only as long as the backward needs it)
    inputs_done: list[list[int]] = field(default_factory=list)
    inputs_reused: list[list[int]] = field(default_factory=list)   # per step: inputs a kernel overwrites in place
    # per kernel Inductor generated (not extern): the bytes its scheduler counts it moving, and the fx nodes it
    # runs (a fusion's pointwise ops read and write memory once: parallel/steptime.py prices them so)
    generated: list[tuple[int, list[fx.Node]]] = field(default_factory=list)


def _schedule(g: fx.GraphModule, example_inputs: Sequence, is_backward: bool, is_inference: bool) -> Schedule:
    """Generate `g`'s code as compile_fx_inner would (an AOTAutograd forward or backward graph,
    given to Inductor's inner compiler) and read its memory events."""
    placeholders = _placeholders(g)
    with compat.inductor_generated(g, example_inputs, is_backward, is_inference) as graph:
        return _read(graph, placeholders, g)


def _placeholders(g: fx.GraphModule) -> dict[str, int]:
    return {n.target: i for i, n in enumerate(n for n in g.graph.nodes if n.op == "placeholder")}


def _read(graph, placeholders: dict[str, int], g: fx.GraphModule) -> Schedule:
    """The Schedule of `g` from the GraphLowering Inductor generated its code with."""
    out = _walk(graph, placeholders)
    out.generated = compat.generated_kernels(graph)
    out.gm = g
    return out


class _Walk:
    """The generated wrapper's lines, read as memory events (see _walk)."""

    def __init__(self, placeholders: dict[str, int]):
        self.placeholders = placeholders
        self.out = Schedule(gm=None)
        self.live: dict[str, sympy.Expr] = {}     # the graph's own storages, by the name holding each
        self.host: dict[str, sympy.Expr] = {}     # its storages in host memory (offloaded activations)
        self.step: dict[str, int] = {}             # the step before whose kernel each storage was allocated
        self.pending = sympy.Integer(0)            # allocated since the last kernel
        self.reused: list[int] = []                # inputs a kernel will overwrite in place

    def kernel(self, name: str, origins: list) -> None:
        o = self.out
        o.names.append(name)
        o.allocs.append(self.pending)
        o.frees.append(sympy.Integer(0))
        o.origins.append(origins)
        o.inputs_done.append([])
        o.inputs_reused.append(self.reused)
        self.pending, self.reused = sympy.Integer(0), []

    def alloc(self, name: str, nbytes) -> None:
        self.live[name] = self.live.get(name, sympy.Integer(0)) + nbytes
        self.step.setdefault(name, len(self.out.names))
        self.pending += nbytes

    def free(self, name: str) -> None:
        if self.host.pop(name, None) is not None:
            return
        if name in self.live:
            if not self.out.names:
                self.kernel("start", [])
            self.out.frees[-1] += self.live.pop(name)
        elif name in self.placeholders:
            if not self.out.names:
                self.kernel("start", [])
            self.out.inputs_done[-1].append(self.placeholders[name])


def _storage_bytes(node) -> sympy.Expr:
    """Bytes an allocation of this IR buffer takes (0 for a view into another's storage)."""
    ir, _ = compat.inductor_modules()
    layout = node.get_output_spec() if hasattr(node, "get_output_spec") else node.get_layout()
    if isinstance(layout, (ir.NoneLayout, ir.NonOwningLayout, ir.MultiOutputLayout)):
        return sympy.Integer(0)
    if getattr(node, "get_inputs_that_alias_output", None) and node.get_inputs_that_alias_output():
        return sympy.Integer(0)
    return sympy.sympify(layout.storage_size()) * layout.dtype.itemsize


def _walk(graph, placeholders: dict[str, int]) -> Schedule:
    """The memory events of the code Inductor generated for `graph`, in its order: each buffer's
    allocation, reuse (a freed buffer or an input taken over in place) and free, and when the
    code drops each input, between its kernel calls (on CPU several scheduler nodes run in one
    C++ kernel, their buffers allocated before it and freed after)."""
    ir, w = compat.inductor_modules()
    walk = _Walk(placeholders)
    kernels = tuple(getattr(w, c) for c in ("KernelCallLine", "ExternKernelOutLine", "ExternKernelAllocLine",
                                             "ExternKernelMultiOutLine", "IndexPutFallbackLine", "ScatterFallbackLine")
                    if hasattr(w, c))
    for line in graph.wrapper_code.lines:
        if isinstance(line, w.AllocateLine):
            if line.node.get_name() not in graph.removed_buffers:
                walk.alloc(line.node.get_name(), _storage_bytes(line.node))
        elif isinstance(line, w.ReuseLine):
            old, new = line.node.get_name(), line.reused_as.get_name()
            if old in walk.live:
                walk.live[new] = walk.live.pop(old)
                walk.step[new] = walk.step.get(old, len(walk.out.names))
            elif old in placeholders:       # an input overwritten in place: its storage is now the output's
                walk.reused.append(placeholders[old])
                walk.alloc(new, _storage_bytes(line.reused_as))
        elif isinstance(line, w.FreeIfNotReusedLine):
            if not line.is_reused:
                walk.free(line.node.get_name())
        elif isinstance(line, w.FreeLine):
            walk.free(line.node.get_name())
        elif isinstance(line, w.MultiOutputLine):
            if line.arg_name in walk.host:
                walk.host[line.result_name] = walk.host.pop(line.arg_name)
            elif line.arg_name in walk.live:
                part = _storage_bytes(graph.get_buffer(line.result_name))
                walk.live[line.arg_name] -= part
                walk.live[line.result_name] = part
                walk.step[line.result_name] = walk.step.get(line.arg_name, len(walk.out.names))
        elif isinstance(line, kernels):
            node = getattr(line, "node", None)
            if isinstance(line, w.ExternKernelAllocLine) or type(line).__name__ == "ExternKernelMultiOutLine":
                name = node.get_name()
                if isinstance(node.get_output_spec(), ir.MultiOutputLayout):
                    total = sum((_storage_bytes(o) for o in getattr(node, "outputs", ()) or ()
                                 if isinstance(o, ir.IRNode)), sympy.Integer(0))
                else:
                    total = _storage_bytes(node)
                if compat.extern_kernel_op(node) in offload.HOST_OPS:
                    walk.host[name] = total
                else:
                    walk.alloc(name, total)
            origins = [o for o in getattr(node, "origins", ()) if isinstance(o, fx.Node)] if node is not None else []
            walk.kernel(getattr(line, "kernel_name", None) or (node.get_name() if node is not None else "kernel"), origins)
    if walk.pending != 0 or walk.reused:
        walk.kernel("end", [])
    out = walk.out
    real = graph.scheduler.mutation_real_name
    for name in graph.get_output_names():
        name = _real(name, real)
        out.output_steps.append(walk.step.get(name))
        if name in placeholders:
            out.outputs.append(("input", placeholders[name]))
            out.output_keys.append(name)
        elif name in walk.live:
            out.outputs.append(("buffer", walk.live[name]))
            out.output_keys.append(name)
        elif name in walk.host:
            out.outputs.append(("host", walk.host[name]))
            out.output_keys.append(name)
        else:
            out.outputs.append(None)
            out.output_keys.append(None)
    # an output's bytes leave the graph's own count when the caller takes it (memory.py)
    return out


def _real(name: str, real: dict) -> str:
    """The buffer an in-place mutation's new name stands for."""
    while name in real:
        name = real[name]
    return name


def compile_context(gm: fx.GraphModule, steps: Optional[tuple] = None) -> contextlib.AbstractContextManager:
    """What compiling `gm` with Inductor needs of tailorfx's decisions that the graph's code does
    not show: values tagged to be saved in bf16 cross to the backward in bf16 (a joint-graph pass,
    rewrite/saved_dtype.py), and a graph with recompute or save tags compiles with AOTAutograd's
    cache off (its key is the code, blind to the tags: a tagged graph compiled after the same
    graph untagged loaded the untagged artifact); after Inductor's partitioner, tensors tagged for
    host memory are offloaded (rewrite/offload.py) and, with `steps` (a handle, and per input whether
    it is trained), the optimizer steps go into the backward (rewrite/optimizer_step.py). Used
    alike by the lowering and the prediction."""
    stack = contextlib.ExitStack()
    low = saved_dtype.tagged(gm)
    host = any(offload.tagged(n) for n in gm.graph.nodes)
    if low or host or steps is not None or any("recompute" in n.meta for n in gm.graph.nodes):
        stack.enter_context(compat.autograd_cache_off())
    if low:
        stack.enter_context(compat.inductor_joint_pass(saved_dtype.round_trip_backward_reads, "tailorfx-saved-low-1"))
    if host or steps is not None:
        after = functools.partial(after_partition, host=host, steps=steps)
        stack.enter_context(compat.inductor_partitioner(after, f"tailorfx-partition-5-{host}-{steps}"))
    return stack


def after_partition(fw: fx.GraphModule, bw: Optional[fx.GraphModule], num_fwd_outputs: int,
                    host: bool = False, steps: Optional[tuple] = None) -> None:
    """compile_context's work on Inductor's forward and backward: offload, then the steps in backward."""
    if host:
        offload.offload_saved_waiting(fw, bw, num_fwd_outputs)
    if steps is not None and bw is not None and not fuse_into_backward(fw, bw, num_fwd_outputs, steps[1], steps[0],
                                                                      op=True):
        warnings.warn(STEPS_NOT_FUSED)


def trace(gm: fx.GraphModule, example_inputs: Sequence, steps: Optional[tuple] = None
          ) -> tuple[fx.GraphModule, Optional[fx.GraphModule], int, Schedule, Optional[Schedule]]:
    """(forward, backward, number of user outputs, their schedules) of `gm` as Inductor compiles
    it for training, on `example_inputs` (fake, possibly symbolic); compiles no code. `steps`:
    compile_context's."""
    rec: dict = {}

    def inner(g: fx.GraphModule, inputs, **kw):
        backward = bool(kw.get("is_backward", False))
        as_traced = fx.GraphModule(g, copy.deepcopy(g.graph))   # before post-grad passes: AOTAutograd's names
        rec["bw" if backward else "fw"] = (as_traced, _schedule(g, inputs, backward, bool(kw.get("is_inference"))))
        return compat.make_boxed_func(as_traced.forward)

    own = fx.GraphModule(gm, copy.deepcopy(gm.graph))   # compile_fx takes ownership of what it gets
    with compat.isolated_tracing(example_inputs), compat.backward_compiled_with_forward(), compile_context(own, steps):
        compat.compile_fx()(own, list(example_inputs), inner_compile=inner)
    return _traced(rec)


def _traced(rec: dict) -> tuple[fx.GraphModule, Optional[fx.GraphModule], int, Schedule, Optional[Schedule]]:
    """trace's result from the (as traced, schedule) of the forward ("fw") and backward ("bw")."""
    fw, fw_sched = rec["fw"]
    bw, bw_sched = rec.get("bw", (None, None))
    n_user = len(fw_sched.outputs)
    if bw is not None:
        bw_inputs = [n for n in bw.graph.nodes if n.op == "placeholder"]
        n_user -= sum(1 for n in bw_inputs if not n.name.startswith("tangents"))
    return fw, bw, n_user, fw_sched, bw_sched


class Recorder:
    """trace's graphs and schedules read off the lowering's own compile (`wrap` its inner compiler;
    compat.on_generated_code), so a graph Inductor compiles is not generated a second time for the
    memory model. `traced()`: trace's result, or None where a cache served a compile (nothing was
    generated to read) or the backward was not compiled with the forward."""

    def __init__(self):
        self.graphs: dict = {}
        self.training = False

    def wrap(self, compile_inner: Callable) -> Callable:
        def inner(g: fx.GraphModule, inputs, **kw):
            key = "bw" if kw.get("is_backward") else "fw"
            self.training = self.training or (key == "fw" and not kw.get("is_inference"))
            as_traced = fx.GraphModule(g, copy.deepcopy(g.graph))   # before post-grad passes, as trace keeps it
            placeholders = _placeholders(g)

            def read(graph) -> None:
                self.graphs.setdefault(key, (as_traced, _read(graph, placeholders, g)))
            with compat.on_generated_code(read):
                return compile_inner(g, inputs, **kw)
        return inner

    def traced(self) -> Optional[tuple[fx.GraphModule, Optional[fx.GraphModule], int, Schedule, Optional[Schedule]]]:
        if "fw" not in self.graphs or (self.training and "bw" not in self.graphs):
            return None
        return _traced(self.graphs)
