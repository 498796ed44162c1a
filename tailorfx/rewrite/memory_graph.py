"""One graph simulated by the memory model: its ops run in order in a Pool of live storages, as
fx-generated code runs them (run_graph) or as Inductor's generated code does (run_schedule).

Each op allocates its outputs (views and in-place ops alias their base), an opaque op adds the
bytes it holds inside itself while it runs, and every storage is freed after its last use.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.fx as fx

from tailorfx import compat
from tailorfx.rewrite import match
from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.memory_estimate import Timeline
from tailorfx.rewrite.offload import HOST_OPS
from tailorfx.rewrite.optimizer_step import aliases_input, is_step
from tailorfx.rewrite.trace import Sizer, graph_outputs
from tailorfx.runtime.cpu_scratch import MATMULS, matmul_scratch_bytes
from tailorfx.runtime.flash_cpu import flash_pack_bytes, flash_thread_bytes
from tailorfx.setup import TrainingSetup


class Pool:
    """Storages alive during the simulation, each with the set of values holding it.

    The simulation calls `alloc` for each new storage, `hold`/`release` as holders take and drop
    it (it is freed when the last one does), `mark` after each op (with the bytes the op holds
    inside itself while it runs) and `forward_done` once a forward graph has returned. A
    subclass may override these to observe the step (tailorfx/parallel/profile.py tags each storage
    with the part of the model that made it); it must call the base methods. Holders: the fx
    node whose value it is, `("saved", k, name)` (a forward output saved for backward k),
    `("user", k)` (an output the caller holds), `("grad", k)`, `("tangent", k)`, "__out__" (a
    graph's output on its way to the caller). A host storage (an offloaded activation,
    rewrite/offload.py) counts apart: in `host_total` and the timeline's host peak, not in `total`.
    """

    def __init__(self, timeline: Timeline):
        self.bytes: dict[int, int] = {}
        self.holders: dict[int, set] = {}
        self.grad_sids: set[int] = set()
        self.host_sids: set[int] = set()
        self.host_total = 0
        self.total = 0
        self.grad_total = 0
        self.next_id = 0
        self.timeline = timeline
        self.born: dict[int, int] = {}   # storage -> the timeline point of the op that made it

    def alloc(self, nbytes: int, holder, grad: bool = False, host: bool = False) -> int:
        sid = self.next_id
        self.next_id += 1
        self.born[sid] = len(self.timeline.points)
        self.bytes[sid] = nbytes
        self.holders[sid] = {holder}
        if host:
            self.host_sids.add(sid)
            self.host_total += nbytes
            self.timeline.host_peak = max(self.timeline.host_peak, self.host_total)
            return sid
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
            del self.holders[sid]
            if sid in self.host_sids:
                self.host_sids.discard(sid)
                self.host_total -= nbytes
                return
            self.total -= nbytes
            if sid in self.grad_sids:
                self.grad_sids.discard(sid)
                self.grad_total -= nbytes

    def mark(self, phase: str, node: str, extra: int = 0) -> None:
        self.timeline.points.append((phase, node, self.total + extra))
        self.timeline.grads.append(self.grad_total)
        self.timeline.extras.append(extra)
        self.timeline.hosts.append(self.host_total)

    def forward_done(self, k: int) -> None:
        """Forward graph `k` has returned: what it saved and what the caller holds are held, the
        rest of its outputs freed."""


def _op_transient(node: fx.Node, sizer: Sizer, setup: TrainingSetup, inductor: bool = False) -> int:
    """Bytes an opaque tailorfx op allocates inside itself while it runs (its chunk buffers, or
    one parameter's optimizer update in backward), or an ATen op whose kernel makes a temporary
    (`inductor`: an origin of a kernel Inductor generated, which fuses what it computes)."""
    t = node.target
    if is_step(node):
        g = node_value(node.args[2])
        return setup.update_temp_bytes(sizer(g) // g.element_size()) if isinstance(g, torch.Tensor) else 0
    if t in MATMULS:   # a 16-bit CPU matmul's oneDNN scratchpad (none in a GPU budget's prediction)
        return 0 if setup.device is not None else matmul_scratch_bytes(t, fx.node.map_arg(node.args, node_value))
    if t in (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default):
        # CPU flash attention's per-thread buffers (flash_thread_bytes), and in backward a copy of
        # the output gradient unless it is (B, S, H, D)-strided already (as the backward of
        # transformers' out.transpose(1, 2) makes it)
        if setup.device is not None:
            return 0   # a GPU budget on CPU fake tensors: CUDA's flash scratch is setup.device's term
        backward = t is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        q, k = (node_value(a) for a in (node.args[1:3] if backward else node.args[:2]))
        if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
            return 0
        q_len, kv_len, dim = (sizer.as_int(d) for d in (q.shape[-2], k.shape[-2], q.shape[-1]))
        buffers = flash_thread_bytes(backward, q_len, kv_len, dim, q.dtype)
        if not backward:   # on a CPU with AMX, 16-bit k and v packed for oneDNN
            causal = bool(compat.op_argument(t, "is_causal", node.args, node.kwargs, False))
            shape = tuple(sizer.as_int(d) for d in q.shape)
            return buffers + flash_pack_bytes(shape, sizer.as_int(k.shape[1]), kv_len, q.dtype, causal)
        dout = node_value(node.args[0])
        if not isinstance(dout, torch.Tensor) or sizer.as_int(dout.shape[1]) == 1:
            return buffers
        return buffers + (sizer(dout) if sizer.as_int(dout.stride(1)) != dim else 0)
    role = compat.flex_attention_role(t)
    if role is not None:   # Inductor's FlexAttention kernel, or a GPU budget (Inductor's lowering there): fused
        return 0 if inductor or setup.device is not None else _unfused_flex(node, role, sizer)
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


def _unfused_flex(node: fx.Node, role: str, sizer: Sizer) -> int:
    """The score-sized buffers torch's unfused FlexAttention ('forward' or 'backward' op) holds."""
    from tailorfx.runtime.flex import unfused_transient_bytes
    q, k = node_value(node.args[0]), node_value(node.args[1])
    if not isinstance(q, torch.Tensor):
        return 0
    mods = node.args[3 if role == "forward" else 7]   # the score_mod's graph (a submodule)
    mods = getattr(node.graph.owning_module, mods.target, None) if isinstance(mods, fx.Node) else mods
    softcap = isinstance(mods, fx.GraphModule) and any(
        "tanh" in str(n.target) for n in mods.graph.nodes if n.op == "call_function")
    shape = (sizer.as_int(d) for d in (*q.shape[:3], k.shape[2]))
    return unfused_transient_bytes(role, *shape, q.element_size() == 2, softcap)


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


def eager_last_uses(g: fx.GraphModule, checkpoint_args: bool = False) -> dict[fx.Node, int]:
    """Where eager autograd holds a backward graph's values past their last use in it (the index
    of the op after which each is freed): an autograd node's saved tensors, incoming gradient and
    temporaries until the whole node has run (the ops its AOTAutograd `seq_nr` makes; a custom
    op's saved tensor measured held while its next gradient is made, PowBackward's `self.pow(1)`
    while it multiplies: a formula of at most three ops); with `checkpoint_args` (torch's
    checkpoint wraps the modules themselves), a checkpointed region's inputs until the backward of
    every op it recomputes has run (the checkpoint keeps the arguments it replays the region from:
    a sequence chunk's slice keeps the whole hidden state it was cut from)."""
    nodes = list(g.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    last = {n: max((index[u] for u in n.users), default=index[n]) for n in nodes}
    run_end, ends = {}, {}
    for i in range(len(nodes) - 1, -1, -1):
        nr, nxt = nodes[i].meta.get("seq_nr"), nodes[i + 1] if i + 1 < len(nodes) else None
        run_end[i] = run_end[i + 1] if nr is not None and nxt is not None and nxt.meta.get("seq_nr") == nr else i
    made: dict[int, list[fx.Node]] = {}      # run end -> the tensors its ops make (not views)
    for i, n in enumerate(nodes):
        if n.op == "placeholder" and n.users:
            ends[n] = run_end[last[n]]
        elif n.op == "call_function" and n.meta.get("seq_nr") is not None:
            if not aliases_input(n):
                made.setdefault(run_end[i], []).append(n)
            if n.meta.get("partitioner_tag") != "is_forward":      # not a checkpoint's replay
                for a in n.all_input_nodes:     # the node's saved (or recomputed) inputs and gradient
                    if run_end[index[a]] != run_end[i] and run_end[i] > ends.get(a, last[a]):
                        ends[a] = run_end[i]
    for end, temps in made.items():
        # one C++ formula (a few ops: pow's, rsqrt's, mm's backward) frees its temporaries as it
        # returns; a longer run is Python (DTensor's loss_parallel handlers), freed as it goes
        if len(temps) <= 3:
            ends.update({t: end for t in temps if last[t] < end})
    backward_of, regions = {}, {}
    for i, n in enumerate(nodes):
        tag, nr = n.meta.get("partitioner_tag"), n.meta.get("seq_nr")
        if tag == "is_backward" and nr is not None:
            backward_of[nr] = i
        elif tag == "is_forward" and n.meta.get("ac_graph_id") is not None:
            regions.setdefault(n.meta["ac_graph_id"], []).append(n)
    for members in regions.values() if checkpoint_args else ():
        end = max((backward_of.get(m.meta.get("seq_nr"), -1) for m in members), default=-1)
        inside = set(members)
        for a in {a for m in members for a in m.all_input_nodes} - inside:
            if end > ends.get(a, last[a]):
                ends[a] = end
    return ends


_ADDS = (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)


def never_run(bw: fx.GraphModule, absent: set) -> dict[fx.Node, Optional[fx.Node]]:
    """The nodes of a backward that eager autograd never runs when the tangents named in `absent`
    get no gradient (outputs other than the loss): node -> None where every gradient it reads is
    absent, or -> the one gradient an add sums an absent one with (autograd passes that one on, no
    sum made). A node that reads an absent and a present gradient otherwise runs (on zeros)."""
    flows, out = set(), {}
    for n in bw.graph.nodes:
        if n.op == "placeholder":
            if n.name.startswith("tangents"):
                flows.add(n)
                if n.name in absent:
                    out[n] = None
            continue
        grads = [a for a in n.all_input_nodes if a in flows]
        if not grads or n.op != "call_function":
            continue
        flows.add(n)
        present = [a for a in grads if a not in out or out[a] is not None]
        if not present:
            out[n] = None
        elif n.target in _ADDS and len(grads) == 2 and len(present) == 1:
            out[n] = out.get(present[0], present[0])
    return {n: a for n, a in out.items() if n.op != "placeholder"}


def run_graph(g: fx.GraphModule, pool: Pool, env: dict, sizer: Sizer, phase: str, setup: TrainingSetup,
              grad_nodes: frozenset = frozenset(), inputs_held: Optional[Callable[[], None]] = None,
              grads_consumed: bool = False, last_use: Optional[dict[fx.Node, int]] = None,
              skipped: Optional[dict] = None) -> list:
    """Simulate one graph. `env` maps placeholder names to storage-id lists (pre-existing values);
    values of `grad_nodes` are counted as gradients; `inputs_held` runs once the graph holds its
    inputs (each then lives until its last use in the graph, or the index `last_use` gives,
    unless held elsewhere); `grads_consumed`: each gradient is consumed as it is made (eager
    autograd adding it into an accumulated .grad), not returned with the others; `skipped`: nodes
    that make nothing (never_run), each with no value or the value it passes on."""
    skipped = skipped or {}
    nodes = list(g.graph.nodes)
    forward = phase.startswith("forward")
    index = {n: i for i, n in enumerate(nodes)}
    last = {n: max((index[u] for u in n.users), default=index[n]) for n in nodes}
    last.update({a: max(i, last[a]) for a, i in (last_use or {}).items()})
    ending: dict[int, list] = {}
    for a in last_use or {}:
        ending.setdefault(last[a], []).append(a)
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
        if n in skipped:
            held[n] = list(held.get(skipped[n], [])) if skipped[n] is not None else []
        elif n.op == "call_function" and n.target.__name__ == "getitem" and isinstance(n.args[0], fx.Node):
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
            host = n.target in HOST_OPS
            held[n] = [pool.alloc(sizer(v), n, n in grad_nodes or k in picked, host) if isinstance(v, torch.Tensor)
                       else -1 for k, v in enumerate(vals)]
            held[n] = [s for s in held[n] if s >= 0] if not isinstance(val, (list, tuple)) else held[n]
        for sid in held[n]:
            pool.hold(sid, n)
        pool.mark(phase, n.name, _op_transient(n, sizer, setup))
        for a in set(n.all_input_nodes) | {n} | set(ending.get(i, ())):
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


def run_schedule(g: fx.GraphModule, sched, pool: Pool, env: dict, sizer: Sizer, phase: str,
                 setup: TrainingSetup, grads: bool = False, dropped: Optional[Callable[[str], None]] = None) -> list:
    """Simulate one graph as Inductor's generated code runs it (rewrite/inductor_schedule.py): its
    kernel calls in order, with what the code allocates before each and frees after. `env` as for
    run_graph; `dropped(name)` runs when the generated code drops its reference to that input
    (what else holds it decides whether it is freed); `grads`: the outputs are gradients."""
    inputs = placeholders(g)
    for n in inputs:
        for sid in env.get(n.name, []):
            pool.hold(sid, ("input", phase, n.name))

    def drop(i: int) -> None:
        for sid in env.get(inputs[i].name, []):
            pool.release(sid, ("input", phase, inputs[i].name))
        if dropped is not None:
            dropped(inputs[i].name)
    first = len(pool.timeline.points)   # the timeline point of the schedule's first kernel
    for t, name in enumerate(sched.names):
        for i in sched.inputs_reused[t]:   # its storage becomes this kernel's output
            drop(i)
        pool.total += sizer.bytes(sched.allocs[t])
        pool.mark(phase, name, max((_op_transient(o, sizer, setup, True) for o in sched.origins[t]), default=0))
        pool.total -= sizer.bytes(sched.frees[t])
        for i in sched.inputs_done[t]:
            drop(i)
    outs, made = [], {}
    early = [0] * (len(pool.timeline.grads) - first)   # per kernel: gradient bytes its outputs made
    steps = sched.output_steps or [None] * len(sched.outputs)
    for o, key, step in zip(sched.outputs, sched.output_keys, steps):
        if o is None:
            outs.append([])
        elif o[0] == "input":
            outs.append(list(env.get(inputs[o[1]].name, [])))
        else:   # a buffer the graph made leaves it as a storage the caller holds
            if key not in made:
                nbytes, host = sizer.bytes(o[1]), o[0] == "host"
                if not host:    # already counted by the schedule's allocations
                    pool.total -= nbytes
                made[key] = pool.alloc(nbytes, "__made__", grad=grads, host=host)
                if step is not None:   # made by that kernel, not after the last (rewrite/depth.py repeats it)
                    at = first + min(step, len(sched.names) - 1)
                    pool.born[made[key]] = at
                    if grads and not host:   # a gradient from that kernel on
                        early[at - first] += nbytes
            outs.append([made[key]])
    since = 0
    for t, nbytes in enumerate(early):   # the timeline's gradient bytes, each counted from its kernel
        since += nbytes
        pool.timeline.grads[first + t] += since
    for sids in outs:
        for sid in sids:
            pool.hold(sid, "__out__")
    for sid in made.values():
        pool.release(sid, "__made__")
    for n in inputs:
        for sid in env.get(n.name, []):
            pool.release(sid, ("input", phase, n.name))
    return outs


def placeholders(g: fx.GraphModule) -> list[fx.Node]:
    """The graph's inputs, in order."""
    return [n for n in g.graph.nodes if n.op == "placeholder"]
