"""Per-rank memory of a parallel layout (tp, dp, pp, sp), predicted without allocating anything;
inside torchrun, the same for the rank's sharded model (RankPrediction: opt.predict_memory()).

    predict_rank_memory(config, tp=2, dp=4, seq_len=8192, batch_size=1, setup="amp-bf16")

Built by composition on the memory model (rewrite/memory.py); the rank's graph and its tagged
simulation are in trace.py and profile.py, the dp and pp compositions in compose.py:

The rank's graph. The model (a config, a zero-argument factory or a module; built or copied under
a FakeTensorMode, so an 8B model holds no memory) is captured at one micro-batch of one rank:
`batch_size` rows of `seq_len` tokens (seq_len/dp under sp). Under tp the runtime's own
`apply_tp` shards it first (shard.shard_model), with the plan read off its graph (plan.py), on torch's
fake process group of tp ranks (compat.init_fake_process_group; inside torchrun, on the real tp
mesh), so the captured graph is the one a tp rank runs: DTensor shards, the vocab-parallel head
and loss, the collectives. The memory model simulates that step as eager autograd runs it, and
every storage it allocates is tagged with the part of the model that made it: the root before
the first block (embedding), each block, the root after the last block (norm, head, loss). One
capture per (tp, rows, sequence slice, head style) is cached; everything below re-reads it.

tp: the simulation as it is (RankPrediction does the same inside torchrun).

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

pp: the stages cut as the runtime cuts them (stages.stage_blocks on block_costs of the
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
styles too (sequence_plan.infer_sequence_parallel): the stream's norms, residual adds and
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
a gloo step reads 0 to 3 hidden states high on some ranks under tp, frees gloo's worker thread
made that the profiler does not record: docs/parallel.md), FSDP2's MixedPrecisionPolicy (the runtime sets none: gathered
parameters are in the setup's parameter dtype), gradient accumulation across steps (a step is
one micro-batch per rank, or the pipeline's micro-batches), allocator fragmentation (the setup's
headroom and planner.HEADROOM are kept free).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor.parallel import loss_parallel

from tailorfx import planner
from tailorfx.budget import format_bytes
from tailorfx.codegen.pipeline import capture_static
from tailorfx.codegen.schedule import build_schedule, simulate_schedule
from tailorfx.errors import PredictionError
from tailorfx.options import positive_int
from tailorfx.parallel.compose import fsdp_peak, pipeline_walk, shard_bytes, shard_shapes, stage_io, stage_profiles, tp_peak
from tailorfx.parallel.plan import head_style
from tailorfx.parallel.profile import Point, profile
from tailorfx.parallel.shard import VocabHead
from tailorfx.parallel.spec import ParallelSpec, describe_layout, runs_chain
from tailorfx.parallel.stages import block_costs, stage_blocks
from tailorfx.parallel.trace import RankCapture, capture_rank, hold_what_outputs_save, param_dtype
from tailorfx.passes.attention.rules import drop_causal_sdpa_masks
from tailorfx.rewrite import memory
from tailorfx.rewrite.capture import seq_info
from tailorfx.setup import TrainingSetup
from tailorfx.setup import resolve as resolve_setup


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


# ---- predict_rank_memory -------------------------------------------------------------------------------
def predict_rank_memory(model_or_config: Any, *, tp: int = 1, dp: int = 1, pp: int = 1, sp: Optional[str] = None,
                        schedule: str = "1f1b", microbatches: Optional[int] = None, seq_len: int,
                        batch_size: int = 1, setup: Any = None, rank: Optional[int] = None, vocab_loss: str = "fused",
                        passes: Optional[Sequence[str]] = None, _mesh=None, _graph=None,
                        backend: Optional[str] = None, _options: tuple = ()) -> RankMemory:
    """Memory of the worst rank of a parallel layout for one training step, predicted by
    composition on the memory model (see the module docstring); nothing is allocated.

    `model_or_config`: a Hugging Face or tailorfx config, a zero-argument factory, or a module
    (copied with fake tensors). `batch_size`: the rows of one rank's micro-batch (under pp each
    of the `microbatches` micro-batches, default pp, has that many rows; under sp every rank
    takes every row and seq_len/dp of its tokens). `setup`: a TrainingSetup or preset name
    (default: the model's dtype with AdamW). `rank`: under pp, that pipeline rank's memory
    instead of the worst's. `vocab_loss`: a vocab-parallel head's loss "fused" with it or under
    DTensor's "loss_parallel". `passes`: the rewrites, as optimize(parallel=..., passes=) takes
    them: of a pipeline's step graph (None: the default, the LM head fused with its loss and the
    MLPs in mini-sequence chunks under pp without tp); under dp, tp or both ParallelSpec.rewrites'
    ("minisequence", "recompute": each block checkpointed, its ops recomputed in the traced
    step). `backend`: the collectives' ("nccl" or
    "gloo", whose reduce-scatter holds a copy of its input; default the process group's inside
    torchrun, else "nccl"). The layout is checked as
    optimize(parallel=...) checks it (ValueError for one the runtime refuses, such as
    sp="ulysses" with tp).
    """
    spec = ParallelSpec(tp=tp, dp=dp, pp=pp, sp=sp, schedule=schedule, microbatches=microbatches or pp,
                        vocab_loss=vocab_loss)
    positive_int("seq_len", seq_len, allow_none=False)
    positive_int("batch_size", batch_size, allow_none=False)
    s = resolve_setup(setup, param_dtype=param_dtype(model_or_config))
    ulysses = sp == "ulysses"
    if ulysses and seq_len % dp:
        raise ValueError(f"sp='ulysses' over dp={dp} ranks needs a sequence length divisible by {dp}, got {seq_len}")
    rewrites = spec.rewrites(passes)
    cap = capture_rank(model_or_config, tp=tp, rows=batch_size, seq=seq_len // dp if ulysses else seq_len,
                       dtype=s.param_dtype, head=head_style(spec), vocab_loss=vocab_loss, mesh=_mesh,
                       passes=rewrites, graph=_graph, options=_options,
                       cut="pipeline" if pp > 1 else "chain" if runs_chain(spec, rewrites) else "")
    points = profile(cap, s)
    _check_blocks_attributed(cap, spec)
    if pp > 1:
        worst = _pipeline_worst(cap, spec, s, rank)
    elif dp > 1:
        worst = _fsdp_worst(cap, points, dp, ulysses, _backend(backend) == "gloo")
    else:
        worst = _tp_worst(cap, points)
    peak, master, state, grads_held, step_parts = _rank_total(s, worst.numels, worst.param_bytes, worst.fb_peak,
                                                              worst.parts, worst.comm_resident)
    return RankMemory(tp=tp, dp=dp, pp=pp, sp=sp, schedule=schedule if pp > 1 else "",
                      microbatches=spec.microbatches if pp > 1 else 1, seq_len=seq_len, batch_size=batch_size,
                      setup=s, rank=worst.label, peak_bytes=peak, param_bytes=worst.param_bytes, master_bytes=master,
                      optimizer_bytes=state, resident_comm_bytes=worst.comm_resident,
                      forward_backward_peak_bytes=worst.fb_peak, at_peak=step_parts, grad_bytes=grads_held,
                      stages=worst.stages, bubble=worst.bubble, notes=worst.notes,
                      pipeline_ranks=worst.pipeline_ranks)


@dataclass(frozen=True)
class _WorstRank:
    """The rank a layout's prediction is of: what it holds and its peak above resident in forward
    and backward (`parts`: that peak by part), with the pipeline's figures under pp."""
    label: str
    fb_peak: int
    parts: dict
    numels: list[int]                 # elements of each parameter (shard) it holds
    param_bytes: int
    comm_resident: int = 0            # pipeline receive buffers
    stages: tuple[StageMemory, ...] = ()
    pipeline_ranks: tuple[tuple[int, int, int], ...] = ()
    bubble: float = 0.0
    notes: tuple[str, ...] = ()


