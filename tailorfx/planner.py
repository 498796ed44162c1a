"""The planner: which passes run, in which order, with which parameters. Without a budget, the
exact rewrites that only lower memory (the fused head and mini-sequence, the exact attention swap
where an attention makes an S x S tensor) and any approximate rewrite the user asked for. With a
budget it searches plans (mini-sequence, selective recompute, full recompute of the first k blocks,
with or without their attention, and selective in the rest), predicts each one's peak with the
memory model, and keeps the plan that fits with the least recomputed FLOPs."""
from __future__ import annotations

import graphlib
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx

from tailorfx import passes as pass_registry
from tailorfx.attention import Exact
from tailorfx.errors import BudgetError
from tailorfx.codegen.lower import partition_for
from tailorfx.passes.attention import grouped_query
from tailorfx.plan_search import (HEADROOM, Candidate, Evaluate, last_resort, ladders, recomputes_nothing,  # noqa: F401
                                  search, usable, with_result)
from tailorfx.rewrite import cost, memory
from tailorfx.rewrite.capture import SeqInfo, graph_device
from tailorfx.rewrite.trace_cache import traced_step
from tailorfx.rewrite.passes import PassContext
from tailorfx.rewrite.regions import RegionMap
from tailorfx.setup import TrainingSetup

# the blocks of the last-resort candidate's attention backward: its accumulator 1/16th, ~3% slower
ATTENTION_BACKWARD_BLOCKS = 16


@dataclass(frozen=True)
class Plan:
    """The passes chosen for one graph, why, and the runners-up."""
    passes: tuple[str, ...]
    options: dict = field(default_factory=dict)
    reason: str = ""
    chosen: Optional[Candidate] = None
    runners_up: tuple[Candidate, ...] = ()
    # the chosen plan's memory estimate at the captured length, under the plan's setup, as the
    # search predicted it (the static part of the bound reads it: no second trace of the graph)
    estimate: Optional[memory.MemoryEstimate] = field(default=None, compare=False, repr=False)

    @property
    def unchecked(self) -> bool:
        """A shallow capture's plan not yet predicted on this graph (hinted_plan): check_hinted
        predicts it on what the lowering made."""
        return self.chosen is not None and self.chosen.fits is None

    def __str__(self) -> str:
        s = f"passes={list(self.passes)}" + (f" ({self.reason})" if self.reason else "")
        s += f"; chosen: {self.chosen}" if self.chosen is not None else ""
        return s + "".join(f"\n    runner-up: {c}" for c in self.runners_up)


def _order(names: Sequence[str]) -> tuple[str, ...]:
    """The passes in an order that respects every pass's `after=` (ties by name), e.g. attention,
    precision, minisequence, recompute."""
    graph = {n: [d for d in pass_registry.make(n, {}).after if d in names] for n in sorted(set(names))}
    return tuple(graphlib.TopologicalSorter(graph).static_order())


NO_BACKWARD = "; recompute left out: no backward (grad mode off)"


def choose(requested: Optional[Sequence[str]], regions: RegionMap, options: dict) -> Plan:
    """`requested=None`: the planner picks; a list: exactly those passes, in pipeline order."""
    # kernels="triton" runs the kernels pass, and the exact attention pass that it lowers from
    implied = ("attention", "kernels") if options.get("kernels") else ()
    # a graph captured with grad mode off (a reference model's or a KL term's forward) has no
    # backward: nothing to recompute, and AOTAutograd's inference path refuses recompute tags
    # around an op it counts as random (SDPA's)
    no_backward = options.get("grad", True) is False
    if requested is not None:
        requested = [*requested, *(p for p in implied if p not in requested)]
        for name in requested:
            pass_registry.make(name, options)   # fails early, naming the available passes
        kept = [p for p in requested if not (no_backward and p == "recompute")]
        return Plan(_order(kept), dict(options), "requested" + (NO_BACKWARD if len(kept) < len(requested) else ""))
    chosen = list(implied)
    for name in ("attention", "precision"):
        # asked for by the user: approximate rewrites never run unasked
        if options.get(name) is not None and name not in chosen:
            pass_registry.make(name, options)   # fails, naming the available passes, if missing
            chosen.append(name)
    options = dict(options)
    if "attention" not in chosen and regions.of_kind("attention"):
        # the exact swap where an attention makes an S x S tensor (a mask SDPA reads, or explicit
        # scores): less memory, and on CPU faster (Falcon: docs/passes.md#attention)
        chosen.append("attention")
        options["attention_only_dense"] = True
    if (options.get("recompute_policy") is not None or options.get("offload") is not None) and not no_backward:
        chosen.append("recompute")
    if "minisequence" in pass_registry.available() and (
            regions.of_kind("mlp") or regions.of_kind("lm_head_loss")):
        chosen.append("minisequence")
    return Plan(_order(chosen), options, "default: exact rewrites that only lower memory")


