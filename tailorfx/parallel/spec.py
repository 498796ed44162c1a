"""The layout of a parallel run: `ParallelSpec`, what `optimize(parallel=dict(...))` takes, checked
as it is made, and the single-device rewrites each layout takes.

    ParallelSpec.parse(dict(tp=2, dp=2))      -> ParallelSpec(tp=2, dp=2, pp=1, ..., microbatches=1)
    ParallelSpec(pp=2, schedule="1f1b", microbatches=8).rewrites(None)   -> ("minisequence",)
    ParallelSpec(dp=2).rewrites(["minisequence", "recompute"])          -> ("minisequence", "recompute")
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional, Sequence

from tailorfx.codegen.schedule import SCHEDULES

# The single-device rewrites a pipeline's step graph takes: "minisequence" before it is cut
# (exact, structural: custom ops that stages run under eager autograd; the default), "recompute"
# each block of a stage one activation-checkpointing unit; the others need AOTAutograd's joint graph
STAGE_PASSES = ("minisequence", "recompute")
STAGE_DEFAULT = ("minisequence",)
# What the sharded model takes under dp (FSDP2), tp or both: "recompute", each repeated block one
# activation-checkpointing unit (torch's composable checkpoint), which saves only its input; and
# "minisequence": under dp alone the LM head fused with its loss and the MLPs in chunks, the step
# graph run as a chain of its blocks' stages (apply.apply_chain); under tp each MLP module in
# sequence chunks, each chunk checkpointed (shard.chunk_mlps: the runtime runs transformers' eager
# modules on DTensor shards, and the LM head's loss is fused with it whatever the passes)
SHARDED_PASSES = ("minisequence", "recompute")


@dataclass(frozen=True)
class ParallelSpec:
    """Degrees of tensor (`tp`), data (`dp`, FSDP2) and pipeline (`pp`) parallelism, whose product
    is the world; `sp` sequence parallelism: "ulysses" (the dp ranks split the sequence instead
    of the batch) or "megatron" (the tp ranks split it between the sharded layers); the pipeline
    `schedule` and its `microbatches` (default pp); `vocab_loss`, how a vocab-parallel LM head's
    loss runs: "fused" with it in row chunks, or under DTensor's "loss_parallel"."""
    tp: int = 1
    dp: int = 1
    pp: int = 1
    sp: Optional[str] = None
    schedule: str = "1f1b"
    microbatches: Optional[int] = None
    vocab_loss: str = "fused"

    def __post_init__(self):
        for k in ("tp", "dp", "pp", "microbatches"):
            v = getattr(self, k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"parallel={self}: {k}={v!r} is not valid: a positive int")
        if self.sp not in (None, "ulysses", "megatron"):
            raise ValueError(f"parallel={self}: sp={self.sp!r} is not valid: 'ulysses' (the dp ranks split the "
                             f"sequence instead of the batch), 'megatron' (the tp ranks split the sequence between "
                             f"the sharded layers: norms, residual) or None")
        if self.sp == "megatron" and (self.tp < 2 or self.pp > 1):
            raise ValueError(f"parallel={self}: sp='megatron' splits the sequence over the tp ranks between the "
                             f"sharded layers: give tp>=2, without pp (Megatron SP across pipeline stages is not "
                             f"supported)")
        if self.sp == "ulysses" and (self.dp < 2 or self.tp * self.pp > 1):
            raise ValueError(f"parallel={self}: sp='ulysses' splits the sequence over the dp ranks: give dp>=2, "
                             f"without tp/pp (Ulysses is supported over the dp ranks alone)")
        if self.vocab_loss not in ("fused", "loss_parallel"):
            raise ValueError(f"parallel={self}: vocab_loss={self.vocab_loss!r} is not valid: 'fused' (the "
                             f"vocab-parallel head's cross-entropy in row chunks, no logits-sized tensor kept) or "
                             f"'loss_parallel' (DTensor's, on the logits shard)")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"parallel={self}: schedule={self.schedule!r} is not valid: one of {list(SCHEDULES)}")
        if self.microbatches is None:
            object.__setattr__(self, "microbatches", self.pp)

    @classmethod
    def parse(cls, parallel: Any) -> ParallelSpec:
        """The user's `parallel=` (a dict of ParallelSpec's fields, or a ParallelSpec), checked."""
        if isinstance(parallel, ParallelSpec):
            return parallel
        if not isinstance(parallel, dict):
            raise ValueError(f"parallel={parallel!r} is not valid: give a dict such as parallel=dict(tp=2, dp=2), "
                             f"or parallel='auto' with a budget")
        keys = [f.name for f in fields(cls)]
        unknown = sorted(set(parallel) - set(keys))
        if unknown:
            raise ValueError(f"unknown parallel option(s) {unknown}; allowed: {keys}")
        return cls(**parallel)

    @property
    def virtual(self) -> int:
        """Stages per pipeline rank: two under the interleaved schedule."""
        return 2 if self.schedule == "interleaved_1f1b" else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual

    def __str__(self) -> str:
        """As the user would write it: dict(...) of what differs from the defaults."""
        given = [(f.name, getattr(self, f.name)) for f in fields(self)
                 if getattr(self, f.name) != f.default and not (f.name == "microbatches" and self.microbatches == self.pp)]
        return "dict(" + ", ".join(f"{k}={v!r}" for k, v in given) + ")"

    def rewrites(self, passes: Optional[Sequence[str]], recompute_policy: Optional[str] = None) -> tuple[str, ...]:
        """The single-device rewrites this layout takes (`passes`, as optimize() got it): None, the
        default, is STAGE_DEFAULT under pp without tp, none otherwise; [] none. The sharded model
        takes SHARDED_PASSES under dp, tp or both, pipeline stages without tp STAGE_PASSES. Any
        other request says what runs."""
        pipelined = self.pp > 1 and self.tp == 1
        if passes is None:
            return STAGE_DEFAULT if pipelined else ()
        if not passes:
            return ()
        if self.pp == 1:
            if self.sp:
                raise ValueError(f"parallel={self} takes no single-device rewrite under sp: recompute and "
                                 f"mini-sequence run under dp (FSDP2), tp and in pipeline stages; drop passes=")
            _only(passes, SHARDED_PASSES, f"parallel={self} takes {list(SHARDED_PASSES)} only",
                  "drop them, or run the passes without parallel=")
            if recompute_policy not in (None, "full"):
                raise ValueError(f"recompute={recompute_policy!r} under parallel={self}: the sharded model's "
                                 f"blocks are checkpointed whole (recompute='full'); drop recompute= or give 'full'")
            return tuple(passes)
        if not pipelined:
            raise ValueError(f"parallel={self} takes no single-device rewrite: drop passes= (pipeline "
                             f"stages without tp take {list(STAGE_PASSES)}, dp and tp {list(SHARDED_PASSES)}), or "
                             f"run the passes without parallel=")
        _only(passes, STAGE_PASSES, f"passes={list(passes)}: pipeline stages take {list(STAGE_PASSES)} only",
              "they rewrite AOTAutograd's joint graph, which a stage run by torch's pipeline runtime does not "
              "have; drop them")
        if "recompute" in passes and self.schedule == "zb_h1":
            raise ValueError(f"recompute under parallel={self}: the zero-bubble schedule splits each backward in "
                             f"two (input, then weight gradients), which a checkpointed block would run its forward "
                             f"for twice; use schedule='1f1b' or drop recompute")
        if recompute_policy not in (None, "full"):
            raise ValueError(f"recompute={recompute_policy!r} under parallel={self}: each block of a stage is "
                             f"checkpointed whole (recompute='full'); drop recompute= or give 'full'")
        return tuple(passes)


def runs_chain(spec: ParallelSpec, passes: Sequence[str]) -> bool:
    """Whether the layout runs its rewritten step graph as a chain of its blocks (apply.apply_chain):
    mini-sequence without pp or tp (under tp the MLPs' modules run in chunks: shard.chunk_mlps)."""
    return spec.pp == 1 and spec.tp == 1 and "minisequence" in passes


def _only(passes: Sequence[str], allowed: Sequence[str], what: str, fix: str) -> None:
    """ValueError `what`, naming the passes outside `allowed`, and `fix`, if there are any."""
    other = [p for p in passes if p not in allowed]
    if other:
        raise ValueError(f"{what}, not {other}: {fix}")


def describe_layout(tp: int, pp: int, dp: int, sp: Optional[str]) -> str:
    """A layout in short: "tp2xpp2xdp2 (sp=megatron)", "1 rank"."""
    parts = [f"{k}{v}" for k, v in (("tp", tp), ("pp", pp), ("dp", dp)) if v > 1]
    s = "x".join(parts) or "1 rank"
    return s + (f" (sp={sp})" if sp else "")
