"""Per-rank memory of a parallel layout (tp, dp, pp, sp), predicted without allocating anything,
and the layout a world of devices should use under a budget.

    predict_rank_memory(config, tp=2, dp=4, seq_len=8192, batch_size=1, setup="amp-bf16")
    plan_world(config, world=64, budget="80GB", seq_len=8192)

Built by composition on the memory model (rewrite/memory.py):

The rank's graph. The model (a config, a zero-argument factory or a module; built or copied under
a FakeTensorMode, so an 8B model holds no memory) is captured at one micro-batch of one rank:
`batch_size` rows of `seq_len` tokens (seq_len/dp under sp). Under tp the runtime's own
`apply_tp` shards it first, with the plan read off its graph (passes/parallel.py), on torch's
fake process group of tp ranks (compat.init_fake_process_group; inside torchrun, on the real tp
mesh), so the captured graph is the one a tp rank runs: DTensor shards, the vocab-parallel head
and loss, the collectives. The memory model simulates that step as eager autograd runs it, and
every storage it allocates is tagged with the part of the model that made it: the root before
the first block (embedding), each block, the root after the last block (norm, head, loss). One
capture per (tp, rows, sequence slice, head style) is cached; everything below re-reads it.

tp: the simulation as it is (ParallelPlan.predict does the same inside torchrun).

dp (FSDP2 as runtime.apply_fsdp applies it: fully_shard on each block, then the root; torch's
defaults). Parameters, master weights, optimizer state and the gradients of finished blocks are
rank 0's shards (FSDP2 splits dim 0 in ceil(d0/dp) rows: rank 0 holds the largest). At each point
of the simulated step FSDP2 adds:
  forward:  the root's unsharded parameters (the root keeps them from its forward to its
            post-backward), the running block's, and the all-gather output of the last group
            gathered (kept until the next copy-out; the last one until the root's post-forward);
  backward: the root's and the running block's unsharded parameters, the next block's
            all-gather (the default backward prefetch of one group), the previous block's
            reduce-scatter input (kept until the next reduce-scatter); the running block's
            gradients whole, the finished blocks' sharded, the root's whole (reduced last);
  at each block's post-backward: its whole gradients, its reduce-scatter input and output.
Unsharded sizes are padded to a multiple of dp rows, as FSDP2 pads them.

pp: the stages cut as the runtime cuts them (pipeline_split.split_points on block_costs of the
same graph, pp * virtual stages). A stage's profile is the tagged simulation restricted to the
stage's own tensors: its live bytes at each point of one micro-batch's forward and backward,
and what it keeps per micro-batch once its forward is done (saved activations, outputs). Each
rank's actions in the schedule (codegen/schedule.py, the order the runtime runs) are walked: a
forward keeps its stage's bytes, a backward frees them; gradients exist from a stage's first
backward on and later ones accumulate into them; what a stage sends (its outputs, the
gradients of its inputs) stays until the step ends, where torch's schedule waits on every send.
The largest total is the rank's peak: the kept micro-batches at that moment are the stage's
`peak_inflight` (simulate_schedule). A pipeline's last stage returns the loss alone (no logits
held through backward, as a training loop holds a model's output). The receive buffers torch's
PipelineStage allocates for every micro-batch (activations in, gradients back) are resident:
communication buffers, outside the step's peak above resident.

sp="ulysses": the dp composition (the dp ranks are FSDP ranks too) on the graph of a
seq_len/dp slice of every row, plus q, k, v and the output of each attention from its forward to
its backward, as communication buffers: Ulysses' attention returns through an all-to-all (a
copy, where SDPA's saved output is the output projection's input itself), and gloo was measured
keeping q, k and v's all-to-all buffers that long too (3 MiB a layer at sp=2 on
benchmarks/parallel.py's model; the predictions are within 2% at sp=2 and sp=4). Where the
collective library frees them sooner this over-estimates, on the safe side.

sp="megatron": the tp composition on the graph of the model sharded with the sequence-parallel
styles too (passes.parallel.infer_sequence_parallel): the stream's norms, residual adds and
all-gathered inputs are in the traced graph, collectives and all.

pp with dp (runtime.apply_fsdp_stages: each stage one fully_shard unit over the dp ranks):
the pipeline walk with the rank's parameters, master weights, optimizer state and finished
gradients as dp shards, plus each stage's whole parameters from its first action to its last
(gathered once, reshard_after_forward=False), and at the reduce-scatter after a stage's last
backward its whole gradients and the reduce-scatter input (FSDP2 frees the gradients before
allocating the output). gloo sometimes frees a stage's all-gather output late (one more copy of
its parameters for part of the step, in about one step in ten on 2-core CPU runs): not counted.

The worst rank: the ranks of a tp, dp or sp group hold the same bytes (FSDP's rank 0 the
largest shard); under pp the stages differ and the worst stage's rank is reported, every
stage's figures with it.

Not modelled: buffers inside collective libraries (NCCL's live outside the caching allocator;
gloo on CPU was measured holding 0 to 3 hidden-state-sized temporaries on some ranks under tp, 2%
of the benchmark's tp=4 peak), FSDP2's MixedPrecisionPolicy (the runtime sets none: gathered
parameters are in the setup's parameter dtype), gradient accumulation across steps (a step is
one micro-batch per rank, or the pipeline's micro-batches), allocator fragmentation (the setup's
headroom and planner.HEADROOM are kept free).
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import math
import weakref
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Union

import torch
import torch.fx as fx
import torch.nn as nn

from tailorfx import compat
from tailorfx.budget import Budget, BudgetError, format_bytes
from tailorfx.rewrite import memory
from tailorfx.rewrite.capture import node_value, seq_info
from tailorfx.rewrite.regions import find_regions, is_param, normalize_path, param_source
from tailorfx.setup import TrainingSetup
from tailorfx.setup import resolve as resolve_setup

MAX_TP = 8          # one node: tensor parallel's all-reduces stay on NVLink


# ---- results ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage: its blocks, where it runs, what it holds."""
    stage: int
    rank: int                   # pipeline rank (stage % pp)
    blocks: tuple[str, ...]
    param_bytes: int            # this tp rank's shard of the stage's parameters
    kept_bytes: int             # activations and outputs kept per micro-batch after its forward
    peak_inflight: int          # micro-batches it keeps at once (the schedule's)
    recv_buffer_bytes: int      # torch's receive buffers, every micro-batch (resident)


