"""The torch.compile backend "tailorfx": analyse, plan, rewrite and lower each Dynamo graph.

`optimize()` and `torch.compile(model, backend="tailorfx")` share this path, so both see and do
the same thing. A graph the pipeline cannot handle runs as captured and the reason is recorded.
"""
from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from tailorfx import compat, planner
from tailorfx.budget import format_bytes
from tailorfx.errors import BudgetError, failure_site
from tailorfx.options import Options, backend_options
from tailorfx.codegen import lower as lowering_mod
from tailorfx.rewrite import memory, trace_cache
from tailorfx.rewrite.capture import SeqInfo, node_value, pin_to_model, seq_info, strip_identity_dropout
from tailorfx.rewrite.passes import LazyPeak, PassContext, PassRecord, peak_of
from tailorfx.rewrite.regions import RegionMap, find_regions, is_param
from tailorfx.progress import stage
from tailorfx.runtime.optim import GraphInputs
from tailorfx.setup import following

DDP_SPLIT = ("inside DistributedDataParallel, Dynamo's DDPOptimizer hands tailorfx the step in pieces cut at "
             "DDP's gradient buckets, which cut regions (an MLP, attention and its causal mask) apart: the pieces "
             "run as captured. Set optimize_ddp = False in Dynamo's config "
             "before the first step, or hand DDP (or Trainer) tailorfx.optimize(model), which keeps the step "
             "one graph")


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
    captured_peak: Optional[LazyPeak] = None   # predicted peak of the graph as captured
    final_peak: Optional[LazyPeak] = None      # ... after every pass
    step: Optional[memory.StepGraphs] = None   # forward/backward graphs as lowered (eager lowering)
    step_static: bool = False                  # ... at the captured sizes only (lower.lower)
    failed: bool = False                       # passes failed: the graph runs as captured
    replaced: str = ""                         # why a later capture took its place (trainers/ _loop_holds)
    # position_ids inputs whose example batch holds one document a row (as_eager predictions)
    single_document: frozenset = frozenset()

    @property
    def peak_captured(self) -> Optional[int]:
        return peak_of(self.captured_peak)

    @property
    def peak_final(self) -> Optional[int]:
        return peak_of(self.final_peak)


@dataclass
class StepObservation:
    """Which graphs one training call of the model ran (in first-call order, with counts) and
    which parameters they read: the memory model predicts a step only when these graphs are all
    of it, each run once."""
    calls: dict = field(default_factory=dict)      # graph index -> times run during the call
    params: set = field(default_factory=set)       # id() of every nn.Parameter the graphs read
    outside: list = field(default_factory=list)    # trainable parameter names no graph read
    num_graphs: int = 0                            # graphs compiled when it was taken
    source: int = 0                                # id() of the compiled callable observed

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
    accumulating: bool = False         # a training call found gradients held (accumulated micro-batches)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)    # how callers reach the graphs (a trainer's head served)
    param_readers: dict = field(default_factory=dict)      # id(param) -> graphs reading it
    graph_inputs: list = field(default_factory=list)       # runtime.optim.GraphInputs per graph
    parallel: Any = None        # parallel.ParallelPlan under optimize(parallel=...)
    compiled: dict = field(default_factory=dict)   # graph index -> the callable that runs it
    runs: dict = field(default_factory=dict)       # graph index -> times it ran


