"""Lowering: AOTAutograd splits forward/backward; each runs as fx code (eager) or through Inductor.
A graph no pass changed runs as Dynamo captured it ("dynamo"): eager autograd, no AOTAutograd."""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx

from tailorfx import compat
from tailorfx.rewrite.capture import with_eager_grouped_mm
from tailorfx.rewrite.inductor_schedule import Recorder, compile_context
from tailorfx.rewrite.lazy_outputs import Split, split_lazy_outputs
from tailorfx.rewrite.trace import captured_inputs, fake_inputs, trainable_inputs
from tailorfx.rewrite.optimizer_step import STEPS_NOT_FUSED, fuse_into_backward
from tailorfx.rewrite.passes import own, owned
from tailorfx.rewrite import offload
from tailorfx.rewrite.saved_dtype import store_saved_low
from tailorfx.runtime.lazy_grad import reattach
from tailorfx.runtime.optim import GraphInputs, kept_grads

LOWERINGS = ("eager", "inductor")


def resolve_lowering(lowering: str, example_inputs: Sequence) -> str:
    """'auto' is Inductor on CUDA (Triton kernels) and eager on CPU, where the memory model is exact."""
    if lowering == "auto":
        cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
        return "inductor" if cuda else "eager"
    if lowering not in LOWERINGS:
        raise ValueError(f"lowering must be 'auto' or one of {LOWERINGS}, got {lowering!r}")
    return lowering


def settle(lowering: str, changed: bool, optimizer_in_backward: bool) -> str:
    """The lowering a graph gets: an unchanged graph under the eager lowering runs as Dynamo's own
    graph ("dynamo"), so capture costs what eager costs: AOTAutograd's functionalized graphs and
    runtime wrappers would add time and buy nothing when there is no rewrite to lower (and eager
    autograd saves what the default partitioner, which the memory model traces, saves)."""
    if lowering == "eager" and not changed and not optimizer_in_backward:
        return "dynamo"
    return lowering


def partition_for(lowering: str, gm: Optional[fx.GraphModule] = None) -> str:
    """The partitioner a graph is lowered with, so the memory model traces the same split:
    Inductor's own ("inductor": its partition and kernel schedule, rewrite/inductor_schedule.py),
    min-cut for graphs carrying recompute tags (it honours them), else the default partitioner,
    which saves what eager autograd would."""
    if lowering == "inductor":
        return "inductor"
    if gm is not None and any("recompute" in n.meta for n in gm.graph.nodes):
        return "min_cut"
    return "default"


def lower(gm: fx.GraphModule, example_inputs: Sequence, lowering: str,
          on_partition: Optional[Callable] = None, steps_in_backward: Optional[GraphInputs] = None,
          record: bool = False) -> Callable:
    """Compile a (rewritten) Dynamo graph for training; returns Dynamo's boxed callable.

    `on_partition(fw, bw, num_fwd_outputs, static)` sees the graphs that will run (under Inductor
    also `schedules=`, its code's), so the memory model can reuse them instead of tracing again;
    `record`: Inductor's caches left out, so that its code is generated and read (a plan to check
    on it). `steps_in_backward`:
    put the optimizer step of each parameter inside the backward graph (see
    rewrite/optimizer_step.py); the forward records its inputs there, so the backward can find the
    parameters to update. Logits-like outputs leave the compiled graph detached and get their
    gradient path back outside it (rewrite/lazy_outputs.py), so no zero gradient of them is
    materialised. The eager lowering compiles a graph with a symbolic sequence length first at the
    captured sizes (static shapes: 2-4x faster to trace, and what a training loop at one length
    runs), and for the symbolic sizes the first time a call has other sizes.
    """
    if lowering == "dynamo":
        return _dynamo_graph(with_eager_grouped_mm(gm))
    if lowering in ("eager", "inductor") and any(isinstance(t, compat.FakeTensor) for t in example_inputs):
        # a model on fake tensors (sizing.py builds them) is predicted, never trained: nothing to
        # compile (Inductor's code would read the fake tensors' memory), the memory model traces
        # the graph itself, with the lowering's partition and schedule
        return gm.forward
    needs = owned(gm)   # what the graph's code reaches by name at run time (chunked regions)
    split = split_lazy_outputs(gm)
    gm = split.gm
    if lowering == "inductor":
        return _with_lazy_outputs(_compile_fx(gm, example_inputs, on_partition, steps_in_backward, record), split)
    compile_on = _aot_compiler(gm, lowering, needs, on_partition, steps_in_backward)
    return _with_lazy_outputs(_compile_per_size(gm, example_inputs, compile_on), split)