@dataclass(frozen=True)
class RankMemory:
    """Predicted memory of the worst rank of a layout, for one training step.

    peak_bytes = resident (parameters, master weights, optimizer state, resident communication
    buffers) + the step's peak above resident (`forward_backward_peak_bytes`, what
    `tailorfx.measure_peak` sees around forward and backward; or the optimizer step's, if larger).
    """
    tp: int
    dp: int
    pp: int
    sp: Optional[str]
    schedule: str
    microbatches: int
    seq_len: int
    batch_size: int
    setup: TrainingSetup
    rank: str                          # which rank is the worst ("any", "pipeline rank 0")
    peak_bytes: int
    param_bytes: int                   # this rank's resident parameters (shards)
    master_bytes: int
    optimizer_bytes: int
    resident_comm_bytes: int           # pipeline receive buffers
    forward_backward_peak_bytes: int   # peak above resident during forward and backward
    at_peak: dict                      # the step's peak above resident, by part (sums to it)
    grad_bytes: int                    # gradients held after backward (this rank's shards)
    stages: tuple[StageMemory, ...] = ()
    bubble: float = 0.0
    notes: tuple[str, ...] = ()
    # under pp, each pipeline rank's (peak, forward_backward_peak, parameter) bytes
    pipeline_ranks: tuple[tuple[int, int, int], ...] = ()

    @property
    def resident_bytes(self) -> int:
        return self.param_bytes + self.master_bytes + self.optimizer_bytes + self.resident_comm_bytes

    def breakdown(self) -> dict[str, int]:
        """The peak split into parameters, gradients, optimizer state (with master weights),
        activations and communication buffers (sums to peak_bytes)."""
        a = self.at_peak
        return {"parameters": self.param_bytes + a.get("gathered parameters", 0),
                "gradients": a.get("gradients", 0),
                "optimizer state": self.optimizer_bytes + self.master_bytes,
                "activations": a.get("activations", 0),
                "communication buffers": self.resident_comm_bytes + a.get("communication buffers", 0)}

    def layout(self) -> str:
        return describe_layout(self.tp, self.pp, self.dp, self.sp)

    def as_estimate(self) -> memory.MemoryEstimate:
        """The same figures as a memory.MemoryEstimate (what opt.predict_memory() returns):
        static = resident, the step's peak as its one timeline point."""
        step = self.peak_bytes - self.resident_bytes
        a = self.at_peak
        timeline = memory.Timeline([("backward", "parallel composition", self.forward_backward_peak_bytes)],
                                   [a.get("gradients", 0)])
        return memory.MemoryEstimate(
            peak_bytes=self.peak_bytes, static_bytes=self.resident_bytes, param_bytes=self.param_bytes,
            grad_bytes=self.grad_bytes, optimizer_bytes=self.optimizer_bytes, dynamic_peak_bytes=step,
            saved_bytes=0, peak_phase="step", peak_node=self.layout(), timeline=timeline,
            master_bytes=self.master_bytes, grads_at_peak=a.get("gradients", 0), setup=self.setup)

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.breakdown().items() if v)
        return f"{self.layout()}: {format_bytes(self.peak_bytes)} per rank ({self.rank}; {parts})"


def describe_layout(tp: int, pp: int, dp: int, sp: Optional[str]) -> str:
    parts = [f"{k}{v}" for k, v in (("tp", tp), ("pp", pp), ("dp", dp)) if v > 1]
    s = "x".join(parts) or "1 rank"
    return s + (f" (sp={sp})" if sp else "")


# ---- the model, built or copied under a FakeTensorMode ----------------------------------------------
def fake_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers are fake tensors (no memory): what the
    predictions shard and capture. Other tensor attributes are copied as they are (small)."""
    mode = _mode_of(model) or compat.FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict = {}
    for t in [*model.parameters(), *model.buffers()]:
        if isinstance(t, compat.FakeTensor):
            memo[id(t)] = t
            continue
        f = mode.from_tensor(t)
        memo[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
    return copy.deepcopy(model, memo)


def _mode_of(model: nn.Module):
    return compat.detect_fake_mode([*model.parameters(), *model.buffers()])


def _source_key(src: Any) -> tuple:
    """The cache key of a model source: a config by its contents, a module or factory by identity
    (checked against a weak reference, so a new object at a recycled id is not mistaken for it)."""
    if isinstance(src, nn.Module) or callable(src) and not hasattr(src, "to_dict"):
        return ("object", id(src))
    if hasattr(src, "to_json_string"):
        return ("hf", src.to_json_string(use_diff=False))
    return ("config", repr(src))


def _param_dtype(src: Any) -> Optional[torch.dtype]:
    """The dtype a module's parameters have, or a Hugging Face config asks for (its `dtype`)."""
    if isinstance(src, nn.Module):
        p = next(src.parameters(), None)
        return p.dtype if p is not None else None
    dtype = getattr(src, "dtype", None) if hasattr(src, "to_dict") else None
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else None


@contextlib.contextmanager
def _fake_model(src: Any, dtype: torch.dtype):
    """A fresh module to shard and capture, and the FakeTensorMode it lives in (entered). A
    config is built in `dtype` (the setup's), whatever dtype it names itself."""
    from tailorfx.sizing import _build
    if isinstance(src, nn.Module):
        model = fake_copy(src)
        mode = _mode_of(model)
        if any(p.is_floating_point() and p.dtype != dtype for p in model.parameters()):
            with mode:
                model = model.to(dtype)       # the setup's weights
    else:
        if hasattr(src, "to_dict") and getattr(src, "dtype", None) is not None:
            src = copy.deepcopy(src)
            src.dtype = dtype
        mode = compat.FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            model = _build(src, dtype)
    with mode:
        yield model


# ---- one capture: the rank's step graph, its parts and their parameters ------------------------------
@dataclass
class _Capture:
    steps: memory.StepGraphs
    seq: Any
    gm: fx.GraphModule
    regions: Any
    blocks: list[str]
    fw_group: dict[str, int]
    bw_group: dict[str, int]
    node_group: dict
    fw_attn: frozenset
    bw_attn: frozenset
    params: list[list[tuple[tuple[int, ...], int]]]   # per group: (tp-local shape, itemsize) of each parameter
    attn_bytes: int                 # q, k, v and output of one attention
    heads: tuple[int, int]          # its query and key/value heads (this tp rank's)
    scope: Callable                 # the context the graph is traced under (loss_parallel)
    profiles: dict = field(default_factory=dict)
    owner: Any = None               # a weak reference to the module or factory captured (None: a config)
    wgrad: list = field(default_factory=list)   # per group: output bytes of its ops that take a parameter

    @property
    def num_groups(self) -> int:
        return len(self.blocks) + 2

    def group_bytes(self, g: int) -> int:
        return sum(math.prod(s) * b for s, b in self.params[g])


_CAPTURES: dict[tuple, _Capture] = {}
_TP_PLANS: dict[tuple, Any] = {}
_CACHE_SIZE = 16


def clear_cache() -> None:
    """Forget cached captures (each holds a traced graph of the model)."""
    _CAPTURES.clear()
    _TP_PLANS.clear()


_MESH_IDS = itertools.count()


