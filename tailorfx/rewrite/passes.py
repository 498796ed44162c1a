"""Pass protocol, the pass manager, the verifier, and per-pass records for inspection."""
from __future__ import annotations

import dataclasses
import difflib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.fx as fx

from tailorfx.rewrite.capture import SeqInfo, node_value
from tailorfx.rewrite.regions import RegionMap, find_regions

PASS_META = "tailorfx_pass"   # node.meta key: the pass that created the node


@dataclass(frozen=True)
class PassResult:
    """What a pass returns: the (new) graph, whether it changed, and what it did."""
    gm: fx.GraphModule
    changed: bool
    stats: dict = field(default_factory=dict)
    touched: tuple[str, ...] = ()     # region paths rewritten
    skipped: tuple[str, ...] = ()     # "path: reason" for regions left as they were


@dataclass
class PassContext:
    """Everything a pass may read. Passes read nothing else (no globals, no environment)."""
    regions: RegionMap
    seq: SeqInfo
    options: dict = field(default_factory=dict)
    graph_index: int = 0
    pipeline: tuple[str, ...] = ()   # the passes of this run, in order (a pass may plan for later ones)


class Pass(Protocol):
    name: str
    after: tuple[str, ...]

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult: ...


@dataclass
class PassRecord:
    """One pass over one graph, kept for opt.report(), opt.graphs and opt.diff()."""
    name: str
    graph_index: int
    before: str
    after: str
    changed: bool
    touched: tuple[str, ...]
    skipped: tuple[str, ...]
    stats: dict
    peak_before: Optional[int]
    peak_after: Optional[int]
    seconds: float
    gm: Optional[fx.GraphModule] = None

    def diff(self) -> str:
        lines = difflib.unified_diff(self.before.splitlines(), self.after.splitlines(),
                                     f"before {self.name}", f"after {self.name}", lineterm="", n=1)
        return "\n".join(lines)


def clone(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy whose graph can be mutated without touching `gm` (node meta is shared, read-only)."""
    g = fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    return fx.GraphModule(gm, g)


class VerifyError(AssertionError):
    """A graph broke an invariant that every pass must keep."""


def verify(gm: fx.GraphModule) -> None:
    """Check a graph is well formed and carries the metadata later stages rely on.

    - fx lint passes (topological order, no dangling uses, one output);
    - every computing node whose result is used has a fake value in meta["val"] or
      meta["example_value"];
    - every node a pass created names that pass in meta["tailorfx_pass"] (a non-empty str).
    """
    try:
        gm.graph.lint()
    except Exception as e:  # fx raises RuntimeError with a precise message
        raise VerifyError(f"graph lint failed: {e}") from e
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method", "call_module") and n.users and \
                node_value(n) is None:
            raise VerifyError(f"node {n.name} ({n.op} {n.target}) has no fake value in meta['val']")
        if PASS_META in n.meta and not (isinstance(n.meta[PASS_META], str) and n.meta[PASS_META]):
            raise VerifyError(f"node {n.name} has an empty or non-string meta['{PASS_META}']")


def check_order(passes: Sequence[Pass]) -> None:
    """Every declared `after=` dependency that is in the pipeline must come earlier in it."""
    names = [p.name for p in passes]
    for i, p in enumerate(passes):
        for dep in getattr(p, "after", ()):
            if dep in names and names.index(dep) > i:
                raise ValueError(f"pass {p.name!r} must run after {dep!r}; order was {names}")


class PassManager:
    """Runs passes in order over one graph, verifying and recording each step."""

    def __init__(self, passes: Sequence[Pass], predict: Optional[Callable[[fx.GraphModule], int]] = None,
                 run_verify: bool = True):
        check_order(passes)
        self.passes = list(passes)
        self.predict = predict
        self.run_verify = run_verify
        self.initial_peak: Optional[int] = None

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> tuple[fx.GraphModule, list[PassRecord]]:
        records = []
        peak = self.initial_peak = self.predict(gm) if self.predict else None
        ctx = dataclasses.replace(ctx, pipeline=tuple(p.name for p in self.passes))
        for p in self.passes:
            before = gm.code
            t0 = time.perf_counter()
            res = p.run(gm, ctx)
            if self.run_verify:
                verify(res.gm)
            seconds = time.perf_counter() - t0
            peak_after = self.predict(res.gm) if (self.predict and res.changed) else peak
            records.append(PassRecord(p.name, ctx.graph_index, before, res.gm.code, res.changed,
                                      res.touched, res.skipped, dict(res.stats), peak, peak_after,
                                      seconds, res.gm))
            gm, peak = res.gm, peak_after
            if res.changed:   # later passes see regions of the graph as it now is
                ctx = dataclasses.replace(ctx, regions=find_regions(gm, ctx.seq))
        return gm, records
