"""optimize(..., parallel=dict(tp=2, dp=2) | dict(pp=2, schedule="1f1b", microbatches=4)), inside
a torchrun process.

    tp/dp: capture -> regions -> passes.parallel.infer_tp_plan (+ infer_sequence_parallel for
             sp="megatron") -> check(tp) -> runtime.apply_tp (DTensor, tp mesh dim)
             -> the vocab-parallel head's loss fused (runtime.vocab_parallel)
             -> runtime.apply_checkpoint (passes=["recompute"], dp alone)
             -> runtime.apply_fsdp (FSDP2, dp mesh dim)
    pp:    capture (static shapes) -> regions -> passes.pipeline_split (block FLOPs, bytes)
             -> the exact structural rewrites (rewrite_step: minisequence, the LM head fused with
                its loss) -> codegen.pipeline.cut_stages -> codegen.schedule
             -> torch.distributed.pipelining
    predict_memory(): tp alone, the memory model on the sharded graph; with dp/pp/sp,
             parallel_memory.predict_rank_memory on a fake copy of the model taken before sharding
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch.nn as nn

from tailorfx.parallel.plan import (accepts_use_cache, describe_rewrites, head_style, plan_tensor_parallel,
                                    rewrite_step, tp_styles)
from tailorfx.parallel.shard import shard_model
from tailorfx.parallel.spec import ParallelSpec
from tailorfx.parallel.stages import block_costs, stage_blocks
from tailorfx.rewrite.regions import find_regions
from tailorfx.runtime.tensor_parallel import on_device, rank_device

@dataclass
class ParallelPlan:
    """What was applied: degrees, each module's style, and why the others stay replicated."""
    tp: int = 1
    dp: int = 1
    styles: dict[str, str] = field(default_factory=dict)
    replicated: dict[str, str] = field(default_factory=dict)
    blocks: list[str] = field(default_factory=list)
    loss_scope: Any = None      # runtime.tensor_parallel.LossParallelScope for a vocab-parallel head
    fused_loss: Any = None      # runtime.vocab_parallel.FusedVocabParallelLoss: the head's loss fused with it
    head_note: str = ""         # how the vocab-parallel head's loss runs, and why
    pp: int = 1
    schedule: str = ""
    microbatches: int = 1
    stage_blocks: list[list[str]] = field(default_factory=list)   # blocks of each pipeline stage
    bubble: float = 0.0           # the schedule's simulated idle fraction (uniform stage costs)
    runtime: Any = None           # torch's pipeline schedule runtime, this rank's stages
    rank_params: Optional[set] = None   # ids of the parameters this rank's stages hold
    is_last: bool = False
    sp: Optional[str] = None      # "ulysses": the dp ranks hold slices of the sequence; "megatron": the tp
                                  # ranks, between the sharded layers
    example: dict = field(default_factory=dict)   # the example batch (per-rank predictions trace it)
    dp_group: Any = None
    dp_rank: int = 0
    source: Any = None            # a fake-tensor copy of the model before sharding (dp/pp/sp predictions)
    tp_mesh: Any = None           # the tp mesh dimension the copy is sharded on for them
    pp_rank: int = 0
    predictions: dict = field(default_factory=dict)   # setup -> this rank's prediction (a capture each)
    passes: tuple = ()            # the rewrites: the pipeline's step graph's before it was cut, or
                                  # "recompute" (the sharded model's blocks checkpointed)
    captured: Any = None          # that graph as captured (tp=1): the prediction traces it, not a new capture
    rewrites: list = field(default_factory=list)   # (region, what was done to it) for the report
    device: Any = None            # this rank's device: batches are moved to it

    def step(self, kwargs: dict):
        """One pipelined training step (forward and backward of every micro-batch); the mean
        micro-batch loss on the rank holding the last stage, None elsewhere."""
        import torch
        losses: list = []
        kwargs = self._on_device(kwargs)
        target = next(iter(kwargs.values())) if self.is_last else None
        self.runtime.step(**kwargs, target=target, losses=losses)
        return torch.stack([x.detach() for x in losses]).mean() if self.is_last else None

    def _on_device(self, batch):
        """A batch on this rank's device (as it came where it is already there)."""
        return on_device(batch, self.device) if self.device is not None else batch

    def run(self, model: nn.Module, args: tuple, kwargs: dict):
        """One call of the sharded model; a vocab-parallel head's loss runs under loss_parallel,
        in forward here and in the caller's backward through the scope's hooks."""
        if self.pp > 1:
            raise ValueError("under parallel=dict(pp=...) one call is a whole pipelined training step: use "
                             "opt.step(**batch), which runs forward and backward of every micro-batch and "
                             "returns the loss on the last stage's rank")
        args, kwargs = self._on_device((args, self._without_cache(model, kwargs)))
        if self.sp == "ulysses":
            return self._run_ulysses(model, args, kwargs)
        if self.loss_scope is None:
            return model(*args, **kwargs)
        from torch.distributed.tensor.parallel import loss_parallel
        try:
            with loss_parallel():
                out = model(*args, **kwargs)
        finally:
            fused = self.fused_loss is not None and self.fused_loss.last_fused
            if self.fused_loss is not None:
                self.fused_loss.clear()
        loss = getattr(out, "loss", None)
        if loss is not None and loss.requires_grad and not fused:
            out["loss"] = self.loss_scope.enter_on_backward(loss)
        return out

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
        from tailorfx.runtime.ulysses import shard_batch
        if args:
            raise ValueError("sp='ulysses' takes the batch as keywords (input_ids=, labels=, ...)")
        out = model(**shard_batch(kwargs, rank=self.dp_rank, size=self.dp))
        loss = getattr(out, "loss", None)
        if loss is not None:
            out["loss"] = _ulysses_loss(loss, self.dp, self.dp_group)
        return out

    def predict(self, model: nn.Module, seq_len: Optional[int], setup):
        """This rank's memory for one step at the example batch's shape, nothing run. Tensor
        parallel alone: the memory model on the sharded model's own graph (DTensor shards,
        collectives and all; traced on fake tensors). With dp (FSDP2), pp or sp: the composition
        of parallel_memory.predict_rank_memory on a fake copy of the model taken before it was
        sharded (the example's rows are this rank's micro-batch; under pp the whole step's,
        split into the micro-batches; under sp every rank's, split over the sequence). Kept per
        setup: the model's shapes do not change."""
        from tailorfx.errors import PredictionError
        length = self.example["input_ids"].shape[1] if "input_ids" in self.example else None
        if seq_len not in (None, length):
            raise PredictionError(f"under parallel= the prediction is at the example batch's length ({length}): "
                                  f"give example_inputs of length {seq_len}")
        key = repr(setup)
        if key not in self.predictions:
            self.predictions[key] = self._predict(model, length, setup)
        return self.predictions[key]

    def _predict(self, model: nn.Module, length: Optional[int], setup):
        import contextlib
        from tailorfx import planner
        from tailorfx.codegen.pipeline import capture_static
        from tailorfx.rewrite.capture import seq_info
        if self.dp > 1 or self.pp > 1 or self.sp == "ulysses" or self.passes:
            return self._predict_composed(length, setup)
        if self.loss_scope is not None:
            from torch.distributed.tensor.parallel import loss_parallel
            scope = loss_parallel
        else:
            scope = contextlib.nullcontext
        try:
            with scope():
                gm, _, _ = capture_static(model, self.example)
                return planner.predict_graphs([(gm, "dynamo", None)], [seq_info(gm, None)], None, setup)
        finally:
            if self.fused_loss is not None:    # the capture's run left the head's tensors in the hook
                self.fused_loss.clear()

    def _predict_composed(self, length: Optional[int], setup):
        from tailorfx.errors import PredictionError
        from tailorfx.parallel.memory import predict_rank_memory
        if self.source is None or length is None:
            raise PredictionError("per-rank prediction under dp/pp/sp needs the example batch's input_ids and the "
                                  "model's copy taken before sharding (optimize(parallel=...) keeps both)")
        rows = self.example["input_ids"].shape[0]
        if self.pp > 1:
            rows //= self.microbatches
        pipelined = self.pp > 1
        rm = predict_rank_memory(self.source, tp=self.tp, dp=self.dp, pp=self.pp, sp=self.sp,
                                 schedule=self.schedule or "1f1b",
                                 microbatches=self.microbatches if pipelined else None,
                                 seq_len=length, batch_size=rows, setup=setup, rank=self.pp_rank if pipelined else None,
                                 vocab_loss="fused" if self.fused_loss is not None else "loss_parallel",
                                 passes=self.passes, _mesh=self.tp_mesh if self.tp > 1 else None,
                                 _graph=self.captured)
        return rm.as_estimate()

    def describe(self) -> list[tuple[str, str]]:
        rows = [(fqn, style + (f"; {self.head_note}" if style.startswith("colwise_vocab_parallel") and self.head_note
                               else "")) for fqn, style in self.styles.items()]
        rows += [(fqn, f"replicated: {why}") for fqn, why in self.replicated.items()]
        rows += list(self.rewrites)
        sharded = f", fully_shard over dp={self.dp} (the stage one unit)" if self.dp > 1 else ""
        rows += [(", ".join(b) or "(no block)", f"pipeline stage {i} of {len(self.stage_blocks)}, rank "
                  f"{i % self.pp}, {self.schedule}, {self.microbatches} micro-batches, bubble {self.bubble:.1%}"
                  + sharded) for i, b in enumerate(self.stage_blocks)]
        if self.sp == "ulysses":
            rows.append(("(attention)", f"Ulysses: the sequence split over the {self.dp} dp ranks, heads by all-to-all"))
        elif self.sp == "megatron":
            rows.append(("(residual stream)", f"Megatron sequence parallel: norms and residual adds on 1/{self.tp} of "
                                              f"the sequence per tp rank"))
        if self.dp > 1 and self.pp == 1:
            rows += [(b, f"fully_shard over dp={self.dp}") for b in self.blocks] + [("(root)", f"fully_shard over dp={self.dp}")]
        if "recompute" in self.passes:    # pipeline stages never take it (ParallelSpec.rewrites)
            rows += [(b, "recompute: activation checkpointing (torch's composable checkpoint), the block saves "
                         "only its input and runs its forward again in backward") for b in self.blocks]
        return rows