def _capture(src: Any, *, tp: int, rows: int, seq: int, head: str, dtype: torch.dtype, mesh=None) -> _Capture:
    key = (_source_key(src), tp, rows, seq, head if tp > 1 else "", dtype)
    hit = _CAPTURES.get(key)
    if hit is not None and (hit.owner is None or hit.owner() is src):
        return hit
    import torch.distributed as dist
    own_group = False
    if tp > 1 and mesh is None:
        if dist.is_initialized():
            raise RuntimeError(f"predicting tp={tp} needs a process group of {tp} ranks to shard a fake copy "
                               f"on, and this process already has one (world {dist.get_world_size()}): call it "
                               f"outside torchrun, or through opt.predict_memory() of the sharded model")
        compat.init_fake_process_group(tp)
        own_group = True
    try:
        if own_group:
            from torch.distributed.device_mesh import init_device_mesh
            on = _device(src).type if isinstance(src, nn.Module) else "cpu"
            # a new name each time: DTensor caches sharding decisions by mesh equality, and a decision
            # cached from an earlier capture's (destroyed) mesh leaks that mesh into this graph, where
            # AOTAutograd then fails ("Node tangents_4 was invalid, but is output")
            mesh = init_device_mesh(on if on == "cpu" or torch.cuda.is_available() else "cpu", (tp,),
                                    mesh_dim_names=(f"tp_capture{next(_MESH_IDS)}",))
        cap = _capture_on(src, key, tp=tp, rows=rows, seq=seq, head=head, dtype=dtype, mesh=mesh)
    finally:
        if own_group:
            dist.destroy_process_group()
    if key[0][0] == "object":
        try:
            cap.owner = weakref.ref(src)
        except TypeError:     # not weakly referenceable: not cached
            return cap
    while len(_CAPTURES) >= _CACHE_SIZE:
        _CAPTURES.pop(next(iter(_CAPTURES)))
    _CAPTURES[key] = cap
    return cap


def _capture_on(src, key, *, tp, rows, seq, head, dtype, mesh) -> _Capture:
    from tailorfx.codegen.lower import partition_for
    from tailorfx.codegen.pipeline import capture_static
    scope = contextlib.nullcontext
    with _fake_model(src, dtype) as model:
        ids = torch.zeros(rows, seq, dtype=torch.long, device=_device(model))
        batch = {"input_ids": ids, "labels": ids}
        if tp > 1:
            styles = _tp_styles(model, src, dtype, tp, head)
            _apply_tp(model, styles, mesh)
            if any(st.startswith("colwise_vocab_parallel") for st in styles.values()):
                from torch.distributed.tensor.parallel import loss_parallel
                scope = loss_parallel
        with scope():
            gm, _, _ = capture_static(model, batch)
        local = {}
        for name, p in model.named_parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            local[name] = (tuple(t.shape), t.element_size(), p.requires_grad)
    with scope():     # AOTAutograd outside the model's fake mode (it makes its own), collectives still known
        steps = memory.trace_step(gm, None, partition_for("dynamo", gm), None)
    steps = replace(steps, eager_autograd=True)
    return _annotate(gm, steps, local, scope)


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _tp_plan(src: Any, dtype: torch.dtype, model: Optional[nn.Module] = None):
    """The TP plan read off the model's graph (passes/parallel.py), once per model: it does not
    depend on tp. `model`: an already built fake copy to read it from."""
    from tailorfx.parallelize import plan_tensor_parallel
    key = _source_key(src)
    hit = _TP_PLANS.get(key)
    if hit is not None and (hit[1] is None or hit[1]() is src):
        return hit[0]
    ids = torch.zeros(1, 16, dtype=torch.long)
    with (contextlib.nullcontext(model) if model is not None else _fake_model(src, dtype)) as m:
        plan, _ = plan_tensor_parallel(m, (), {"input_ids": ids.to(_device(m)), "labels": ids.to(_device(m))})
    try:
        owner = weakref.ref(src) if key[0] == "object" else None
    except TypeError:
        return plan
    _TP_PLANS[key] = (plan, owner)
    return plan


def _tp_styles(model: nn.Module, src: Any, dtype: torch.dtype, tp: int, head: str) -> dict[str, str]:
    """The plan's styles, checked against tp; `head` "gather": the LM head gathers its logits
    (as the runtime shards it for pipeline stages); "sequence": with sp="megatron"'s styles."""
    plan = _tp_plan(src, dtype, model)
    plan.check(tp)
    if head == "sequence":
        if plan.sequence_error:
            from tailorfx.passes.parallel import SequenceParallelError
            raise SequenceParallelError(plan.sequence_error)
        return {**plan.styles, **plan.sequence}
    if head == "gather":
        return {f: ("colwise_gather_output" if s == "colwise_vocab_parallel" else s) for f, s in plan.styles.items()}
    return dict(plan.styles)


def _apply_tp(model: nn.Module, styles: dict[str, str], mesh) -> None:
    """runtime.apply_tp's styles, without the scatter from rank 0 that distribute_tensor does by
    default (a real mesh inside torchrun must not see collectives on fake tensors)."""
    from torch.distributed.tensor.parallel import parallelize_module
    from tailorfx.runtime.tensor_parallel import _style
    plan = {}
    for fqn, s in styles.items():
        style = _style(s)
        if hasattr(style, "src_data_rank"):
            style.src_data_rank = None
        plan[fqn] = style
    parallelize_module(model, mesh, plan)


def _stack_paths(meta: Optional[dict]) -> list[str]:
    paths = [normalize_path(v[0] if isinstance(v, tuple) else str(v)) for v in (meta or {}).values()]
    return [p for p in paths if p]


def _groups(g: fx.GraphModule, key: str, block_index: dict[str, int], backward: bool) -> dict[fx.Node, int]:
    """Node -> part: 1 + block index inside a block; outside blocks, the root before the first
    block (0) or after the last one (L+1), in forward order (backward runs the head's first)."""
    L = len(block_index)
    nodes = [n for n in g.graph.nodes if n.op not in ("placeholder", "output")]
    found: dict[fx.Node, Optional[int]] = {}
    for n in nodes:
        found[n] = next((block_index[p] for p in _stack_paths(n.meta.get(key)) if p in block_index), None)
    inside = [i for i, n in enumerate(nodes) if found[n] is not None]
    out: dict[fx.Node, int] = {}
    first, last = (inside[0], inside[-1]) if inside else (len(nodes), len(nodes))
    before, after = (L + 1, 0) if backward else (0, L + 1)
    prev = before
    for i, n in enumerate(nodes):
        if found[n] is not None:
            prev = out[n] = 1 + found[n]
        else:
            out[n] = before if i < first else after if i > last else prev
    return out


