"""optimize(..., parallel=dict(tp=2, dp=2)): read a tensor-parallel plan off the captured graph,
then apply it (DTensor) and FSDP2 on one ("dp", "tp") DeviceMesh, inside a torchrun process.

    capture (one forward, Dynamo) -> regions -> passes.parallel.infer_tp_plan -> check(tp)
      -> runtime.apply_tp (tp mesh dim) -> runtime.apply_fsdp (dp mesh dim)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch.nn as nn

from tailorfx.passes.parallel import TPPlan, infer_tp_plan
from tailorfx.rewrite.capture import capture_graphs
from tailorfx.rewrite.regions import find_regions

KEYS = ("tp", "dp", "pp", "sp", "schedule", "microbatches")


@dataclass
class ParallelPlan:
    """What was applied: degrees, each module's style, and why the others stay replicated."""
    tp: int = 1
    dp: int = 1
    styles: dict[str, str] = field(default_factory=dict)
    replicated: dict[str, str] = field(default_factory=dict)
    blocks: list[str] = field(default_factory=list)
    loss_scope: Any = None      # runtime.tensor_parallel.LossParallelScope for a vocab-parallel head

    def run(self, model: nn.Module, args: tuple, kwargs: dict):
        """One call of the sharded model; a vocab-parallel head's loss runs under loss_parallel,
        in forward here and in the caller's backward through the scope's hooks."""
        if self.loss_scope is None:
            return model(*args, **kwargs)
        from torch.distributed.tensor.parallel import loss_parallel
        with loss_parallel():
            out = model(*args, **kwargs)
        loss = getattr(out, "loss", None)
        if loss is not None and loss.requires_grad:
            out["loss"] = self.loss_scope.enter_on_backward(loss)
        return out

    def describe(self) -> list[tuple[str, str]]:
        rows = [(fqn, style) for fqn, style in self.styles.items()]
        rows += [(fqn, f"replicated: {why}") for fqn, why in self.replicated.items()]
        if self.dp > 1:
            rows += [(b, f"fully_shard over dp={self.dp}") for b in self.blocks] + [("(root)", f"fully_shard over dp={self.dp}")]
        return rows


def check_parallel(parallel: Any) -> dict:
    """The user's `parallel=` dict, checked: positive ints for tp/dp; what is not built yet says so."""
    if not isinstance(parallel, dict):
        raise ValueError(f"parallel={parallel!r} is not valid: give a dict such as parallel=dict(tp=2, dp=2)")
    unknown = sorted(set(parallel) - set(KEYS))
    if unknown:
        raise ValueError(f"unknown parallel option(s) {unknown}; allowed: {list(KEYS)}")
    for k in ("tp", "dp", "pp", "microbatches"):
        v = parallel.get(k, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"parallel={parallel!r}: {k}={v!r} is not valid: a positive int")
    if parallel.get("pp", 1) > 1 or parallel.get("sp") is not None:
        raise ValueError(f"parallel={parallel!r}: pipeline (pp>1) and sequence (sp=) parallelism are not "
                         f"available in optimize() yet; use tp= and dp=")
    return {"tp": parallel.get("tp", 1), "dp": parallel.get("dp", 1)}


def plan_tensor_parallel(model: nn.Module, args: tuple, kwargs: dict) -> tuple[TPPlan, list[str]]:
    """Capture `model` on the example inputs and read one plan off all its graphs; also the
    paths of its repeated blocks (FSDP's units)."""
    graphs, _ = capture_graphs(model, args, kwargs)
    styles: dict[str, str] = {}
    replicated: dict[str, str] = {}
    groups, blocks = [], []
    for g in graphs:
        regions = find_regions(g.gm, g.seq)
        head = next((r for r in regions.of_kind("lm_head_loss")), None)
        plan = infer_tp_plan(g.gm, g.example_inputs, model, head and head.path, bool(head and not head.note))
        styles.update(plan.styles)
        replicated.update(plan.replicated)
        groups += plan.groups
        blocks += [r.path for r in regions.of_kind("block") if r.path not in blocks]
    return TPPlan(styles, groups, {k: v for k, v in replicated.items() if k not in styles}), blocks


def parallelize(model: nn.Module, parallel: dict, args: tuple, kwargs: dict) -> ParallelPlan:
    """Shard `model` in place as `parallel` asks; returns what was done (for the report)."""
    from tailorfx.runtime.tensor_parallel import apply_fsdp, apply_loss_parallel, apply_tp, device_mesh
    spec = check_parallel(parallel)
    if not args and not kwargs:
        raise ValueError("parallel= needs example_inputs: the tensor-parallel plan is read off the graph "
                         "of one forward pass")
    mesh = device_mesh(tp=spec["tp"], dp=spec["dp"])
    tp_plan, blocks = plan_tensor_parallel(model, args, kwargs)
    out = ParallelPlan(spec["tp"], spec["dp"], blocks=blocks)
    if spec["tp"] > 1:
        tp_plan.check(spec["tp"])
        apply_tp(model, styles=tp_plan.styles, mesh=mesh["tp"])
        out.styles, out.replicated = dict(tp_plan.styles), dict(tp_plan.replicated)
        head = next((f for f, st in tp_plan.styles.items() if st == "colwise_vocab_parallel"), None)
        if head is not None:
            out.loss_scope = apply_loss_parallel(model, head=head)
    if spec["dp"] > 1:
        apply_fsdp(model, blocks=blocks, mesh=mesh["dp"])
    return out