def _compile_fx(gm: fx.GraphModule, example_inputs: Sequence, on_partition: Optional[Callable],
                steps_in_backward: Optional[GraphInputs], record: bool) -> Callable:
    """`gm` compiled by Inductor, the backward with the forward; `on_partition` also gets the
    schedules of the code it generated (`schedules=`), read off this compile (inductor_schedule.Recorder)
    for the memory model, unless a cache served it (`record`: none does)."""
    trained = trainable_inputs(gm)
    steps = (steps_in_backward.handle, tuple(trained)) if steps_in_backward is not None and any(trained) else None
    recorder = Recorder()
    inner = _compiler_with_steps(steps_in_backward) if steps else compat.compile_fx_inner()
    with compile_context(gm, steps), compat.backward_compiled_with_forward(), \
            compat.compile_caches_off() if record else contextlib.nullcontext():
        compiled = compat.compile_fx()(gm, list(example_inputs), inner_compile=recorder.wrap(inner))
    if on_partition is not None and (traced := recorder.traced()) is not None:
        fw, bw, n, fw_s, bw_s = traced
        static = not any(_symbolic(p.meta.get("val")) for p in fw.graph.nodes if p.op == "placeholder")
        on_partition(fw, bw, n, static, schedules=(fw_s, bw_s))
    return compiled


def _eager_forward(g: fx.GraphModule, _) -> Callable:
    return compat.make_boxed_func(g.forward)


def _eager_backward(g: fx.GraphModule, _) -> Callable:   # saved tensors freed at their last use
    return compat.args_clearing_func(g)


def _compiler_with_steps(steps_in_backward: GraphInputs) -> Callable:
    """Inductor's per-graph compiler, its forward recording its inputs for the optimizer steps in
    its backward (tailorfx::grad_ready), and its backward handing autograd the gradients those
    steps left (a parameter with no in-backward optimizer, or read by another graph too)."""
    def inner(g: fx.GraphModule, inputs, **kw):
        compiled = compat.compile_fx_inner()(g, inputs, **kw)
        if kw.get("is_inference"):
            return compiled

        def forward(args):
            steps_in_backward.record(args)
            return compiled(args)

        def backward(args):
            outs = list(compiled(args))
            for slot, grad in kept_grads(steps_in_backward.handle).items():
                outs[slot] = grad
            return outs
        run = backward if kw.get("is_backward") else forward
        run._boxed_call = True
        return run
    return inner


def _recording_forward(steps_in_backward: GraphInputs) -> Callable:
    """An AOTAutograd forward compiler whose graph records its inputs for the backward's optimizer steps."""
    def compiler(g: fx.GraphModule, _):
        forward = g.forward

        def run(args):
            steps_in_backward.record(args)
            return forward(*args)
        run._boxed_call = True
        return run
    return compiler


def _aot_compiler(gm: fx.GraphModule, lowering: str, needs: dict, on_partition: Optional[Callable],
                  steps_in_backward: Optional[GraphInputs]) -> Callable[[list, bool], Callable]:
    """`compile_on(inputs, static)`: `gm` through AOTAutograd at `inputs`, each partition with its
    saved tensors in their tagged dtype, the optimizer steps in the backward when asked, and owning
    what the graph reaches by name."""
    partition_fn = (compat.min_cut_rematerialization_partition if partition_for(lowering, gm) == "min_cut"
                    else compat.default_partition)

    def compile_on(inputs: list, static: bool) -> Callable:
        def partition(joint, joint_inputs, *, num_fwd_outputs, **kw):
            fw, bw = partition_fn(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)
            store_saved_low(fw, bw, num_fwd_outputs)
            offload.offload_saved(fw, bw, num_fwd_outputs)
            if steps_in_backward is not None and bw is not None and any(trained := trainable_inputs(gm)) \
                    and not fuse_into_backward(fw, bw, num_fwd_outputs, trained, steps_in_backward.handle):
                warnings.warn(STEPS_NOT_FUSED)
            if on_partition is not None:
                on_partition(fw, bw, num_fwd_outputs, static)
            # a pending backward may outlive the rewritten graph: the graphs that run own what it owns
            for name, obj in needs.items():
                for g in (fw, bw) if bw is not None else (fw,):
                    own(g, name, obj)
            return fw, bw
        return compat.aot_module_simplified(
            gm, inputs, fw_compiler=_recording_forward(steps_in_backward) if steps_in_backward is not None
            else _eager_forward, bw_compiler=_eager_backward, partition_fn=partition)
    return compile_on


