"""Forward and backward graphs of a training step, traced on fake tensors, and their sizes.

AOTAutograd traces a Dynamo graph into the forward and backward graphs that will really run
(same partitioner as the lowering), on fake tensors, so nothing is allocated. Sizes are sympy
expressions in the sequence length, so one trace serves every length.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional, Sequence

import sympy
import torch
import torch.fx as fx

from tailorfx import compat
from tailorfx.rewrite.capture import node_value, without_identity_dropout
from tailorfx.rewrite.lazy_outputs import split_lazy_outputs
from tailorfx.rewrite.optimizer_step import forward_inputs, fuse_into_backward
from tailorfx.rewrite.offload import offload_saved
from tailorfx.rewrite.saved_dtype import store_saved_low
from tailorfx.rewrite.regions import is_param
from tailorfx.setup import TrainingSetup

if TYPE_CHECKING:
    from tailorfx.rewrite.inductor_schedule import Schedule  # noqa: F401

@dataclass
class StepGraphs:
    """The forward and backward graphs of one captured subgraph, as AOTAutograd partitions them."""
    fw: fx.GraphModule
    bw: Optional[fx.GraphModule]
    num_user_outputs: int
    static_inputs: list[bool]          # per fw placeholder: a parameter or buffer
    requires_grad: list[bool]          # per fw placeholder
    # run under eager autograd (the "dynamo" lowering), not as AOTAutograd's backward: each saved
    # tensor is freed once the backward no longer needs it, not when the whole backward returns
    eager_autograd: bool = False
    # the graph traces modules that run eagerly and whose step calls loss.backward(): autograd hands
    # the backward the loss's gradient alone, none for another output (a tensor a hook kept)
    loss_tangent_only: bool = False
    # torch's checkpoint wraps the modules themselves (tp and dp ranks): it keeps the arguments it
    # replays a block or a sequence chunk from until their backward has run
    checkpoint_args_held: bool = False
    # outputs rewrite/lazy_outputs.py added (a head chain's input), the last user outputs: the lowering
    # holds them for the chain's backward; eager autograd ("dynamo") runs the graph unsplit and does not
    lazy_anchors: int = 0
    # lowered by Inductor: each graph's kernel order and buffers (rewrite/inductor_schedule.py)
    fw_schedule: Optional["Schedule"] = None
    bw_schedule: Optional["Schedule"] = None


def fake_inputs(gm: fx.GraphModule) -> list:
    """The fake (possibly symbolic) example inputs Dynamo recorded on the placeholders."""
    return [node_value(n) for n in gm.graph.nodes if n.op == "placeholder"]


def captured_inputs(gm: fx.GraphModule) -> Optional[list]:
    """Dynamo's example inputs at the sizes it captured (each symbol at its hint), as fake tensors
    of a static FakeTensorMode; None when a size has no hint or an input is a view at an offset.
    A trace on them serves only the captured length, and is about 3x faster than one on the
    symbolic inputs (no sympy per op): the planner's candidates are compared at that length."""
    def hint(x):
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            h = x.node.hint
            if h is None:
                raise LookupError(x)
            return h
        return x
    mode = compat.FakeTensorMode()
    out = []
    try:
        for v in fake_inputs(gm):
            if isinstance(v, torch.Tensor):
                if not isinstance(v, compat.FakeTensor) or hint(v.storage_offset()) != 0:   # DTensor: not itself fake
                    return None
                with mode:
                    t = torch.empty_strided([hint(d) for d in v.shape], [hint(d) for d in v.stride()],
                                            dtype=v.dtype, device=v.device)
                out.append(t.requires_grad_(v.requires_grad))
            else:
                out.append(hint(v))
    except LookupError:
        return None
    return out


def trace_step(gm: fx.GraphModule, example_inputs: Optional[Sequence] = None,
               partition: str = "default", setup: Optional[TrainingSetup] = None) -> StepGraphs:
    """Trace `gm` with AOTAutograd on fake tensors and keep the partitioned graphs (runs nothing).

    By default it traces on the fake inputs Dynamo recorded, so sizes stay symbolic in the
    sequence length. With `setup.optimizer_in_backward` the backward graph gets the same
    in-graph optimizer steps the lowering puts there. Logits-like outputs are split off as the
    lowering does (rewrite/lazy_outputs.py). Dropouts that return their input are left out: eager
    runs them as no-ops and the single-device backend strips them before lowering.
    """
    split = split_lazy_outputs(without_identity_dropout(gm))
    gm, anchors = split.gm, len(graph_outputs(split.gm)) - split.num_outputs if split.lazy else 0
    example_inputs = fake_inputs(gm) if example_inputs is None else example_inputs
    if partition == "inductor":   # Inductor's partition and schedules
        from tailorfx.rewrite import inductor_schedule
        steps = (-1, tuple(trainable_inputs(gm))) if setup is not None and setup.optimizer_in_backward else None
        fw, bw, n, fw_s, bw_s = inductor_schedule.trace(gm, example_inputs, steps)
        return replace(make_step(gm, fw, bw, n), fw_schedule=fw_s, bw_schedule=bw_s, lazy_anchors=anchors)
    rec: dict = {}
    partition_fn = (compat.default_partition if partition == "default"
                    else compat.min_cut_rematerialization_partition)

    def part(joint, joint_inputs, *, num_fwd_outputs, **kw):
        fw, bw = partition_fn(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)
        store_saved_low(fw, bw, num_fwd_outputs)
        offload_saved(fw, bw, num_fwd_outputs)
        if setup is not None and setup.optimizer_in_backward and bw is not None:
            fuse_into_backward(fw, bw, num_fwd_outputs, trainable_inputs(gm), handle=-1)
        rec.update(fw=fw, bw=bw, n=num_fwd_outputs)
        return fw, bw

    def fw_compiler(g, _):
        rec.setdefault("fw", g)
        return compat.make_boxed_func(g.forward)

    def bw_compiler(g, _):
        return compat.make_boxed_func(g.forward)

    with compat.isolated_tracing(example_inputs):
        compat.aot_module_simplified(gm, list(example_inputs), fw_compiler=fw_compiler,
                                     bw_compiler=bw_compiler, partition_fn=part)
    return replace(make_step(gm, rec["fw"], rec.get("bw"), rec.get("n")), lazy_anchors=anchors)