def _check_blocks_attributed(cap: RankCapture, spec: ParallelSpec) -> None:
    """dp and pp compose per repeated block: some traced op must belong to one."""
    L = len(cap.blocks)
    if (spec.dp > 1 or spec.pp > 1) and not any(1 <= g <= L for g in cap.fw_group.values()):
        raise PredictionError("cannot predict dp/pp per rank: no op of the traced step could be attributed to a "
                              "repeated block (FSDP's units, pipeline stages)" + ("" if L else
                              ": the graph has no repeated blocks"))


def _held(shapes: list) -> tuple[list[int], int]:
    """(elements of each, total bytes) of parameters given as (shape, itemsize)."""
    return [math.prod(x) for x, _ in shapes], sum(math.prod(x) * b for x, b in shapes)


def _all_shapes(cap: RankCapture) -> list:
    """Every parameter of the rank's model, group by group."""
    return [sh for g in range(len(cap.blocks) + 2) for sh in cap.params[g]]


def _tp_worst(cap: RankCapture, points: list[Point]) -> _WorstRank:
    """tp (and sp="megatron"): every rank holds the same, the simulation as it is."""
    fb_peak, parts = tp_peak(points)
    return _WorstRank("every rank", fb_peak, parts, *_held(_all_shapes(cap)))