def _compile_per_size(gm: fx.GraphModule, example_inputs: Sequence,
                      compile_on: Callable[[list, bool], Callable]) -> Callable:
    """A graph with symbolic sizes compiled at its captured sizes now, and for the symbolic sizes the
    first time a call has others (guarded: a call breaking what that compilation assumed raises)."""
    fake = fake_inputs(gm)     # Dynamo's, with the symbolic sizes (example_inputs may be real)
    symbolic = [i for i, v in enumerate(fake) if _symbolic(v)]
    static = captured_inputs(gm) if symbolic else None
    if static is None:
        return compile_on(list(example_inputs), False)
    with compat.isolated_tracing(static):
        at_captured = compile_on(static, True)
    sizes = [_sizes(static[i]) for i in symbolic]
    mode = compat.detect_fake_mode(fake)
    lazy: dict = {}

    def run(*args):
        if all(_sizes(args[i]) == s for i, s in zip(symbolic, sizes)):
            return at_captured(*args)
        if "compiled" not in lazy:     # a new length: the symbolic sizes, compiled once
            before = compat.shape_guard_count(mode)
            try:
                with compat.isolated_tracing(fake):
                    lazy["compiled"] = compile_on(fake, False)
            except Exception as e:     # the rewritten graph's own ops under eager autograd: exact, as traced
                warnings.warn(f"tailorfx: compiling the graph for symbolic sizes failed ({type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); calls at sizes other "
                              f"than the captured ones run it under eager autograd")
                lazy["compiled"] = gm.forward
            lazy["guarded"] = compat.shape_guard_count(mode) > before
        if lazy["guarded"] and not compat.guards_hold(mode, fake, list(args)):
            raise RuntimeError("tailorfx: the graph compiled for symbolic sizes assumed something about them that "
                               f"this call's sizes ({[_sizes(args[i]) for i in symbolic]}) break: call the model at "
                               f"its captured sizes ({sizes}), or optimize() it again on an example of these")
        return lazy["compiled"](*args)
    return run


def _symbolic(v) -> bool:
    """A SymInt, or a tensor with a symbolic size."""
    if isinstance(v, torch.SymInt):
        return True
    return isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape)


def _sizes(v):
    return tuple(v.shape) if isinstance(v, torch.Tensor) else v


def _dynamo_graph(gm: fx.GraphModule) -> Callable:
    """Dynamo's graph run as captured. Outputs with symbolic sizes are stamped as AOTAutograd
    stamps them, so the graph Dynamo compiles after a graph break keeps those dims dynamic (else
    it specialises, and the memory model cannot follow the sequence length through it)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    flat = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    marks = []
    for i, node in enumerate(flat):
        val = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None
        dims = {d for d, size in enumerate(val.shape) if isinstance(size, torch.SymInt)} \
            if isinstance(val, torch.Tensor) else set()
        if dims:
            marks.append((i, dims))
    forward = gm.forward
    if not marks:
        return forward

    def run(*args):
        outs = forward(*args)
        seq = outs if isinstance(outs, (tuple, list)) else (outs,)
        for i, dims in marks:
            if isinstance(seq[i], torch.Tensor):
                compat.mark_dynamo_propagated_dynamic_indices(seq[i], dims)
        return outs
    return run


def call_args(args: tuple) -> list:
    """The arguments of a call to a compiled graph, boxed (one list, which the callee empties) or
    not, as a list of their own."""
    return list(args[0]) if len(args) == 1 and isinstance(args[0], list) else list(args)


def _with_lazy_outputs(compiled: Callable, split: Split) -> Callable:
    """The compiled graph returning what the model returns (see rewrite/lazy_outputs.py)."""
    if not split.lazy:
        return compiled

    def run(*args):
        # a boxed callee empties its argument list: keep the parameters the chains need first
        flat = call_args(args)
        outs = compiled(*args)
        kept = reattach(outs, flat, split.lazy, split.num_outputs)
        return tuple(kept) if isinstance(outs, tuple) else kept
    return run