def build_pipeline(plan: Plan) -> list:
    """The passes of a plan, instantiated in order."""
    return [pass_registry.make(name, plan.options) for name in plan.passes]


def budget_candidates(base: Plan, num_blocks: int, has_head: bool = False, cpu: bool = True,
                      has_attention: bool = True) -> list[Candidate]:
    """Plans from least to most recompute, the user's own passes (attention...) in all. The fused LM
    head recomputes nothing (its gradient is taken in forward) and never materialises the logits:
    smaller and faster than no rewrite, kept with room to spare. `cpu`: on the CPU the last
    candidate runs the blocked attention backward, elsewhere it offloads checkpoints to host memory."""
    keep = tuple(p for p in base.passes if p not in ("minisequence", "recompute"))
    out = [Candidate("no memory rewrite", _order(keep))]
    if has_head:
        out.append(Candidate("fused LM head", _order(keep + ("minisequence",)), (("minisequence_mlps", False),)))
    out.append(Candidate("minisequence", _order(keep + ("minisequence",))))
    ms_rc = _order(keep + ("minisequence", "recompute"))
    act = base.options.get("offload") == "activations"   # the ladder offloads k blocks' tensors, not recomputes them
    out.append(Candidate("minisequence + selective recompute, all blocks", ms_rc,
                         (("recompute_policy", "selective"), ("recompute_blocks", None)) + ((("offload", None),) if act else ())))
    # full recompute (or offload) in the first k blocks, selective in the rest; then the same ladder
    # with each full block's attention saved (no attention forward again, a q-sized tensor more a block)
    rungs = [("selective", "selective recompute, all blocks, saved activations of {k} blocks offloaded to host")] \
        if act else [("full", "full recompute, {k} blocks{rest}")] + (
            [("full-except-attention", "full recompute but attention, {k} blocks{rest}")] if has_attention else [])
    for policy, what in rungs:
        for k in range(1, num_blocks + 1):
            rest, also = ((("recompute_rest", "selective"),), ", selective in the rest") if k < num_blocks else ((), "")
            out.append(Candidate(f"minisequence + {what.format(k=f'{k}/{num_blocks}', rest=also)}", ms_rc,
                                 (("recompute_policy", policy), ("recompute_blocks", k)) + rest))
    if num_blocks:   # past full recompute: the blocks' token-wise segments chunked too
        out.append(Candidate("minisequence segments", _order(keep + ("minisequence",)),
                             (("minisequence_segments", True),)))
        out.append(Candidate("minisequence segments + full recompute, all blocks", ms_rc,
                             (("minisequence_segments", True), ("recompute_policy", "full"),
                              ("recompute_blocks", None))))
        if cpu and "attention" in keep and base.options.get("attention") is None:
            # last: the exact attention's CPU flash backward in blocks (its fp32 q-sized
            # accumulator one block's; ~3% slower attention backward)
            out.append(Candidate("minisequence segments + full recompute, all blocks + attention backward in blocks",
                                 ms_rc, (("attention", Exact(backward_blocks=ATTENTION_BACKWARD_BLOCKS)),
                                         ("minisequence_segments", True), ("recompute_policy", "full"),
                                         ("recompute_blocks", None))))
        if not cpu and base.options.get("offload") is None:
            # last on a GPU: each block's checkpoint in host memory (ALST's offload; a copy each
            # way over the host link, time the FLOP count does not show)
            out.append(Candidate("minisequence segments + full recompute, all blocks, checkpoints offloaded to host",
                                 ms_rc, (("minisequence_segments", True), ("offload", "checkpoints"),
                                         ("recompute_policy", "full"), ("recompute_blocks", None))))
    if base.options.get("offload") == "checkpoints":   # asked for: every plan that recomputes offloads its checkpoints
        out = [replace(c, label=f"{c.label}, checkpoints offloaded to host") if "recompute" in c.passes else c
               for c in out]
    return out


