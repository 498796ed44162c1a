"""The layout a world of devices should use under a budget: every (tp, pp, dp, sp) of `world` ranks
predicted per rank with the rewrites it takes (fit.try_rewrites), and its step time on the
device class (steptime.predict_step_time); the fastest that fits (tokens per second) first.

    plan_world(config, world=64, budget="H100-80GB", seq_len=8192)[0]   -> the chosen WorldCandidate
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Union

import torch

from tailorfx import planner
from tailorfx.budget import Budget, format_bytes
from tailorfx.errors import BudgetError
from tailorfx.options import positive_int
from tailorfx.parallel.fit import try_rewrites
from tailorfx.parallel.memory import RankMemory
from tailorfx.parallel.spec import ParallelSpec, describe_layout
from tailorfx.parallel.devices import DeviceClass, device_class
from tailorfx.parallel.steptime import StepTime, predict_step_time
from tailorfx.parallel.trace import RankCapture, capture_rank, param_dtype, read_tp_plan
from tailorfx.setup import TrainingSetup
from tailorfx.setup import resolve as resolve_setup

MAX_TP = 8          # one node: tensor parallel's all-reduces stay on NVLink


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
    passes: tuple[str, ...] = ()       # the single-device rewrites its ranks take (parallel.fit)
    step: Optional[StepTime] = None    # its predicted step time (steptime.predict_step_time)

    @property
    def peak_bytes(self) -> Optional[int]:
        return self.memory.peak_bytes if self.memory is not None else None

    @property
    def step_s(self) -> Optional[float]:
        return self.step.total_s if self.step is not None else None

    @property
    def tokens(self) -> int:
        """Tokens the whole world trains on per step: each data-parallel group's rows (under
        Ulysses the dp ranks share theirs) times the pipeline's micro-batches times the sequence."""
        m = self.memory
        return 0 if m is None else m.seq_len * m.batch_size * m.microbatches * (1 if self.sp == "ulysses" else self.dp)

    @property
    def tokens_per_s(self) -> Optional[float]:
        return self.tokens / self.step_s if self.step is not None else None

    @property
    def bubble(self) -> float:
        return self.memory.bubble if self.memory is not None else 0.0

    def layout(self) -> str:
        return describe_layout(self.tp, self.pp, self.dp, self.sp)

    def __str__(self) -> str:
        peak = format_bytes(self.peak_bytes) if self.peak_bytes is not None else "-"
        rewrites = f" + {'+'.join(self.passes)}" if self.passes else ""
        step = f", {self.tokens_per_s:,.0f} tokens/s" if self.step is not None else ""
        return f"{self.layout()}{rewrites}: {self.status}, {peak} per rank{step}" + (
            f" ({self.reason})" if self.reason else "")


def preference(c: WorldCandidate) -> tuple:
    """The order plan_world breaks ties of predicted step time in, fewest cross-node collectives first: data
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
               max_tp: int = MAX_TP, device: Union[str, DeviceClass, None] = None,
               global_rows: Optional[int] = None, tp_mesh: Optional[Callable[[int], Any]] = None
               ) -> list[WorldCandidate]:
    """The layouts (tp, pp, dp, sp) of `world` ranks, each predicted per rank with its own rewrites
    (fit.try_rewrites: the layout's default, then under dp alone each block recomputed where only
    that fits) and its step time on `device` (default: the GPU a budget preset names, else
    "H100"), the chosen one first: the fastest in tokens per second (ties: `preference`) among
    those whose worst rank fits the budget less the planner's headroom (planner.usable), then the
    other fitting ones, fastest first, those over the budget (smallest first) and those not
    available, each with the reason. Tokens per second, not step time: at `batch_size` rows per
    rank a dp layout trains on more tokens per step than a tp one.

    Enumerated: tp * pp * dp == world, tp <= max_tp (one node) and dividing the heads read off
    the graph, pp at most the number of blocks, sp="megatron" beside every tp >= 2 without pp
