"""Predicted time of one training step of a parallel layout, for its slowest rank, from the graph
the memory prediction reads (trace.capture_rank), on a device class (devices.py's DEVICE_CLASSES, or one
measured by calibrate.py):

    predict_step_time(config, tp=2, dp=4, seq_len=8192, device="H100") -> StepTime

compute      each op of the rank's forward and backward graphs (recompute included: the
             partitioner puts the recomputed ops in the backward graph) takes
             max(FLOPs / matmul (or fused attention) rate, bytes read and written / memory bandwidth) plus a dispatch
             overhead (more on DTensors: tensor parallel runs the sharded model eagerly). FLOPs
             are torch.utils.flop_counter's formulas, the CPU flash kernels' and tailorfx's own
             ops' (the fused head: logits, both gradients; mini-sequence regions: their graph's, in
             backward twice more and its forward again but a final linear's; the Triton flash
             kernel: the pairs its mask attends). Views cost nothing. A graph Inductor lowered is
             walked by the kernels it generated: each fused kernel moves the bytes Inductor's
             scheduler counts for it, once, and launches once.
collectives  the ring's steps x latency + its traffic / bandwidth per call: an all-reduce takes
             2(n-1) steps and moves 2(n-1)/n of its bytes, an all-gather, reduce-scatter or
             all-to-all n-1 steps and (n-1)/n; a group inside a node
             uses the links (NVLink), one across nodes the network. tp's collectives are in the
             graph (and two all-reduces per chunk of the vocab-parallel loss); FSDP2's (an
             all-gather per unit in forward, again in backward for the blocks, a reduce-scatter
             per unit) and Ulysses' (all-to-alls of q, k, v and the output, forward and backward)
             are added per layout, as the memory prediction adds their buffers.
pipeline     each pipeline rank's time per micro-batch (its stages' ops and sends); the slowest's
             times microbatches / (1 - bubble).
shared cores on a CPU whose ranks share fewer cores than there are ranks (DeviceClass.shared_cores),
             the ranks' compute cannot take less than all ranks' compute over the cores: a
             pipeline's idle ranks leave their core to the busy ones, other layouts keep all busy.
optimizer    AdamW as a memory-bound pass: read parameters, gradients, master weights and both
             moments, write all but the gradients.
overlap      where the device overlaps FSDP's collectives with compute (CUDA streams), the step
             takes the larger of the two; on CPU (gloo) they add up.
host copies  offload's copies to pinned host memory and back, at the host link's bandwidth on a
             copy stream: only what outlasts its graph's compute counts (a plan's, plan_step_time).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from tailorfx import compat
from tailorfx.attention import BACKWARD_FLOPS, FORWARD_FLOPS, build_spec
from tailorfx.parallel.compose import stage_groups, stage_io
from tailorfx.parallel.devices import DeviceClass, device_class
from tailorfx.parallel.memory import RankMemory, predict_rank_memory
from tailorfx.parallel.plan import head_style
from tailorfx.parallel.spec import ParallelSpec, describe_layout
from tailorfx.parallel.stages import block_costs, stage_blocks
from tailorfx.parallel.trace import RankCapture, capture_rank
from tailorfx.rewrite import cost
from tailorfx.rewrite.capture import node_value
from tailorfx.runtime.triton_ops import attention_kind


@dataclass(frozen=True)
class StepTime:
    """One training step of a layout's slowest rank, predicted, in seconds by part."""
    layout: str
    device: str
    compute_s: float             # the rank's ops, dispatch included, over all its micro-batches
    tp_comm_s: float             # the graph's collectives (tensor parallel, the vocab-parallel loss)
    fsdp_comm_s: float           # FSDP2's all-gathers and reduce-scatters (exposed or hidden: see total)
    ulysses_comm_s: float
    p2p_s: float                 # pipeline sends
    bubble_s: float              # pipeline ranks idle
    optimizer_s: float
    flops: int                   # the rank's FLOPs in the step (recompute included)
    overlap_fsdp: bool = False
    by_kind: tuple = ()          # compute_s by kind: (("gemm", s), ("attention", s), ("other", s)); pp=1 only
    host_copies_s: float = 0.0   # offload's copies to and from the host, what compute does not hide

    @property
    def forward_backward_s(self) -> float:
        work = self.compute_s + self.tp_comm_s + self.ulysses_comm_s + self.p2p_s + self.bubble_s + self.host_copies_s
        return max(work, self.fsdp_comm_s) if self.overlap_fsdp else work + self.fsdp_comm_s

    @property
    def total_s(self) -> float:
        return self.forward_backward_s + self.optimizer_s

    def breakdown(self) -> dict[str, float]:
        return {"compute": self.compute_s, "tp collectives": self.tp_comm_s, "FSDP collectives": self.fsdp_comm_s,
                "Ulysses all-to-alls": self.ulysses_comm_s, "pipeline sends": self.p2p_s,
                "pipeline bubble": self.bubble_s, "host copies": self.host_copies_s, "optimizer": self.optimizer_s}

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.breakdown().items() if v)
        return f"{self.layout} on {self.device}: {self.total_s * 1e3:.1f} ms per step ({parts})"