def _annotate(gm: fx.GraphModule, steps: memory.StepGraphs, local: dict, scope) -> _Capture:
    seq = seq_info(gm, None)
    regions = find_regions(gm, seq)
    blocks = [r.path for r in regions.of_kind("block")]
    index = {b: i for i, b in enumerate(blocks)}
    fw = _groups(steps.fw, "nn_module_stack", index, False)
    bw = _groups(steps.bw, "fwd_nn_module_stack", index, True) if steps.bw is not None else {}
    attn_paths = {r.path for r in regions.of_kind("attention")}
    fw_attn = frozenset(n.name for n in fw if attn_paths & set(_stack_paths(n.meta.get("nn_module_stack"))))
    bw_attn = frozenset(n.name for n in bw if attn_paths & set(_stack_paths(n.meta.get("fwd_nn_module_stack"))))
    # each module's part: the part of the first forward node inside it
    module_group: dict[str, int] = {}
    for n, grp in fw.items():
        for p in _stack_paths(n.meta.get("nn_module_stack")):
            module_group.setdefault(p, grp)
    L = len(blocks)
    params: list[list] = [[] for _ in range(L + 2)]
    for name, (shape, itemsize, trained) in local.items():
        if not trained:
            continue
        mod = name.rsplit(".", 1)[0] if "." in name else ""
        blk = next((i for i, b in enumerate(blocks) if name.startswith(b + ".")), None)
        grp = 1 + blk if blk is not None else module_group.get(mod, 0)
        params[grp].append((shape, itemsize))
    attn_bytes, heads, kv_heads = _attention(gm)
    return _Capture(steps, seq, gm, regions, blocks, {n.name: v for n, v in fw.items()},
                    {n.name: v for n, v in bw.items()}, {**fw, **bw}, fw_attn, bw_attn, params,
                    attn_bytes, (heads, kv_heads), scope, wgrad=_weight_grad_inputs(gm, index))


def _weight_grad_inputs(gm: fx.GraphModule, index: dict[str, int]) -> list[int]:
    """Per group, the bytes of the outputs of ops that combine a trained parameter with an
    activation (linears, a norm's weight product): a zero-bubble input-gradient pass (torch's
    `stage_backward_input`) keeps the gradient of each until the weight pass that reads it."""
    out = [0] * (len(index) + 2)
    for n, grp in _groups(gm, "nn_module_stack", index, False).items():
        v = node_value(n)
        if n.op not in ("call_function", "call_method") or not isinstance(v, torch.Tensor) or not v.requires_grad:
            continue
        ins = [a for a in n.all_input_nodes if isinstance(node_value(a), torch.Tensor)]
        trained = [a for a in ins if is_param(a, through_casts=True) and node_value(param_source(a)).requires_grad]
        if trained and any(a not in trained and node_value(a).requires_grad for a in ins):
            t = v.to_local() if hasattr(v, "to_local") else v     # a DTensor: this rank's shard
            out[grp] += t.numel() * t.element_size()
    return out


def _attention(gm: fx.GraphModule) -> tuple[int, int, int]:
    """Bytes of q, k, v and the output of the first scaled-dot-product attention in the graph,
    and its query and key/value head counts (zeros if there is none)."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and "scaled_dot_product" in getattr(n.target, "__name__", ""):
            vals = [node_value(a) for a in n.args[:3] if isinstance(a, fx.Node)] + [node_value(n)]
            vals = [v[0] if isinstance(v, (tuple, list)) else v for v in vals]
            nbytes = sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))
            heads = [v.shape[1] if isinstance(v, torch.Tensor) and v.dim() == 4 else 0 for v in vals[:2]]
            return nbytes, *heads
    return 0, 0, 0


# ---- the tagged simulation ----------------------------------------------------------------------
@dataclass
class _Point:
    kind: str            # "f" forward, "b" backward, "e" the forward ended (its outputs released)
    group: int
    attn: bool
    live: tuple          # bytes live per part (transient of the running op in its part)
    grads: tuple         # gradient bytes live per part
    saved_freed: tuple = ()   # bytes per part of the forward's saved tensors backward has freed so far


class _TaggedPool(memory._Pool):
    """The memory model's pool, also counting live bytes per part of the model."""

    def __init__(self, cap: _Capture):
        super().__init__(memory.Timeline())
        self.cap = cap
        n = cap.num_groups
        self.live, self.glive = [0] * n, [0] * n
        self.sid_group: dict[int, int] = {}
        self.current = n - 1
        self.points: list[_Point] = []
        self.saved_sids: set[int] = set()
        self.saved_freed = [0] * n

    def alloc(self, nbytes: int, holder, grad: bool = False) -> int:
        sid = super().alloc(nbytes, holder, grad)
        g = self.cap.node_group.get(holder, self.current) if isinstance(holder, fx.Node) else self.current
        self.sid_group[sid] = g
        self.live[g] += nbytes
        if grad:
            self.glive[g] += nbytes
        return sid

    def hold(self, sid: int, holder) -> None:
        super().hold(sid, holder)
        if isinstance(holder, tuple) and holder[0] == "saved" and sid in self.bytes:
            self.saved_sids.add(sid)

    def release(self, sid: int, holder) -> None:
        nbytes, was_grad = self.bytes.get(sid), sid in self.grad_sids
        super().release(sid, holder)
        if nbytes is not None and sid not in self.bytes:
            g = self.sid_group.pop(sid)
            self.live[g] -= nbytes
            if was_grad:
                self.glive[g] -= nbytes
            if sid in self.saved_sids:
                self.saved_sids.discard(sid)
                self.saved_freed[g] += nbytes

    def mark(self, phase: str, node: str, extra: int = 0) -> None:
        kind = "f" if phase.startswith("forward") else "b" if phase.startswith("backward") else "o"
        if kind != "o":
            names = self.cap.fw_group if kind == "f" else self.cap.bw_group
            self.current = names.get(node, self.current)
            attn = node in (self.cap.fw_attn if kind == "f" else self.cap.bw_attn)
            live = list(self.live)
            live[self.current] += extra
            self.points.append(_Point(kind, self.current, attn, tuple(live), tuple(self.glive),
                                      tuple(self.saved_freed)))


def _profile(cap: _Capture, setup: TrainingSetup, keep_outputs: bool = True) -> list[_Point]:
    """The step simulated under `setup`, each point's live bytes split by part (cached).
    `keep_outputs`: the caller holds the model's outputs (logits) through backward, as a training
    loop does; a pipeline's last stage returns only the loss."""
    key = (setup.param_dtype, setup.grads, setup.optimizer, setup.optimizer_in_backward, setup.master_weights,
           keep_outputs)
    if key not in cap.profiles:
        s = setup.with_(grad_accum_steps=1)
        pool = _TaggedPool(cap)
        sizer = memory.Sizer(cap.seq, None)
        saved = _forward(pool, cap.steps, sizer, s, keep_outputs)
        if cap.steps.bw is not None:
            memory._backward(pool, cap.steps, 0, saved, sizer, s)
        cap.profiles[key] = pool.points
    return cap.profiles[key]


def _forward(pool: _TaggedPool, st: memory.StepGraphs, sizer, setup: TrainingSetup, keep_outputs: bool) -> dict:
    """memory._forward, except that without `keep_outputs` only a scalar output (the loss) is held."""
    from tailorfx.rewrite.trace import _outputs
    outs = memory._run_graph(st.fw, pool, {}, sizer, "forward[0]", setup)
    nodes = _outputs(st.fw)
    saved = {}
    for o, sids in zip(nodes[st.num_user_outputs:], outs[st.num_user_outputs:]):
        if isinstance(o, fx.Node):
            saved[o.name] = sids
            for sid in sids:
                pool.hold(sid, ("saved", 0, o.name))
    for o, sids in zip(nodes[:st.num_user_outputs], outs[:st.num_user_outputs]):
        v = node_value(o) if isinstance(o, fx.Node) else None
        if keep_outputs or (isinstance(v, torch.Tensor) and v.dim() == 0):
            for sid in sids:
                pool.hold(sid, ("user", 0))
    for sids in outs:
        for sid in sids:
            pool.release(sid, "__out__")
    # what the forward leaves: a last stage keeps this per micro-batch (its logits are gone)
    pool.points.append(_Point("e", pool.current, False, tuple(pool.live), tuple(pool.glive), tuple(pool.saved_freed)))
    return saved


