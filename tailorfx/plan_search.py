"""The planner's search: among candidate plans (planner.budget_candidates), the one that fits the
budget with the least recompute, found with few traces of the graph. Each evaluation traces the
rewritten graph and walks the memory model over it (seconds for a deep model, minutes under
Inductor); what a candidate recomputes is counted on its rewritten graph alone, before any trace,
so a candidate that recomputes more than a fitting one already found is never traced."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional

from tailorfx.attention import Exact
from tailorfx.budget import format_bytes
from tailorfx.errors import BudgetError
from tailorfx.progress import progress

# A plan fits when its predicted peak is within the budget less this headroom: predictions with
# recompute tags were measured up to ~3.6% under the allocator's peak (the min-cut partitioner's
# choices); without them they are exact to the byte.
HEADROOM = 0.04


@dataclass(frozen=True)
class Candidate:
    """One plan the planner considered, with what the memory and cost models said of it."""
    label: str
    passes: tuple[str, ...]
    options: tuple = ()               # extra (key, value) pass options
    peak: Optional[int] = None        # predicted peak of one step (params, grads, optimizer, activations)
    added_flops: Optional[int] = None  # forward FLOPs rerun in backward
    fits: Optional[bool] = None

    def __str__(self) -> str:
        from tailorfx.rewrite.cost import fmt_flops
        peak = format_bytes(self.peak) if self.peak is not None else "-"
        flops = fmt_flops(self.added_flops) if self.added_flops is not None else "-"
        return f"{self.label}: peak {peak}, recompute {flops}" + ("" if self.fits is None else
                                                                     (" (fits)" if self.fits else " (over)"))


Evaluate = Callable[[Candidate], tuple[Candidate, object]]
Flops = Callable[[Candidate], int]


def last_resort(c: Candidate) -> bool:
    """Tried only when no other candidate fits: it costs speed the FLOP count does not show."""
    spec = dict(c.options).get("attention")
    return (isinstance(spec, Exact) and spec.backward_blocks > 1) or dict(c.options).get("offload") is not None


def search(candidates: list[Candidate], evaluate: Evaluate, budget: int, budget_label: str,
           breakdown: Callable[[object], dict], allocator_headroom: float = 0.0, hint: Optional[str] = None,
           flops: Optional[Flops] = None) -> tuple[Candidate, object, list[Candidate]]:
    """The fitting candidate with the least recompute (then the fewest blocks offloaded); raises
    BudgetError if none fits. The `hint`ed one (a label) is tried first and taken if it fits. Then
    candidates that recompute nothing: when one fits, no plan that recomputes can beat it, and none
    is traced. Each ladder of first-k-blocks candidates (peak falling as k grows) is searched for its
    smallest k that fits, from the earlier ladder's (smallest_fitting); the others are all tried.
    `flops(c)`: what c recomputes, counted before it is evaluated: the others are tried in order of
    it, and a candidate recomputing more than a fitting one found is not evaluated (it cannot be chosen)."""
    last = [c for c in candidates if last_resort(c)]
    ks = [c for c in candidates if isinstance(dict(c.options).get("recompute_blocks"), int)]
    free = [c for c in candidates if c not in ks and c not in last and recomputes_nothing(c)]
    head = [c for c in candidates if c not in ks and c not in free and c not in last]
    total = len(free) + len(head) + sum(len(x).bit_length() for x in ladders(ks)) + len(last)
    with progress(total=total, desc="planning", unit="plan") as bar:
        done: dict[int, tuple[Candidate, object]] = {}   # the hint, when it does not fit, is not traced again

        def tried(c: Candidate) -> tuple[Candidate, object]:
            if id(c) not in done:
                bar.set_postfix_str(c.label, refresh=False)
                done[id(c)] = evaluate(c)
                bar.update(1)
            return done[id(c)]
        if (hinted := next((tried(c) for c in candidates if c.label == hint), None)) and hinted[0].fits:
            return hinted[0], hinted[1], []
        seen: list[tuple[Candidate, object]] = [tried(c) for c in free]
        if any(c.fits for c, _ in seen):
            head, ks = [], []
        for c in (sorted(head, key=flops) if flops else head):
            if not _costlier(c, seen, flops):
                seen.append(tried(c))
        floor = 0
        for ladder in ladders(ks):   # a later ladder saves less a block: its smallest k is at least the last's
            # (but its last rung is tried: at all blocks the first ladder's peak may be the higher one)
            floor = min(smallest_fitting(ladder, floor, tried, seen, usable(budget, allocator_headroom), flops),
                        len(ladder) - 1)
        if not any(c.fits for c, _ in seen):
            seen += [tried(c) for c in last]
    fitting = [(c, p) for c, p in seen if c.fits]
    if not fitting:
        _over_budget(seen, breakdown, budget_label, allocator_headroom)
    fitting.sort(key=lambda cp: (cp[0].added_flops, dict(cp[0].options).get("recompute_blocks") or 0, cp[0].peak))
    chosen, payload = fitting[0]
    others = sorted((c for c, _ in seen if c is not chosen), key=lambda c: (not c.fits, c.added_flops))
    return chosen, payload, others


def _costlier(c: Candidate, seen: list, flops: Optional[Flops]) -> bool:
    """Whether `c` recomputes more than a fitting candidate already evaluated (so it cannot be chosen)."""
    least = min((s.added_flops for s, _ in seen if s.fits), default=None)
    return flops is not None and least is not None and flops(c) > least


def smallest_fitting(ladder: list[Candidate], floor: int, tried: Evaluate, seen: list, threshold: float,
                     flops: Optional[Flops] = None) -> int:
    """The index of the ladder's smallest k that fits (len(ladder) if none does), searched from
    `floor` up; each candidate evaluated goes into `seen`. A ladder's peak falls by about the same
    bytes a block, so once two rungs are known the search goes where the line through them crosses
    the budget's `threshold`, then to the rung beside it, which settles k where the line holds; where
    it does not, the next probe halves the range left (at worst three probes a halving). A rung that
    recomputes more than a fitting candidate found is counted as above k, untraced."""
    lo, hi = floor, len(ladder) - 1
    known: list[tuple[int, int]] = []   # (index, peak) of the rungs evaluated
    step, beside = "line", None         # the next probe's kind: on the line, beside its guess, or halving
    while lo <= hi:
        if step == "beside" and not lo <= beside <= hi:
            step = "line"
        guess = _crossing(known, threshold) if step == "line" else None
        if step == "beside":
            mid = beside
        else:
            mid = min(max(guess, lo), hi) if guess is not None else (lo + hi) // 2
        if _costlier(ladder[mid], seen, flops):
            hi, step = mid - 1, "halve"
            continue
        c, payload = tried(ladder[mid])
        seen.append((c, payload))
        known.append((mid, c.peak))
        lo, hi = (lo, mid - 1) if c.fits else (mid + 1, hi)
        step, beside = ("beside", mid - 1 if c.fits else mid + 1) if guess is not None else \
            ("halve" if step == "beside" else "line", None)
    return lo


def _crossing(known: list[tuple[int, int]], threshold: float) -> Optional[int]:
    """The smallest index whose peak, on the line through the last two rungs evaluated, is within the
    threshold; None with fewer than two, or a line that does not fall."""
    if len(known) < 2:
        return None
    (i1, p1), (i2, p2) = known[-2], known[-1]
    if i1 == i2 or (p2 - p1) / (i2 - i1) >= 0:
        return None
    return math.ceil(i1 + (threshold - p1) * (i2 - i1) / (p2 - p1))


def _over_budget(seen: list, breakdown: Callable[[object], dict], budget_label: str, allocator_headroom: float):
    """Raise the BudgetError that names the smallest peak any candidate reached and what dominates it."""
    smallest, payload = min(seen, key=lambda cp: cp[0].peak)
    parts = breakdown(payload)
    dominant, detail = max(parts, key=parts.get), ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items())
    suggested = math.ceil(smallest.peak / usable(1, allocator_headroom))
    raise BudgetError(
        f"budget {budget_label} cannot be met: the smallest peak any plan reaches is "
        f"{format_bytes(smallest.peak)} ({smallest.label}; {detail}), dominated by {dominant}. Use a "
        f"budget of at least {format_bytes(suggested)} (that peak plus {HEADROOM:.0%} headroom for prediction error"
        + (f" and the setup's {allocator_headroom:.0%} allocator headroom" if allocator_headroom else "")
        + "), or shrink what dominates (shorter sequences or smaller batches for activations; "
        "a lighter TrainingSetup for weights, gradients and optimizer state: pure-bf16, "
        "pure-bf16-fused-optimizer, 8-bit AdamW).", smallest.peak, dominant, suggested)


def ladders(ks: list[Candidate]) -> list[list[Candidate]]:
    """The first-k-blocks candidates by recompute policy, in order: each ladder's peak falls as k grows."""
    out: dict = {}
    for c in ks:
        out.setdefault(dict(c.options).get("recompute_policy"), []).append(c)
    return list(out.values())


def recomputes_nothing(c: Candidate) -> bool:
    """No pass of the candidate reruns forward work in backward: no recompute, and mini-sequence
    (if any) fuses the LM head only (its gradient is taken in forward)."""
    return "recompute" not in c.passes and ("minisequence" not in c.passes
                                           or dict(c.options).get("minisequence_mlps") is False)


def usable(budget: int, allocator_headroom: float = 0.0) -> float:
    """The part of a budget plans may fill: less the setup's allocator headroom and HEADROOM."""
    return budget * (1 - allocator_headroom) * (1 - HEADROOM)


def with_result(c: Candidate, peak: int, flops: int, budget: int, allocator_headroom: float = 0.0) -> Candidate:
    return replace(c, peak=peak, added_flops=flops, fits=peak <= usable(budget, allocator_headroom))