def with_steps_in_backward(step: StepGraphs, gm: fx.GraphModule) -> StepGraphs:
    """`step` (gm traced by trace_step without the optimizer in backward) with the in-graph
    optimizer steps trace_step(setup=optimizer_in_backward) puts in its backward, on a copy of
    that backward: one AOTAutograd trace serves both (the planner's second search)."""
    if step.bw is None:
        return step
    bw = fx.GraphModule(step.bw, copy.deepcopy(step.bw.graph))
    fuse_into_backward(step.fw, bw, step.num_user_outputs, trainable_inputs(gm), handle=-1)   # placeholders as split's
    return replace(step, bw=bw)


def trainable_inputs(gm: fx.GraphModule) -> list[bool]:
    """Per Dynamo placeholder: a parameter the step trains (it gets a gradient)."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            v = node_value(n)
            out.append(is_param(n) and isinstance(v, torch.Tensor) and v.requires_grad)
    return out


def make_step(gm: fx.GraphModule, fw: fx.GraphModule, bw: Optional[fx.GraphModule],
              num_user_outputs: Optional[int]) -> StepGraphs:
    """StepGraphs from a Dynamo graph and the forward/backward graphs AOTAutograd made of it."""
    dyn_ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fw_ph = [n for n in fw.graph.nodes if n.op == "placeholder"]
    static = [is_param(n) for n in dyn_ph]
    if len(static) == len(forward_inputs(fw)):   # the generators CUDA's partitioner appends come last
        static += [False] * (len(fw_ph) - len(static))
    else:   # AOTAutograd added or removed inputs: fall back on requires_grad
        static = [isinstance(node_value(n), torch.Tensor) and node_value(n).requires_grad for n in fw_ph]
    grads = [isinstance(v, torch.Tensor) and v.requires_grad for v in fake_inputs(gm)]
    n_out = num_user_outputs if num_user_outputs is not None else len(graph_outputs(fw))
    return StepGraphs(fw, bw, n_out, static, grads + [False] * (len(fw_ph) - len(grads)))


def graph_outputs(g: fx.GraphModule) -> list:
    """What `g` returns, in order (nodes, or constants such as None)."""
    out = next(n for n in reversed(g.graph.nodes) if n.op == "output")
    return list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]


class Sizer:
    """Bytes of a tensor, evaluated at a chosen sequence length (other symbols at their hints)."""

    def __init__(self, seq, seq_len: Optional[int] = None):
        """`seq`: the SeqInfo of the graph(s) sized, or one per graph (each graph of a capture with
        graph breaks has its own symbols; all sequence symbols take `seq_len`)."""
        seqs = [s for s in (seq if isinstance(seq, (list, tuple)) else [seq]) if s is not None]
        self.subs = {}
        for s in seqs:
            self.subs.update(s.hints)
        for s in seqs:
            if s.symbol is not None and seq_len is not None:
                self.subs[s.symbol] = seq_len
                # inputs of the same length (a padding mask) may carry symbols of their own
                self.subs.update({k: seq_len for k, v in s.hints.items() if v == s.length and s.length > 1})
        self._cache: dict = {}

    def as_int(self, x) -> int:
        """A size or SymInt at the predicted length."""
        e = compat.sym_expr(x)
        if e.is_Integer:
            return int(e)
        return int(e.xreplace({k: sympy.Integer(v) for k, v in self.subs.items() if k in e.free_symbols}))

    def __call__(self, t: torch.Tensor) -> int:
        return self.bytes(compat.sym_expr(t.numel()), t.element_size())

    def bytes(self, e, itemsize: int = 1) -> int:
        """`e` (a sympy count of elements) times `itemsize`, at the predicted length."""
        if e.is_Integer:
            return int(e) * itemsize
        key = e
        if key not in self._cache:
            val = e.xreplace({k: sympy.Integer(v) for k, v in self.subs.items() if k in e.free_symbols})
            if not val.is_number:
                raise ValueError(f"tensor size {e} depends on symbols with no known value: {val.free_symbols}")
            self._cache[key] = int(val)
        return self._cache[key] * itemsize
