"""How long a sequence fits a budget, by the memory model: `max_seq_len()`, `sequence_bound()` (the
longest any plan of these rewrites could reach) and the capture they predict from (a config or
factory built under a FakeTensorMode, so an 8B model costs nothing)."""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn as nn

from tailorfx import planner
from tailorfx.api import OptimizedModule, optimize
from tailorfx.attention import Exact
from tailorfx.budget import Budget, format_bytes, longest_fitting
from tailorfx.errors import BudgetError, PredictionError
from tailorfx.options import check_passes, positive_int
from tailorfx.progress import stage
from tailorfx.rewrite import bound, depth, memory
from tailorfx.runtime.accumulation import model_device
from tailorfx.setup import PRESETS, TrainingSetup, with_device_costs
from tailorfx.setup import resolve as resolve_setup
from tailorfx.shallow import capture_step, parameter_count, prediction_model as _prediction_model


def _shallow_first(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn(..., shallow=True)`, predicted from a shallow capture of a config's repeating layers,
    and again from the whole model where its blocks do not repeat alike (depth.NotComposable).
    `shallow=False` asks for the whole model at once (what plan_step_time walks)."""
    @functools.wraps(fn)
    def wrapper(*args, shallow: bool = True, **kwargs):
        if not shallow:
            return fn(*args, shallow=False, **kwargs)
        try:
            return fn(*args, shallow=True, **kwargs)
        except depth.NotComposable:
            return fn(*args, shallow=False, **kwargs)
    return wrapper


def capture_for_prediction(model_or_config: Any, passes: Sequence[str], seq_len: int = 256,
                           batch_size: int = 1, dtype: Optional[torch.dtype] = None,
                           **optimize_kwargs) -> OptimizedModule:
    """Capture and rewrite a model for memory prediction only.

    A config or factory is built under a FakeTensorMode; a model instance is captured on a
    short real batch.
    """
    with _prediction_model(model_or_config, dtype) as (model, _):
        return _capture(model, passes, seq_len, batch_size, **optimize_kwargs)


@_shallow_first
def plan_for_budget(model_or_config: Any, budget: Union[str, int, Budget], seq_len: int, setup: Any = None,
                    batch_size: Optional[int] = None, *, shallow: bool = False, **optimize_kwargs) -> OptimizedModule:
    """The planner's choice for one training step of `seq_len` tokens under `budget`, by the memory
    model alone: a config or factory is built and captured on fake tensors (an 8B model costs
    nothing). BudgetError, naming the smallest budget that fits, when no plan does. The result's
    `plan` lists each graph's chosen candidate and the runners-up with their predicted peaks."""
    s = resolve_setup(setup)
    b = Budget.parse(budget)
    positive_int("seq_len", seq_len, allow_none=False)
    positive_int("batch_size", batch_size)
    with _prediction_model(model_or_config, s.param_dtype, shallow, sites=2) as (model, d):
        s = with_device_costs(s, b, model, batch_size or s.micro_batch_size)
        _check_static(model, s, b, planner.usable(b.bytes, s.headroom), d)   # before an 8B model's captures
        with stage("capturing and planning the step on fake tensors"):
            return _capture(model, None, seq_len, batch_size or s.micro_batch_size, budget=b, setup=s,
                            **optimize_kwargs)


_capture = functools.partial(capture_step, optimize)   # (model, passes, seq_len, batch_size, **optimize kwargs)


@_shallow_first
def max_seq_len(model_or_config: Any, budget: Union[str, int, Budget], batch_size: Optional[int] = None,
                passes: Optional[Sequence[str]] = None, setup: Any = None, optimizer: Optional[str] = "adamw",
                dtype: Optional[torch.dtype] = None, limit: int = 1 << 21, granularity: int = 128,
                offload: Optional[str] = None, *, shallow: bool = False) -> int:
    """Longest sequence whose training step fits `budget`, by the memory model (nothing is run).

    A config or factory is built under a FakeTensorMode, so an 8B model costs no memory. One
    capture serves every length (the sequence dim is symbolic); the answer is bisected on the
    prediction to `granularity` tokens. passes=[]: vanilla; ["recompute"]; ["minisequence",
    "recompute"]; None: the plan that saves the most (exact O(S) attention with its backward in
    blocks, mini-sequence of every block's token-wise segments, full recompute of every block,
    and the optimizer step in backward where that fits longer, as the planner would move it).
    `offload="checkpoints"`: each block's checkpoint waits for the backward in host memory.
    `setup` (a TrainingSetup or preset name) says how the model trains: dtypes, optimizer
    state, optimizer in backward, micro-batch size, allocator headroom; without it, `dtype`
    weights and `optimizer`. The budget holds the steady state of that setup, less the headroom
    the planner keeps for prediction error (planner.usable), so optimize() accepts every length
    this returns.
    """
    b = Budget.parse(budget)
    positive_int("batch_size", batch_size)
    positive_int("limit", limit, allow_none=False)
    positive_int("granularity", granularity, allow_none=False)
    passes = check_passes(passes)
    if setup is not None:
        s = resolve_setup(setup)
        if dtype is not None and dtype != s.param_dtype:
            raise ValueError(f"dtype={dtype} disagrees with setup {s.name!r} ({s.param_dtype} weights); drop dtype")
    else:
        if isinstance(model_or_config, nn.Module):
            dtype = dtype or next(model_or_config.parameters()).dtype
        s = resolve_setup(None, param_dtype=dtype, optimizer=optimizer)
    chosen = list(passes) if passes is not None else ["attention", "minisequence", "recompute"]
    with _prediction_model(model_or_config, s.param_dtype, shallow) as (model, d):
        s = with_device_costs(s, b, model, batch_size or s.micro_batch_size)
        usable = planner.usable(b.bytes, s.headroom)
        _check_static(model, s, b, usable, d)   # before the capture: an 8B capture takes half a minute
        with stage("capturing the step on fake tensors"):
            # the plan that saves the most; the attention backward in blocks runs on the CPU only
            cpu = planner.plans_for_cpu(model_device(model), s)
            saves_most = {} if passes is not None else {"minisequence": "segments"} if not cpu else {
                "minisequence": "segments", "attention": Exact(backward_blocks=planner.ATTENTION_BACKWARD_BLOCKS)}
            opt = _capture(model, chosen, 256, batch_size or s.micro_batch_size, setup=s,
                           recompute="full" if "recompute" in chosen else None, offload=offload, **saves_most)
    if opt.session.graphs and opt.session.graphs[0].seq.symbol is None:
        raise PredictionError("the capture did not keep the sequence length symbolic (a graph break before the "
                              "model's first layer?); max_seq_len cannot extrapolate from it")

    def peak(S: int) -> int:
        return opt.predict_memory(S).peak_bytes

    one = peak(1)
    fits, also = [peak] if one <= usable else [], ""
    if passes is None and s.step_can_move_into_backward:
        # as the planner does when nothing else fits: the optimizer step moved into backward
        fused = planner.in_backward(s)

        def fused_peak(S: int) -> int:
            return opt.predict_memory(S, setup=fused).peak_bytes
        fused_one = fused_peak(1)
        fits += [fused_peak] if fused_one <= usable else []
        also = f"; with the optimizer step in backward {format_bytes(fused_one)}"
    if not fits:
        raise BudgetError(f"even one token does not fit {b} under {s.describe()}: the step peaks at "
                          f"{format_bytes(one)} ({_parts(opt.predict_memory(1))}){also}", one, "activations")
    return max(longest_fitting(f, usable, limit, granularity) for f in fits)


def _parts(est: memory.MemoryEstimate) -> str:
    return ", ".join(f"{k} {format_bytes(v)}" for k, v in est.breakdown().items() if v)


def _check_static(model: nn.Module, s: TrainingSetup, b: Budget, usable: float,
                  d: Optional[depth.Depth] = None) -> None:
    """BudgetError when weights, master weights, optimizer state and gradients alone overflow
    `usable`, naming the presets whose static part would fit: this model's trainable parameters and
    other tensors (with `d`, those of the whole model the shallow one stands for)."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    other = sum(t.numel() * t.element_size() for t in model.buffers()) + sum(
        p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    if d is not None:
        nbytes, period_trained = depth.period_sizes(d)
        trained += d.repeats * sum(n for n, _ in period_trained)
        other += d.repeats * (nbytes - sum(n * dt.itemsize for n, dt in period_trained))
    static = s.static_bytes(trained) + other
    if static <= usable:
        return
    held_grads = 0 if s.optimizer_in_backward or s.optimizer is None else trained * s.grads.itemsize
    parts = {"weights": trained * s.param_dtype.itemsize + other, "master weights": s.master_bytes(trained),
             "optimizer state": s.state_bytes(trained), "gradients": held_grads,
             "DDP gradient buckets": s.bucket_bytes(trained)}
    alike = {name: p.with_(ddp=s.ddp) for name, p in PRESETS.items() if not (s.ddp and p.optimizer_in_backward)}
    fits = [f"{name} ({format_bytes(p.static_bytes(trained) + other)})" for name, p in alike.items()
            if p.static_bytes(trained) + other <= usable]
    raise BudgetError(
        f"the static part alone does not fit {b} less {planner.HEADROOM:.0%} headroom for prediction error"
        + (f" and {s.headroom:.0%} allocator headroom" if s.headroom else "")
        + f": {s.describe()} needs {format_bytes(static)} before any activation ("
        + ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items() if v) + "). "
        + (f"Setups whose static part fits: {', '.join(fits)}." if fits else
           "No preset fits either: use 8-bit AdamW (TrainingSetup(optimizer='adamw8bit')), shard the "
           "model over devices, or a larger device."), static, "static")


@_shallow_first
def sequence_bound(model_or_config: Any, budget: Union[str, int, Budget, None], batch_size: Optional[int] = None,
                   setup: Any = None, optimizer: Optional[str] = "adamw", dtype: Optional[torch.dtype] = None,
                   limit: int = 1 << 21, granularity: int = 128, seq_len: Optional[int] = None,
                   offload: Optional[bool] = None, *, shallow: bool = False) -> bound.Bound:
    """The longest sequence any plan of tailorfx's rewrites could fit in `budget`, from a lower
    bound on every plan's peak (rewrite/bound.py: static bytes + each block's input + the residual
    stream's gradient + the last attention's operands and their gradients at full length). The
    result's `parts` say what the bound is made of at that length; max_seq_len() / its seq_len
    is how close the best plan comes. With `seq_len` (budget then may be None): the bound at that
    length. `offload`: plans may keep checkpoints in host memory (default: planned for a GPU, a
    model there or a GPU budget preset, where the planner may offload them; False: the
    device-only bound)."""
    if budget is None and seq_len is None:
        raise ValueError("sequence_bound needs a budget (the longest length) or seq_len (the bound there)")
    b = Budget.parse(budget if budget is not None else 1 << 60)
    positive_int("batch_size", batch_size)
    if setup is not None:
        s = resolve_setup(setup)
    else:
        if isinstance(model_or_config, nn.Module):
            dtype = dtype or next(model_or_config.parameters()).dtype
        s = resolve_setup(None, param_dtype=dtype, optimizer=optimizer)
    with _prediction_model(model_or_config, s.param_dtype, shallow) as (model, d):
        s = with_device_costs(s, b, model, batch_size or s.micro_batch_size)
        usable = planner.usable(b.bytes, s.headroom)
        _check_static(model, s, b, usable, d)
        opt = _capture(model, ["attention", "minisequence", "recompute"], 256, batch_size or s.micro_batch_size,
                       setup=s, recompute="full", minisequence="segments")
    at = opt.bound_at(offload)
    if at is None:
        raise PredictionError("sequence_bound needs a model with transformer blocks captured with a symbolic length")
    if seq_len is not None:
        return at(seq_len)
    S = longest_fitting(lambda n: at(n).peak_bytes, usable, limit, granularity)
    return at(S)