def _ulysses_loss(loss, size: int, group):
    """The whole sequence's loss as the value; as the gradient, `size` times this rank's share, so
    FSDP's mean over the ranks sums the shares (each is its tokens' sum over the whole count)."""
    import torch.distributed as dist
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return loss * size + (total - loss.detach() * size)


def parallelize(model: nn.Module, parallel: Any, args: tuple, kwargs: dict, *, passes: Optional[tuple] = None,
                options: Optional[dict] = None) -> ParallelPlan:
    """Shard `model` in place as `parallel` asks; returns what was done (for the report).
    `passes`, `options`: optimize()'s (see ParallelSpec.rewrites)."""
    from tailorfx.runtime.tensor_parallel import apply_checkpoint, apply_fsdp, device_mesh
    spec = ParallelSpec.parse(parallel)
    rewrites = spec.rewrites(passes, (options or {}).get("recompute_policy"))
    if not args and not kwargs:
        raise ValueError("parallel= needs example_inputs: the tensor-parallel plan is read off the graph "
                         "of one forward pass")
    device = rank_device()
    mesh = device_mesh(tp=spec.tp, dp=spec.dp, pp=spec.pp, device=device)
    if device.type == "cuda":   # each rank on its own GPU (a model moved to "cuda" before is on GPU 0 everywhere)
        model.to(device)
        args, kwargs = on_device((args, kwargs), device)
    source = None
    if spec.dp > 1 or spec.pp > 1 or spec.sp or rewrites:    # what per-rank predictions shard and capture
        from tailorfx.models.build import fake_copy
        source = fake_copy(model)
    if spec.pp > 1:
        if spec.tp > 1:   # the stages are cut from the sharded model's graph; its head gathers the logits
            tp_plan, _ = plan_tensor_parallel(model, args, kwargs)
            styles = tp_styles(tp_plan, spec.tp, head_style(spec))
            shard_model(model, styles=styles, mesh=mesh["tp"], head_loss=tp_plan.head_loss, vocab_loss=spec.vocab_loss)
        out = pipeline(model, spec, kwargs, mesh["pp"], dp_mesh=mesh["dp"], passes=rewrites, options=options,
                       device=device)
        if spec.tp > 1:
            out.tp, out.styles, out.replicated = spec.tp, styles, dict(tp_plan.replicated)
        out.example, out.source, out.tp_mesh = dict(kwargs), source, mesh["tp"]
        out.pp_rank, out.device = mesh["pp"].get_local_rank(), device
        return out
    tp_plan, blocks = plan_tensor_parallel(model, args, kwargs)
    out = ParallelPlan(spec.tp, spec.dp, blocks=blocks, example=dict(kwargs), source=source, tp_mesh=mesh["tp"],
                       passes=rewrites, device=device)
    if spec.tp > 1:
        styles = tp_styles(tp_plan, spec.tp, head_style(spec))
        head = shard_model(model, styles=styles, mesh=mesh["tp"], head_loss=tp_plan.head_loss,
                           vocab_loss=spec.vocab_loss)
        out.styles, out.replicated = styles, dict(tp_plan.replicated)
        if head is not None:
            out.loss_scope, out.fused_loss, out.head_note = head.scope, head.fused, head.note
    if spec.sp == "megatron":
        out.sp = "megatron"
    elif spec.sp:
        from tailorfx.runtime.ulysses import register
        model.set_attn_implementation(register(group=mesh["dp"].get_group(), size=spec.dp))
        out.sp, out.dp_group, out.dp_rank = spec.sp, mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    if "recompute" in rewrites:     # inside FSDP's units, as torchtitan composes them
        apply_checkpoint(model, blocks=blocks)
    if spec.dp > 1:
        apply_fsdp(model, blocks=blocks, mesh=mesh["dp"])
    return out