# ---- prediction: the one place that runs the memory model on a graph --------------------------
def predict_graphs(graphs: Sequence[tuple[fx.GraphModule, str, Optional[memory.StepGraphs]]],
                   seqs: Sequence[SeqInfo], seq_len: Optional[int] = None,
                   setup: Optional[TrainingSetup] = None, captured: bool = False,
                   outputs_held: bool = True) -> memory.MemoryEstimate:
    """The memory model's estimate of one step made of `graphs`, each (graph, its lowering, its lowered
    forward/backward if known), at `seq_len` (default: the captured length), each traced with the
    partition its lowering runs (`captured`: on static shapes where `seq_len` is each graph's captured
    length, 3-4x faster, the same bytes). `outputs_held`: the loop holds the output (logits) through
    backward, as `out = model(...); out.loss.backward()`; else only the loss."""
    static = captured and all(seq_len in (None, s.length) for s in seqs)
    steps = [replace(step if step is not None else traced_step(gm, partition_for(lowering, gm), setup, static),
                     eager_autograd=lowering == "dynamo", loss_tangent_only=lowering == "dynamo")
             for gm, lowering, step in graphs]
    return memory.simulate_step(steps, list(seqs), seq_len or seqs[0].length or None, setup=setup,
                                hold=memory.all_outputs if outputs_held else memory.scalar_outputs)


def predict_peak(gm: fx.GraphModule, seq: SeqInfo, lowering: str, setup: Optional[TrainingSetup] = None) -> int:
    """Predicted peak of a step that is this one graph, at its captured length."""
    return predict_graphs([(gm, lowering, None)], [seq], setup=setup, captured=True).peak_bytes


def run_plan(plan: Plan, gm: fx.GraphModule, ctx: PassContext, verify: bool = True,
             predict: Optional[Callable[[fx.GraphModule], int]] = None):
    """The plan's passes over gm: (rewritten graph, per-pass records, the pass manager)."""
    pm = pass_registry.PassManager(build_pipeline(plan), predict=predict, run_verify=verify)
    rewritten, records = pm.run(gm, ctx)
    return rewritten, records, pm


# ---- planning against a budget ------------------------------------------------------------------
def plans_for_cpu(device: torch.device, setup: Optional[TrainingSetup]) -> bool:
    """Whether a step is planned for the CPU's kernels (the blocked attention backward as the last
    candidate) or for a GPU's (checkpoints offloaded to host last): a model on the CPU without a
    GPU budget preset. max_seq_len, sequence_bound and the planner decide alike."""
    return torch.device(device).type == "cpu" and (setup is None or setup.device is None)


def _candidates(gm: fx.GraphModule, ctx: PassContext, base: Plan) -> tuple[list[Candidate], bool]:
    """The budget's candidates for gm, and whether they are planned for the CPU (plans_for_cpu)."""
    cpu = plans_for_cpu(graph_device(gm), base.options.get("setup"))
    depth = ctx.seq.depth   # a shallow capture standing for a deeper model (rewrite/depth.py): its blocks are counted
    blocks = depth.layers if depth is not None else len(ctx.regions.of_kind("block"))
    found = budget_candidates(base, blocks, bool(ctx.regions.of_kind("lm_head_loss")), cpu=cpu,
                              has_attention=bool(ctx.regions.of_kind("attention")))
    if base.options.get("grad", True) is False:   # no backward: nothing to recompute (choose())
        found = [c for c in found if "recompute" not in c.passes]
    return found, cpu


def in_backward(setup: TrainingSetup) -> TrainingSetup:
    """`setup` with the optimizer step moved into backward (gradients freed as they are used)."""
    return setup.with_(optimizer_in_backward=True, name=f"{setup.name} + optimizer in backward")