def _backend(backend: Optional[str]) -> str:
    """The collective backend predicted for: as given, else the process group's inside torchrun,
    else NCCL's (a plan is for GPUs)."""
    if backend is not None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r} is not valid: 'gloo' or 'nccl'")
        return backend
    return dist.get_backend() if dist.is_initialized() else "nccl"


def _fsdp_worst(cap: RankCapture, points: list[Point], dp: int, ulysses: bool, gloo: bool = False) -> _WorstRank:
    """dp (FSDP2; with sp="ulysses", its all-to-all buffers too): rank 0, the largest shards."""
    attn = cap.attn_bytes if ulysses else 0
    notes = (("no scaled_dot_product_attention in the graph: Ulysses' all-to-all buffers not counted",)
             if ulysses and not attn else ())
    fb_peak, parts = fsdp_peak(cap, points, dp, attn, gloo)
    return _WorstRank("FSDP rank 0 (the largest shards)", fb_peak, parts, *_held(shard_shapes(_all_shapes(cap), dp)),
                      notes=notes)


def _pipeline_worst(cap: RankCapture, spec: ParallelSpec, s: TrainingSetup, rank: Optional[int]) -> _WorstRank:
    """pp (with dp, each stage sharded over the dp ranks): each pipeline rank's walk of the
    schedule over its stages; the worst rank's figures, or `rank`'s, with every stage's."""
    pp, dp, m, v = spec.pp, spec.dp, spec.microbatches, spec.virtual
    blocks_of = stage_blocks(cap.stage_costs or block_costs(cap.gm, cap.regions), spec.num_stages)
    profs = stage_profiles(cap, profile(cap, s, keep_outputs=False), blocks_of, s)
    sched = build_schedule(spec.schedule, pp, m, v)
    sim = simulate_schedule(spec.schedule, pp, m, v)
    io = stage_io(cap, blocks_of)
    fsdp = {}
    if dp > 1:      # each stage one FSDP2 unit over the dp ranks (runtime.apply_fsdp_stages)
        ratio = s.grads.itemsize / s.param_dtype.itemsize
        for k, st in enumerate(profs):
            shard, padded = shard_bytes([sh for g in st.groups for sh in cap.params[g]], dp)
            fsdp[k] = (padded, int(padded * ratio), int(shard * ratio))
    per_rank = []
    for r in range(pp):
        mine = list(range(r, pp * v, pp))
        peak, parts = pipeline_walk(profs, io, sched, r, fsdp)
        local = [sh for k in mine for g in profs[k].groups for sh in cap.params[g]]
        if dp > 1:
            local = shard_shapes(local, dp)
        recv = m * sum(io[k][0] + io[k][1] for k in mine)
        total = _rank_total(s, *_held(local), peak, parts, recv)
        per_rank.append((total, r, peak, parts, local, recv))
    stages = tuple(StageMemory(stage=k, rank=k % pp, blocks=tuple(blocks_of[k]),
                               param_bytes=shard_bytes([sh for g in profs[k].groups for sh in cap.params[g]], dp)[0],
                               kept_bytes=profs[k].kept, peak_inflight=sim.peak_inflight[k],
                               recv_buffer_bytes=m * (io[k][0] + io[k][1]))
                   for k in range(pp * v))
    if rank is not None and not 0 <= rank < pp:
        raise ValueError(f"rank={rank} is not a pipeline rank of pp={pp}")
    pick = per_rank[rank] if rank is not None else max(per_rank, key=lambda t: (t[0][0], -t[1]))
    _, worst, fb_peak, parts, local, comm_resident = pick
    return _WorstRank(f"pipeline rank {worst} (stages {list(range(worst, pp * v, pp))})", fb_peak, parts,
                      *_held(local), comm_resident=comm_resident, stages=stages,
                      pipeline_ranks=tuple((t[0][0], t[2], _held(t[4])[1]) for t in per_rank),
                      bubble=float(sim.bubble))


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


