"""The memory model: simulated execution of one training step on fake tensors.

Walking the traced forward and backward graphs (rewrite/trace.py) in order, each op allocates its
outputs (views and in-place ops alias their base) and every storage is freed after its last use,
as fx-generated code does; forward outputs saved for backward live until the backward graph
returns (autograd's ctx holds them); what happens to gradients and optimizer state follows the
TrainingSetup (held to the step, accumulated, or consumed by an update inside backward).

Here the step; one graph's walk in its Pool of storages is memory_graph.py, the Timeline and
MemoryEstimate it returns memory_estimate.py (all three importable from here).
"""
from __future__ import annotations

import functools
import weakref
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx

from tailorfx import compat
from tailorfx.rewrite import depth as depth_mod
from tailorfx.rewrite.capture import SeqInfo, node_value
from tailorfx.rewrite.memory_estimate import MemoryEstimate, Timeline
from tailorfx.rewrite.memory_graph import Pool, eager_last_uses, never_run, placeholders, run_graph, run_schedule
from tailorfx.rewrite.optimizer_step import is_step, storage_root
from tailorfx.rewrite.trace import (Sizer, StepGraphs, fake_inputs, graph_outputs, make_step,  # noqa: F401
                                    trace_step, trainable_inputs)
from tailorfx.runtime.cpu_scratch import matmul_scratch_bytes
from tailorfx.setup import TrainingSetup, resolve


def all_outputs(output) -> bool:
    """Hold-output policy: the caller holds every output of the forward (a training loop holds the
    model's output, logits included, through backward)."""
    return True


def scalar_outputs(output) -> bool:
    """Hold-output policy: only a scalar output (the loss) outlives the forward; the others (the
    logits) are freed as it returns, as a pipeline's last stage returns the loss alone."""
    v = node_value(output) if isinstance(output, fx.Node) else None
    return isinstance(v, torch.Tensor) and v.dim() == 0


def _grad_nodes(bw: fx.GraphModule) -> frozenset:
    """The backward's gradient values: its outputs and what it hands to in-graph optimizer steps."""
    out = {o for o in graph_outputs(bw) if isinstance(o, fx.Node)}
    out |= {n.args[2] for n in bw.graph.nodes if is_step(n)}
    out = {o for o in out if isinstance(node_value(o), torch.Tensor)}
    return frozenset(out | {storage_root(o) for o in out})   # a gradient that is a view: count its base


