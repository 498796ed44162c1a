"""The torch.compile backend "tailorfx": analyse, plan, rewrite and lower each Dynamo graph.

`optimize()` and `torch.compile(model, backend="tailorfx")` share this path, so both see and do
the same thing. A graph the pipeline cannot handle runs as captured and the reason is recorded.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.fx as fx

from tailorfx import planner
from tailorfx.budget import BudgetError, format_bytes
from tailorfx.options import Options, backend_options
from tailorfx.codegen import lower as lowering_mod
from tailorfx.rewrite import cost, memory
from tailorfx.rewrite.capture import SeqInfo, seq_info, strip_identity_dropout
from tailorfx.rewrite.passes import PassContext, PassManager, PassRecord
from tailorfx.rewrite.regions import RegionMap, find_regions
from tailorfx.runtime.optim import GraphInputs


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
    failed: bool = False                       # passes failed: the graph runs as captured


@dataclass
class StepObservation:
    """Which graphs one training call of the model ran (in first-call order, with counts) and
    which parameters they read: the memory model predicts a step only when these graphs are all
    of it, each run once."""
    calls: dict = field(default_factory=dict)      # graph index -> times run during the call
    params: set = field(default_factory=set)       # id() of every nn.Parameter the graphs read
    outside: list = field(default_factory=list)    # trainable parameter names no graph read
    num_graphs: int = 0                            # graphs compiled when it was taken

    def run(self, idx: int, args: tuple) -> None:
        self.calls[idx] = self.calls.get(idx, 0) + 1
        self.params.update(id(a) for a in lowering_mod.call_args(args) if isinstance(a, torch.nn.Parameter))

    def problems(self) -> list[str]:
        """Why the captured graphs are not the whole step (empty: they are)."""
        out = []
        if self.outside:
            names = ", ".join(self.outside[:4]) + (f", ... ({len(self.outside)} in all)" if len(self.outside) > 4 else "")
            out.append(f"parameters {names} are used by code Dynamo ran eagerly, outside every captured graph "
                       f"(a graph break inside a loop makes Dynamo skip the whole function)")
        again = [f"graph {i} ran {n} times" for i, n in self.calls.items() if n > 1]
        if again:
            out.append(", ".join(again) + " in one call (a graph break inside a repeated layer)")
        return out


@dataclass
class Session:
    """Graphs compiled by one backend instance, in the order Dynamo handed them over."""
    graphs: list[GraphRecord] = field(default_factory=list)
    observing: Optional[StepObservation] = None    # set by OptimizedModule around a training call
    last_step: Optional[StepObservation] = None     # the last training call's observation
    seq_len: Optional[int] = None
    training: Optional[bool] = None    # the model's .training at the call (None: not known)
    warnings: list[str] = field(default_factory=list)
    param_readers: dict = field(default_factory=dict)      # id(param) -> graphs reading it
    graph_inputs: list = field(default_factory=list)       # runtime.optim.GraphInputs per graph


class TailorBackend:
    """A Dynamo backend: (GraphModule, example_inputs) -> compiled callable."""

    def __init__(self, options: Options = Options(), session: Optional[Session] = None):
        self.options = options
        self.session = session if session is not None else Session()

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        idx = len(self.session.graphs)
        strip_identity_dropout(gm)
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
            # Dynamo guards on grad mode and module.training, so each mode gets its own graph
            opts = {**self.options.options_dict(),
                    "training": torch.is_grad_enabled() and self.session.training is not False}
            plan = planner.choose(self.options.passes, regions, opts)
            if opts.get("budget_bytes") and self.options.passes is None:
                plan = self._plan_for_budget(gm, regions, seq, plan, lowering, idx)
            predict = self._predictor(seq, lowering, plan.options.get("setup")) if self.options.predict else None
            pm = PassManager(planner.build_pipeline(plan), predict=predict, run_verify=self.options.verify)
            rewritten, records = pm.run(gm, PassContext(regions, seq, plan.options, idx))
            peaks = (pm.initial_peak, records[-1].peak_after if records else pm.initial_peak)
            _check_requested(_requested(self.options.passes, opts), records, idx, bool(opts.get("strict")), notes)
            _check_budget(self.options.passes, opts, peaks[1], seq)
        except ValueError:
            raise   # bad user options or an unreachable budget: say so, do not hide it behind a fallback
        except Exception as e:   # an unsupported graph: run it as captured, and say why
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            notes.append(f"graph {idx}: passes failed, graph runs as captured (eager autograd, nothing "
                         f"rewritten): {type(e).__name__}: {first}")
            warnings.warn(notes[-1])
            self.session.graphs.append(GraphRecord(idx, original, original, regions, seq, plan, records, "eager",
                                                   notes, failed=True))
            # Not our lowering: a failed trace can leave Dynamo's fake tensors and shape guards in a
            # state where a second AOTAutograd trace of the same graph computes wrong gradients.
            return self._observed(idx, gm.forward)
        setup = plan.options.get("setup")
        lowering = lowering_mod.settle(lowering, any(r.changed for r in records),
                                       setup is not None and setup.optimizer_in_backward)
        rec = GraphRecord(idx, original, rewritten, regions, seq, plan, records, lowering, notes, *peaks)
        self.session.graphs.append(rec)

        def keep(fw, bw, n):
            rec.step = memory.make_step(rewritten, fw, bw, n)
        steps_in_backward = None
        if setup is not None and setup.optimizer_in_backward:
            if lowering == "eager":
                steps_in_backward = GraphInputs(self.session.param_readers)
                self.session.graph_inputs.append(steps_in_backward)
            else:
                notes.append(f"graph {idx}: {lowering} lowering: the optimizer steps in backward run from "
                             f"post-accumulate-grad hooks after the graph's backward, not inside it")
        return self._observed(idx, lowering_mod.lower(rewritten, example_inputs, lowering, on_partition=keep,
                                                      steps_in_backward=steps_in_backward))

    def _observed(self, idx: int, compiled: Callable) -> Callable:
        """`compiled`, telling the session's current StepObservation (if any) that graph idx ran."""
        session = self.session

        def run(*args):
            if session.observing is not None:
                session.observing.run(idx, args)
            return compiled(*args)
        if getattr(compiled, "_boxed_call", False):
            run._boxed_call = True
        return run

    @staticmethod
    def _predictor(seq: SeqInfo, lowering: str, setup=None) -> Callable[[fx.GraphModule], int]:
        def predict(g: fx.GraphModule) -> int:
            part = lowering_mod.partition_for(lowering, g)
            est = memory.simulate_step([memory.trace_step(g, None, part, setup)], seq, seq.length or None,
                                       setup=setup)
            return est.peak_bytes
        return predict

    def _plan_for_budget(self, gm, regions, seq, base: planner.Plan, lowering: str, idx: int) -> planner.Plan:
        """Search plans against the budget at the captured length (see planner.search). When no
        plan fits the user's setup, the same plans with the optimizer step moved into backward
        (gradients freed as they are used) are tried; the plan then says so."""
        opts = base.options
        budget, setup = opts["budget_bytes"], opts.get("setup")
        sizer = memory.Sizer(seq, seq.length or None)
        label = opts.get("budget_label", "")

        def search(s):
            def evaluate(c: planner.Candidate):
                o = {**opts, **dict(c.options), "setup": s}
                pm = PassManager(planner.build_pipeline(planner.Plan(c.passes, o)), run_verify=self.options.verify)
                g, _ = pm.run(gm, PassContext(regions, seq, o, idx))
                step = memory.trace_step(g, None, lowering_mod.partition_for(lowering, g), s)
                est = memory.simulate_step([step], seq, seq.length or None, setup=s)
                return planner.with_result(c, est.peak_bytes, cost.recompute_flops(g, sizer.as_int), budget,
                                           s.headroom if s else 0.0), (est, o)

            cands = planner.budget_candidates(base, len(regions.of_kind("block")),
                                              bool(regions.of_kind("lm_head_loss")))
            return planner.search(cands, evaluate, budget, label, lambda payload: payload[0].breakdown(),
                                  s.headroom if s else 0.0)

        try:
            chosen, (_, o), others = search(setup)
            reason = f"fits budget {label}"
        except BudgetError:
            if setup is None or setup.optimizer is None or setup.optimizer_in_backward or setup.grad_accum_steps > 1:
                raise
            fused = setup.with_(optimizer_in_backward=True, name=f"{setup.name} + optimizer in backward")
            chosen, (_, o), others = search(fused)   # raises if even this does not fit
            reason = (f"fits budget {label} only with the optimizer step in backward: train with "
                      f"tailorfx.SetupOptimizer(model.parameters(), opt.setup)")
            self.session.warnings.append(f"graph {idx}: {reason}")
            warnings.warn(self.session.warnings[-1])
        return planner.Plan(chosen.passes, o, reason, chosen, tuple(others))


