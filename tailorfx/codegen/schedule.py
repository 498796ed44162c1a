"""Pipeline schedules as per-rank action lists, a simulator, a deadlock check, and export to
torch.distributed.pipelining.

    sched = build_schedule("1f1b", stages=4, microbatches=8)   # rank -> (F, F, F, F, B, F, B, ...)
    sim = simulate(sched)                                       # sim.bubble == Fraction(3, 11)
    order = to_pipelining(sched)                                # torch's `pipeline_order`

A stage index is global: with `virtual` chunks per rank there are ranks * virtual stages and
stage s runs on rank s % ranks (the looped placement of Megatron and torch's Interleaved1F1B).
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from fractions import Fraction
from typing import Mapping, Optional, Union

from tailorfx import compat

KINDS = ("F", "B", "I", "W")   # forward, full backward, backward for inputs only, weight gradient
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
Number = Union[int, float, Fraction]


class ScheduleError(ValueError):
    """A schedule that misses, duplicates or misplaces an action."""


class ScheduleDeadlock(ScheduleError):
    """No rank can start its next action and actions remain."""


@dataclasses.dataclass(frozen=True)
class Action:
    """One computation of one microbatch on one (global) stage."""
    kind: str
    stage: int
    microbatch: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"action kind must be one of {KINDS}, got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.kind}(stage={self.stage}, mb={self.microbatch})"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What each rank runs, in order; `actions[rank]` is that rank's whole step."""
    name: str
    num_ranks: int
    num_microbatches: int
    num_virtual: int
    actions: Mapping[int, tuple[Action, ...]] = dataclasses.field(hash=False)

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.num_virtual

    def rank_of(self, stage: int) -> int:
        return stage % self.num_ranks


@dataclasses.dataclass(frozen=True)
class TimedAction:
    rank: int
    action: Action
    start: Number
    end: Number


@dataclasses.dataclass(frozen=True)
class ScheduleSim:
    """Simulated step. `bubble` is the largest idle fraction of any rank over [0, makespan]
    (`bubble_per_rank` has each). Per stage, `peak_inflight` is the most microbatches whose forward
    ran and whose activations are not yet freed (freed by B, or by I under zero-bubble: I consumes
    the activation stash); `peak_held` also counts the inputs a pending W still keeps (freed by B
    or W), so it is what a zero-bubble schedule adds. Times are exact Fractions under default costs."""
    schedule: Schedule
    makespan: Number
    bubble: Number
    bubble_per_rank: tuple[Number, ...]
    peak_inflight: tuple[int, ...]
    peak_held: tuple[int, ...]
    timeline: tuple[TimedAction, ...]


# ---- builders: one function per schedule, each returns one rank's actions ----------------------
def _gpipe(rank: int, p: int, m: int) -> list[Action]:
    """All forwards, then all backwards (Huang et al. 2019), in torch's ScheduleGPipe order."""
    return [Action("F", rank, i) for i in range(m)] + [Action("B", rank, i) for i in range(m)]


def _one_f_one_b(rank: int, p: int, m: int) -> list[Action]:
    """p-1-rank warmup forwards, then one forward and one backward in turn (PipeDream-flush), so a
    rank holds at most p - rank microbatches."""
    warmup = min(p - 1 - rank, m)
    out = [Action("F", rank, i) for i in range(warmup)]
    for k in range(m - warmup):
        out += [Action("F", rank, warmup + k), Action("B", rank, k)]
    return out + [Action("B", rank, k) for k in range(m - warmup, m)]


def _zb_h1(rank: int, p: int, m: int) -> list[Action]:
    """1F1B with B split into I then W (Qi et al. 2023, ZB-H1): rank r defers its W's by r
    microbatches so they fill the cooldown bubbles, and every rank then holds the inputs of p
    microbatches at most, 1F1B's peak on rank 0 (torch's ScheduleInterleavedZeroBubble at v=1)."""
    warmup = min(p - 1 - rank, m)
    out = [Action("F", rank, i) for i in range(warmup)]
    for k in range(m):
        if warmup + k < m:
            out.append(Action("F", rank, warmup + k))
        out.append(Action("I", rank, k))
        if k >= rank:
            out.append(Action("W", rank, k - rank))
    return out + [Action("W", rank, k) for k in range(max(m - rank, 0), m)]