class TailorBackend:
    """A Dynamo backend: (GraphModule, example_inputs) -> compiled callable.

    Dynamo keeps every backend and compiled callable for the life of the process (its backend
    registry and the cache entries on the model class's shared forward code). With
    `owner_holds_session=True` (an OptimizedModule, which holds the session) they keep only a
    weak reference to it, so a module's graphs, traces and kernels go when the module goes.
    """

    def __init__(self, options: Options = Options(), session: Optional[Session] = None,
                 owner_holds_session: bool = False):
        self.options = options
        session = session if session is not None else Session()
        self._session_ref = weakref.ref(session) if owner_holds_session else (lambda: session)

    @property
    def session(self) -> Session:
        return _live(self._session_ref)

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        if compat.ddp_splits_graphs():   # a piece of the step: run as captured, and say why
            self.session.warnings.append(DDP_SPLIT)
            warnings.warn(DDP_SPLIT)
            return gm.forward
        # may ask Dynamo to trace again (symbolic length, constant floats)
        pin_to_model(gm, example_inputs, inference=not torch.is_grad_enabled())
        strip_identity_dropout(gm)
        return self._compile(gm, example_inputs, hinted=True)

    def _compile(self, gm: fx.GraphModule, example_inputs: list, hinted: bool) -> Callable:
        """Plan, rewrite and lower gm. `hinted`: a shallow capture's plan (planner.hinted_plan) is
        taken unsearched and checked on the lowering's trace; if it does not fit, gm is compiled again
        with the planner's search."""
        idx = len(self.session.graphs)
        seq = seq_info(gm, self.session.seq_len)
        lowering = lowering_mod.resolve_lowering(self.options.lowering, example_inputs)
        with stage(f"graph {idx}: finding regions"):
            regions = find_regions(gm, seq)
        notes: list[str] = [f"graph {idx}: {why}" for why in regions.left]
        try:
            ctx = PassContext(regions, seq, {}, idx)   # shared by the plans tried and the one run
            plan, warning = self._plan(gm, ctx, lowering, hinted)
            if plan.options.get("depth") is not None:   # a shallow capture: the chosen plan's repeats
                seq = replace(seq, depth=plan.options["depth"])
                ctx = replace(ctx, seq=seq)
            rewritten, records, pm = planner.run_plan(plan, gm, replace(ctx, options=plan.options),
                                                      self.options.verify, self._predictor(seq, lowering, plan))
            peaks = (pm.initial, records[-1].after_peak if records else pm.initial)
            asked = self.options.options_dict()   # the user's own, not what the planner added
            _check_requested(_requested(self.options.passes, asked), records, idx, bool(asked.get("strict")), notes)
            if self.options.passes is None:
                _check_default(regions, records, idx, notes)
            _check_budget(self.options.passes, plan.options, peaks[1], seq)   # reads it only under a budget
        except ValueError:
            raise   # bad user options or an unreachable budget: say so, do not hide it behind a fallback
        except Exception as e:   # an unsupported graph: run it as captured, and say why
            return self._run_as_captured(gm, regions, seq, idx, e, lowering)
        setup = plan.options.get("setup")
        settled = lowering_mod.settle(lowering, any(r.changed for r in records),
                                      setup is not None and setup.optimizer_in_backward)
        rec = GraphRecord(idx, gm, rewritten, regions, seq, plan, records, settled, notes, *peaks,
                          single_document=_single_document(gm, example_inputs))
        self.session.graphs.append(rec)
        inputs_before = len(self.session.graph_inputs)
        try:
            lowered = self._lower(rec, example_inputs)
            if plan.unchecked:   # the hint, predicted on what was lowered
                rec.plan = planner.check_hinted(plan, rewritten, seq, lowering)
        except ValueError:
            raise
        except Exception as e:   # the rewritten graph cannot be traced or compiled: run it as captured
            self.session.graphs.pop()
            return self._run_as_captured(gm, regions, seq, idx, e, settled)
        if rec.plan is None:   # the hint does not fit this graph: search
            del self.session.graphs[idx:], self.session.graph_inputs[inputs_before:]
            return self._compile(gm, example_inputs, hinted=False)
        if warning:
            self.session.warnings.append(warning)
            warnings.warn(warning)
        return self._observed(idx, lowered)

    def _plan(self, gm: fx.GraphModule, ctx: PassContext, lowering: str,
              hinted: bool) -> tuple[planner.Plan, Optional[str]]:
        """The passes the user named, else the planner's default, searched against the budget
        when there is one (Dynamo guards on grad mode and module.training, so each mode gets its
        own graph and plan); a shallow capture's plan if `hinted` (checked on what the lowering made). With
        the warning that the plan fits only with the optimizer step in backward, if it does."""
        opts = {**self.options.options_dict(), "grad": torch.is_grad_enabled(),
                "training": torch.is_grad_enabled() and self.session.training is not False, "lowering": lowering}
        if opts.get("setup") is not None:   # the model's dtype now, and what the loop around it holds: trainers/
            followed = following(opts["setup"], _trained_dtypes(gm), opts["training"])
            hinted = hinted and followed == opts["setup"]    # the shallow capture planned for the dtype given
            opts["setup"] = followed.held_by_loop(compat.active_ddp() is not None, self.session.accumulating)
        plan = planner.choose(self.options.passes, ctx.regions, opts)
        if not (opts.get("budget_bytes") and self.options.passes is None):
            return plan, None
        if hinted and (unchecked := planner.hinted_plan(gm, ctx, plan)) is not None:
            return unchecked
        if not hinted:   # the hint did not fit this graph
            plan = replace(plan, options={k: v for k, v in plan.options.items() if k != "plan_hint"})
        return planner.plan_for_budget(gm, ctx, plan, lowering, self.options.verify)

    def _predictor(self, seq: SeqInfo, lowering: str, plan: planner.Plan) -> Optional[Callable[[fx.GraphModule], int]]:
        """Each pass's predicted peak, for the report (off with predict=False)."""
        if not self.options.predict:
            return None
        setup = plan.options.get("setup")
        return lambda g: planner.predict_peak(g, seq, lowering, setup)

    def _run_as_captured(self, gm: fx.GraphModule, regions: RegionMap, seq: SeqInfo, idx: int,
                         e: Exception, lowering: str) -> Callable:
        """The graph as Dynamo captured it, with the reason the passes failed in the report; under
        a budget only if the graph as captured is predicted to fit it (else BudgetError)."""
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        why = f"{type(e).__name__}: {first}{failure_site(e)}"
        self._check_captured_fits(gm, seq, idx, why, lowering)
        note = f"graph {idx}: passes failed, graph runs as captured (eager autograd, nothing rewritten): {why}"
        warnings.warn(note)
        plan = planner.Plan((), {}, "not planned")
        self.session.graphs.append(GraphRecord(idx, gm, gm, regions, seq, plan, [], "eager", [note], failed=True))
        # Not our lowering: a failed trace can leave Dynamo's fake tensors and shape guards in a
        # state where a second AOTAutograd trace of the same graph computes wrong gradients.
        return self._observed(idx, gm.forward)

    def _lower(self, rec: GraphRecord, example_inputs: list) -> Callable:
        """The rewritten graph compiled for its lowering; the forward/backward it runs are kept
        for the memory model, and the optimizer step goes into backward if the setup says so."""
        def keep(fw, bw, n, static, schedules=None):
            rec.step, rec.step_static = memory.make_step(rec.rewritten, fw, bw, n), static
            if schedules is not None:   # Inductor's: the code it generated, read off this compile
                rec.step = replace(rec.step, fw_schedule=schedules[0], bw_schedule=schedules[1])
            trace_cache.remember_trace(rec.rewritten, lowering_mod.partition_for(rec.lowering, rec.rewritten),
                                       steps_in_backward is not None, rec.step, static)
        setup = rec.plan.options.get("setup")
        steps_in_backward = None
        if setup is not None and setup.optimizer_in_backward:
            steps_in_backward = GraphInputs(self.session.param_readers)
            self.session.graph_inputs.append(steps_in_backward)
        with stage(f"graph {rec.index}: lowering ({rec.lowering})"):
            return lowering_mod.lower(rec.rewritten, example_inputs, rec.lowering, on_partition=keep,
                                      steps_in_backward=steps_in_backward, record=rec.plan.unchecked)

    def _check_captured_fits(self, gm: fx.GraphModule, seq: SeqInfo, idx: int, why: str, lowering: str) -> None:
        """Under a budget, the passes of graph idx failed (`why`): running it as captured keeps
        the budget only if its predicted peak fits; else, or when that cannot be predicted,
        BudgetError (a budget is kept or refused, never run past)."""
        opts = self.options.options_dict()
        budget = opts.get("budget_bytes")
        if not budget:
            return
        head = (f"graph {idx}: the rewrites for the budget {opts.get('budget_label')} failed ({why}), "
                f"and the graph as captured")
        try:
            peak = planner.predict_peak(gm, seq, lowering, opts.get("setup"))
        except Exception as e:
            raise BudgetError(f"{head} cannot be predicted ({type(e).__name__}: {str(e).strip()[:200]}), so the "
                              f"budget cannot be kept: drop budget= to run it unbudgeted", 0, "activations") from e
        if peak > budget:
            raise BudgetError(f"{head} predicts a peak of {format_bytes(peak)} at sequence length {seq.length}, "
                              f"over the budget: drop budget= to run it unbudgeted, or raise the budget to "
                              f"{format_bytes(peak)}", peak, "activations")

    def _observed(self, idx: int, compiled: Callable) -> Callable:
        """A callable that runs graph idx, telling the session's current StepObservation (if
        any) that it ran. It reaches the session and `compiled` through the backend's reference:
        with owner_holds_session, Dynamo's cache entry does not keep them alive."""
        ref = self._session_ref
        ref().compiled[idx] = compiled

        def run(*args):
            session = _live(ref)
            session.runs[idx] = session.runs.get(idx, 0) + 1
            if session.observing is not None:
                session.observing.run(idx, args)
            return session.compiled[idx](*args)
        if getattr(compiled, "_boxed_call", False):
            run._boxed_call = True
        return run