def _check_budget(requested, opts: dict, peak: Optional[int], seq: SeqInfo) -> None:
    """Passes the user named under a budget: the predicted peak must fit (the planner's plans
    are checked by the planner)."""
    budget = opts.get("budget_bytes")
    if requested is None or not budget or peak is None or peak <= budget:
        return
    raise BudgetError(f"passes {list(requested)} predict a peak of {format_bytes(peak)} at sequence length "
                      f"{seq.length}, over the budget {opts.get('budget_label')}: drop passes= to let the "
                      f"planner choose, or raise the budget", peak, "activations")


class RewriteNotApplied(ValueError):
    """A rewrite the user asked for (strict=True) could not be applied; names regions and reasons."""


def _requested(passes, opts: dict) -> set[str]:
    """The passes the user asked for: named ones, and those an option asks for (an attention
    spec, a precision, a recompute policy) when the planner chooses."""
    asked = {name for name, key in (("attention", "attention"), ("precision", "precision"),
                                    ("recompute", "recompute_policy")) if opts.get(key) is not None}
    return set(passes) if passes is not None else asked


def _check_requested(requested, records: list[PassRecord], idx: int, strict: bool, notes: list[str]) -> None:
    """A pass the user named that left regions unchanged: a warning naming each region and the
    reason, or with strict=True an error."""
    missed = [f"{r.name}: {s}" for r in records if requested and r.name in requested for s in r.skipped]
    if not missed:
        return
    msg = f"graph {idx}: requested rewrites not applied: " + "; ".join(missed)
    if strict:
        raise RewriteNotApplied(msg + " (strict=True; drop strict to run the rest)")
    notes.append(msg)
    warnings.warn(msg)


def tailorfx_backend(gm: fx.GraphModule, example_inputs: list, options: Optional[dict] = None) -> Callable:
    """Entry point for `torch.compile(model, backend="tailorfx", options={...})`: the planner's
    default passes, or optimize()'s keywords given as options (passes, budget, ...)."""
    opts, _ = backend_options(options)
    return TailorBackend(opts)(gm, example_inputs)
