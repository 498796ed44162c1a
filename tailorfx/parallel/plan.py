"""What a layout does to a model, read off its captured graph: the tensor-parallel plan with
Megatron's sequence parallelism on top (tp_plan.py, sequence_plan.py), the styles the LM head
takes under each layout, and the single-device rewrites the step graph takes (spec.rewrites).
The rank's model (apply.py) and the fake copy a prediction traces (trace.py) read the same.

    plan, blocks = plan_tensor_parallel(model, (), batch)
    styles = tp_styles(plan, spec.tp, head_style(spec))     # the dict apply_tp shards by
"""
from __future__ import annotations

import inspect
from typing import Any, Optional

import torch.fx as fx
import torch.nn as nn

from tailorfx import planner
from tailorfx.parallel.sequence_plan import SequenceParallelError, infer_sequence_parallel
from tailorfx.parallel.spec import ParallelSpec
from tailorfx.parallel.tp_plan import TPPlan, infer_tp_plan
from tailorfx.passes.minisequence import head_loss_transform
from tailorfx.rewrite.capture import capture_graphs, seq_info
from tailorfx.rewrite.passes import PassContext
from tailorfx.rewrite.regions import find_regions


def plan_tensor_parallel(model: nn.Module, args: tuple, kwargs: dict) -> tuple[TPPlan, list[str]]:
    """Capture `model` on the example inputs and read one plan off all its graphs; also the
    paths of its repeated blocks (FSDP's units). The plan carries Megatron's sequence
    parallelism on top (sequence_plan.infer_sequence_parallel) as `sequence`, or why not."""
    graphs, _ = capture_graphs(model, args, kwargs, static=True)
    styles: dict[str, str] = {}
    replicated: dict[str, str] = {}
    groups, blocks, mlps = [], [], []
    sequence: dict[str, str] = {}
    sequence_error = None
    head_loss: Any = "no LM head feeding a loss"
    for g in graphs:
        regions = find_regions(g.gm, g.seq)
        head = next((r for r in regions.of_kind("lm_head_loss")), None)
        plan = infer_tp_plan(g.gm, g.example_inputs, model, head and head.path, bool(head and not head.note))
        if head is not None and plan.styles.get(head.path) == "colwise_vocab_parallel":
            head_loss = head_loss_transform(g.gm, head)
        if sequence_error is None:
            try:
                sequence.update(infer_sequence_parallel(g.gm, g.example_inputs, model, plan, regions))
            except SequenceParallelError as e:
                sequence_error = str(e)
        styles.update(plan.styles)
        replicated.update(plan.replicated)
        groups += plan.groups
        blocks += [r.path for r in regions.of_kind("block") if r.path not in blocks]
        mlps += [r.path for r in regions.of_kind("mlp") if r.token_wise and r.path and r.path not in mlps]
    return TPPlan(styles, groups, {k: v for k, v in replicated.items() if k not in styles},
                  sequence={} if sequence_error else sequence, sequence_error=sequence_error,
                  head_loss=head_loss, mlps=tuple(mlps)), blocks


def head_style(spec: ParallelSpec) -> str:
    """How the LM head is sharded under `spec`: "gather" (its logits gathered whole: a pipeline
    stage hands them on), "sequence" (sp="megatron": it reads the stream's sequence shards) or
    "vocab" (vocab-parallel into its loss)."""
    return "gather" if spec.pp > 1 else "sequence" if spec.sp == "megatron" else "vocab"


def tp_styles(plan: TPPlan, tp: int, head: str) -> dict[str, str]:
    """The plan's styles for `tp` ranks (ValueError when tp does not divide what it splits), the
    head's as `head` (head_style) asks: "sequence" adds the sequence-parallel styles
    (SequenceParallelError when the graph has a region that cannot take them)."""
    plan.check(tp)
    if head == "sequence":
        if plan.sequence_error:
            raise SequenceParallelError(plan.sequence_error)
        split = {f: f"rowwise_{st}" for f, st in plan.sequence.items()
                 if st.startswith("embedding_to_sequence") and plan.styles.get(f) == "rowwise_embedding"}
        return {**plan.styles, **plan.sequence, **split}
    if head == "gather":
        return {f: ("colwise_gather_output" if s == "colwise_vocab_parallel" else s) for f, s in plan.styles.items()}
    return dict(plan.styles)


def skips_logits(passes, options: Optional[dict], staged: bool = False) -> bool:
    """Whether a fused vocab-parallel head skips its logits in training with labels: under the
    mini-sequence rewrite, as on one device (logits=None; keep_logits=True keeps them), where one
    call runs the whole model (`staged`: pipeline stages or a chain, whose step graph fuses the head)."""
    return not staged and "minisequence" in passes and not dict(options or ()).get("keep_logits")


def accepts_use_cache(model: nn.Module) -> bool:
    """Whether `model` is a transformers model whose forward takes use_cache."""
    return (getattr(getattr(model, "config", None), "use_cache", None) is not None
            and "use_cache" in inspect.signature(model.forward).parameters)


def step_options(options: Optional[dict]) -> dict:
    """Of optimize()'s options, those the step graph's passes read: the passes' own (kernels= would
    add the Triton kernel passes, a budget the planner), given ones only."""
    return {k: v for k, v in (options or {}).items()
            if (k.startswith("minisequence") or k == "keep_logits") and v is not None}


def rewrite_step(gm: fx.GraphModule, passes: tuple[str, ...], options: Optional[dict] = None):
    """`gm` (a static training-step graph) after `passes`, as optimize() runs them on one device;
    also the pass records (empty when nothing ran)."""
    if not passes:
        return gm, []
    seq = seq_info(gm, None)
    regions = find_regions(gm, seq)
    plan = planner.choose(list(passes), regions, {**step_options(options), "training": True})
    rewritten, records, _ = planner.run_plan(plan, gm, PassContext(regions, seq, plan.options))
    return rewritten, records


def describe_rewrites(records) -> list[tuple[str, str]]:
    """Report rows: each region a pass rewrote, and each it left with the reason."""
    what = {"mlp": "{} chunk(s) along the sequence, intermediates recomputed per chunk in backward",
            "lm_head_loss": "fused with its loss, {} chunk(s), no logits kept for backward"}
    rows = []
    for r in records:
        for path, st in r.stats.items():
            if isinstance(st, dict) and "num_chunks" in st:
                rows.append((path, f"{r.name}: " + what.get(st.get("kind"), "rewritten, {} chunk(s)").format(st["num_chunks"])))
        rows += [(sk.split(": ", 1)[0], f"{r.name}: left as it was: {sk.split(': ', 1)[-1]}") for sk in r.skipped]
    return rows