# ---- inside torchrun: the rank's sharded model --------------------------------------------------------
@dataclass
class RankPrediction:
    """What opt.predict_memory() of a model parallelize() sharded reads: this rank's memory for one
    step at the example batch's shape, nothing run. Tensor parallel alone: the memory model on
    the sharded model's own graph (DTensor shards, collectives and all; traced on fake tensors).
    With dp (FSDP2), pp, sp or rewrites: predict_rank_memory on a fake copy of the model taken
    before it was sharded (the example's rows are this rank's micro-batch; under pp the whole
    step's, split into the micro-batches; under sp every rank's, split over the sequence). Kept
    per setup: the model's shapes do not change."""
    spec: ParallelSpec
    example: dict
    passes: tuple = ()                            # the rewrites the layout took (spec.rewrites)
    source: Optional[nn.Module] = None            # the fake copy taken before sharding (dp/pp/sp/rewrites)
    tp_mesh: Any = None                           # the tp mesh dimension the copy is sharded on
    pp_rank: int = 0
    captured: Optional[fx.GraphModule] = None     # the pipeline's (tp=1) or chain's step graph: traced, not captured again
    options: tuple = ()                           # the passes' options (plan.step_options), as items
    head: Optional[VocabHead] = None              # the rank's vocab-parallel head
    cache: dict = field(default_factory=dict)     # repr(setup) -> MemoryEstimate

    def predict(self, model: nn.Module, seq_len: Optional[int], setup) -> memory.MemoryEstimate:
        """This rank's step under `setup` (`model`: the rank's sharded model; `seq_len`: None or
        the example's length)."""
        length = self.example["input_ids"].shape[1] if "input_ids" in self.example else None
        if seq_len not in (None, length):
            raise PredictionError(f"under parallel= the prediction is at the example batch's length ({length}): "
                                  f"give example_inputs of length {seq_len}")
        key = repr(setup)
        if key not in self.cache:
            spec = self.spec
            composed = spec.dp > 1 or spec.pp > 1 or spec.sp == "ulysses" or self.passes
            self.cache[key] = self._composed(length, setup) if composed else self._traced(model, setup)
        return self.cache[key]

    def _traced(self, model: nn.Module, setup) -> memory.MemoryEstimate:
        scope = loss_parallel if self.head is not None else contextlib.nullcontext
        try:
            with scope():
                gm, _, _ = capture_static(model, self.example)
                gm = hold_what_outputs_save(drop_causal_sdpa_masks(gm))    # as the eager rank runs (trace.py)
                return planner.predict_graphs([(gm, "dynamo", None)], [seq_info(gm, None)], None, setup)
        finally:
            if self.head is not None and self.head.fused is not None:    # the capture's run left the head's tensors in the hook
                self.head.fused.clear()

    def _composed(self, length: Optional[int], setup) -> memory.MemoryEstimate:
        if self.source is None or length is None:
            raise PredictionError("per-rank prediction under dp/pp/sp needs the example batch's input_ids and the "
                                  "model's copy taken before sharding (optimize(parallel=...) keeps both)")
        spec = self.spec
        pipelined = spec.pp > 1
        rows = self.example["input_ids"].shape[0] // (spec.microbatches if pipelined else 1)
        fused = self.head is not None and self.head.fused is not None
        rm = predict_rank_memory(self.source, tp=spec.tp, dp=spec.dp, pp=spec.pp, sp=spec.sp,
                                 schedule=spec.schedule if pipelined else "1f1b",
                                 microbatches=spec.microbatches if pipelined else None,
                                 seq_len=length, batch_size=rows, setup=setup, rank=self.pp_rank if pipelined else None,
                                 vocab_loss="fused" if fused else "loss_parallel",
                                 passes=self.passes, _mesh=self.tp_mesh if spec.tp > 1 else None,
                                 _graph=self.captured, _options=self.options)
        return rm.as_estimate()