def pipeline(model: nn.Module, spec: ParallelSpec, kwargs: dict, mesh, *, dp_mesh=None, passes: tuple = (),
             options: Optional[dict] = None, device=None) -> ParallelPlan:
    """Cut the model's step graph into pp * virtual stages balanced by the cost model (on the
    graph as captured), after `passes` rewrote it, shard this rank's stages over the dp ranks
    (FSDP2, one unit per stage) and load them into torch's pipeline runtime with the tailorfx
    schedule."""
    from tailorfx.codegen.pipeline import capture_static, cut_stages, pipeline_runtime
    from tailorfx.codegen.schedule import simulate_schedule
    from tailorfx.rewrite.capture import seq_info
    m, pp, v = spec.microbatches, spec.pp, spec.virtual
    rows = {k: t.shape[0] for k, t in kwargs.items() if hasattr(t, "shape") and t.dim()}
    if any(r % m for r in rows.values()):
        raise ValueError(f"example_inputs have {sorted(set(rows.values()))} rows, which microbatches={m} does not "
                         f"divide: give a batch of a multiple of {m} rows (every step must have that shape)")
    micro = {k: (t[: t.shape[0] // m] if k in rows else t) for k, t in kwargs.items()}
    gm, example, micro = capture_static(model, micro)
    captured = gm     # unchanged below: the passes rewrite a copy, and cutting the stages reads it
    regions = find_regions(gm, seq_info(gm, None))
    costs = block_costs(gm, regions)
    num_stages = spec.num_stages
    blocks_of = stage_blocks(costs, num_stages)
    gm, records = rewrite_step(gm, passes, options)
    if records:
        regions = find_regions(gm, seq_info(gm, None))
    block_stage = {name: i for i, blocks in enumerate(blocks_of) for b in regions.of_kind("block")
                   if b.path in blocks for name in b.nodes}
    stages = cut_stages(gm, example, model, block_stage, num_stages, micro)
    rank = mesh.get_local_rank()
    if dp_mesh is not None:     # a dp mesh of one rank shards nothing
        from tailorfx.runtime.tensor_parallel import apply_fsdp_stages
        apply_fsdp_stages([stages[s] for s in range(rank, num_stages, pp)], model=model, mesh=dp_mesh)
    runtime = pipeline_runtime(stages, rank=rank, num_ranks=pp, name=spec.schedule, microbatches=m, virtual=v,
                               group=mesh.get_group(), device=device)
    mine = {id(p) for s in range(rank, num_stages, pp) for p in stages[s].parameters()}
    bubble = float(simulate_schedule(spec.schedule, pp, m, virtual=v).bubble)
    return ParallelPlan(pp=pp, dp=spec.dp, schedule=spec.schedule, microbatches=m, stage_blocks=blocks_of, bubble=bubble,
                        runtime=runtime, rank_params=mine, is_last=(num_stages - 1) % pp == rank,
                        blocks=list(costs.blocks), passes=tuple(passes), rewrites=describe_rewrites(records),
                        captured=captured if spec.tp == 1 else None)