# ---- one op --------------------------------------------------------------------------------------------
_FREE = {"getitem", "wait_tensor", "detach", "alias", "empty", "zeros", "full", "scalar_tensor", "lift_fresh_copy",
         "reloaded"}
_HOST_COPIES = ("offload", "reload")   # runtime/offload.py's copies, on a stream of their own
# (steps, fraction of the bytes each rank sends) of a ring collective over n ranks
RING = {"all_reduce": lambda n: (2 * (n - 1), 2 * (n - 1) / n),
        "all_gather_into_tensor": lambda n: (n - 1, (n - 1) / n),
        "reduce_scatter_tensor": lambda n: (n - 1, (n - 1) / n),
        "all_to_all_single": lambda n: (n - 1, (n - 1) / n)}
_CPU_FLASH = {"_scaled_dot_product_flash_attention_for_cpu": FORWARD_FLOPS,
              "_scaled_dot_product_flash_attention_for_cpu_backward": BACKWARD_FLOPS}


def _nbytes(x) -> int:
    """Bytes of the tensors in x (nested in lists, tuples and dicts), at their sizes' hints."""
    if isinstance(x, torch.Tensor):
        return compat.size_hint(x.numel()) * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return sum(_nbytes(v) for v in x.values()) if isinstance(x, dict) else 0


def _short(target) -> str:
    return compat.op_short_name(target) or getattr(target, "__name__", str(target))


def _causal(target, args, kwargs) -> bool:
    """An attention kernel's is_causal argument (it attends half the pairs), False if it has none."""
    return bool(compat.op_argument(target, "is_causal", args, kwargs, False))


# a mini-sequence region's op -> how many times it runs its graph's pointwise work: once forward; in
# backward each chunk's forward again, then its backward (about twice the forward's)
_REGIONS = {"token_chunked": 1, "token_segment": 1, "token_chunked_random": 1,
            "token_chunked_backward": 3, "token_segment_backward": 3, "token_chunked_random_backward": 3}


def op_flops(target, args, kwargs, out) -> int:
    """FLOPs of one call: torch's formulas, the CPU flash kernels', tailorfx's ops' (0 if unknown)."""
    if target in (torch.ops.higher_order.run_and_save_rng_state, torch.ops.higher_order.run_with_rng_state):
        inner = args[0] if target is torch.ops.higher_order.run_and_save_rng_state else args[1]
        rest = args[1:] if target is torch.ops.higher_order.run_and_save_rng_state else args[2:]
        return op_flops(inner, rest, kwargs, out[1] if isinstance(out, tuple) else out)
    packet = getattr(target, "overloadpacket", None)
    name = _short(target)
    if packet in flop_registry:
        f = int(flop_registry[packet](*args, **kwargs, out_val=out))
        return f // 2 if _causal(target, args, kwargs) else f     # torch counts every pair
    if name in _CPU_FLASH:
        first = 1 if name.endswith("backward") else 0         # the backward's first argument: grad_out
        q, k = args[first], args[first + 1]
        pairs = q.numel() // q.shape[-1] * k.shape[-2] // (2 if _causal(target, args, kwargs) else 1)
        return _CPU_FLASH[name] * pairs * q.shape[-1]
    if name in ("triton_attention", "triton_attention_backward"):
        return _triton_attention_flops(name, args)
    if name in ("chunked_linear_cross_entropy_with_grads", "vocab_parallel_cross_entropy_with_grads",
                "chunked_linear_cross_entropy", "vocab_parallel_cross_entropy", "triton_linear_cross_entropy"):
        hidden, weight = args[0], args[1]
        rows = hidden.numel() // hidden.shape[-1]
        passes = 3 if name.endswith("with_grads") else 1      # logits, then the two gradients' matmuls
        if name.startswith("triton"):                         # the gradients its arguments ask for
            passes = 1 + bool(args[9]) + bool(args[10])
        return 2 * passes * rows * weight.numel()
    if name in _REGIONS:          # its matmuls; the rest is priced by its bytes (_region_bytes)
        f = _region_scale(name, args) * cost.region_flops(args[0], compat.size_hint, matmuls_only=True)
        if name.endswith("backward"):   # each chunk's forward again (a final linear's not), then its backward
            f = 2 * f + _region_scale(name, args, recompute=True) * cost.region_recompute_flops(
                args[0], compat.size_hint, matmuls_only=True)
        return int(f)
    return 0


