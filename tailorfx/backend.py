"""The torch.compile backend "tailorfx": analyse, plan, rewrite and lower each Dynamo graph.

`optimize()` and `torch.compile(model, backend="tailorfx")` share this path, so both see and do
the same thing. A graph the pipeline cannot handle is lowered unchanged and the reason recorded.
"""
from __future__ import annotations

import traceback
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.fx as fx

from tailorfx import planner
from tailorfx.codegen import lower as lowering_mod
from tailorfx.rewrite import cost, memory
from tailorfx.rewrite.capture import SeqInfo, seq_info
from tailorfx.rewrite.passes import PassContext, PassManager, PassRecord
from tailorfx.rewrite.regions import RegionMap, find_regions


@dataclass
class GraphRecord:
    """Everything tailorfx did to one Dynamo graph."""
    index: int
    original: fx.GraphModule
    rewritten: fx.GraphModule
    regions: RegionMap
    seq: SeqInfo
    plan: planner.Plan
    records: list[PassRecord]
    lowering: str
    warnings: list[str] = field(default_factory=list)
    peak_captured: Optional[int] = None     # predicted peak of the graph as captured
    peak_final: Optional[int] = None        # ... after every pass
    step: Optional[memory.StepGraphs] = None   # forward/backward graphs as lowered (eager lowering)


@dataclass
class Session:
    """Graphs compiled by one backend instance, in the order Dynamo handed them over."""
    graphs: list[GraphRecord] = field(default_factory=list)
    seq_len: Optional[int] = None
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Options:
    passes: Optional[tuple[str, ...]] = None
    pass_options: tuple = ()          # sorted (key, value) pairs, hashable
    lowering: str = "auto"
    predict: bool = True
    verify: bool = True

    def options_dict(self) -> dict:
        return dict(self.pass_options)


class TailorBackend:
    """A Dynamo backend: (GraphModule, example_inputs) -> compiled callable."""

    def __init__(self, options: Options = Options(), session: Optional[Session] = None):
        self.options = options
        self.session = session if session is not None else Session()

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        idx = len(self.session.graphs)
        seq = seq_info(gm, self.session.seq_len)
        lowering = lowering_mod.resolve_lowering(self.options.lowering, example_inputs)
        regions = find_regions(gm, seq)
        notes: list[str] = []
        original = gm   # passes are pure: they clone before they rewrite
        plan = planner.Plan((), {}, "not planned")
        records: list[PassRecord] = []
        rewritten = gm
        peaks = (None, None)
        try:
            opts = self.options.options_dict()
            plan = planner.choose(self.options.passes, regions, opts)
            if opts.get("budget_bytes") and self.options.passes is None:
                plan = self._plan_for_budget(gm, regions, seq, plan, lowering, idx)
            predict = self._predictor(seq, lowering, plan.options.get("optimizer")) if self.options.predict else None
            pm = PassManager(planner.build_pipeline(plan), predict=predict, run_verify=self.options.verify)
            rewritten, records = pm.run(gm, PassContext(regions, seq, plan.options, idx))
            peaks = (pm.initial_peak, records[-1].peak_after if records else pm.initial_peak)
        except ValueError:
            raise   # bad user options or an unreachable budget: say so, do not hide it behind a fallback
        except Exception as e:   # an unsupported graph: leave it as it was, and say why
            notes.append(f"graph {idx}: passes failed, graph left unchanged: {type(e).__name__}: {e}")
            warnings.warn(notes[-1])
            traceback.print_exc()
            rewritten = original
        rec = GraphRecord(idx, original, rewritten, regions, seq, plan, records, lowering, notes, *peaks)
        self.session.graphs.append(rec)

        def keep(fw, bw, n):
            rec.step = memory.make_step(rewritten, fw, bw, n)
        return lowering_mod.lower(rewritten, example_inputs, lowering, on_partition=keep)

    @staticmethod
    def _predictor(seq: SeqInfo, lowering: str, optimizer: Optional[str] = None) -> Callable[[fx.GraphModule], int]:
        def predict(g: fx.GraphModule) -> int:
            part = lowering_mod.partition_for(lowering, g)
            est = memory.simulate_step([memory.trace_step(g, None, part)], seq, seq.length or None, optimizer)
            return est.peak_bytes
        return predict

    def _plan_for_budget(self, gm, regions, seq, base: planner.Plan, lowering: str, idx: int) -> planner.Plan:
        """Search plans against the budget at the captured length (see planner.search)."""
        opts = base.options
        budget, optimizer = opts["budget_bytes"], opts.get("optimizer")
        sizer = memory.Sizer(seq, seq.length or None)

        def evaluate(c: planner.Candidate):
            o = {**opts, **dict(c.options)}
            pm = PassManager(planner.build_pipeline(planner.Plan(c.passes, o)), run_verify=self.options.verify)
            g, _ = pm.run(gm, PassContext(regions, seq, o, idx))
            step = memory.trace_step(g, None, lowering_mod.partition_for(lowering, g))
            est = memory.simulate_step([step], seq, seq.length or None, optimizer)
            return planner.with_result(c, est.peak_bytes, cost.recompute_flops(g, sizer.as_int), budget), (est, o)

        def breakdown(payload) -> dict:
            est, _ = payload
            fixed = est.param_bytes + est.grad_bytes
            return {"weights and gradients": fixed, "optimizer state": est.optimizer_bytes,
                    "activations": max(0, est.peak_bytes - fixed - est.optimizer_bytes)}

        cands = planner.budget_candidates(base, len(regions.of_kind("block")))
        chosen, (_, o), others = planner.search(cands, evaluate, budget, opts.get("budget_label", ""), breakdown)
        return planner.Plan(chosen.passes, o, f"fits budget {opts.get('budget_label', '')}", chosen, tuple(others))


def tailorfx_backend(gm: fx.GraphModule, example_inputs: list) -> Callable:
    """Entry point for `torch.compile(model, backend="tailorfx")`: the planner's default passes."""
    return TailorBackend()(gm, example_inputs)