def _interleaved(rank: int, p: int, m: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021): microbatches go in groups of p through
    each of the rank's v chunks in turn, depth first; (v-1)*p + 2*(p-1-rank) warmup forwards
    (torch's ScheduleInterleaved1F1B order when m % p == 0)."""
    total = m * v

    def action(kind: str, k: int) -> Action:
        chunk = (k // p) % v
        chunk = chunk if kind == "F" else v - 1 - chunk
        return Action(kind, chunk * p + rank, (k // (p * v)) * p + k % p)

    warmup = min((v - 1) * p + 2 * (p - 1 - rank), total)
    out = [action("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [action("F", warmup + k), action("B", k)]
    return out + [action("B", k) for k in range(total - warmup, total)]


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


def build_schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The named schedule for `stages` pipeline ranks, each holding `virtual` chunks (stages), and
    `microbatches` microbatches per step."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}: known ones are {', '.join(SCHEDULES)}")
    p = _positive_int(stages, "stages")
    m = _positive_int(microbatches, "microbatches")
    v = _positive_int(virtual, "virtual")
    if v > 1 and name != "interleaved_1f1b":
        raise ValueError(f"{name!r} runs one stage per rank: pass virtual=1, or use 'interleaved_1f1b' "
                         f"for {v} virtual stages per rank")
    if name == "interleaved_1f1b":
        if m % p:
            lower, upper = (m // p) * p, (m // p + 1) * p
            fix = f"{lower} or {upper}" if lower else f"{upper}"
            raise ValueError(f"interleaved_1f1b sends microbatches through each chunk in groups of "
                             f"stages={p}, so microbatches must be a multiple of {p}: got {m}; use {fix}")
        actions = {r: tuple(_interleaved(r, p, m, v)) for r in range(p)}
    else:
        build = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "zb_h1": _zb_h1}[name]
        actions = {r: tuple(build(r, p, m)) for r in range(p)}
    return Schedule(name, p, m, v, actions)


# ---- validation and the dependency engine -----------------------------------------------------
def _index(schedule: Schedule) -> dict[tuple[str, int, int], Action]:
    """(kind, stage, microbatch) -> action, after checking every action is present once, on the
    right rank, and that each (stage, microbatch) has F and either B or both I and W."""
    p, m, n = schedule.num_ranks, schedule.num_microbatches, schedule.num_stages
    if sorted(schedule.actions) != list(range(p)):
        raise ScheduleError(f"schedule {schedule.name!r} must list ranks 0..{p - 1}, got {sorted(schedule.actions)}")
    seen: dict[tuple[str, int, int], Action] = {}
    for rank, actions in sorted(schedule.actions.items()):
        for a in actions:
            if not (0 <= a.stage < n and 0 <= a.microbatch < m):
                raise ScheduleError(f"rank {rank}: {a} is outside {n} stages x {m} microbatches")
            if schedule.rank_of(a.stage) != rank:
                raise ScheduleError(f"rank {rank}: {a} belongs on rank {schedule.rank_of(a.stage)} "
                                    f"(stage s runs on rank s % {p})")
            if (a.kind, a.stage, a.microbatch) in seen:
                raise ScheduleError(f"rank {rank}: {a} appears twice")
            seen[a.kind, a.stage, a.microbatch] = a
    for s in range(n):
        for mb in range(m):
            have = {k for k in KINDS if (k, s, mb) in seen}
            if have not in ({"F", "B"}, {"F", "I", "W"}):
                split = sorted(have & {"I", "W"})
                need = {"F", "I", "W"} if split else {"F", "B"}
                what = (f"has both B and {' and '.join(split)}" if split and "B" in have
                        else f"misses {' and '.join(sorted(need - have))}")
                raise ScheduleError(f"schedule {schedule.name!r}: stage {s}, microbatch {mb} {what}; each "
                                    f"(stage, microbatch) needs one F and one B, or one F, one I and one W")
    return seen


def _dependencies(a: Action, index: Mapping, num_stages: int) -> list[Action]:
    """Actions that must end before `a` starts (communication is free and immediate)."""
    if a.kind == "F":
        return [index["F", a.stage - 1, a.microbatch]] if a.stage > 0 else []
    if a.kind == "W":
        return [index["I", a.stage, a.microbatch]]
    deps = [index["F", a.stage, a.microbatch]]
    if a.stage < num_stages - 1:
        nxt = index.get(("B", a.stage + 1, a.microbatch)) or index["I", a.stage + 1, a.microbatch]
        deps.append(nxt)
    return deps


def _run(schedule: Schedule, index: Mapping, cost) -> list[TimedAction]:
    """Each rank runs its list in order; an action starts once its rank is free and its
    dependencies have ended. Raises ScheduleDeadlock when no rank can go on."""
    ends: dict[Action, Number] = {}
    pos = {r: 0 for r in schedule.actions}
    free = {r: Fraction(0) for r in schedule.actions}
    timeline: list[TimedAction] = []
    progressed = True
    while progressed:
        progressed = False
        for rank, actions in sorted(schedule.actions.items()):
            while pos[rank] < len(actions):
                a = actions[pos[rank]]
                deps = _dependencies(a, index, schedule.num_stages)
                if any(d not in ends for d in deps):
                    break
                start = max([free[rank], *(ends[d] for d in deps)])
                free[rank] = ends[a] = start + cost(a)
                timeline.append(TimedAction(rank, a, start, ends[a]))
                pos[rank] += 1
                progressed = True
    stuck = [(r, acts[pos[r]]) for r, acts in sorted(schedule.actions.items()) if pos[r] < len(acts)]
    if stuck:
        def waits(a: Action) -> str:
            return ", ".join(str(d) for d in _dependencies(a, index, schedule.num_stages) if d not in ends)
        raise ScheduleDeadlock(f"schedule {schedule.name!r} deadlocks: " + "; ".join(
            f"rank {r} is stuck on {a}, waiting for {waits(a)}" for r, a in stuck))
    return timeline


def check(schedule: Schedule) -> None:
    """Raise ScheduleError for a missing, duplicated or misplaced action and ScheduleDeadlock
    (naming each stuck rank and its next action) for an order that cannot finish."""
    _run(schedule, _index(schedule), lambda a: 1)


# ---- simulation ----------------------------------------------------------------------------------
def _cost_function(costs: Optional[Mapping], num_stages: int, num_virtual: int):
    """Cost of an action: per kind, a number or a {stage: number} mapping; kinds not given cost
    F=1, B=2, I=1, W=1 per rank, split evenly over its `num_virtual` chunks."""
    table = {k: Fraction(c, num_virtual) for k, c in (("F", 1), ("B", 2), ("I", 1), ("W", 1))}
    per_stage: dict[str, Mapping[int, Number]] = {}
    for kind, value in (costs or {}).items():
        if kind not in KINDS:
            raise ValueError(f"costs keys must be action kinds {KINDS}, got {kind!r}")
        values = value.values() if isinstance(value, Mapping) else [value]
        if any(isinstance(c, bool) or not isinstance(c, (int, float, Fraction)) or c < 0 for c in values):
            raise ValueError(f"costs[{kind!r}] must be a non-negative number or {{stage: number}}, got {value!r}")
        if isinstance(value, Mapping):
            if set(value) != set(range(num_stages)):
                raise ValueError(f"costs[{kind!r}] gives stages {sorted(value)}; it needs every stage "
                                 f"0..{num_stages - 1}")
            per_stage[kind] = value
        else:
            table[kind] = value
    return lambda a: per_stage[a.kind][a.stage] if a.kind in per_stage else table[a.kind]


def _peaks(schedule: Schedule, free_at: tuple[str, ...]) -> tuple[int, ...]:
    """Per stage, the most microbatches forwarded and not yet released by a `free_at` action;
    a rank runs one action at a time, so its list order is the order of these events."""
    live, peak = defaultdict(int), [0] * schedule.num_stages
    for actions in schedule.actions.values():
        for a in actions:
            if a.kind == "F":
                live[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
            elif a.kind in free_at:
                live[a.stage] -= 1
    return tuple(peak)


def simulate(schedule: Schedule, costs: Optional[Mapping] = None) -> ScheduleSim:
    """Run `schedule` on the event-driven model (after `check`) and measure bubble and memory."""
    timeline = _run(schedule, _index(schedule), _cost_function(costs, schedule.num_stages, schedule.num_virtual))
    makespan = max((t.end for t in timeline), default=Fraction(0))
    busy = defaultdict(lambda: Fraction(0))
    for t in timeline:
        busy[t.rank] += t.end - t.start
    per_rank = tuple((makespan - busy[r]) / makespan if makespan else Fraction(0) for r in range(schedule.num_ranks))
    timeline.sort(key=lambda t: (t.rank, t.start))
    return ScheduleSim(schedule, makespan, max(per_rank), per_rank, _peaks(schedule, ("B", "I")),
                       _peaks(schedule, ("B", "W")), tuple(timeline))


def simulate_schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> ScheduleSim:
    """simulate(build_schedule(...)) under uniform costs: `.bubble`, `.peak_inflight` per stage."""
    return simulate(build_schedule(name, stages, microbatches, virtual))


# ---- export --------------------------------------------------------------------------------------
def to_pipelining(schedule: Schedule) -> dict[int, list]:
    """The compute-only `pipeline_order` torch.distributed.pipelining's multi-stage runtime loads
    (rank -> its actions in order; no idle slots, which that runtime skips anyway)."""
    check(schedule)
    return {r: [compat.pipelining_action(a.kind, a.stage, a.microbatch) for a in actions]
            for r, actions in sorted(schedule.actions.items())}