def _triton_attention_flops(name: str, args) -> int:
    """tailorfx's Triton flash kernel, forward or backward: flash's FLOPs per pair its mask attends
    (the spec's count: a window's, BigBird's, LongNet's; documents not known here count whole)."""
    back = name.endswith("backward")
    q, k = args[1:3] if back else args[0:2]
    mask, flat, causal = args[7:10] if back else args[4:7]
    rows, heads, seq = (compat.size_hint(d) for d in q.shape[:3])
    if mask == "full":
        pairs = rows * heads * seq * compat.size_hint(k.shape[-2]) // (2 if causal else 1)
    else:
        kind, params = attention_kind(mask, flat)
        pairs = rows * build_spec(kind, tuple(params.items()), causal, 1.0).num_pairs(seq, heads)
    return (BACKWARD_FLOPS if back else FORWARD_FLOPS) * pairs * compat.size_hint(q.shape[-1])


def _region_scale(name: str, args, recompute: bool = False) -> float:
    """A mini-sequence op's tokens over those its region's graph holds (the capture that registered
    its key first, maybe at another length; `recompute`: its recomputed part's, the last capture's):
    a token-wise region's cost scales with them."""
    seq = args[2] if name.endswith("backward") else args[1]
    recorded = cost.region_input_numel(args[0], compat.size_hint, recompute)
    return compat.size_hint(seq[0].numel()) / recorded if recorded else 1.0


def _region_bytes(name: str, args) -> int:
    """A mini-sequence region's pointwise bytes, which its op's FLOPs leave out: its graph's over
    every chunk, as many times as _REGIONS says."""
    times = _REGIONS.get(name)
    return int(times * _region_scale(name, args) * cost.region_bytes(args[0], compat.size_hint)) if times else 0


def _is_attention(target) -> bool:
    if target in (torch.ops.higher_order.run_and_save_rng_state, torch.ops.higher_order.run_with_rng_state):
        return True     # what is recomputed under an RNG state: attention with dropout (its kernel)
    return "attention" in _short(target)


@dataclass
class _GraphTime:
    """Per group (the memory model's parts), compute seconds; and the graph's collectives."""
    compute: dict
    flops: dict
    comm: list                   # (kind, bytes, calls) of each collective in the graph
    kinds: dict                  # the same seconds by kind: attention, gemm (other ops with FLOPs), other
    host_bytes: int = 0          # offload's copies to the host (forward) or back (backward)