def _fused_reason(label: str, note: str) -> str:
    return (f"fits budget {label} only with the optimizer step in backward: train with "
            f"tailorfx.SetupOptimizer(model.parameters(), opt.setup){note}")


def plan_for_budget(gm: fx.GraphModule, ctx: PassContext, base: Plan, lowering: str,
                    verify: bool = True) -> tuple[Plan, Optional[str]]:
    """Search plans against the budget at the captured length (see search). When no plan fits
    the user's setup, the same plans with the optimizer step moved into backward (gradients freed
    as they are used) are tried; the plan then says so, and the second value is that warning."""
    opts = base.options
    setup = opts.get("setup")
    label = opts.get("budget_label", "")
    cands, cpu = _candidates(gm, ctx, base)
    rewritten: dict = {}      # candidate -> its rewritten graph: the second search predicts the same graphs
    hint = opts.get("plan_hint")   # shallow.py: the plan a shallow capture of the config chose, tried first
    fixed = setup is None or not setup.step_can_move_into_backward
    if not (hint and hint.fused) or fixed:   # else that search found none without the optimizer step in backward
        try:
            chosen, o, others, est = _search_setup(gm, ctx, cands, opts, setup, lowering, verify, rewritten, cpu)
            return Plan(chosen.passes, o, f"fits budget {label}{hint.note(chosen, others) if hint else ''}", chosen, tuple(others), est), None
        except BudgetError:
            if fixed:
                raise
    fused = in_backward(setup)
    chosen, o, others, est = _search_setup(gm, ctx, cands, opts, fused, lowering, verify, rewritten, cpu)   # raises if none fits
    reason = _fused_reason(label, hint.note(chosen, others) if hint else "")
    return Plan(chosen.passes, o, reason, chosen, tuple(others), est), f"graph {ctx.graph_index}: {reason}"


def hinted_plan(gm: fx.GraphModule, ctx: PassContext, base: Plan) -> Optional[tuple[Plan, Optional[str]]]:
    """The plan a shallow capture of the model's config chose (options["plan_hint"], shallow.py;
    its CPU variant where it took that), as plan_for_budget would return it, but not yet predicted on
    this graph (`chosen.fits` None): check_hinted predicts it on the lowering's own trace, so a deep
    graph is traced once, not once to plan and again to lower. None without a hint naming a candidate."""
    opts = base.options
    hint = opts.get("plan_hint")
    if hint is None or not opts.get("budget_bytes") or (
            hint.fused and not getattr(opts.get("setup"), "step_can_move_into_backward", True)):
        return None
    cands, cpu = _candidates(gm, ctx, base)
    c = next((c for c in cands if c.label == hint.label), None)
    if c is None:
        return None
    if hint.variant and cpu and grouped_query(gm, ctx):
        c = repeat_kv_variant(c, opts) or c
    setup, label, note = opts.get("setup"), opts.get("budget_label", ""), hint.note(c, [])
    if hint.fused:
        setup, reason = in_backward(setup), _fused_reason(label, note)
    else:
        reason = f"fits budget {label}{note}"
    return Plan(c.passes, _resolved(c, opts, ctx, setup)[0], reason, c), \
        (f"graph {ctx.graph_index}: {reason}" if hint.fused else None)


def check_hinted(plan: Plan, g: fx.GraphModule, seq: SeqInfo, lowering: str) -> Optional[Plan]:
    """A hinted_plan predicted on `g`, the graph it rewrote (at `seq`, its depth the plan's), as the
    search predicts a candidate (the lowering's trace of `g` serves, not a second one): the plan with
    its peak, recompute and estimate if it fits the budget, else None (search without the hint)."""
    setup = plan.options.get("setup")
    chosen, est = _predicted(plan.chosen, g, seq, lowering, setup, plan.options["budget_bytes"],
                             setup.headroom if setup else 0.0)
    return replace(plan, chosen=chosen, estimate=est) if chosen.fits else None


