"""optimize(budget=..., parallel=...): the single-device rewrites each rank's step takes, chosen so
that the worst rank's predicted peak (memory.predict_rank_memory, on fake tensors) fits the budget,
the plan that recomputes least first; BudgetError naming the smallest budget when none fits.

    fit_rewrites(model, ParallelSpec(dp=2), Budget.parse("1GB"), seq_len=2048, batch_size=1, setup=s)
        -> Fit(passes=("recompute",), memory=RankMemory(...), tried=(...))
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from tailorfx import planner
from tailorfx.budget import Budget, format_bytes
from tailorfx.errors import BudgetError
from tailorfx.parallel.memory import RankMemory, predict_rank_memory
from tailorfx.parallel.spec import SHARDED_PASSES, STAGE_PASSES, ParallelSpec
from tailorfx.setup import TrainingSetup


@dataclass(frozen=True)
class Fit:
    """The rewrites chosen for a layout under a budget, the worst rank's memory with them, and
    every (rewrites, memory) tried, in order."""
    passes: tuple[str, ...]
    memory: RankMemory
    tried: tuple[tuple[tuple[str, ...], RankMemory], ...]
    fits: bool = True                  # False: none fit; `passes` and `memory` are the smallest tried

    def describe(self) -> str:
        tried = "; ".join(f"{list(p) or 'none'}: {format_bytes(m.peak_bytes)}" for p, m in self.tried)
        return f"rewrites {list(self.passes) or 'none'} fit the budget per rank ({tried})"


def candidates(spec: ParallelSpec, requested: Optional[Sequence[str]],
               recompute_policy: Optional[str] = None) -> list[tuple[str, ...]]:
    """The rewrites to try, least recompute first: the user's own list (as the layout takes it),
    else the layout's default and then, without pp or sp (dp, tp or both), SHARDED_PASSES'
    combinations (the MLPs chunked, with the LM head fused under dp alone, as it always is under
    tp; each block recomputed; both); in pipeline stages (without tp, not under the zero-bubble
    schedule) mini-sequence with each block recomputed after the default."""
    first = spec.rewrites(requested, recompute_policy)
    if spec.pp > 1 and requested is None and spec.tp == 1 and not spec.sp and spec.schedule != "zb_h1":
        return [first] + ([STAGE_PASSES] if first != STAGE_PASSES else [])
    if requested is not None or spec.pp > 1 or spec.sp:
        return [first]
    more = [("minisequence",), ("recompute",), SHARDED_PASSES]
    return [first] + [p for p in more if p != first]


def try_rewrites(model, spec: ParallelSpec, usable: float, *, seq_len: int, batch_size: int,
                 setup: TrainingSetup, requested: Optional[Sequence[str]] = None,
                 recompute_policy: Optional[str] = None, mesh=None) -> Fit:
    """The first candidate whose worst rank peaks within `usable` bytes, else the smallest tried
    (`fits` False). When the first does not fit the last (the most frugal) is tried next: if it
    does not fit either, none between is predicted. `mesh`: under tp inside torchrun, a real mesh
    of tp ranks to shard on."""
    tried = []

    def predict(passes):
        memory = predict_rank_memory(model, tp=spec.tp, dp=spec.dp, pp=spec.pp, sp=spec.sp, schedule=spec.schedule,
                                     microbatches=spec.microbatches, seq_len=seq_len, batch_size=batch_size,
                                     setup=setup, vocab_loss=spec.vocab_loss, passes=list(passes), _mesh=mesh)
        tried.append((passes, memory))
        return memory
    cands = candidates(spec, requested, recompute_policy)
    order = cands[:1] + cands[-1:] + cands[1:-1] if len(cands) > 2 else cands
    for k, passes in enumerate(order):
        memory = predict(passes)
        if memory.peak_bytes > usable:
            if k == 1 and len(cands) > 2:     # the most frugal does not fit: nothing between does
                break
            continue
        if k == 1 and len(cands) > 2:         # it fits: the least recompute that fits comes first
            for between in cands[1:-1]:
                if predict(between).peak_bytes <= usable:
                    return Fit(between, tried[-1][1], tuple(tried))
        return Fit(passes, memory, tuple(tried))
    passes, smallest = min(tried, key=lambda t: t[1].peak_bytes)
    return Fit(passes, smallest, tuple(tried), fits=False)


def fit_rewrites(model, spec: ParallelSpec, budget: Budget, *, seq_len: int, batch_size: int,
                 setup: TrainingSetup, requested: Optional[Sequence[str]] = None,
                 recompute_policy: Optional[str] = None, mesh=None) -> Fit:
    """try_rewrites against `budget` less the planner's headroom (and the setup's allocator
    headroom); BudgetError with the smallest peak tried when none fits. `mesh`: as try_rewrites'."""
    fit = try_rewrites(model, spec, planner.usable(budget.bytes, setup.headroom), seq_len=seq_len,
                       batch_size=batch_size, setup=setup, requested=requested, recompute_policy=recompute_policy,
                       mesh=mesh)
    if fit.fits:
        return fit
    passes, smallest = fit.passes, fit.memory
    parts = smallest.breakdown()
    dominant = max(parts, key=parts.get)
    suggested = math.ceil(smallest.peak_bytes / planner.usable(1, setup.headroom))
    raise BudgetError(
        f"budget {budget} cannot be met by parallel={spec} at {seq_len} tokens x {batch_size} rows per rank: "
        f"the smallest per-rank peak of the rewrites it takes is {format_bytes(smallest.peak_bytes)} "
        f"(rewrites {list(passes) or 'none'}, worst rank: {smallest.rank}; "
        + ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items() if v) + f"), dominated by {dominant}. "
        f"Use a budget of at least {format_bytes(suggested)} (that peak plus the planner's {planner.HEADROOM:.0%} "
        f"headroom), more ranks (tailorfx plan --world N ranks the layouts), or a lighter TrainingSetup.",
        smallest.peak_bytes, dominant, suggested)