def _trained(steps: Sequence[StepGraphs], sizer: Sizer) -> list[tuple[int, torch.dtype]]:
    """(numel, dtype) of every parameter that gets a gradient."""
    out = []
    for st in steps:
        fw_ph = [n for n in st.fw.graph.nodes if n.op == "placeholder"]
        for n, static, rg in zip(fw_ph, st.static_inputs, st.requires_grad):
            v = node_value(n)
            if static and rg and isinstance(v, torch.Tensor):
                out.append((sizer(v) // v.element_size(), v.dtype))
    return out


def simulate_step(steps: Sequence[StepGraphs], seq: Optional[SeqInfo] = None,
                  seq_len: Optional[int] = None, optimizer: Optional[str] = None,
                  keep_outputs: bool = True, setup: Optional[TrainingSetup] = None, *,
                  hold: Callable[[object], bool] = all_outputs, pool: Optional[Pool] = None) -> MemoryEstimate:
    """Predict one training step over captured subgraphs run in order (forward, backward, update).

    `setup` says how the step trains (tailorfx.TrainingSetup: master weights, optimizer state,
    gradient accumulation, optimizer in backward); without it, the parameters' own dtype and
    `optimizer` (None, "sgd" or "adamw"). Gradient accumulation is predicted for the last
    micro-batch, when the accumulated gradients already exist. `hold(output)`: whether the
    caller holds that forward output past the forward (all_outputs, scalar_outputs);
    `keep_outputs`: it holds those to the end of the step, not only through their graph's
    backward. `pool`: the Pool to simulate in (a subclass that observes the step), a fresh one
    by default.
    """
    sizer = Sizer(seq, seq_len)
    trained = _trained(steps, sizer)
    if setup is None:
        setup = resolve(None, param_dtype=trained[0][1] if trained else None, optimizer=optimizer)
    has_opt = setup.optimizer is not None
    pool = pool if pool is not None else Pool(Timeline())
    timeline = pool.timeline
    param_bytes = grad_bytes = 0
    saved_total = 0
    saved_made: dict[int, int] = {}   # timeline point -> bytes saved for backward of the storages it made
    if has_opt and setup.grad_accum_steps > 1:   # gradients of the earlier micro-batches
        grad_bytes = sum(n for n, _ in trained) * setup.grads.itemsize
        pool.alloc(grad_bytes, "accumulated", grad=True)
    depth = _depth(seq, steps, setup)
    tags = depth_mod.block_tags(steps, depth) if depth is not None else {}
    pending = []   # (step, saved-name -> sids, user outputs' sids)
    for k, st in enumerate(steps):
        param_bytes += sum(sizer(node_value(n)) for n, static in zip(placeholders(st.fw), st.static_inputs)
                           if static and isinstance(node_value(n), torch.Tensor))
        saved, user = _forward(pool, st, k, sizer, setup, hold)
        kept = {s for sids in saved.values() for s in sids if s not in pool.host_sids}
        saved_total += sum(pool.bytes.get(s, 0) for s in kept)
        for s in kept:
            saved_made[pool.born[s]] = saved_made.get(pool.born[s], 0) + pool.bytes.get(s, 0)
        pending.append((k, st, saved, user))
    for k, st, saved, user in reversed(pending):
        if st.bw is not None:
            grad_bytes += _backward(pool, st, k, saved, sizer, setup, user)
            if not keep_outputs:
                for sid in user:
                    pool.release(sid, ("user", k))
    master = sum(setup.master_bytes(n) for n, _ in trained) if has_opt else 0
    state = sum(setup.state_bytes(n) for n, _ in trained) if has_opt else 0
    if has_opt and not setup.optimizer_in_backward:
        # one parameter at a time (tailorfx.runtime.optim; torch's single-tensor AdamW)
        pool.mark("optimizer", f"{setup.optimizer}.step",
                  max((setup.update_temp_bytes(n) for n, _ in trained), default=0))
    if depth is not None:
        composed = depth_mod.compose(timeline.points, timeline.extras, timeline.grads, timeline.hosts, tags, depth)
        if composed is None:
            raise depth_mod.NotComposable(f"the step's {depth.captured} captured blocks do not repeat alike")
        timeline = Timeline(composed.points, composed.grads, composed.host_peak, composed.extras, composed.hosts)
        # what each repeated period saves: the storages its ops made, as often as they run again
        saved_total += sum(nbytes * composed.repeats.get(k, 0) for k, nbytes in saved_made.items())
        period_bytes, period_trained = depth_mod.period_sizes(depth)
        param_bytes += depth.repeats * period_bytes
        trained = trained + period_trained * depth.repeats
        held = setup.optimizer is None or not setup.optimizer_in_backward   # as _accumulate keeps them
        grad_bytes += depth.repeats * sum(n * dt.itemsize for n, dt in period_trained) * held
        master = sum(setup.master_bytes(n) for n, _ in trained) if has_opt else 0
        state = sum(setup.state_bytes(n) for n, _ in trained) if has_opt else 0
    dyn_peak, phase, node = timeline.peak()
    buckets = sum(n * dt.itemsize for n, dt in trained) if setup.ddp else 0   # DDP's copy of the gradients
    static = param_bytes + master + state + buckets
    length = seq_len or next((s.length for s in (seq if isinstance(seq, (list, tuple)) else [seq]) if s), 0)
    device = setup.device.bytes(length) if setup.device is not None else 0
    return MemoryEstimate(peak_bytes=static + dyn_peak + device, static_bytes=static, device_bytes=device,
                          param_bytes=param_bytes, grad_bytes=grad_bytes,
                          optimizer_bytes=state, dynamic_peak_bytes=dyn_peak,
                          saved_bytes=saved_total, peak_phase=phase, peak_node=node,
                          timeline=timeline, master_bytes=master,
                          grads_at_peak=timeline.grads_at_peak(), setup=setup, host_bytes=timeline.host_peak,
                          bucket_bytes=buckets)


def _depth(seq, steps: Sequence[StepGraphs], setup: TrainingSetup) -> Optional["depth_mod.Depth"]:
    """The Depth the captured step stands for (SeqInfo.depth, sizing's shallow captures), where
    its timeline can be composed: one graph, no gradient accumulation, and gradients that either
    stay or are consumed inside the backward graph (no per-gradient step after it)."""
    seqs = [s for s in (seq if isinstance(seq, (list, tuple)) else [seq]) if s is not None]
    depth = seqs[0].depth if len(seqs) == 1 else None
    if depth is None:
        return None
    if len(steps) != 1 or setup.grad_accum_steps > 1 or (
            setup.optimizer is not None and not setup.optimizer_in_backward and setup.grads != setup.param_dtype):
        raise depth_mod.NotComposable("the step's setup adds per-gradient work the composition does not repeat")
    if any(st.fw_schedule is not None and any(o is not None and o[0] == "host" for o in st.fw_schedule.outputs)
           for st in steps):   # Inductor's code for the shallow graph offloads otherwise than the whole's
        raise depth_mod.NotComposable("an Inductor step with activations offloaded to host is not composed")
    return depth


def _forward(pool: Pool, st: StepGraphs, k: int, sizer: Sizer, setup: TrainingSetup,
             hold: Callable[[object], bool] = all_outputs):
    """Run one forward graph: (saved-for-backward name -> storage ids, the held user outputs' ids),
    each held until backward (saved) or the end of the step (the user outputs `hold` keeps)."""
    outs = (run_schedule(st.fw, st.fw_schedule, pool, {}, sizer, f"forward[{k}]", setup) if st.fw_schedule
            else run_graph(st.fw, pool, {}, sizer, f"forward[{k}]", setup))
    nodes = graph_outputs(st.fw)
    saved = {}
    for o, sids in zip(nodes[st.num_user_outputs:], outs[st.num_user_outputs:]):
        if isinstance(o, fx.Node):
            saved[o.name] = sids
            for sid in sids:
                pool.hold(sid, ("saved", k, o.name))
    held = st.num_user_outputs - (st.lazy_anchors if st.eager_autograd else 0)
    user = [sid for o, sids in zip(nodes[:held], outs[:held]) if hold(o) for sid in sids]
    for sid in user:
        pool.hold(sid, ("user", k))
    for sids in outs:
        for sid in sids:
            pool.release(sid, "__out__")
    pool.forward_done(k)
    return saved, user


def _backward(pool: Pool, st: StepGraphs, k: int, saved: dict, sizer: Sizer, setup: TrainingSetup,
              user: list) -> int:
    """Run one backward graph and hand its gradients to autograd and the setup; returns the
    bytes of gradients that stay (see _accumulate). `user`: the held outputs' storages, to which
    what only nodes that never run saved is added (the outputs' autograd graphs keep it)."""
    env, absent = {}, set()
    for n in placeholders(st.bw):
        if n.name in saved:
            env[n.name] = saved[n.name]
        elif n.name.startswith("tangents") and isinstance(node_value(n), torch.Tensor):
            t = node_value(n)
            if st.loss_tangent_only and t.dim() > 0:
                env[n.name] = []
                absent.add(n.name)
            else:
                env[n.name] = [pool.alloc(sizer(t), ("tangent", k))]

    skipped = never_run(st.bw, absent) if absent else None
    for n in placeholders(st.bw) if skipped and user else ():
        if n.name in saved and n.users and all(u in skipped for u in n.users):
            for sid in saved[n.name]:
                pool.hold(sid, ("user", k))
                user.append(sid)

    def release_saved():
        for name, sids in saved.items():
            for sid in sids:
                pool.release(sid, ("saved", k, name))
    # AOTAutograd clears autograd's ctx before the backward runs (no retain_graph) and hands the
    # saved tensors over in a list the backward's code empties (codegen/lower.py, as Inductor's
    # code does): each lives until its last use in the graph. Eager autograd frees each node's
    # saved tensors once that node has run.
    eager = st.eager_autograd
    consumed = eager and setup.optimizer is not None and setup.grad_accum_steps > 1 and not setup.optimizer_in_backward
    if st.bw_schedule is not None:
        # AOTAutograd clears autograd's saved tensors before the backward runs (no retain_graph)
        # and Inductor's code drops each input after its last use: a saved tensor lives as long
        # as the backward needs it (measured on Gemma-2: held to the end it over-predicted 50%)
        def dropped(name: str) -> None:
            for sid in saved.get(name, []):
                pool.release(sid, ("saved", k, name))
        grads = run_schedule(st.bw, st.bw_schedule, pool, env, sizer, f"backward[{k}]", setup, grads=True,
                             dropped=dropped)
    else:
        grads = run_graph(st.bw, pool, env, sizer, f"backward[{k}]", setup, _grad_nodes(st.bw),
                          release_saved, consumed, eager_last_uses(st.bw, st.checkpoint_args_held) if eager else None,
                          skipped)
    for n in placeholders(st.bw):
        for sid in env.get(n.name, []):
            pool.release(sid, ("tangent", k))
    # AccumulateGrad copies a gradient whose layout differs from its (contiguous) parameter,
    # one at a time, while the others are held
    relayout = [sizer(node_value(o)) for o in graph_outputs(st.bw)
                if isinstance(o, fx.Node) and isinstance(node_value(o), torch.Tensor)
                and not node_value(o).is_contiguous()]
    if relayout:
        pool.mark(f"backward[{k}]", "accumulate_grad", max(relayout))
    return _accumulate(pool, [sids for sids in grads if sids], setup, k)


def _accumulate(pool: Pool, grads: list[list[int]], setup: TrainingSetup, k: int) -> int:
    """What autograd and the setup do with the gradients one backward graph returned; returns the
    bytes of gradients that stay (new ones: accumulated ones were counted up front)."""
    phase = f"backward[{k}]"
    kept = 0
    for sids in grads:
        nbytes = sum(pool.bytes.get(s, 0) for s in sids)
        if setup.optimizer is None or (setup.grad_accum_steps == 1 and not setup.optimizer_in_backward
                                       and setup.grads == setup.param_dtype):
            for sid in sids:   # accumulated into .grad: they live to the end of the step
                pool.hold(sid, ("grad", k))
            kept += nbytes
        elif setup.optimizer_in_backward:   # a post-accumulate hook updates and frees it
            numel = nbytes // setup.param_dtype.itemsize
            pool.mark(phase, "optimizer_hook", setup.update_temp_bytes(numel))
        elif setup.grad_accum_steps == 1:   # fp32 gradients: moved into the master's .grad
            numel = nbytes // setup.param_dtype.itemsize
            pool.alloc(numel * setup.grads.itemsize, ("grad", k), grad=True)
            kept += numel * setup.grads.itemsize
            pool.mark(phase, "master_grad")
        # else: added in place into the accumulated gradient
        for sid in sids:
            pool.release(sid, "__out__")
    return kept


def predict(graphs: Sequence[fx.GraphModule], seq: Optional[SeqInfo] = None,
            seq_len: Optional[int] = None, partition: str = "default",
            optimizer: Optional[str] = None, setup: Optional[TrainingSetup] = None) -> MemoryEstimate:
    """Trace and simulate: the peak of one step of these Dynamo graphs, run in order."""
    steps = [trace_step(gm, None, partition, setup) for gm in graphs]
    return simulate_step(steps, seq, seq_len, optimizer, setup=setup)


class LiveBytes(compat.TorchDispatchMode):
    """Peak bytes of the storages that eager code allocates while active, on real or fake
    tensors: each new storage counts until Python frees it (what autograd saves included), and
    with `cpu_scratch` each 16-bit CPU matmul's oneDNN scratch beside its output (fake tensors
    standing in for a CUDA model's say they are on the CPU: pass False there)."""

    def __init__(self, cpu_scratch: bool = True):
        super().__init__()
        self.live = self.peak = 0
        self.cpu_scratch = cpu_scratch
        self._seen: dict[int, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(a.untyped_storage()) for a in compat.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in compat.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if id(st) in self._seen or id(st) in inputs:   # a view (or in-place result) of an input
                    continue
                n = st.nbytes()
                self.live += n
                self.peak = max(self.peak, self.live)
                self._seen[id(st)] = weakref.ref(st, functools.partial(self._free, id(st), n))
        if self.cpu_scratch:   # a 16-bit CPU matmul's oneDNN scratchpad, beside its output while it runs
            self.peak = max(self.peak, self.live + matmul_scratch_bytes(func, args))
        return out

    def _free(self, key: int, n: int, _ref) -> None:
        self._seen.pop(key, None)
        self.live -= n
