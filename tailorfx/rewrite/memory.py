"""The memory model: simulated execution of one training step on fake tensors.

Walking the traced forward and backward graphs (rewrite/trace.py) in order, each op allocates its
outputs (views and in-place ops alias their base) and every storage is freed after its last use,
as fx-generated code does; forward outputs saved for backward live until the backward graph
returns (autograd's ctx holds them); what happens to gradients and optimizer state follows the
TrainingSetup (held to the step, accumulated, or consumed by an update inside backward).
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx

from tailorfx import compat
from tailorfx.rewrite import match
from tailorfx.rewrite.capture import SeqInfo, node_value
from tailorfx.rewrite.optimizer_step import aliases_input, storage_root
from tailorfx.rewrite.trace import (Sizer, StepGraphs, fake_inputs, graph_outputs, make_step,  # noqa: F401
                                    trace_step, trainable_inputs)
from tailorfx.setup import TrainingSetup, resolve

@dataclass
class Timeline:
    """Live bytes after each op of the simulated step (above what existed before the step)."""
    points: list[tuple[str, str, int]] = field(default_factory=list)   # (phase, node, bytes)
    grads: list[int] = field(default_factory=list)                     # gradient bytes live at each point

    def peak(self) -> tuple[int, str, str]:
        if not self.points:
            return 0, "", ""
        phase, node, b = max(self.points, key=lambda p: p[2])
        return b, phase, node

    def grads_at_peak(self) -> int:
        if not self.points:
            return 0
        i = max(range(len(self.points)), key=lambda i: self.points[i][2])
        return self.grads[i]


@dataclass
class MemoryEstimate:
    """Predicted memory of one training step.

    static (held across steps: weights, master weights, optimizer state) + dynamic peak (above
    static during the step: gradients, activations, transients) = peak.
    """
    peak_bytes: int            # static + dynamic peak: what a device must hold
    static_bytes: int          # parameters, buffers, master weights and optimizer state
    param_bytes: int
    grad_bytes: int            # gradients held after backward (0 with the optimizer in backward)
    optimizer_bytes: int       # optimizer state (0 when no optimizer is modelled)
    dynamic_peak_bytes: int    # peak above static during the step (what measure_peak sees)
    saved_bytes: int           # activations saved for backward, at the end of forward
    peak_phase: str
    peak_node: str
    timeline: Timeline
    master_bytes: int = 0      # fp32 master weights
    grads_at_peak: int = 0     # gradient bytes live at the peak (part of the dynamic peak)
    setup: Optional[TrainingSetup] = None
    device_bytes: int = 0      # a CUDA device's workspaces the graphs do not show (setup.device; part of peak)

    @property
    def forward_backward_peak_bytes(self) -> int:
        """Peak above static during forward and backward only (what measure_peak sees around
        `loss.backward()`; in-backward optimizer steps included, the separate step not)."""
        pts = [b for phase, _, b in self.timeline.points if phase.startswith(("forward", "backward"))]
        return max(pts, default=0)

    def summary(self) -> dict[str, int]:
        return {"peak": self.peak_bytes, "static": self.static_bytes, "params": self.param_bytes,
                "master_weights": self.master_bytes, "grads": self.grad_bytes,
                "optimizer_state": self.optimizer_bytes, "dynamic_peak": self.dynamic_peak_bytes,
                "grads_at_peak": self.grads_at_peak, "saved_activations": self.saved_bytes,
                "cuda_workspaces": self.device_bytes}

    def breakdown(self) -> dict[str, int]:
        """The peak split into what it is made of (sums to peak_bytes)."""
        return {"weights": self.param_bytes, "master weights": self.master_bytes,
                "optimizer state": self.optimizer_bytes, "gradients": self.grads_at_peak,
                "activations and transients": self.dynamic_peak_bytes - self.grads_at_peak,
                "CUDA workspaces": self.device_bytes}


class Pool:
    """Storages alive during the simulation, each with the set of values holding it.

    The simulation calls `alloc` for each new storage, `hold`/`release` as holders take and drop
    it (it is freed when the last one does), `mark` after each op (with the bytes the op holds
    inside itself while it runs) and `forward_done` once a forward graph has returned. A
    subclass may override these to observe the step (tailorfx/parallel/profile.py tags each storage
    with the part of the model that made it); it must call the base methods. Holders: the fx
    node whose value it is, `("saved", k, name)` (a forward output saved for backward k),
    `("user", k)` (an output the caller holds), `("grad", k)`, `("tangent", k)`, "__out__" (a
    graph's output on its way to the caller).
    """

    def __init__(self, timeline: Timeline):
        self.bytes: dict[int, int] = {}
        self.holders: dict[int, set] = {}
        self.grad_sids: set[int] = set()
        self.total = 0
        self.grad_total = 0
        self.next_id = 0
        self.timeline = timeline

    def alloc(self, nbytes: int, holder, grad: bool = False) -> int:
        sid = self.next_id
        self.next_id += 1
        self.bytes[sid] = nbytes
        self.holders[sid] = {holder}
        self.total += nbytes
        if grad:
            self.grad_sids.add(sid)
            self.grad_total += nbytes
        return sid

    def hold(self, sid: int, holder) -> None:
        if sid in self.holders:
            self.holders[sid].add(holder)

    def release(self, sid: int, holder) -> None:
        h = self.holders.get(sid)
        if h is None:
            return
        h.discard(holder)
        if not h:
            nbytes = self.bytes.pop(sid)
            self.total -= nbytes
            del self.holders[sid]
            if sid in self.grad_sids:
                self.grad_sids.discard(sid)
                self.grad_total -= nbytes

    def mark(self, phase: str, node: str, extra: int = 0) -> None:
        self.timeline.points.append((phase, node, self.total + extra))
        self.timeline.grads.append(self.grad_total)

    def forward_done(self, k: int) -> None:
        """Forward graph `k` has returned: what it saved and what the caller holds are held, the
        rest of its outputs freed."""


def all_outputs(output) -> bool:
    """Hold-output policy: the caller holds every output of the forward (a training loop holds the
    model's output, logits included, through backward)."""
    return True


def scalar_outputs(output) -> bool:
    """Hold-output policy: only a scalar output (the loss) outlives the forward; the others (the
    logits) are freed as it returns, as a pipeline's last stage returns the loss alone."""
    v = node_value(output) if isinstance(output, fx.Node) else None
    return isinstance(v, torch.Tensor) and v.dim() == 0


def _op_transient(node: fx.Node, sizer: Sizer, setup: TrainingSetup) -> int:
    """Bytes an opaque tailorfx op allocates inside itself while it runs (its chunk buffers, or
    one parameter's optimizer update in backward), or an ATen op whose kernel makes a temporary."""
    t = node.target
    if getattr(t, "__name__", "") == "grad_ready":
        g = node_value(node.args[2])
        return setup.update_temp_bytes(sizer(g) // g.element_size()) if isinstance(g, torch.Tensor) else 0
    if t in (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default):
        # CPU flash attention's per-thread score blocks, and in backward an fp32 q-sized gradient
        # accumulator (measured, 40 to 16K tokens, 2-8 heads, D 16-128: backward = q's fp32 bytes
        # + per_thread a thread, forward about 0.57 of the per-thread part)
        if setup.device is not None:
            return 0   # a GPU budget on CPU fake tensors: CUDA's flash scratch is setup.device's term
        backward = t is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        q = node_value(node.args[1] if backward else node.args[0])
        if not isinstance(q, torch.Tensor):
            return 0
        S = sizer.as_int(q.shape[-2])
        per_thread = min(1 << 20, S * (256 if S < 192 else 512 if S < 768 else 1024))
        buffers = torch.get_num_threads() * per_thread
        return sizer(q) * 4 // q.element_size() + buffers if backward else int(0.57 * buffers)
    if t is torch.ops.aten.native_dropout_backward.default:
        # CPU computes grad * mask * scale as two ops: an output-sized temporary (CUDA fuses them)
        v = node_value(node)
        return sizer(v) if isinstance(v, torch.Tensor) and v.device.type == "cpu" else 0
    name = compat.tailorfx_op_name(t)
    if name is None:
        return 0
    from tailorfx.runtime import attention_kernels, ops
    args = list(fx.node.map_arg(node.args, node_value))
    # a GPU budget (setup.device: CUDA's costs) predicted on CPU fake tensors: the ops as CUDA runs them
    return (ops.transient_bytes(name, args, sizer.as_int, cuda=setup.device is not None)
            + attention_kernels.transient_bytes(name, args, sizer.as_int))


def _replayed_value(n: fx.Node):
    """The outputs of `run_with_rng_state(state, op, *args)` (the partitioner's replay of a random
    op it recomputes in backward, recorded without a value), from the op on its fake inputs."""
    args = fx.node.map_arg(n.args[2:], node_value)
    kwargs = fx.node.map_arg(n.kwargs, node_value)
    mode = compat.own_fake_mode(match.tensors_in((args, kwargs)))
    if mode is None:
        return None
    with mode:
        return n.args[1](*args, **kwargs)


def _run_graph(g: fx.GraphModule, pool: Pool, env: dict, sizer: Sizer, phase: str, setup: TrainingSetup,
               grad_nodes: frozenset = frozenset(), inputs_held: Optional[Callable[[], None]] = None,
               grads_consumed: bool = False) -> list:
    """Simulate one graph. `env` maps placeholder names to storage-id lists (pre-existing values);
    values of `grad_nodes` are counted as gradients; `inputs_held` runs once the graph holds its
    inputs (each then lives until its last use in the graph, unless held elsewhere);
    `grads_consumed`: each gradient is consumed as it is made (eager autograd adding it into an
    accumulated .grad), not returned with the others."""
    nodes = list(g.graph.nodes)
    forward = phase.startswith("forward")
    index = {n: i for i, n in enumerate(nodes)}
    last = {n: max((index[u] for u in n.users), default=index[n]) for n in nodes}
    out_node = nodes[-1]
    held: dict[fx.Node, list[int]] = {}
    for i, n in enumerate(nodes):
        if n.op == "placeholder":
            held[n] = list(env.get(n.name, []))
            for sid in held[n]:
                pool.hold(sid, n)
            continue
        if inputs_held is not None:
            inputs_held()
            inputs_held = None
        if n.op == "output":
            break
        val = node_value(n)
        if n.op == "call_function" and n.target.__name__ == "getitem" and isinstance(n.args[0], fx.Node):
            parent = held.get(n.args[0], [])
            k = n.args[1]
            held[n] = [parent[k]] if isinstance(k, int) and k < len(parent) else list(parent)
        elif aliases_input(n) or (forward and n.target is torch.ops.aten._unsafe_view.default):
            # _unsafe_view (a linear's matmul reshaped back) returns a view, though its schema says
            # a new tensor. Only the forward counts it so for now: counted as a view in the backward
            # too, a tp x FSDP2 rank's prediction fell 2.3% under its measured peak
            # (tests/test_parallel.py), from eager storages not identified yet
            base = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            held[n] = list(held.get(base, [])) if base is not None else []
        else:
            if val is None and n.target is torch.ops.higher_order.run_with_rng_state:
                val = _replayed_value(n)   # a recomputed SDPA: the partitioner gave it no value
            vals = val if isinstance(val, (list, tuple)) else [val]
            # an op returning several values (a custom op's gradients): each counts as a gradient
            # when the getitem taking it out is one
            picked = {u.args[1] for u in n.users if u in grad_nodes and u.op == "call_function"
                      and u.target.__name__ == "getitem"}
            held[n] = [pool.alloc(sizer(v), n, n in grad_nodes or k in picked) if isinstance(v, torch.Tensor) else -1
                       for k, v in enumerate(vals)]
            held[n] = [s for s in held[n] if s >= 0] if not isinstance(val, (list, tuple)) else held[n]
        for sid in held[n]:
            pool.hold(sid, n)
        pool.mark(phase, n.name, _op_transient(n, sizer, setup))
        for a in set(n.all_input_nodes) | {n}:
            if last[a] <= i and (a not in out_node.all_input_nodes or (grads_consumed and a in grad_nodes)):
                for sid in held.get(a, []):
                    pool.release(sid, a)
    outs = []
    for o in graph_outputs(g):
        outs.append(list(held.get(o, [])) if isinstance(o, fx.Node) else [])
        for sid in outs[-1]:
            pool.hold(sid, "__out__")
    # the graph's frame is gone: values survive only through what it returned
    for n, sids in held.items():
        for sid in sids:
            pool.release(sid, n)
    return outs


def _run_schedule(g: fx.GraphModule, sched, pool: Pool, env: dict, sizer: Sizer, phase: str,
                  setup: TrainingSetup, grads: bool = False, dropped: Optional[Callable[[str], None]] = None) -> list:
    """Simulate one graph as Inductor's generated code runs it (rewrite/inductor_schedule.py): its
    kernel calls in order, with what the code allocates before each and frees after. `env` as for
    _run_graph; `dropped(name)` runs when the generated code drops
    its reference to that input (what else holds it decides whether it is freed); `grads`: the
    outputs are gradients."""
    inputs = _placeholders(g)
    for n in inputs:
        for sid in env.get(n.name, []):
            pool.hold(sid, ("input", phase, n.name))

    def drop(i: int) -> None:
        for sid in env.get(inputs[i].name, []):
            pool.release(sid, ("input", phase, inputs[i].name))
        if dropped is not None:
            dropped(inputs[i].name)
    for t, name in enumerate(sched.names):
        for i in sched.inputs_reused[t]:   # its storage becomes this kernel's output
            drop(i)
        pool.total += sizer.bytes(sched.allocs[t])
        pool.mark(phase, name, max((_op_transient(o, sizer, setup) for o in sched.origins[t]), default=0))
        pool.total -= sizer.bytes(sched.frees[t])
        for i in sched.inputs_done[t]:
            drop(i)
    outs, made = [], {}
    for o, key in zip(sched.outputs, sched.output_keys):
        if o is None:
            outs.append([])
        elif o[0] == "input":
            outs.append(list(env.get(inputs[o[1]].name, [])))
        else:   # a buffer the graph made leaves it as a storage the caller holds
            if key not in made:
                nbytes = sizer.bytes(o[1])
                pool.total -= nbytes
                made[key] = pool.alloc(nbytes, "__made__", grad=grads)
            outs.append([made[key]])
    for sids in outs:
        for sid in sids:
            pool.hold(sid, "__out__")
    for sid in made.values():
        pool.release(sid, "__made__")
    for n in inputs:
        for sid in env.get(n.name, []):
            pool.release(sid, ("input", phase, n.name))
    return outs


def _grad_nodes(bw: fx.GraphModule) -> frozenset:
    """The backward's gradient values: its outputs and what it hands to in-graph optimizer steps."""
    out = {o for o in graph_outputs(bw) if isinstance(o, fx.Node)}
    out |= {n.args[2] for n in bw.graph.nodes
            if n.op == "call_function" and getattr(n.target, "__name__", "") == "grad_ready"}
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
    if has_opt and setup.grad_accum_steps > 1:   # gradients of the earlier micro-batches
        grad_bytes = sum(n for n, _ in trained) * setup.grads.itemsize
        pool.alloc(grad_bytes, "accumulated", grad=True)
    pending = []   # (step, saved-name -> sids, user outputs' sids)
    for k, st in enumerate(steps):
        param_bytes += sum(sizer(node_value(n)) for n, static in zip(_placeholders(st.fw), st.static_inputs)
                           if static and isinstance(node_value(n), torch.Tensor))
        saved, user = _forward(pool, st, k, sizer, setup, hold)
        saved_total += sum(pool.bytes.get(s, 0) for s in {s for sids in saved.values() for s in sids})
        pending.append((k, st, saved, user))
    for k, st, saved, user in reversed(pending):
        if st.bw is not None:
            grad_bytes += _backward(pool, st, k, saved, sizer, setup)
            if not keep_outputs:
                for sid in user:
                    pool.release(sid, ("user", k))
    master = sum(setup.master_bytes(n) for n, _ in trained) if has_opt else 0
    state = sum(setup.state_bytes(n) for n, _ in trained) if has_opt else 0
    if has_opt and not setup.optimizer_in_backward:
        # one parameter at a time (tailorfx.runtime.optim; torch's single-tensor AdamW)
        pool.mark("optimizer", f"{setup.optimizer}.step",
                  max((setup.update_temp_bytes(n) for n, _ in trained), default=0))
    dyn_peak, phase, node = timeline.peak()
    static = param_bytes + master + state
    length = seq_len or next((s.length for s in (seq if isinstance(seq, (list, tuple)) else [seq]) if s), 0)
    device = setup.device.bytes(length) if setup.device is not None else 0
    return MemoryEstimate(peak_bytes=static + dyn_peak + device, static_bytes=static, device_bytes=device,
                          param_bytes=param_bytes, grad_bytes=grad_bytes,
                          optimizer_bytes=state, dynamic_peak_bytes=dyn_peak,
                          saved_bytes=saved_total, peak_phase=phase, peak_node=node,
                          timeline=timeline, master_bytes=master,
                          grads_at_peak=timeline.grads_at_peak(), setup=setup)


def _placeholders(g: fx.GraphModule) -> list[fx.Node]:
    return [n for n in g.graph.nodes if n.op == "placeholder"]


def _forward(pool: Pool, st: StepGraphs, k: int, sizer: Sizer, setup: TrainingSetup,
             hold: Callable[[object], bool] = all_outputs):
    """Run one forward graph: (saved-for-backward name -> storage ids, the held user outputs' ids),
    each held until backward (saved) or the end of the step (the user outputs `hold` keeps)."""
    outs = (_run_schedule(st.fw, st.fw_schedule, pool, {}, sizer, f"forward[{k}]", setup) if st.fw_schedule
            else _run_graph(st.fw, pool, {}, sizer, f"forward[{k}]", setup))
    nodes = graph_outputs(st.fw)
    saved = {}
    for o, sids in zip(nodes[st.num_user_outputs:], outs[st.num_user_outputs:]):
        if isinstance(o, fx.Node):
            saved[o.name] = sids
            for sid in sids:
                pool.hold(sid, ("saved", k, o.name))
    user = [sid for o, sids in zip(nodes[:st.num_user_outputs], outs[:st.num_user_outputs]) if hold(o) for sid in sids]
    for sid in user:
        pool.hold(sid, ("user", k))
    for sids in outs:
        for sid in sids:
            pool.release(sid, "__out__")
    pool.forward_done(k)
    return saved, user


def _backward(pool: Pool, st: StepGraphs, k: int, saved: dict, sizer: Sizer, setup: TrainingSetup) -> int:
    """Run one backward graph and hand its gradients to autograd and the setup; returns the
    bytes of gradients that stay (see _accumulate)."""
    env = {}
    for n in _placeholders(st.bw):
        if n.name in saved:
            env[n.name] = saved[n.name]
        elif n.name.startswith("tangents") and isinstance(node_value(n), torch.Tensor):
            env[n.name] = [pool.alloc(sizer(node_value(n)), ("tangent", k))]

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
        grads = _run_schedule(st.bw, st.bw_schedule, pool, env, sizer, f"backward[{k}]", setup, grads=True,
                              dropped=dropped)
    else:
        grads = _run_graph(st.bw, pool, env, sizer, f"backward[{k}]", setup, _grad_nodes(st.bw),
                           release_saved, consumed)
    for n in _placeholders(st.bw):
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
    tensors: each new storage counts until Python frees it (what autograd saves included)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
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
        return out

    def _free(self, key: int, n: int, _ref) -> None:
        self._seen.pop(key, None)
        self.live -= n
