"""One module (or package, with its helpers) per rewrite; each is pure: (GraphModule, ctx) -> PassResult.

REGISTRY maps the names users pass to `optimize(passes=[...])` to pass factories; a factory takes
the options dict and returns a Pass. PassManager runs a pipeline of them over one graph.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional, Sequence

import torch.fx as fx

from tailorfx.rewrite.passes import LazyPeak, Pass, PassContext, PassRecord, run_pass, verify
from tailorfx.rewrite.regions import find_regions

REGISTRY: dict[str, Callable] = {}


def register(name: str):
    def deco(factory):
        REGISTRY[name] = factory
        return factory
    return deco


def available() -> list[str]:
    _load()
    return sorted(REGISTRY)


def _load() -> None:
    """Import the pass modules so they register themselves."""
    import importlib
    for mod in ("attention", "kernels", "minisequence", "precision", "recompute"):
        try:
            importlib.import_module(f"tailorfx.passes.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"tailorfx.passes.{mod}":
                raise


def make(name: str, options: dict):
    _load()
    if name not in REGISTRY:
        raise ValueError(f"unknown pass {name!r}; available passes: {', '.join(available()) or 'none'}")
    return REGISTRY[name](options)


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
        self.initial: Optional[LazyPeak] = None     # the given graph's predicted peak

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> tuple[fx.GraphModule, list[PassRecord]]:
        """The graph after every pass, and a record per pass. `gm` is left as it is: each pass
        rewrites the manager's copy of the graph before it (run_pass), so each record keeps the
        graph as its pass left it."""
        records = []
        peak = self.initial = LazyPeak(self.predict, gm) if self.predict else None
        ctx = dataclasses.replace(ctx, pipeline=tuple(p.name for p in self.passes))
        for p in self.passes:
            before = gm.code
            key = ("pass result", id(gm), p.name, ctx.pipeline, repr(sorted(ctx.options.items(), key=repr)))
            if key in ctx.memo:    # the planner ran this plan already: the same graphs, traced once
                res, seconds = ctx.memo[key][1:]
            else:
                t0 = time.perf_counter()
                res = run_pass(p, gm, ctx)
                if self.run_verify:
                    verify(res.gm)
                seconds = time.perf_counter() - t0
                ctx.memo[key] = (gm, res, seconds)    # gm kept alive: its id stays its own
            peak_after = LazyPeak(self.predict, res.gm) if (self.predict and res.changed) else peak
            records.append(PassRecord(p.name, ctx.graph_index, before, res.gm.code, res.changed,
                                      res.touched, res.skipped, dict(res.stats), peak, peak_after,
                                      seconds, res.gm))
            gm, peak = res.gm, peak_after
            if res.changed:   # later passes see regions of the graph as it now is
                ctx = dataclasses.replace(ctx, regions=find_regions(gm, ctx.seq))
        return gm, records
