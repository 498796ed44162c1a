"""The planner: chooses which passes run, in which order, with which parameters."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from tailorfx import passes as pass_registry
from tailorfx.rewrite.regions import RegionMap

# The order passes run in when several are asked for; a pass's own `after=` is checked too.
# precision before minisequence: the chunked regions then run in the precision chosen for them.
PIPELINE_ORDER = ("attention", "precision", "minisequence", "recompute", "parallel")


@dataclass(frozen=True)
class Plan:
    """The passes chosen for one graph and why."""
    passes: tuple[str, ...]
    options: dict = field(default_factory=dict)
    reason: str = ""

    def __str__(self) -> str:
        return f"passes={list(self.passes)} ({self.reason})" if self.reason else f"passes={list(self.passes)}"


def choose(requested: Optional[Sequence[str]], regions: RegionMap, options: dict) -> Plan:
    """`requested=None`: the planner picks; a list: exactly those passes, in pipeline order."""
    if requested is not None:
        for name in requested:
            pass_registry.make(name, options)   # fails early, naming the available passes
        order = sorted(requested, key=lambda n: PIPELINE_ORDER.index(n) if n in PIPELINE_ORDER else 99)
        return Plan(tuple(order), dict(options), "requested")
    chosen = []
    for name in ("attention", "precision"):
        if options.get(name) is not None:   # asked for by the user: approximate rewrites never run unasked
            pass_registry.make(name, options)   # fails, naming the available passes, if missing
            chosen.append(name)
    if "minisequence" in pass_registry.available() and (
            regions.of_kind("mlp") or regions.of_kind("lm_head_loss")):
        chosen.append("minisequence")
    return Plan(tuple(chosen), dict(options), "default: exact rewrites that only lower memory")


def build_pipeline(plan: Plan) -> list:
    """The passes of a plan, instantiated in order."""
    return [pass_registry.make(name, plan.options) for name in plan.passes]
