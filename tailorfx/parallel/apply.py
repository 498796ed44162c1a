"""optimize(..., parallel=dict(tp=2, dp=2) | dict(pp=2, schedule="1f1b", microbatches=4)), inside
a torchrun process: the layout applied to this rank's model, one `apply_*` step per parallelism,
in the order torchtitan composes them (`parallelize`).

    tp:  plan.plan_tensor_parallel (styles read off the graph, + sequence parallel for
         sp="megatron") -> shard.shard_model (DTensor on the tp mesh dim; the vocab-parallel
         head's loss fused with it or under loss_parallel)
    sp="ulysses": attention through all-to-alls over the dp ranks (runtime/ulysses.py)
    pp:  the step graph captured (static shapes), cut into stages balanced by the cost model
         (stages.stage_blocks) after the exact structural rewrites (plan.rewrite_step:
         minisequence, the LM head fused with its loss) -> codegen.pipeline.cut_stages, each stage
         one FSDP2 unit over the dp ranks -> torch.distributed.pipelining with codegen.schedule's
    recompute (dp alone): runtime.apply_checkpoint, each block one unit
    dp:  runtime.apply_fsdp (FSDP2: each block, then the root, on the dp mesh dim)

parallel="auto" (entry.py) picks the layout, then the same steps; each rank takes its rows of each
batch (`global_batch`).

What it returns, ParallelPlan: the report (what went where), the runtime (what a call of the
sharded model runs with) and the prediction (memory.RankPrediction, opt.predict_memory()).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor.parallel import loss_parallel

from tailorfx import compat
from tailorfx.codegen.pipeline import (StageChain, StagePieces, capture_static, chain_stages, cut_stages, loss_only,
                                       pipeline_runtime)
from tailorfx.codegen.schedule import simulate_schedule
from tailorfx.models.build import fake_copy
from tailorfx.models.llama import CausalLMOutput
from tailorfx.parallel.memory import RankPrediction
from tailorfx.parallel.plan import (accepts_use_cache, describe_rewrites, head_style, plan_tensor_parallel,
                                    rewrite_step, skips_logits, step_options, tp_styles)
from tailorfx.parallel.shard import CHUNKED_MLP, VocabHead, chunk_mlps, shard_model
from tailorfx.parallel.spec import ParallelSpec, runs_chain
from tailorfx.parallel.stages import block_costs, stage_blocks
from tailorfx.parallel.tp_plan import TPPlan
from tailorfx.passes.attention.rules import drop_causal_sdpa_masks
from tailorfx.rewrite.capture import seq_info
from tailorfx.rewrite.regions import find_regions
from tailorfx.runtime import ulysses
from tailorfx.runtime.tensor_parallel import (apply_checkpoint, apply_fsdp, apply_fsdp_chain, apply_fsdp_stages,
                                              device_mesh, on_device, rank_device)


def parallelize(model: nn.Module, spec: ParallelSpec, args: tuple, kwargs: dict, *, passes: tuple = (),
                options: Optional[dict] = None, global_batch: bool = False, mesh=None) -> ParallelPlan:
    """Shard `model` in place as `spec` asks; returns what was done. `passes`: the rewrites the
    layout takes (spec.rewrites: the pipeline's step graph's, or "recompute" under dp alone);
    `options`: optimize()'s pass options (the pipeline's rewrites read theirs). `global_batch`:
    every rank is given the same batch (the example and each call), and takes its dp rank's rows
    of it (Ulysses: all of them, and its slice of the sequence). `mesh`: the (pp, dp, tp) device
    mesh already made for the layout (a budget's predictions shard on it), else one is made."""
    if not args and not kwargs:
        raise ValueError("parallel= needs example_inputs: the tensor-parallel plan is read off the graph "
                         "of one forward pass")
    device = rank_device()
    mesh = mesh if mesh is not None else device_mesh(tp=spec.tp, dp=spec.dp, pp=spec.pp, device=device)
    rows = (mesh["dp"].get_local_rank(), spec.dp) if global_batch and spec.dp > 1 and spec.sp != "ulysses" else None
    if rows is not None:
        args, kwargs = rank_rows(args, rows), rank_rows(kwargs, rows)
    if device.type == "cuda":   # each rank on its own GPU (a model moved to "cuda" before is on GPU 0 everywhere)
        model.to(device)
        args, kwargs = on_device((args, kwargs), device)
    # what per-rank predictions shard and capture: a copy on fake tensors, taken before sharding
    source = fake_copy(model) if spec.dp > 1 or spec.pp > 1 or spec.sp or passes else None
    # read off the whole model's graph; pipeline stages without tp read their blocks off the step graph
    plan, blocks = plan_tensor_parallel(model, args, kwargs) if spec.tp > 1 or spec.pp == 1 else (None, [])
    styles, head = {}, None
    if spec.tp > 1:     # first: the pipeline cuts the sharded model's graph
        styles, head = apply_tensor_parallel(model, spec=spec, plan=plan, mesh=mesh["tp"],
                                             skip_logits=skips_logits(passes, options, staged=spec.pp > 1),
                                             setup=(options or {}).get("setup"))
    chunked = chunk_mlps(model, plan.mlps, options) if spec.tp > 1 and spec.pp == 1 and "minisequence" in passes else []
    dp_group, dp_rank = None, 0
    if spec.sp == "ulysses":
        dp_group, dp_rank = apply_ulysses(model, mesh=mesh["dp"])
    pipe = chain = None
    if spec.pp > 1:     # each stage one FSDP2 unit over the dp ranks
        pipe = apply_pipeline(model, spec=spec, kwargs=kwargs, mesh=mesh, passes=passes, options=options,
                              device=device)
        blocks = pipe.blocks
    elif runs_chain(spec, passes):     # the step graph rewritten, a chain of its blocks
        chain = apply_chain(model, kwargs=kwargs, mesh=mesh, passes=passes, options=options)
    if "recompute" in passes and chain is None and pipe is None:     # inside FSDP's units, as torchtitan does
        apply_checkpoint(model, blocks=blocks)
    if spec.dp > 1 and spec.pp == 1 and chain is None:
        apply_fsdp(model, blocks=blocks, mesh=mesh["dp"])
    staged = pipe or chain
    report = ParallelReport(spec, styles, dict(plan.replicated) if spec.tp > 1 else {}, blocks,
                            head_note=head.note if head is not None else "", passes=passes,
                            stage_blocks=pipe.stage_blocks if pipe else [], bubble=pipe.bubble if pipe else 0.0,
                            rewrites=staged.rewrites if staged else [(path, f"minisequence: {CHUNKED_MLP}, {n}")
                                                                     for path, n in chunked])
    runtime = ParallelRuntime(spec, passes=passes, device=device, head=head, dp_group=dp_group, dp_rank=dp_rank,
                              pipeline=pipe, rows=rows, chain=chain.module if chain else None)
    prediction = RankPrediction(spec, dict(kwargs), passes=passes, source=source, tp_mesh=mesh["tp"],
                                pp_rank=pipe.rank if pipe else 0, captured=staged.captured if staged else None,
                                head=head, options=tuple(sorted(step_options(options).items())))
    return ParallelPlan(report, runtime, prediction)


def apply_tensor_parallel(model: nn.Module, *, spec: ParallelSpec, plan: TPPlan, mesh,
                          skip_logits: bool = False, setup=None) -> tuple[dict[str, str], Optional[VocabHead]]:
    """The plan's styles on the tp `mesh` (the LM head's as head_style(spec) says); returns them
    and the vocab-parallel head, if any (`skip_logits`: its logits not built in training; `setup`:
    the TrainingSetup, whose head_grad_dtype the fused loss follows)."""
    styles = tp_styles(plan, spec.tp, head_style(spec))
    return styles, shard_model(model, styles=styles, mesh=mesh, head_loss=plan.head_loss, vocab_loss=spec.vocab_loss,
                               skip_logits=skip_logits,
                               grad_weight_fp32=getattr(setup, "head_grad_fp32", False))


def apply_ulysses(model: nn.Module, *, mesh) -> tuple[Any, int]:
    """sp="ulysses": each dp rank holds a slice of every sequence, and the model's attention runs on
    the whole sequence for a slice of the heads, by all-to-all over the dp `mesh`; returns the dp
    group and this rank's place in it (the batch is split by it)."""
    group = mesh.get_group()
    model.set_attn_implementation(ulysses.register(group=group, size=mesh.size()))
    return group, mesh.get_local_rank()


@dataclass(frozen=True)
class Pipeline:
    """This rank's part of a pipeline (apply_pipeline)."""
    schedule: Any                   # torch's pipeline schedule runtime, over this rank's stages
    rank: int                       # this rank's place in the pipeline
    is_last: bool                   # this rank holds the last stage (it sees the loss)
    rank_params: set                # ids of the parameters its stages hold
    blocks: list[str]               # every block of the model, in order
    stage_blocks: list[list[str]]   # the blocks of each stage
    bubble: float                   # the schedule's simulated idle fraction (uniform stage costs)
    rewrites: list                  # (region, what a pass did to it) for the report
    captured: Optional[fx.GraphModule]   # the step graph as captured (tp=1): the prediction traces it


def check_zero_bubble(gm: fx.GraphModule, spec: ParallelSpec, splits: bool) -> None:
    """The zero-bubble schedule splits each stage's backward into its input gradients and, later,
    its weight gradients: refused for a stage graph with tailorfx's custom ops where torch's
    pipelining loses their backward nodes between the two (`splits` False: torch 2.11)."""
    ops = sorted({name for n in gm.graph.nodes if n.op == "call_function" and (name := compat.tailorfx_op_name(n.target))})
    if ops and not splits:
        raise ValueError(f"schedule='zb_h1' under parallel={spec}: this torch's pipelining (before 2.13) loses a "
                         f"custom op's backward between a stage's input and weight gradients, and the stages run "
                         f"tailorfx's {', '.join(ops)} (torch 2.13 keeps it): use schedule='1f1b' (the same peak on "
                         f"the first rank) or torch>=2.13")


def apply_pipeline(model: nn.Module, *, spec: ParallelSpec, kwargs: dict, mesh, passes: tuple = (),
                   options: Optional[dict] = None, device=None) -> Pipeline:
    """Cut the model's step graph into spec.num_stages stages balanced by the cost model (on the
    graph as captured), after `passes` rewrote it, shard this rank's stages over the dp ranks
    (FSDP2, one unit per stage) and load them into torch's pipeline runtime with the tailorfx
    schedule."""
    m, pp, num_stages = spec.microbatches, spec.pp, spec.num_stages
    rows = {k: t.shape[0] for k, t in kwargs.items() if hasattr(t, "shape") and t.dim()}
    if any(r % m for r in rows.values()):
        raise ValueError(f"example_inputs have {sorted(set(rows.values()))} rows, which microbatches={m} does not "
                         f"divide: give a batch of a multiple of {m} rows (every step must have that shape)")
    micro = {k: (t[: t.shape[0] // m] if k in rows else t) for k, t in kwargs.items()}
    if accepts_use_cache(model):     # a stage returns no cache (and a checkpointed block would fill one twice)
        micro["use_cache"] = False
    gm, example, micro = capture_static(model, micro)
    # unchanged below: the passes rewrite a copy, and cutting the stages reads it; without the S x S
    # mask, as apply_chain (else each stage's step holds it and sends it on to the next)
    gm = captured = drop_causal_sdpa_masks(gm)
    regions = find_regions(gm, seq_info(gm, None))
    costs = block_costs(gm, regions)
    blocks_of = stage_blocks(costs, num_stages)
    gm, records = rewrite_step(gm, tuple(p for p in passes if p != "recompute"), options)
    if spec.schedule == "zb_h1":
        check_zero_bubble(gm, spec, compat.pipelining_splits_custom_op_backward())
    if records:
        regions = find_regions(gm, seq_info(gm, None))
    if "recompute" in passes:
        stages = _checkpointed_stages(gm, example, model, regions.of_kind("block"), blocks_of, micro)
    else:
        block_stage = {name: i for i, blocks in enumerate(blocks_of) for b in regions.of_kind("block")
                       if b.path in blocks for name in b.nodes}
        stages = cut_stages(gm, example, model, block_stage, num_stages, micro)
    rank = mesh["pp"].get_local_rank()
    mine = [stages[s] for s in range(rank, num_stages, pp)]
    apply_fsdp_stages(mine, model=model, mesh=mesh["dp"])     # a dp mesh of one rank shards nothing
    schedule = pipeline_runtime(stages, rank=rank, num_ranks=pp, name=spec.schedule, microbatches=m,
                                virtual=spec.virtual, group=mesh["pp"].get_group(), device=device)
    return Pipeline(schedule, rank=rank, is_last=(num_stages - 1) % pp == rank,
                    rank_params={id(p) for st in mine for p in st.parameters()}, blocks=list(costs.blocks),
                    stage_blocks=blocks_of, bubble=float(simulate_schedule(spec.schedule, pp, m, virtual=spec.virtual).bubble),
                    rewrites=describe_rewrites(records), captured=captured if spec.tp == 1 else None)


def block_pieces(gm: fx.GraphModule, example: list, model: nn.Module, blocks: list, batch: dict,
                 recompute: bool, shared: bool = False) -> list:
    """The graph cut into a piece per block and the root's before and after them
    (codegen.pipeline.cut_stages); under recompute each block's piece is one activation-checkpointing
    unit (it saves its input and runs its forward again in backward)."""
    pieces = cut_stages(gm, example, model, chain_stages(gm, [b.nodes for b in blocks]), len(blocks) + 2, batch,
                        shared=shared)
    if recompute:
        from torch.distributed._composable import checkpoint
        for piece in pieces[1:-1]:
            checkpoint(piece)
    return pieces


def _checkpointed_stages(gm: fx.GraphModule, example: list, model: nn.Module, blocks: list, blocks_of: list,
                         micro: dict) -> list[StagePieces]:
    """Pipeline stages under recompute: block_pieces, the pieces of each stage's blocks run as one
    stage."""
    pieces = block_pieces(gm, example, model, blocks, micro, recompute=True)
    index = {b.path: i + 1 for i, b in enumerate(blocks)}
    last = len(blocks_of) - 1
    return [StagePieces(([pieces[0]] if k == 0 else []) + [pieces[index[b]] for b in names]
                        + ([pieces[-1]] if k == last else [])) for k, names in enumerate(blocks_of)]


@dataclass(frozen=True)
class Chain:
    """dp with mini-sequence (apply_chain): the rewritten step graph as a chain of stages."""
    module: StageChain
    rewrites: list                  # (region, what a pass did to it) for the report
    captured: fx.GraphModule        # the step graph as captured: the prediction traces it


def apply_chain(model: nn.Module, *, kwargs: dict, mesh, passes: tuple, options: Optional[dict] = None) -> Chain:
    """Data parallel with the step graph's rewrites (the LM head fused with its loss, the MLPs in
    mini-sequence chunks: custom ops eager autograd runs): the step captured (static shapes), its
    loss alone kept, rewritten, cut into a stage per block and the root's before and after them
    (codegen.pipeline.cut_stages), run one after another (StageChain). Under recompute each
    block's stage is one activation-checkpointing unit; each is one FSDP2 unit, the chain the
    root (as apply_checkpoint and apply_fsdp treat the model's blocks)."""
    batch = dict(kwargs, use_cache=False) if accepts_use_cache(model) else dict(kwargs)   # no cache is returned
    gm, example, batch = capture_static(model, batch)
    # the S x S mask transformers traces without a KV cache (see trace.py), dropped as its eager
    # forward drops it: 48 GiB of an 8B dp rank's step at 128K tokens otherwise
    gm = captured = drop_causal_sdpa_masks(loss_only(gm))
    gm, records = rewrite_step(gm, tuple(p for p in passes if p != "recompute"), options)
    blocks = find_regions(gm, seq_info(gm, None)).of_kind("block")
    if not blocks:
        raise ValueError("parallel= with mini-sequence cuts the step graph at its repeated blocks, and it has none")
    stages = block_pieces(gm, example, model, blocks, batch, recompute="recompute" in passes, shared=True)
    units = stages[1:-1]
    chain = StageChain(stages, {k: tuple(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)})
    apply_fsdp_chain(chain, units=units, model=model, mesh=mesh["dp"])
    return Chain(chain, describe_rewrites(records), captured)


@dataclass(frozen=True)
class ParallelPlan:
    """What parallelize() did on this rank: for opt.report(), for a call, for opt.predict_memory()."""
    report: ParallelReport
    runtime: ParallelRuntime
    prediction: RankPrediction


@dataclass(frozen=True)
class ParallelReport:
    """What was applied: each module's style and why the others stay replicated, the pipeline's
    stages, the rewrites."""
    spec: ParallelSpec
    styles: dict[str, str]            # module -> its tensor-parallel style
    replicated: dict[str, str]        # module -> why it is not sharded
    blocks: list[str]                 # the repeated blocks (FSDP's and checkpointing's units)
    head_note: str = ""               # how the vocab-parallel head's loss runs, and why
    passes: tuple = ()                # the rewrites the layout took (spec.rewrites)
    stage_blocks: list[list[str]] = field(default_factory=list)   # blocks of each pipeline stage
    bubble: float = 0.0
    rewrites: list = field(default_factory=list)   # (region, what a pass did to it)
    budget: str = ""                  # under budget=: which rewrites fit it, and each one's predicted peak

    def describe(self) -> list[tuple[str, str]]:
        """(module, what it got) rows."""
        spec = self.spec
        rows = [(fqn, style + (f"; {self.head_note}" if style.startswith("colwise_vocab_parallel") and self.head_note
                               else "")) for fqn, style in self.styles.items()]
        rows += [(fqn, f"replicated: {why}") for fqn, why in self.replicated.items()]
        rows += list(self.rewrites)
        sharded = f", fully_shard over dp={spec.dp} (the stage one unit)" if spec.dp > 1 else ""
        rows += [(", ".join(b) or "(no block)", f"pipeline stage {i} of {len(self.stage_blocks)}, rank "
                  f"{i % spec.pp}, {spec.schedule}, {spec.microbatches} micro-batches, bubble {self.bubble:.1%}"
                  + sharded) for i, b in enumerate(self.stage_blocks)]
        if self.budget:
            rows.append(("(budget)", self.budget))
        if spec.sp == "ulysses":
            rows.append(("(attention)", f"Ulysses: the sequence split over the {spec.dp} dp ranks, heads by all-to-all"))
        elif spec.sp == "megatron":
            rows.append(("(residual stream)", f"Megatron sequence parallel: norms and residual adds on 1/{spec.tp} of "
                                              f"the sequence per tp rank"))
        if spec.dp > 1 and spec.pp == 1:
            rows += [(b, f"fully_shard over dp={spec.dp}") for b in self.blocks] + [("(root)", f"fully_shard over dp={spec.dp}")]
        if "recompute" in self.passes:    # pipeline stages never take it (ParallelSpec.rewrites)
            rows += [(b, "recompute: activation checkpointing (torch's composable checkpoint), the block saves "
                         "only its input and runs its forward again in backward") for b in self.blocks]
        return rows


@dataclass(frozen=True)
class ParallelRuntime:
    """What a call of the sharded model runs with on this rank."""
    spec: ParallelSpec
    passes: tuple = ()
    device: Optional[torch.device] = None     # this rank's device: batches are moved to it
    head: Optional[VocabHead] = None          # a vocab-parallel head: its loss under loss_parallel or fused
    dp_group: Any = None                      # sp="ulysses": the group the sequence is split over
    dp_rank: int = 0
    pipeline: Optional[Pipeline] = None
    rows: Optional[tuple[int, int]] = None    # (dp rank, dp): each call's batch is global, this rank takes its rows
    chain: Optional[StageChain] = None        # dp with mini-sequence: the rewritten step graph's stages

    @property
    def rank_params(self) -> Optional[set]:
        """Ids of the parameters this rank holds under pp (its stages'), else None (all)."""
        return self.pipeline.rank_params if self.pipeline is not None else None

    def step(self, kwargs: dict):
        """One pipelined training step (forward and backward of every micro-batch); the mean
        micro-batch loss on the rank holding the last stage, None elsewhere."""
        losses: list = []
        kwargs = self._on_device(rank_rows(kwargs, self.rows))
        last = self.pipeline.is_last
        target = next(iter(kwargs.values())) if last else None
        self.pipeline.schedule.step(**kwargs, target=target, losses=losses)
        return torch.stack([x.detach() for x in losses]).mean() if last else None

    def run(self, model: nn.Module, args: tuple, kwargs: dict):
        """One call of the sharded model; a vocab-parallel head's loss runs under loss_parallel,
        in forward here and in the caller's backward through the scope's hooks."""
        if self.spec.pp > 1:
            raise ValueError("under parallel=dict(pp=...) one call is a whole pipelined training step: use "
                             "opt.step(**batch), which runs forward and backward of every micro-batch and "
                             "returns the loss on the last stage's rank")
        args, kwargs = rank_rows(args, self.rows), rank_rows(kwargs, self.rows)
        args, kwargs = self._on_device((args, self._without_cache(model, kwargs)))
        if self.spec.sp == "ulysses":
            return self._run_ulysses(model, args, kwargs)
        if self.chain is not None:
            if args:
                raise ValueError("parallel= with mini-sequence takes the batch as keywords (input_ids=, labels=)")
            return CausalLMOutput(loss=self.chain(**{k: v for k, v in kwargs.items() if k != "use_cache"}))
        if self.head is None:
            return model(*args, **kwargs)
        fused_loss = self.head.fused
        try:
            with loss_parallel():
                out = model(*args, **kwargs)
        finally:
            fused = fused_loss is not None and fused_loss.last_fused
            skipped = fused_loss is not None and fused_loss.skipped
            if fused_loss is not None:
                fused_loss.clear()
        if skipped:
            if not fused:   # the model's own loss read the empty logits: never return that
                raise RuntimeError("the vocab-parallel LM head computed no logits for the fused loss, but the model's "
                                   "loss did not take it (its logits are not the head's output as planned); use "
                                   "optimize(..., keep_logits=True)")
            out["logits"] = None   # as on one device: the head is fused with the loss in training
        loss = getattr(out, "loss", None)
        if loss is not None and loss.requires_grad and not fused:
            out["loss"] = self.head.scope.enter_on_backward(loss)
        return out

    def _on_device(self, batch):
        """A batch on this rank's device (as it came where it is already there)."""
        return on_device(batch, self.device) if self.device is not None else batch

    def _without_cache(self, model: nn.Module, kwargs: dict) -> dict:
        """Checkpointed blocks run their forward twice, so in training a KV cache would take each
        block's keys twice: the call gets use_cache=False (as transformers' own gradient
        checkpointing sets), and use_cache=True is refused."""
        if "recompute" not in self.passes or not model.training or not accepts_use_cache(model):
            return kwargs
        if kwargs.get("use_cache"):
            raise ValueError("use_cache=True in training with recompute: each checkpointed block would add its "
                             "keys and values to the cache again when backward runs it; drop use_cache")
        return {**kwargs, "use_cache": False}

    def _run_ulysses(self, model: nn.Module, args: tuple, kwargs: dict):
        if args:
            raise ValueError("sp='ulysses' takes the batch as keywords (input_ids=, labels=, ...)")
        out = model(**ulysses.shard_batch(kwargs, rank=self.dp_rank, size=self.spec.dp))
        loss = getattr(out, "loss", None)
        if loss is not None:
            out["loss"] = _ulysses_loss(loss, self.spec.dp, self.dp_group)
        return out


def rank_rows(batch, rows: Optional[tuple[int, int]]):
    """This dp rank's rows of a global batch (`rows`: (dp rank, dp); None: the batch as it is): each
    tensor of two or more dims split along its first, which dp must divide."""
    if rows is None:
        return batch
    rank, size = rows

    def part(v):
        if not isinstance(v, torch.Tensor) or v.dim() < 2:
            return v
        if v.shape[0] % size:
            raise ValueError(f"parallel='auto' chose dp={size}, which splits each batch's rows over the dp ranks: "
                             f"{v.shape[0]} rows do not split into {size} (give every rank the same global batch "
                             f"with the rows it was planned at)")
        return v.chunk(size)[rank]
    if isinstance(batch, dict):
        return {k: part(v) for k, v in batch.items()}
    return tuple(part(v) for v in batch)


def _ulysses_loss(loss, size: int, group):
    """The whole sequence's loss as the value; as the gradient, `size` times this rank's share, so
    FSDP's mean over the ranks sums the shares (each is its tokens' sum over the whole count)."""
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return loss * size + (total - loss.detach() * size)