def _graph_time(g: fx.GraphModule, group_of: dict, dev: DeviceClass, dtensor: bool,
                generated: Sequence = ()) -> _GraphTime:
    """Each op of `g` priced alone, but those inside a kernel Inductor `generated` (its Schedule's:
    (bytes, nodes)), which take that kernel's bytes, its matmuls' FLOPs, and one launch."""
    compute: dict[int, float] = {}
    flops: dict[int, int] = {}
    kinds: dict[str, float] = {}
    comm, host = [], 0
    overhead = dev.op_overhead + (dev.dtensor_overhead if dtensor else 0.0)
    fused = {n for _, nodes in generated for n in nodes}
    for nbytes, nodes in generated:
        f = sum(compat.size_hint(op_flops(n.target, *fx.node.map_arg((n.args, n.kwargs), node_value), node_value(n)))
                for n in nodes if n.op == "call_function")
        t = max(f / dev.matmul_flops, nbytes / dev.memory_bandwidth) + overhead
        grp = group_of.get(nodes[0].name, 0) if nodes else 0
        compute[grp] = compute.get(grp, 0.0) + t
        flops[grp] = flops.get(grp, 0) + f
        kinds["gemm" if f else "other"] = kinds.get("gemm" if f else "other", 0.0) + t
    for n in g.graph.nodes:
        if n.op != "call_function" or n in fused:
            continue
        name = _short(n.target)
        if name in _FREE or getattr(n.target, "is_view", False):
            continue
        out = node_value(n)
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), node_value)
        if name in RING:
            comm.append((name, _nbytes(args[0]) if name != "all_gather_into_tensor" else _nbytes(out), 1))
            continue
        if name in _HOST_COPIES:
            host += _nbytes(args[0] if name == "offload" else out)
            continue
        if name.startswith("vocab_parallel_cross_entropy"):     # max and sums all-reduced per chunk
            rows = compat.size_hint(args[0].numel() // args[0].shape[-1])
            comm.append(("all_reduce", 3 * rows * 4, 2 * max(1, int(args[7]))))
        f = compat.size_hint(op_flops(n.target, args, kwargs, out))
        nbytes = _nbytes(args) + _nbytes(out)
        grp = group_of.get(n.name, 0)
        attention = _is_attention(n.target)
        t = max(f / (dev.attention_flops if attention else dev.matmul_flops), nbytes / dev.memory_bandwidth) + overhead
        inner = _region_bytes(name, args) / dev.memory_bandwidth     # a region's pointwise ops, after its matmuls
        compute[grp] = compute.get(grp, 0.0) + t + inner
        flops[grp] = flops.get(grp, 0) + f
        kind = "attention" if attention else "gemm" if f else "other"
        kinds[kind] = kinds.get(kind, 0.0) + t
        kinds["other"] = kinds.get("other", 0.0) + inner
    return _GraphTime(compute, flops, comm, kinds, host)


def _host_copies_s(dev: DeviceClass, times: list) -> float:
    """offload's copies, per graph: on a GPU over PCIe on a copy stream, exposed only where they
    outlast the graph's compute (a forward's copies out, a backward's prefetched reloads); where
    host and device share one memory (a CPU), read and written in line."""
    if not dev.host_bandwidth:
        return sum(2 * t.host_bytes for t in times) / dev.memory_bandwidth
    hidden = dev.overlap_fsdp
    return sum(max(0.0, t.host_bytes / dev.host_bandwidth - (sum(t.compute.values()) if hidden else 0.0))
               for t in times)


def _collective_s(dev: DeviceClass, kind: str, nbytes: float, calls: int, size: int, stride: int) -> float:
    """`calls` collectives of `kind` moving `nbytes` in all over a group of `size` ranks `stride`
    apart in the world's order (tp innermost): on the links if the group stays in a node."""
    if size <= 1:
        return 0.0
    latency, bw = dev.link(kind, size * stride <= dev.ranks_per_node)
    steps, fraction = RING[kind](size)
    return calls * steps * latency + nbytes * fraction / bw


# ---- a layout --------------------------------------------------------------------------------------------
def predict_step_time(model_or_config: Any, *, tp: int = 1, dp: int = 1, pp: int = 1, sp: Optional[str] = None,
                      schedule: str = "1f1b", microbatches: Optional[int] = None, seq_len: int, batch_size: int = 1,
                      setup: Any = None, vocab_loss: str = "fused", passes: Optional[list] = None,
                      device: Union[str, DeviceClass] = "H100", memory: Optional[RankMemory] = None,
                      mesh=None) -> StepTime:
    """The slowest rank's step time of a layout (the arguments as predict_rank_memory takes them)
    on `device` (see the module docstring). `memory`: that layout's RankMemory, if predicted
    already (its capture is cached, so only the walk of the graph is new); `mesh`: as
    predict_rank_memory's, a real tp mesh inside torchrun."""
    dev = device_class(device)
    rm = memory or predict_rank_memory(model_or_config, tp=tp, dp=dp, pp=pp, sp=sp, schedule=schedule,
                                       microbatches=microbatches, seq_len=seq_len, batch_size=batch_size,
                                       setup=setup, vocab_loss=vocab_loss, passes=passes, _mesh=mesh)
    spec = ParallelSpec(tp=rm.tp, dp=rm.dp, pp=rm.pp, sp=rm.sp, schedule=schedule,
                        microbatches=rm.microbatches if rm.pp > 1 else None, vocab_loss=vocab_loss)
    ulysses = rm.sp == "ulysses"
    cap = capture_rank(model_or_config, tp=rm.tp, rows=rm.batch_size, seq=seq_len // rm.dp if ulysses else seq_len,
                       dtype=rm.setup.param_dtype, head=head_style(spec), vocab_loss=vocab_loss,
                       passes=spec.rewrites(passes), mesh=mesh)
    key = ("step time", dev, rm.tp > 1)      # one walk of a capture per device class
    if key not in cap.profiles:
        cap.profiles[key] = (_graph_time(cap.steps.fw, cap.fw_group, dev, rm.tp > 1),
                             _graph_time(cap.steps.bw, cap.bw_group, dev, rm.tp > 1) if cap.steps.bw is not None
                             else _GraphTime({}, {}, [], {}))
    fw, bw = cap.profiles[key]
    per_group = {g: fw.compute.get(g, 0.0) + bw.compute.get(g, 0.0) for g in range(cap.num_groups)}
    flops = sum(fw.flops.values()) + sum(bw.flops.values())
    tp_comm = sum(_collective_s(dev, kind, nbytes, calls, rm.tp, 1) for kind, nbytes, calls in fw.comm + bw.comm)
    attentions = len(cap.regions.of_kind("attention"))
    uly = _collective_s(dev, "all_to_all_single", 2 * cap.attn_bytes * attentions, 8 * attentions,
                        rm.dp, rm.tp) if ulysses else 0.0
    opt = _optimizer_s(rm, dev)
    layout = describe_layout(rm.tp, rm.pp, rm.dp, rm.sp)
    world = rm.tp * rm.dp * rm.pp
    share = max(1.0, world / dev.shared_cores) if dev.shared_cores else 1.0
    if rm.pp == 1:
        units = [{g} for g in range(cap.num_groups)]
        return StepTime(layout, dev.name, sum(per_group.values()) * share, tp_comm, _fsdp_s(cap, dev, rm, units), uly,
                        0.0, 0.0, opt * share, flops, dev.overlap_fsdp, _by_kind([fw, bw], share))
    m = rm.microbatches
    ranks = _pipeline_ranks(cap, spec, dev, per_group, tp_comm)
    compute, p2p, tp_share, stages = max(ranks, key=lambda t: t[0] + t[1] + t[2])
    groups = set().union(*stages)
    busy = (compute + p2p + tp_share) * m
    step = busy / (1 - rm.bubble)
    if dev.shared_cores:        # every rank's compute, on the cores they share
        step = max(step, sum(r[0] for r in ranks) * m * rm.tp * rm.dp / dev.shared_cores + (p2p + tp_share) * m)
    flops = sum(fw.flops.get(g, 0) + bw.flops.get(g, 0) for g in groups)
    return StepTime(layout, dev.name, compute * m, tp_share * m, _fsdp_s(cap, dev, rm, stages), 0.0, p2p * m,
                    step - busy, opt * share, flops * m, dev.overlap_fsdp)


def plan_step_time(opt: Any, device: Union[str, DeviceClass] = "H100") -> StepTime:
    """Predicted step time of one process's optimize()d model on `device`: the plan as lowered (each
    graph's forward and backward, walked as a rank's are above) and its optimizer's pass. A plan of a
    config captured shallow (sizing's default) holds fewer blocks than it stands for: ValueError,
    plan it with shallow=False."""
    from tailorfx.planner import partition_for, traced_step
    dev = device_class(device)
    if any(g.seq.depth is not None for g in opt.graph_records):
        raise ValueError("this plan was made on a shallow capture of the config (a few of its blocks stand for "
                         "all): its step time needs the whole model's graphs; plan it with shallow=False")
    times = []
    for g in opt.graph_records:
        st = g.step or traced_step(g.rewritten, partition_for(g.lowering, g.rewritten), opt.setup, False)
        scheds = (st.fw_schedule, st.bw_schedule)   # Inductor's: walked as it generated them
        times += [_graph_time(gm, {}, dev, False) if s is None else _graph_time(s.gm, {}, dev, False, s.generated)
                  for gm, s in zip((st.fw, st.bw), scheds) if gm is not None]
    s, n = opt.setup, sum(p.numel() for p in opt.model.parameters() if p.requires_grad)
    optimizer = _adamw_s(n * s.param_dtype.itemsize, s.master_bytes(n), s.state_bytes(n), n * s.grads.itemsize, dev)
    return StepTime(describe_layout(1, 1, 1, None), dev.name, sum(sum(t.compute.values()) for t in times), 0.0, 0.0,
                    0.0, 0.0, 0.0, optimizer if s.optimizer else 0.0, sum(sum(t.flops.values()) for t in times), False,
                    _by_kind(times), _host_copies_s(dev, times))


def _by_kind(times: list, scale: float = 1.0) -> tuple:
    """StepTime.by_kind of graphs' _GraphTimes: their seconds by kind, summed, times `scale`."""
    return tuple((k, scale * sum(t.kinds.get(k, 0.0) for t in times)) for k in ("gemm", "attention", "other"))


def _fsdp_s(cap: RankCapture, dev: DeviceClass, rm: RankMemory, units: list[set]) -> float:
    """FSDP2's collectives over the dp ranks, per unit (its groups): an all-gather in forward and
    another in backward for a block (reshard_after_forward), one for the root; a reduce-scatter of
    its gradients. A pipeline stage is one unit, gathered once for all its micro-batches."""
    if rm.dp <= 1:
        return 0.0
    grad_ratio = rm.setup.grads.itemsize / rm.setup.param_dtype.itemsize
    roots = {0, len(cap.blocks) + 1}
    total = 0.0
    for unit in units:
        nbytes = sum(cap.group_bytes(g) for g in unit)
        if not nbytes:
            continue
        gathers = 1 if rm.pp > 1 or unit <= roots else 2
        total += _collective_s(dev, "all_gather_into_tensor", nbytes * gathers, gathers, rm.dp, rm.tp)
        total += _collective_s(dev, "reduce_scatter_tensor", nbytes * grad_ratio, 1, rm.dp, rm.tp)
    return total


def _pipeline_ranks(cap: RankCapture, spec: ParallelSpec, dev: DeviceClass, per_group: dict,
                    tp_comm: float) -> list[tuple[float, float, float, list[set]]]:
    """Per micro-batch, of each pipeline rank: (compute, sends, its share of tp's collectives, in
    proportion to its compute; its stages' groups)."""
    blocks_of = stage_blocks(cap.stage_costs or block_costs(cap.gm, cap.regions), spec.num_stages)
    groups = stage_groups(cap, blocks_of)
    io = stage_io(cap, blocks_of)
    whole = sum(per_group.values()) or 1.0
    ranks = []
    for r in range(spec.pp):
        mine = range(r, spec.num_stages, spec.pp)
        compute = sum(per_group[g] for k in mine for g in groups[k])
        sends = sum(dev.latency * 2 + (io[k][2] + io[k][3]) / dev.link_bandwidth for k in mine)
        ranks.append((compute, sends, tp_comm * compute / whole, [groups[k] for k in mine]))
    return ranks


def _optimizer_s(rm: RankMemory, dev: DeviceClass) -> float:
    return _adamw_s(rm.param_bytes, rm.master_bytes, rm.optimizer_bytes, rm.grad_bytes, dev)


def _adamw_s(params: int, master: int, state: int, grads: int, dev: DeviceClass) -> float:
    """AdamW, memory-bound: parameters, gradients, master weights and moments read, all but the
    gradients written."""
    return (2 * (params + master + state) + grads) / dev.memory_bandwidth


__all__ = ["RING", "StepTime", "op_flops", "plan_step_time", "predict_step_time"]