def _resolved(c: Candidate, opts: dict, ctx: PassContext, setup) -> tuple[dict, SeqInfo]:
    """A candidate's pass options and the SeqInfo its graph is predicted at: under a shallow capture
    standing for a deeper model, the real model's first k blocks recomputed become the captured
    blocks that stand for them (rewrite/depth.py)."""
    options, seq = dict(c.options), ctx.seq
    if seq.depth is not None:
        k, d = seq.depth.for_recompute(options.get("recompute_blocks"))
        seq = replace(seq, depth=d)
        if "recompute_blocks" in options:
            options["recompute_blocks"] = k
    return {**opts, **options, "setup": setup, "depth": seq.depth}, seq


def _predicted(c: Candidate, g: fx.GraphModule, seq: SeqInfo, lowering: str, setup, budget: int,
               headroom: float, flops: Optional[int] = None) -> tuple[Candidate, memory.MemoryEstimate]:
    """`c` with the peak the memory model predicts for its rewritten graph `g` and the FLOPs it
    recomputes (`flops`, where the caller counted them already)."""
    est = predict_graphs([(g, lowering, None)], [seq], setup=setup, captured=True)
    return with_result(c, est.peak_bytes, _recomputed(g, seq) if flops is None else flops, budget, headroom), est


def _recomputed(g: fx.GraphModule, seq: SeqInfo) -> int:
    """The forward FLOPs a rewritten graph reruns in backward, at `seq` (its depth's blocks weighed)."""
    return cost.recompute_flops(g, memory.Sizer(seq, seq.length or None).as_int,
                                seq.depth.weight if seq.depth is not None else None)


def _search_setup(gm, ctx: PassContext, cands: list[Candidate], opts: dict, setup, lowering: str, verify: bool,
                  rewritten: dict, cpu: bool = False):
    """search() over `cands`, peaks predicted under `setup`; the candidates share ctx (and its memo:
    a region is costed once) and `rewritten` (a candidate rewritten for an earlier setup keeps its
    trace). On the CPU the chosen plan is then tried with GQA's backward on repeated k, v."""
    budget = opts["budget_bytes"]
    headroom = setup.headroom if setup else 0.0

    def rewrite(c: Candidate):
        o, seq = _resolved(c, opts, ctx, setup)
        key = (c.passes, tuple((k, o[k]) for k in dict(c.options)))
        if key not in rewritten:
            rewritten[key] = run_plan(Plan(c.passes, o), gm, replace(ctx, options=o, seq=seq), verify)[0]
        return rewritten[key], o, seq

    counted: dict[str, int] = {}

    def flops(c: Candidate) -> int:   # on the rewritten graph alone: no trace
        if c.label not in counted:
            g, _, seq = rewrite(c)
            counted[c.label] = _recomputed(g, seq)
        return counted[c.label]

    def evaluate(c: Candidate):
        g, o, seq = rewrite(c)
        c, est = _predicted(c, g, seq, lowering, setup, budget, headroom, flops(c))
        return c, (est, o)

    chosen, (est, o), others = search(cands, evaluate, budget, opts.get("budget_label", ""),
                                      lambda payload: payload[0].breakdown(), headroom,
                                      opts["plan_hint"].label if opts.get("plan_hint") else None, flops)
    faster = repeat_kv_variant(chosen, opts) if cpu and grouped_query(gm, ctx) else None
    if faster is not None:
        tried, (fest, fo) = evaluate(faster)
        if tried.fits:
            return tried, fo, [chosen, *others], fest
        others = [*others, tried]
    return chosen, o, others, est


def repeat_kv_variant(c: Candidate, opts: dict) -> Optional[Candidate]:
    """The chosen plan with grouped-query attention's CPU backward run on repeated k, v: the
    same FLOPs, faster (ATen's grouped backward leaves threads idle), four q-sized transients
    more; taken when it fits too. None where the user chose the attention or it is not swapped."""
    spec = dict(c.options).get("attention")
    if "attention" not in c.passes or opts.get("attention") is not None or (spec is not None and not isinstance(spec, Exact)):
        return None
    blocks = spec.backward_blocks if spec is not None else 0
    options = tuple(kv for kv in c.options if kv[0] != "attention") + (
        ("attention", Exact(backward_blocks=blocks, repeat_kv=True)),)
    return replace(c, label=f"{c.label} + attention backward on repeated k, v", options=options,
                   peak=None, added_flops=None, fits=None)
