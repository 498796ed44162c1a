"""A deep model's step predicted from a shallow capture: the model a config builds under a
FakeTensorMode with a few of its repeating layers, standing for all of them (rewrite/depth.py
composes the deep step's timeline), and the plan it gives optimize() as a hint. The planner then
traces the model's own step once, for that plan, instead of once per candidate (Llama-3-8B at 32K
tokens: one trace of 32 blocks, not eleven)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import torch
from torch import nn

from tailorfx import compat
from tailorfx.errors import BudgetError
from tailorfx.models.build import built_on_fake_tensors
from tailorfx.planner import plans_for_cpu
from tailorfx.rewrite import capture, depth
from tailorfx.setup import with_device_costs

INPUTS = frozenset({"input_ids", "labels"})   # the step sizing.plan_for_budget captures
OPTIONS = ("minisequence_chunks", "attention", "attention_kernel", "precision", "keep_logits", "kernels")


@contextlib.contextmanager
def prediction_model(model_or_config: Any, dtype: Optional[torch.dtype], shallow: bool = False,
                     sites: int = 1) -> Iterator[tuple[nn.Module, Optional[depth.Depth]]]:
    """(the model itself, or one built from a config or factory under a FakeTensorMode: no
    memory, however large; everything made inside the block is fake too), and with `shallow`,
    for a config of repeating layers, a copy with a few of them and the Depth it stands for
    (rewrite/depth.py; `sites` runs of three periods): what is captured inside the block stands
    for the whole model."""
    if isinstance(model_or_config, nn.Module):
        yield model_or_config, None
        return
    small = depth.reduced(model_or_config, sites) if shallow else None
    with built_on_fake_tensors(small[0] if small else model_or_config, dtype) as model:
        d = depth.with_model(small[1], model) if small else None
        token = capture.STANDS_FOR.set(d)
        try:
            yield model, d
        finally:
            capture.STANDS_FOR.reset(token)


def capture_step(optimize: Callable[..., Any], model: nn.Module, passes: Optional[Sequence[str]], seq_len: int,
                 batch_size: int, **kw) -> Any:
    """`optimize` (api.optimize, which imports this module) of `model` on a batch of `batch_size` x
    `seq_len` tokens, for prediction only (passes=None: the planner's choice)."""
    ids = torch.randint(0, 2, (batch_size, seq_len), device=next(model.parameters()).device)
    return optimize(model, example_inputs={"input_ids": ids, "labels": ids},
                    passes=None if passes is None else list(passes), predict=False, verify=False, **kw)


def parameter_count(opt: Any) -> int:
    """Parameters of the model an OptimizedModule predicts for: with a shallow capture's repeats
    (a plan of a config), those of the whole model."""
    n = sum(p.numel() for p in opt.model.parameters())
    d = opt.session.graphs[0].seq.depth if opt.session.graphs else None
    return n + (d.repeats * sum(k for k, _ in depth.period_sizes(d)[1]) if d is not None else 0)


class Hint(NamedTuple):
    """The plan a shallow capture chose: its candidate's label, whether it fits only with the
    optimizer step in backward (planner.plan_for_budget), "captured of real" blocks, and whether
    the plan was the candidate's CPU variant (GQA's backward on repeated k, v: planner.repeat_kv_variant)."""
    label: str
    fused: bool
    layers: str
    variant: bool = False

    def note(self, chosen: Any, others: list) -> str:
        """What the plan's reason adds when the search took the hint (tried nothing else, or only
        the CPU's variant of it)."""
        if not chosen.label.startswith(self.label) or any(c.label != self.label for c in others):
            return ""
        return f"; chosen on a shallow capture of its config ({self.layers} blocks), checked on this graph"


def shallow_hint(model: nn.Module, budget: Any, setup: Any, examples: tuple, options: dict, lowering: str,
                 optimize: Callable[..., Any]) -> Optional[Hint]:
    """The plan a shallow capture of `model.config` chooses for the example step under `budget`, or
    None where none stands for the model: a config whose layers do not repeat (or fewer than twice
    the shallow capture's), examples other than input_ids and labels, a model the config does not
    build (another class or parameter count; an adapter wrapper such as peft's, seen before any capture)
    or one built to predict for, a CUDA model under a budget that names no GPU, a precision policy
    asked for, or no plan that fits. Under kernels="triton" the capture takes every region's Triton
    kernel (nothing is timed on fake tensors, kernel_choice.choose); where the model's lowering
    times another faster, the hint stands only if the check on its trace still fits (planner.check_hinted)."""
    config, (args, kwargs) = getattr(model, "config", None), examples
    ids = kwargs.get("input_ids")
    if config is None or hasattr(model, "get_base_model") or args or set(kwargs) != INPUTS \
            or not isinstance(ids, torch.Tensor) or ids.dim() != 2 \
            or options.get("precision_policy") \
            or any(isinstance(p, compat.FakeTensor) for p in model.parameters()):
        return None
    small = depth.reduced(config, sites=2)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    costed = with_device_costs(setup, budget, model, ids.shape[0])   # a GPU preset's: planned for a GPU alike
    if small is None or small[1].layers < 2 * small[1].captured \
            or plans_for_cpu(device, costed) != plans_for_cpu(torch.device("cpu"), costed):
        return None   # a capture of over half the blocks saves less than the hint costs
    kw = {k: v for k, v in options.items() if k in OPTIONS and v is not None}
    kw["minisequence"] = "segments" if options.get("minisequence_segments") else None
    if options.get("recompute_policy") or options.get("offload"):
        kw.update(recompute=options.get("recompute_policy"), offload=options.get("offload"))
    try:
        with prediction_model(config, setup.param_dtype, shallow=True, sites=2) as (fake, _):
            opt = capture_step(optimize, fake, None, *ids.shape[::-1], budget=budget, lowering=lowering,
                               setup=with_device_costs(setup, budget, fake, ids.shape[0]), **kw)
    except (BudgetError, depth.NotComposable):
        return None
    if type(opt.model) is not type(model) or parameter_count(opt) != sum(p.numel() for p in model.parameters()):
        return None
    plan = opt.plan[0]
    label = plan.chosen.label   # a CPU plan's variant of a candidate (GQA's backward on repeated k, v): the candidate's
    variant = bool(plan.runners_up) and label.startswith(plan.runners_up[0].label + " + ")
    return Hint(plan.runners_up[0].label if variant else label, "optimizer step in backward" in plan.reason,
                f"{small[1].captured} of {small[1].layers}", variant)