def _live(ref: Callable[[], Optional[Session]]) -> Session:
    """The session behind a backend's reference, or the error a deleted OptimizedModule's graph gives."""
    session = ref()
    if session is None:
        raise RuntimeError("this graph's tailorfx.OptimizedModule was deleted; optimize the model again")
    return session


def _check_budget(requested, opts: dict, lazy: Optional[LazyPeak], seq: SeqInfo) -> None:
    """Passes the user named under a budget: the predicted peak must fit (the planner's plans
    are checked by the planner)."""
    budget = opts.get("budget_bytes")
    if requested is None or not budget:
        return
    peak = peak_of(lazy)
    if peak is None or peak <= budget:
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
                                    ("recompute", "recompute_policy"), ("recompute", "offload"))
             if opts.get(key) is not None}
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


def _trained_dtypes(gm: fx.GraphModule) -> set:
    """The dtypes of the parameters the graph trains (those that require grad)."""
    values = (node_value(n) for n in gm.graph.nodes if n.op == "placeholder" and is_param(n))
    return {v.dtype for v in values if isinstance(v, torch.Tensor) and v.requires_grad and v.is_floating_point()}


def _single_document(gm: fx.GraphModule, example_inputs: list) -> frozenset:
    """Names of gm's placeholders whose example value is position_ids of one document a row."""
    from tailorfx.passes.attention.documents import one_document_per_row
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return frozenset(n.name for n, v in zip(phs, example_inputs) if one_document_per_row(v))


def _check_default(regions, records: list[PassRecord], idx: int, notes: list[str]) -> None:
    """With no passes named: the LM head + loss left unfused, or an attention the exact swap
    could not take, is most of the memory a default plan saves; say which and why, once."""
    by_name = {r.name: r for r in records}
    left = []
    for head in regions.of_kind("lm_head_loss"):
        ms = by_name.get("minisequence")
        if ms is not None and head.path not in {t.split(" ")[0] for t in ms.touched}:
            left += [f"LM head + loss {s}" for s in ms.skipped if s.startswith(head.path + ":")] or \
                [f"LM head + loss {head.path}: not fused"]
    if "attention" in by_name:
        left += [f"attention {s}" for s in by_name["attention"].skipped]
    if left:
        msg = f"graph {idx}: the default plan left as captured: " + "; ".join(left)
        notes.append(msg)
        warnings.warn(msg)


def tailorfx_backend(gm: fx.GraphModule, example_inputs: list, options: Optional[dict] = None) -> Callable:
    """Entry point for `torch.compile(model, backend="tailorfx", options={...})`: the planner's
    default passes, or optimize()'s keywords given as options (passes, budget, ...)."""
    opts, _ = backend_options(options)
    return TailorBackend(opts)(gm, example_inputs)