(unless the graph has a region the stream cannot be split around), sp="ulysses" when dp >= 2 without tp and pp (as
    the runtime supports it) and dp divides the heads and the sequence; pp with dp shards each
    stage over the dp ranks (FSDP2). `batch_size`: rows of one rank's
    micro-batch; pipelines run `microbatches` of them (default pp). `global_rows` instead: every
    layout trains on that one global batch (as optimize(parallel="auto") feeds it), split as the
    layout splits it (_split_batch). `tp_mesh`: inside torchrun, tp -> a real mesh of tp ranks to
    shard the captures on (outside, torch's fake process group). One capture per tp (and per
    head style and sequence slice) serves every dp, so a world of 1,024 costs a few captures.
    Raises BudgetError, naming the smallest peak any layout reaches, when none fits (its
    `candidates` attribute holds the list).
    """
    positive_int("world", world, allow_none=False)
    positive_int("seq_len", seq_len, allow_none=False)
    positive_int("batch_size", batch_size, allow_none=False)
    positive_int("global_rows", global_rows)
    b = Budget.parse(budget)
    dev = device_class(device if device is not None else b.label if b.arch else "H100")
    s = resolve_setup(setup, param_dtype=param_dtype(model_or_config))
    usable = planner.usable(b.bytes, s.headroom)
    base = capture_rank(model_or_config, tp=1, rows=global_rows or batch_size, seq=seq_len, head="vocab",
                        dtype=s.param_dtype)
    out: list[WorldCandidate] = []
    for tp, pp, dp, sp in _layouts(world):
        why = _unavailable(model_or_config, tp, pp, dp, sp, base=base, dtype=s.param_dtype, seq_len=seq_len,
                           max_tp=max_tp)
        why, rows, m = (why, batch_size, microbatches) if why else _split_batch(tp, pp, dp, sp, global_rows, batch_size,
                                                                               microbatches)
        if why is not None:
            out.append(WorldCandidate(tp, pp, dp, sp, "not available", why))
            continue
        try:   # the layout's own rewrites, then (dp alone) each block recomputed if that is what fits
            spec = ParallelSpec(tp=tp, dp=dp, pp=pp, sp=sp, schedule=schedule, microbatches=m)
            mesh = tp_mesh(tp) if tp_mesh is not None and tp > 1 else None
            fit = try_rewrites(model_or_config, spec, usable, seq_len=seq_len, batch_size=rows, setup=s, mesh=mesh)
        except ValueError as e:
            out.append(WorldCandidate(tp, pp, dp, sp, "not available", str(e).splitlines()[0]))
            continue
        rm = fit.memory
        over = "" if fit.fits else f"{format_bytes(rm.peak_bytes)} > {format_bytes(usable)} usable"
        step = predict_step_time(model_or_config, tp=tp, dp=dp, pp=pp, sp=sp, schedule=schedule, seq_len=seq_len,
                                 batch_size=rows, setup=s, passes=list(fit.passes), device=dev, memory=rm, mesh=mesh)
        out.append(WorldCandidate(tp, pp, dp, sp, "fits" if fit.fits else "over budget", over, rm,
                                  passes=fit.passes, step=step))
    fitting = sorted((c for c in out if c.status == "fits"), key=lambda c: (-c.tokens_per_s, preference(c)))
    over = sorted((c for c in out if c.status == "over budget"), key=lambda c: c.peak_bytes)
    rest = [c for c in out if c.status == "not available"]
    if not fitting:
        raise _none_fits(world, b, s, over, rest)
    fitting[0] = replace(fitting[0], chosen=True)
    return fitting + over + rest


def _layouts(world: int):
    """Every (tp, pp, dp, sp) of `world` ranks plan_world considers, in the order it lists them."""
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            layouts = (["megatron"] if tp >= 2 and pp == 1 else []) + [None] + (
                ["ulysses"] if dp >= 2 and tp == pp == 1 else [])
            for sp in layouts:
                yield tp, pp, dp, sp


def _split_batch(tp: int, pp: int, dp: int, sp: Optional[str], global_rows: Optional[int], batch_size: int,
                 microbatches: Optional[int]) -> tuple[Optional[str], int, Optional[int]]:
    """(why the layout cannot take the batch or None, rows of a rank's micro-batch, micro-batches):
    without `global_rows`, `batch_size` and `microbatches` as given; with it, the global batch as
    the layout splits it: its rows over the dp ranks (under Ulysses every dp rank takes every row
    and a slice of the sequence), a pipeline's share in micro-batches of one row."""
    if global_rows is None:
        return None, batch_size, microbatches
    if sp == "ulysses":
        return None, global_rows, None
    if global_rows % dp:
        return f"dp={dp} does not divide the global batch's {global_rows} rows", 0, None
    rows = global_rows // dp
    if pp > 1 and rows < pp:
        return (f"a pipeline of {pp} stages needs {pp} micro-batches or more, and each dp rank has {rows} "
                f"row(s) of the global batch"), 0, None
    return (None, 1, rows) if pp > 1 else (None, rows, None)


def _unavailable(model_or_config: Any, tp: int, pp: int, dp: int, sp: Optional[str], *, base: RankCapture,
                 dtype: torch.dtype, seq_len: int, max_tp: int) -> Optional[str]:
    """Why the runtime cannot run this layout of the model (`base`: its capture at tp=1), or None."""
    if tp > max_tp:
        return f"tp={tp} spans more than one node (tp <= {max_tp})"
    if tp > 1:
        try:
            read_tp_plan(model_or_config, dtype).check(tp)
        except ValueError as e:
            return str(e).split(" (read")[0]
    if pp > len(base.blocks):
        return f"{len(base.blocks)} blocks cannot make {pp} pipeline stages"
    if sp == "megatron" and read_tp_plan(model_or_config, dtype).sequence_error:
        return read_tp_plan(model_or_config, dtype).sequence_error
    if sp == "ulysses":
        bad = [(h, what) for h, what in zip(base.heads, ("query", "key/value")) if h and h % dp]
        if bad or seq_len % dp:
            return (f"Ulysses over {dp} ranks must divide the {bad[-1][0]} {bad[-1][1]} heads" if bad else
                    f"Ulysses over {dp} ranks must divide the sequence ({seq_len})")
    return None


def _none_fits(world: int, b: Budget, s: TrainingSetup, over: list[WorldCandidate],
               rest: list[WorldCandidate]) -> Exception:
    """The error when no layout fits: ValueError if none is available, else a BudgetError naming
    the smallest peak any layout reaches and a budget that would hold it."""
    if not over:
        return ValueError(f"no layout of {world} ranks is available: " + "; ".join(
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
    return err