# ---- compositions ------------------------------------------------------------------------------------
_PARTS = ("activations", "gradients", "gathered parameters", "communication buffers")


def _best(cands) -> tuple[int, dict]:
    """The largest (activations, gradients, gathered, comm) candidate, as (total, parts)."""
    best, parts = -1, {}
    for c in cands:
        t = sum(c)
        if t > best:
            best, parts = t, dict(zip(_PARTS, c))
    return max(best, 0), parts


def _sharded(shapes, n: int) -> tuple[int, int]:
    """(rank 0's shard, the padded whole) bytes of parameters FSDP2 splits over n ranks on dim 0."""
    shard = padded = 0
    for shape, itemsize in shapes:
        d0 = shape[0] if shape else 1
        rest = math.prod(shape[1:]) if len(shape) > 1 else 1
        rows = -(-d0 // n)
        shard += rows * rest * itemsize
        padded += rows * n * rest * itemsize
    return shard, padded


def _shard_shapes(shapes, n: int) -> list[tuple[tuple[int], int]]:
    """Each parameter as rank 0's FSDP2 shard over n ranks: ((elements,), itemsize)."""
    return [((_sharded([sh], n)[0] // sh[1],), sh[1]) for sh in shapes]


def _tp_peak(points: list[_Point]) -> tuple[int, dict]:
    return _best((sum(p.live) - sum(p.grads), sum(p.grads), 0, 0) for p in points if p.kind in ("f", "b"))


def _summary(cap: _Capture, points: list[_Point]) -> list[tuple]:
    """Per point of forward and backward, what the dp compositions read, computed once:
    (kind, part, activations, gradients, gradients of finished blocks, attention layers live).
    Layers live: whose attention ran forward and has not run backward (Ulysses)."""
    key = ("summary", id(points))
    if key in cap.profiles:
        return cap.profiles[key]
    L = len(cap.blocks)
    out = []
    passed, in_attn, prev_group = False, False, None
    for p in points:
        if p.kind not in ("f", "b"):
            continue
        g = p.group
        block = 1 <= g <= L
        if g != prev_group:
            passed, in_attn, prev_group = False, False, g
        if p.attn:
            in_attn = True
            passed = passed or p.kind == "f"
        elif in_attn and p.kind == "b":
            passed = True          # its attention's backward is done
        layers = (g - 1 + (passed if p.kind == "f" else not passed)) if block else (L if g == L + 1 else 0)
        gtot = sum(p.grads)
        finished = sum(p.grads[1:L + 1]) - (p.grads[g] if block else 0)
        out.append((p.kind, g, sum(p.live) - gtot, gtot, finished, layers))
    cap.profiles[key] = out
    return out


def _fsdp_peak(cap: _Capture, points: list[_Point], dp: int, attn_comm: int = 0) -> tuple[int, dict]:
    """The step's peak above resident under FSDP2 over dp ranks (see the module docstring)."""
    L = len(cap.blocks)
    shard, pad = zip(*(_sharded(cap.params[g], dp) for g in range(L + 2)))
    full_blocks = sum(cap.group_bytes(g) for g in range(1, L + 1))
    ratio = sum(shard[1:L + 1]) / full_blocks if full_blocks else 0.0    # finished blocks keep their shards
    root_pad = pad[0] + pad[L + 1]
    p_ = lambda g: pad[g] if 1 <= g <= L else 0
    cands = []
    last_b: dict[int, tuple] = {}
    for kind, g, act, gtot, finished, layers in _summary(cap, points):
        block = 1 <= g <= L
        comm = attn_comm * layers
        if kind == "f":
            held_ag = p_(g) if block else (root_pad if g == 0 else pad[L])
            cands.append((act, gtot, root_pad + p_(g), held_ag + comm))
            continue
        grads = gtot - finished * (1 - ratio)
        last_b[g] = (act, grads)
        prefetch = p_(g - 1) if block else (pad[L] if g == L + 1 else 0)
        rs_held = p_(g + 1) if block else (pad[1] if g == 0 and L else 0)
        cands.append((act, grads, root_pad + p_(g), prefetch + rs_held + comm))
    for g, (act, grads) in last_b.items():    # post-backward: whole gradients copied into the reduce-scatter input
        if 1 <= g <= L:
            cands.append((act, grads + shard[g], root_pad, pad[g] + p_(g - 1)))
        elif g == 0:                   # the root's, at the end of backward
            cands.append((act, grads + shard[0] + shard[L + 1], 0, root_pad))
    return _best(cands)


@dataclass
class _Stage:
    groups: set
    fwd: list           # (non-gradient bytes, gradient bytes) of its own tensors at each forward point
    bwd: list
    kept: int
    grads: int
    largest_grad: int
    wgrad: int = 0      # what a zero-bubble input-gradient pass keeps for the weight pass (beside `kept`)
    # a zero-bubble input-gradient pass runs with retain_graph (torch's stage_backward_input):
    # the saved tensors a plain backward frees as it goes stay held, at each backward point
    bwd_retained: list = field(default_factory=list)


def _stage_profiles(cap: _Capture, points: list[_Point], stage_blocks: list[list[str]], setup) -> list[_Stage]:
    L = len(cap.blocks)
    index = {b: i for i, b in enumerate(cap.blocks)}
    n = len(stage_blocks)
    groups = []
    for k, blocks in enumerate(stage_blocks):
        gs = {1 + index[b] for b in blocks}
        if k == 0:
            gs.add(0)
        if k == n - 1:
            gs.add(L + 1)
        groups.append(gs)
    stage_of = {g: k for k, gs in enumerate(groups) for g in gs}
    fw_points = [p for p in points if p.kind == "f"]
    out = []
    for k, gs in enumerate(groups):
        own = lambda p: (sum(p.live[g] - p.grads[g] for g in gs), sum(p.grads[g] for g in gs))
        fwd = [own(p) for p in fw_points if p.group in gs]
        bwd = [own(p) for p in points if p.kind == "b" and p.group in gs]
        retained = [(ng + sum(p.saved_freed[g] for g in gs), g_) for (ng, g_), p in
                    zip(bwd, [p for p in points if p.kind == "b" and p.group in gs])]
        nxt = next((p for p in fw_points if stage_of.get(p.group, -1) > k), None)
        end = nxt if nxt is not None else next((p for p in points if p.kind == "e"), None)
        kept = sum(own(end)) if end is not None else 0
        ratio = setup.grads.itemsize / setup.param_dtype.itemsize
        shapes = [s for g in gs for s in cap.params[g]]
        gbytes = int(sum(math.prod(s) * b for s, b in shapes) * ratio)
        largest = int(max((math.prod(s) * b for s, b in shapes), default=0) * ratio)
        wgrad = sum(cap.wgrad[g] for g in gs) if cap.wgrad else 0     # activation gradients: their own dtype
        out.append(_Stage(gs, fwd, bwd, kept, gbytes, largest, wgrad, retained))
    return out


def _pipeline_walk(stages: list[_Stage], io: list, schedule, rank: int,
                   fsdp: Optional[dict] = None) -> tuple[int, dict]:
    """The rank's actions in order; the largest (kept + running + gradients + gathered
    parameters + sends held) total. What a stage sends (its outputs after a forward, its input
    gradients after a backward) stays until the step ends: torch's runtime waits on every send
    there. `fsdp` (pp with dp: each stage one fully_shard unit), stage -> (padded whole
    parameters, padded whole gradients, gradient shard): the runtime gathers a stage's
    parameters before its first action and keeps them to its last (reshard_after_forward=False);
    its gradients stay whole until the reduce-scatter after its last backward: FSDP2 copies them
    into the reduce-scatter input, frees them, then allocates the output (the shard it keeps)."""
    held: dict[int, int] = defaultdict(int)
    pending_w: dict[int, list] = defaultdict(list)   # zero-bubble: what each micro-batch holds from I to W
    done: set = set()
    fsdp = fsdp or {}
    gathered = sum(fsdp[t][0] for t in {a.stage for a in schedule.actions[rank]} if t in fsdp)
    left = defaultdict(int)     # backward actions (B, or W) each stage has still to run
    for a in schedule.actions[rank]:
        left[a.stage] += a.kind in ("B", "W")
    reduced: set = set()
    sends = 0
    cands = []
    def held_now() -> tuple[int, int]:
        """(activations kept, gradients held) between actions."""
        kept = sum(held[t] * stages[t].kept for t in held) + sum(sum(v) for v in pending_w.values())
        return kept, sum(fsdp[t][2] if t in reduced else stages[t].grads for t in done)

    for a in schedule.actions[rank]:
        s = a.stage
        st = stages[s]
        kept, grads = held_now()
        if a.kind == "F":
            ng, g = max(st.fwd, key=sum, default=(0, 0))
            cands.append((kept + ng, grads + g, gathered, sends))
            held[s] += 1
        elif a.kind == "I" and s == 0:
            # the first stage has no input to take a gradient for: torch's runtime defers its whole
            # backward to the "W", the micro-batch's activations held until then
            held[s] -= 1
            pending_w[s].append(st.kept)
            sends += io[s][2] + io[s][3]
        elif a.kind in ("B", "I") or (a.kind == "W" and s == 0):
            first_w = a.kind == "W"
            if first_w:
                kept -= pending_w[s].pop(0)
            else:
                kept -= st.kept    # this micro-batch's own activations are inside the backward's profile
            profile = st.bwd_retained if a.kind == "I" and st.bwd_retained else st.bwd
            if s in done:      # a later micro-batch: each new gradient is added into the held one
                ng, g = max(((ng, min(g, st.largest_grad)) for ng, g in profile), key=sum, default=(0, 0))
            else:
                ng, g = max(profile, key=sum, default=(0, 0))
            if not first_w:
                sends += io[s][2]              # this micro-batch's sent outputs: kept (above) until now
            cands.append((kept + ng, grads + g, gathered, sends))
            if not first_w:
                sends += io[s][3]
                held[s] -= 1
            if a.kind != "I":
                done.add(s)
            else:   # "I" (zero-bubble): the input gradient only; until its "W" the stage keeps the
                # gradient of each op output a parameter's gradient is computed from, and the
                # micro-batch's autograd graph below those ops with its saved activations (counted
                # whole: torch frees the part above the last weight op, the loss's on the last
                # stage, once it detaches the stage's output: over by that, the safe side)
                pending_w[s].append(st.kept + st.wgrad)
        elif a.kind == "W":
            cands.append((kept, grads + st.grads if s not in done else grads, gathered, sends))
            if pending_w[s]:
                pending_w[s].pop(0)
            done.add(s)
        left[s] -= a.kind in ("B", "W")
        if s in fsdp and a.kind in ("B", "W") and left[s] == 0:    # REDUCE_GRAD, then RESHARD
            kept, grads = held_now()
            cands.append((kept, grads, gathered, sends + fsdp[s][1]))
            reduced.add(s)
            gathered -= fsdp[s][0]
    return _best(cands)


def _stage_io(cap: _Capture, stage_blocks: list[list[str]]) -> list[tuple[int, int, int, int]]:
    """Per stage, bytes of one micro-batch's: values it receives, gradients it receives back for
    what it sends (torch allocates buffers for both, for every micro-batch, once), values it
    makes and sends, and gradients it sends back for what it received and that requires grad
    (the runtime keeps every send until the step ends)."""
    from tailorfx.codegen.pipeline import stage_of_nodes
    n = len(stage_blocks)
    stage_of_block = {b: k for k, bs in enumerate(stage_blocks) for b in bs}
    block_stage = {name: stage_of_block[r.path] for r in cap.regions.of_kind("block") for name in r.nodes}
    stage = stage_of_nodes(cap.gm, block_stage)
    users = {nd: max((stage.get(u, n - 1) for u in nd.users), default=-1) for nd in stage}
    recv, grad_recv, sent, grad_sent = [0] * n, [0] * n, [0] * n, [0] * n
    for nd, k in stage.items():
        v = node_value(nd)
        if not isinstance(v, torch.Tensor) or users[nd] <= k:
            continue
        nbytes = v.numel() * v.element_size()
        sent[k] += nbytes
        for j in range(k + 1, users[nd] + 1):
            recv[j] += nbytes
            if v.is_floating_point():
                grad_recv[j - 1] += nbytes
            if v.requires_grad:
                grad_sent[j] += nbytes
    return list(zip(recv, grad_recv, sent, grad_sent))


# ---- predict_rank_memory -------------------------------------------------------------------------------
def predict_rank_memory(model_or_config: Any, *, tp: int = 1, dp: int = 1, pp: int = 1, sp: Optional[str] = None,
                        schedule: str = "1f1b", microbatches: Optional[int] = None, seq_len: int,
                        batch_size: int = 1, setup: Any = None, rank: Optional[int] = None, _mesh=None) -> RankMemory:
    """Memory of the worst rank of a parallel layout for one training step, predicted by
    composition on the memory model (see the module docstring); nothing is allocated.

    `model_or_config`: a Hugging Face or tailorfx config, a zero-argument factory, or a module
    (copied with fake tensors). `batch_size`: the rows of one rank's micro-batch (under pp each
    of the `microbatches` micro-batches, default pp, has that many rows; under sp every rank
    takes every row and seq_len/dp of its tokens). `setup`: a TrainingSetup or preset name
    (default: the model's dtype with AdamW). `rank`: under pp, that pipeline rank's memory
    instead of the worst's. The layout is checked as optimize(parallel=...) checks it (ValueError
    for one the runtime refuses, such as sp="ulysses" with tp).
    """
    from tailorfx.codegen.schedule import build_schedule, simulate_schedule
    from tailorfx.options import positive_int
    from tailorfx.parallelize import check_parallel
    spec = check_parallel({"tp": tp, "dp": dp, "pp": pp, "sp": sp, "schedule": schedule,
                           "microbatches": microbatches or pp})
    positive_int("seq_len", seq_len, allow_none=False)
    positive_int("batch_size", batch_size, allow_none=False)
    m, v = spec["microbatches"], spec["virtual"]
    s = resolve_setup(setup, param_dtype=_param_dtype(model_or_config))
    ulysses = sp == "ulysses"
    if ulysses and seq_len % dp:
        raise ValueError(f"sp='ulysses' over dp={dp} ranks needs a sequence length divisible by {dp}, got {seq_len}")
    seq = seq_len // dp if ulysses else seq_len
    head = "gather" if pp > 1 else "sequence" if sp == "megatron" else "vocab"
    cap = _capture(model_or_config, tp=tp, rows=batch_size, seq=seq, head=head, dtype=s.param_dtype, mesh=_mesh)
    points = _profile(cap, s)
    L = len(cap.blocks)
    notes = []
    if (dp > 1 or pp > 1) and not any(1 <= g <= L for g in cap.fw_group.values()):
        from tailorfx.api import PredictionError
        raise PredictionError("cannot predict dp/pp per rank: no op of the traced step could be attributed to a "
                              "repeated block (FSDP's units, pipeline stages)" + ("" if L else
                              ": the graph has no repeated blocks"))
    shapes = [sh for g in range(L + 2) for sh in cap.params[g]]
    stages: tuple = ()
    pipeline_ranks: tuple = ()
    bubble = 0.0
    comm_resident = 0
    rank_label = "every rank"
    if pp > 1:
        from tailorfx.passes.pipeline_split import block_costs, split_points
        costs = block_costs(cap.gm, cap.regions)
        starts = split_points(costs.flops, pp * v, costs.bytes, costs.first_flops, costs.last_flops)
        bounds = [*starts, len(costs.blocks)]
        stage_blocks = [costs.blocks[a:b] for a, b in zip(bounds, bounds[1:])]
        profs = _stage_profiles(cap, _profile(cap, s, keep_outputs=False), stage_blocks, s)
        sched = build_schedule(schedule, pp, m, v)
        sim = simulate_schedule(schedule, pp, m, v)
        bubble = float(sim.bubble)
        io = _stage_io(cap, stage_blocks)
        fsdp = {}
        if dp > 1:      # each stage one FSDP2 unit over the dp ranks (runtime.apply_fsdp_stages)
            ratio = s.grads.itemsize / s.param_dtype.itemsize
            for k, st in enumerate(profs):
                shard, padded = _sharded([sh for g in st.groups for sh in cap.params[g]], dp)
                fsdp[k] = (padded, int(padded * ratio), int(shard * ratio))
        per_rank = []
        for r in range(pp):
            mine = list(range(r, pp * v, pp))
            peak, parts = _pipeline_walk(profs, io, sched, r, fsdp)
            local = [sh for k in mine for g in profs[k].groups for sh in cap.params[g]]
            if dp > 1:
                local = _shard_shapes(local, dp)
            recv = m * sum(io[k][0] + io[k][1] for k in mine)
            numels = [math.prod(x) for x, _ in local]
            total = _rank_total(s, numels, sum(math.prod(x) * b for x, b in local), peak, parts, recv)
            per_rank.append((total, r, peak, parts, local, recv))
        stages = tuple(StageMemory(k, k % pp, tuple(stage_blocks[k]),
                                   _sharded([sh for g in profs[k].groups for sh in cap.params[g]], dp)[0],
                                   profs[k].kept, sim.peak_inflight[k], m * (io[k][0] + io[k][1]))
                       for k in range(pp * v))
        pipeline_ranks = tuple((t[0][0], t[2], sum(math.prod(x) * b for x, b in t[4])) for t in per_rank)
        if rank is not None and not 0 <= rank < pp:
            raise ValueError(f"rank={rank} is not a pipeline rank of pp={pp}")
        pick = per_rank[rank] if rank is not None else max(per_rank, key=lambda t: (t[0][0], -t[1]))
        _, worst, fb_peak, parts, local, comm_resident = pick
        rank_label = f"pipeline rank {worst} (stages {list(range(worst, pp * v, pp))})"
        numels = [math.prod(x) for x, _ in local]
        param_bytes = sum(math.prod(x) * b for x, b in local)
    elif dp > 1:
        attn = cap.attn_bytes if ulysses else 0
        if ulysses and not attn:
            notes.append("no scaled_dot_product_attention in the graph: Ulysses' all-to-all buffers not counted")
        fb_peak, parts = _fsdp_peak(cap, points, dp, attn)
        sharded = _shard_shapes(shapes, dp)
        numels = [math.prod(x) for x, _ in sharded]
        param_bytes = sum(math.prod(x) * b for x, b in sharded)
        rank_label = "FSDP rank 0 (the largest shards)"
    else:
        fb_peak, parts = _tp_peak(points)
        numels = [math.prod(x) for x, _ in shapes]
        param_bytes = sum(math.prod(x) * b for x, b in shapes)
    peak, master, state, grads_held, step_parts = _rank_total(s, numels, param_bytes, fb_peak, parts, comm_resident)
    return RankMemory(tp, dp, pp, sp, schedule if pp > 1 else "", m if pp > 1 else 1, seq_len, batch_size, s,
                      rank_label, peak, param_bytes, master, state, comm_resident, fb_peak, step_parts, grads_held,
                      stages, bubble, tuple(notes), pipeline_ranks)


def _rank_total(s: TrainingSetup, numels: list[int], param_bytes: int, fb_peak: int, parts: dict,
                comm_resident: int) -> tuple[int, int, int, int, dict]:
    """(peak, master weights, optimizer state, gradients held after backward, the step's peak by
    part) of a rank holding parameters of `numels` elements and peaking `fb_peak` above resident
    in forward and backward; the optimizer step (every gradient held, one update's temporaries)
    may peak higher."""
    n = sum(numels)
    has_opt = s.optimizer is not None
    master = s.master_bytes(n) if has_opt else 0
    state = s.state_bytes(n) if has_opt else 0
    grads_held = 0 if not has_opt or s.optimizer_in_backward else n * s.grads.itemsize
    step_peak, step_parts = fb_peak, parts
    if has_opt and not s.optimizer_in_backward:
        update = max((s.update_temp_bytes(x) for x in numels), default=0)
        if grads_held + update > step_peak:
            step_peak, step_parts = grads_held + update, {"gradients": grads_held, "activations": update}
    return param_bytes + master + state + comm_resident + step_peak, master, state, grads_held, step_parts


# ---- plan_world ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorldCandidate:
    """One layout of the world plan_world considered, and what became of it."""
    tp: int
    pp: int
    dp: int
    sp: Optional[str]
    status: str                        # "fits", "over budget" or "not available"
    reason: str = ""
    memory: Optional[RankMemory] = None
    chosen: bool = False

    @property
    def peak_bytes(self) -> Optional[int]:
        return self.memory.peak_bytes if self.memory is not None else None

    @property
    def bubble(self) -> float:
        return self.memory.bubble if self.memory is not None else 0.0

    def layout(self) -> str:
        return describe_layout(self.tp, self.pp, self.dp, self.sp)

    def __str__(self) -> str:
        peak = format_bytes(self.peak_bytes) if self.peak_bytes is not None else "-"
        return f"{self.layout()}: {self.status}, {peak} per rank" + (f" ({self.reason})" if self.reason else "")


def preference(c: WorldCandidate) -> tuple:
    """The order plan_world prefers fitting layouts in, fewest cross-node collectives first: data
    parallel alone (FSDP2: one all-gather and one reduce-scatter per block, overlapped), then
    tensor parallel inside a node (tp <= 8: per-layer all-reduces on NVLink; the smaller tp first),
    then pipeline stages (point-to-point, but a bubble: the smaller pipeline and bubble first),
    then Ulysses sequence parallel (four all-to-alls per layer over the dp ranks). At the same tp,
    Megatron's sequence parallelism first: its all-gather and reduce-scatter move what tp's
    all-reduce moves, and the norms and residual stream take 1/tp of the memory."""
    return (c.sp == "ulysses", c.pp > 1, c.tp, c.pp, c.bubble, c.sp != "megatron")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_world(model_or_config: Any, *, world: int, budget: Union[str, int, Budget], seq_len: int,
               batch_size: int = 1, setup: Any = None, schedule: str = "1f1b", microbatches: Optional[int] = None,
               max_tp: int = MAX_TP) -> list[WorldCandidate]:
    """The layouts (tp, pp, dp, sp) of `world` ranks, each predicted per rank (predict_rank_memory),
    the chosen one first: the preferred (see `preference`) among those whose worst rank fits the
    budget less the planner's headroom (planner.usable), then the other fitting ones, those over
    the budget (smallest first) and those not available, each with the reason.

    Enumerated: tp * pp * dp == world, tp <= max_tp (one node) and dividing the heads read off
    the graph, pp at most the number of blocks, sp="megatron" beside every tp >= 2 without pp
(unless the graph has a region the stream cannot be split around), sp="ulysses" when dp >= 2 without tp and pp (as
    the runtime supports it) and dp divides the heads and the sequence; pp with dp shards each
    stage over the dp ranks (FSDP2). `batch_size`: rows of one rank's
    micro-batch; pipelines run `microbatches` of them (default pp). One capture per tp (and per
    head style and sequence slice) serves every dp, so a world of 1,024 costs a few captures.
    Raises BudgetError, naming the smallest peak any layout reaches, when none fits (its
    `candidates` attribute holds the list).
    """
    from tailorfx import planner
    from tailorfx.options import positive_int
    positive_int("world", world, allow_none=False)
    positive_int("seq_len", seq_len, allow_none=False)
    positive_int("batch_size", batch_size, allow_none=False)
    b = Budget.parse(budget)
    s = resolve_setup(setup, param_dtype=_param_dtype(model_or_config))
    usable = planner.usable(b.bytes, s.headroom)
    base = _capture(model_or_config, tp=1, rows=batch_size, seq=seq_len, head="vocab", dtype=s.param_dtype)
    blocks = len(base.blocks)
    out: list[WorldCandidate] = []

    def unavailable(tp, pp, dp, sp, why):
        out.append(WorldCandidate(tp, pp, dp, sp, "not available", why))

    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            layouts = (["megatron"] if tp >= 2 and pp == 1 else []) + [None] + (
                ["ulysses"] if dp >= 2 and tp == pp == 1 else [])
            for sp in layouts:
                if tp > max_tp:
                    unavailable(tp, pp, dp, sp, f"tp={tp} spans more than one node (tp <= {max_tp})")
                    continue
                if tp > 1:
                    try:
                        _tp_plan(model_or_config, s.param_dtype).check(tp)
                    except ValueError as e:
                        unavailable(tp, pp, dp, sp, str(e).split(" (read")[0])
                        continue
                if pp > blocks:
                    unavailable(tp, pp, dp, sp, f"{blocks} blocks cannot make {pp} pipeline stages")
                    continue
                if sp == "megatron" and _tp_plan(model_or_config, s.param_dtype).sequence_error:
                    unavailable(tp, pp, dp, sp, _tp_plan(model_or_config, s.param_dtype).sequence_error)
                    continue
                if sp == "ulysses":
                    bad = [(h, what) for h, what in zip(base.heads, ("query", "key/value")) if h and h % dp]
                    if bad or seq_len % dp:
                        why = (f"Ulysses over {dp} ranks must divide the {bad[-1][0]} {bad[-1][1]} heads" if bad else
                               f"Ulysses over {dp} ranks must divide the sequence ({seq_len})")
                        unavailable(tp, pp, dp, sp, why)
                        continue
                try:
                    rm = predict_rank_memory(model_or_config, tp=tp, dp=dp, pp=pp, sp=sp, schedule=schedule,
                                             microbatches=microbatches or (pp if pp > 1 else None), seq_len=seq_len,
                                             batch_size=batch_size, setup=s)
                except ValueError as e:
                    unavailable(tp, pp, dp, sp, str(e).splitlines()[0])
                    continue
                fits = rm.peak_bytes <= usable
                over = "" if fits else f"{format_bytes(rm.peak_bytes)} > {format_bytes(usable)} usable"
                out.append(WorldCandidate(tp, pp, dp, sp, "fits" if fits else "over budget", over, rm))
    fitting = sorted((c for c in out if c.status == "fits"), key=preference)
    over = sorted((c for c in out if c.status == "over budget"), key=lambda c: c.peak_bytes)
    rest = [c for c in out if c.status == "not available"]
    if not fitting:
        if not over:
            raise ValueError(f"no layout of {world} ranks is available: " + "; ".join(
                f"{c.layout()}: {c.reason}" for c in rest[:4]))
        best = over[0]
        parts = best.memory.breakdown()
        dominant = max(parts, key=parts.get)
        suggested = math.ceil(best.peak_bytes / planner.usable(1, s.headroom))
        err = BudgetError(
            f"budget {b} cannot be met on {world} ranks: the smallest per-rank peak any layout reaches is "
            f"{format_bytes(best.peak_bytes)} ({best.layout()}: " + ", ".join(
                f"{k} {format_bytes(v)}" for k, v in parts.items() if v) + f"), dominated by {dominant}. Use a "
            f"budget of at least {format_bytes(suggested)}, more ranks, a shorter sequence, or a lighter setup "
            f"({s.describe()})", best.peak_bytes, dominant, suggested)
        err.candidates = over + rest
        raise err
    fitting[0] = replace(fitting[0], chosen=True)
    return fitting + over + rest
