"""A small training helper for models rewritten by the precision pass.

Parameters stay fp32 (the pass casts them inside the graph), so gradients arrive in fp32 and the
optimizer updates fp32 master weights. bf16 needs nothing more. fp16 needs loss scaling: its
gradients underflow below 6e-8 and overflow above 65504, so the loss is multiplied by a dynamic
scale before backward and the gradients divided by it before the step; a step whose gradients hold
inf/nan is skipped and the scale halved (torch.amp.GradScaler does all of it).

    trainer = Trainer(opt_model, torch.optim.AdamW(model.parameters()), precision="fp16")
    for batch in batches:
        result = trainer.step(batch)        # StepResult(loss, skipped, scale)

`train()` is the whole loop around it: gradient accumulation with transformers'
`num_items_in_batch` convention, AdamW, a warmup + cosine/linear LR schedule, clipping, fp16 loss
scaling, checkpoints that resume bit for bit (model, optimizer, scheduler, scaler, data position,
RNG states), a JSON-lines log, a tqdm bar and the "tailorfx" logger:

    data = PackedBatches(docs, seq_len=2048, batch_size=8)   # tailorfx.runtime.packing
    result = train(opt_model, data, steps=1000, grad_accum=4, lr=3e-4, warmup=100,
                   checkpoint_dir="ckpt", save_every=200, resume=True, log_path="train.jsonl")
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Mapping, Optional, Sequence, Union

import torch

from tailorfx.runtime.accumulation import (  # noqa: F401 - count_targets: cli and tests import it from here
    NOT_MODEL_INPUTS, accepts_num_items, accumulate, count_targets, model_device, scalar_loss,
)
from tailorfx.runtime.checkpoint import Cursor, seed_everything
from tailorfx.runtime.train_state import TrainState, open_log, resume_source


def make_scaler(precision: Optional[str], device: str = "cpu", **kwargs) -> Optional[torch.amp.GradScaler]:
    """A dynamic loss scaler for fp16; None for bf16/fp32, whose exponent range needs none."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device, **kwargs)


def train_step(module: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Mapping[str, Any],
               scaler: Optional[torch.amp.GradScaler] = None, max_grad_norm: Optional[float] = None) -> torch.Tensor:
    """One step: zero grads, forward, backward (scaled when `scaler` is given), clip, update.

    Returns the (unscaled, detached) loss. With a scaler, a step whose gradients are not finite is
    skipped by `scaler.step` and the scale lowered by `scaler.update`.
    """
    optimizer.zero_grad(set_to_none=True)
    loss = scalar_loss(module(**batch))
    if scaler is None:
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(_params(optimizer), max_grad_norm)
        optimizer.step()
        return loss.detach()
    scaler.scale(loss).backward()
    if max_grad_norm is not None:
        scaler.unscale_(optimizer)   # clip the true gradients, not the scaled ones
        torch.nn.utils.clip_grad_norm_(_params(optimizer), max_grad_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


@dataclass(frozen=True)
class StepResult:
    loss: float
    skipped: bool          # the optimizer did not step (fp16: inf/nan gradients)
    scale: Optional[float]  # the loss scale after the step (None without a scaler)


class Trainer:
    """Runs train_step with the scaler the precision needs and reports skipped steps."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: Optional[str] = None,
                 scaler: Optional[torch.amp.GradScaler] = None, max_grad_norm: Optional[float] = None,
                 scheduler: Any = None):
        self.module = module
        self.optimizer = optimizer
        self.scaler = scaler if scaler is not None else make_scaler(precision)
        self.max_grad_norm = max_grad_norm
        self.scheduler = scheduler
        self.num_steps = 0
        self.num_skipped = 0

    def step(self, batch: Mapping[str, Any]) -> StepResult:
        before = self.scaler.get_scale() if self.scaler is not None else None
        loss = train_step(self.module, self.optimizer, batch, self.scaler, self.max_grad_norm)
        after = self.scaler.get_scale() if self.scaler is not None else None
        # GradScaler lowers the scale exactly when it found inf/nan and skipped optimizer.step()
        skipped = after is not None and after < before
        self.num_steps += 1
        self.num_skipped += int(skipped)
        if self.scheduler is not None and not skipped:
            self.scheduler.step()
        return StepResult(float(loss), skipped, after)


# ---- the training loop: accumulation, schedule, clipping, checkpoints, logs ------------------

LOG = logging.getLogger("tailorfx")
SCHEDULES = ("cosine", "linear", "constant")


def lr_lambda(schedule: str, total_steps: int, warmup: int = 0, min_lr_ratio: float = 0.0) -> Callable[[int], float]:
    """The multiplier of the base learning rate at optimizer step `step` (0-based): linear warmup
    step/warmup for step < warmup (transformers' convention; warmup=0 starts at the full rate), then
    cosine or linear decay to `min_lr_ratio` at `total_steps`, or constant."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not valid: one of {SCHEDULES}")
    decay_steps = max(1, total_steps - warmup)

    def f(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / decay_steps)
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
        return min_lr_ratio + (1.0 - min_lr_ratio) * shape
    return f


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.0,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay on matrices (dim >= 2) only, not on biases
    and norm weights."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def _peak_memory(device: torch.device) -> Optional[int]:
    """Peak bytes: the device allocator's on CUDA, else the process's peak RSS (both cheap)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024   # KiB on Linux
    except (ImportError, OSError):   # pragma: no cover - not on Linux
        return None


def _finite(x: float) -> Optional[float]:
    return x if math.isfinite(x) else None


@dataclass
class TrainResult:
    """What `train()` did in this call (steps restored from a checkpoint are not repeated here)."""
    step: int                                     # the global optimizer step reached
    losses: list[float] = field(default_factory=list)      # one per optimizer step of this call
    records: list[dict] = field(default_factory=list)      # the JSON-lines records of this call
    start_step: int = 0                           # the step this call started from (resume)
    skipped: int = 0                              # steps without an update: fp16 inf/nan gradients, no labels
    tokens: int = 0                               # input tokens of this call
    elapsed: float = 0.0                          # seconds
    checkpoints: list[str] = field(default_factory=list)   # files written by this call


def train(model: torch.nn.Module, batches: Any, *, steps: int, total_steps: Optional[int] = None,
          grad_accum: int = 1, lr: float = 3e-4, schedule: str = "cosine", warmup: int = 0,
          min_lr_ratio: float = 0.0, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
          eps: float = 1e-8, clip_norm: Optional[float] = 1.0, precision: Optional[str] = None,
          autocast: Optional[bool] = None, optimizer: Optional[torch.optim.Optimizer] = None,
          checkpoint_dir: Union[str, os.PathLike, None] = None, save_every: Optional[int] = None,
          keep_last: Optional[int] = None, resume: Union[bool, str, os.PathLike] = False,
          log_path: Union[str, os.PathLike, None] = None, progress: bool = True, seed: Optional[int] = 0,
          pass_num_items: Optional[bool] = None, drop_keys: Sequence[str] = NOT_MODEL_INPUTS) -> TrainResult:
    """Train `model` (an nn.Module or a tailorfx OptimizedModule, called as `model(**batch)`,
    returning a scalar loss or an output with `.loss`) until the optimizer has taken `steps` steps
    in all, counting those restored by `resume`.

    Data: `batches` yields micro-batches (dicts); each optimizer step consumes `grad_accum` of them
    (see `accumulate`: with transformers models the step equals one batch `grad_accum` times the
    size, through `num_items_in_batch`). It must be deterministic to resume: an indexable source
    (a list of batches, `PackedBatches`; cycled by epochs), an object with state_dict() /
    load_state_dict(), or an iterable that yields the same sequence each time (skipped ahead on
    resume). Keys in `drop_keys` (document_ids) are not passed to the model.

    Optimizer: AdamW (`make_optimizer`: `weight_decay` on matrices only) unless `optimizer` is
    given; learning rate `lr` x `lr_lambda(schedule, total_steps or steps, warmup, min_lr_ratio)`
    through LambdaLR; gradients clipped to `clip_norm` (None: measured, not clipped).

    precision="fp16" adds dynamic loss scaling (`make_scaler`; a step with inf/nan gradients is
    skipped, the scheduler not advanced); "bf16" needs none. `autocast` (default: on for a plain
    module with a precision, off for a tailorfx OptimizedModule, whose precision pass casts inside
    its graph) runs the forward under torch.autocast.

    Checkpoints: with `checkpoint_dir`, every `save_every` steps and at the end, `step_XXXXXXXX.pt`
    holds model, optimizer, scheduler and scaler states, the data position and the RNG states
    (torch CPU and CUDA, python `random`, numpy); `keep_last` prunes older ones. `resume=True`
    continues from the latest checkpoint in `checkpoint_dir` (from scratch when there is none), a
    path resumes from that file; the run then continues bit for bit as if never stopped. A fresh
    run seeds torch, random and numpy with `seed` (None: leaves them).

    Logs: `log_path` gets one JSON line per optimizer step: step, loss, lr, grad_norm (None when
    not finite), tokens (input tokens of the step), targets (label tokens the loss counted),
    tokens_per_s, time (seconds of the step), elapsed (seconds since this call began), skipped,
    scale (fp16 loss scale, else None), peak_mem (bytes: CUDA's peak allocation or the process's
    peak RSS). A fresh run overwrites the file; on resume, lines past the restored step are dropped
    first. Messages go to the
    "tailorfx" logger (per step at DEBUG); `progress` shows a tqdm bar on stderr.
    """
    _check_settings(steps, grad_accum, save_every, precision)
    total_steps = steps if total_steps is None else total_steps
    if autocast is None:
        autocast = precision in ("fp16", "bf16") and not getattr(model, "casts_own_precision", False)
    if pass_num_items is None:
        pass_num_items = accepts_num_items(model)
    opt = optimizer if optimizer is not None else make_optimizer(model, lr, weight_decay, betas, eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(schedule, total_steps, warmup, min_lr_ratio))
    config = {"total_steps": total_steps, "grad_accum": grad_accum, "schedule": schedule, "warmup": warmup,
              "min_lr_ratio": min_lr_ratio, "precision": precision}
    state = TrainState(model, opt, scheduler, make_scaler(precision, model_device(model).type), Cursor(batches),
                       config)
    source = resume_source(resume, checkpoint_dir)
    start = state.restore(source) if source is not None else 0
    if source is None and seed is not None:
        seed_everything(seed)
    log_file = open_log(log_path, keep_through=start if source is not None else None)
    result = TrainResult(step=start, start_step=start)
    LOG.info("training steps %d..%d: grad_accum=%d, lr=%g (%s, warmup %d), precision=%s",
             start + 1, steps, grad_accum, lr, schedule, warmup, precision)
    forward_backward = functools.partial(accumulate, model, scaler=state.scaler, precision=precision,
                                         autocast=autocast, pass_num_items=pass_num_items, drop_keys=drop_keys)
    _run_steps(state, forward_backward, result, steps=steps, grad_accum=grad_accum, clip_norm=clip_norm,
               checkpoint_dir=checkpoint_dir, save_every=save_every, keep_last=keep_last, log_file=log_file,
               progress=progress)
    LOG.info("trained steps %d..%d in %.1fs (%d tokens, %d skipped)%s", start + 1, result.step, result.elapsed,
             result.tokens, result.skipped, f", last loss {result.losses[-1]:.4f}" if result.losses else "")
    return result


def _check_settings(steps: int, grad_accum: int, save_every: Optional[int], precision: Optional[str]) -> None:
    if steps < 0 or grad_accum < 1:
        raise ValueError(f"steps={steps!r} and grad_accum={grad_accum!r}: steps >= 0, grad_accum >= 1")
    if save_every is not None and save_every < 1:
        raise ValueError(f"save_every={save_every!r} is not valid: a positive int or None")
    if precision not in (None, "fp32", "fp16", "bf16"):
        raise ValueError(f"precision={precision!r} is not valid: 'fp16', 'bf16', 'fp32' or None")


def _run_steps(state: TrainState, forward_backward: Callable, result: TrainResult, *, steps: int, grad_accum: int,
               clip_norm: Optional[float], checkpoint_dir: Union[str, os.PathLike, None], save_every: Optional[int],
               keep_last: Optional[int], log_file: Optional[IO[str]], progress: bool) -> None:
    """Optimizer steps `result.step + 1 .. steps` into `result`, each logged, with a checkpoint
    every `save_every` steps and at the end; closes `log_file`."""
    start = result.step
    bar = _progress_bar(progress, steps, start)
    t0 = time.perf_counter()
    try:
        state.model.train()
        for step in range(start + 1, steps + 1):
            loss, record = _take_step(state, step, grad_accum, forward_backward, clip_norm, t0)
            _add_record(result, loss, record, log_file, bar)
            if checkpoint_dir is not None and _save_due(step, save_every):
                result.checkpoints.append(str(state.save(checkpoint_dir, step, keep_last)))
        if checkpoint_dir is not None and result.step > start and not _save_due(result.step, save_every):
            result.checkpoints.append(str(state.save(checkpoint_dir, result.step, keep_last)))
    finally:
        if bar is not None:
            bar.close()
        if log_file is not None:
            log_file.close()
    result.elapsed = time.perf_counter() - t0


def _save_due(step: int, save_every: Optional[int]) -> bool:
    return save_every is not None and step % save_every == 0


def _take_step(state: TrainState, step: int, grad_accum: int, forward_backward: Callable,
               clip_norm: Optional[float], t0: float) -> tuple[float, dict]:
    """Optimizer step `step` on the next `grad_accum` micro-batches; returns (its loss, its log record)."""
    t_step = time.perf_counter()
    micro = [state.cursor.next() for _ in range(grad_accum)]
    tokens = sum(int(mb["input_ids"].numel()) for mb in micro if isinstance(mb.get("input_ids"), torch.Tensor))
    lr_now = state.optimizer.param_groups[0]["lr"]
    state.optimizer.zero_grad(set_to_none=True)
    loss, targets = forward_backward(micro)
    if targets == 0:       # nothing to learn from: no update (the step counts, as a skipped one)
        LOG.warning("step %d: its batches hold no label to learn from (all -100): no update", step)
        grad_norm, skipped = torch.zeros(()), True
    else:
        grad_norm, skipped = _update(state.optimizer, state.scaler, clip_norm, step)
    if not skipped:
        state.scheduler.step()
    loss_f = float(loss)
    dt = time.perf_counter() - t_step
    record = {"step": step, "loss": _finite(loss_f), "lr": lr_now, "grad_norm": _finite(float(grad_norm)),
              "tokens": tokens, "targets": targets, "tokens_per_s": tokens / dt if dt > 0 else None,
              "time": dt, "elapsed": time.perf_counter() - t0, "skipped": skipped,
              "scale": state.scaler.get_scale() if state.scaler is not None else None,
              "peak_mem": _peak_memory(model_device(state.model))}
    LOG.debug("step %d: loss %.4f lr %.3g grad_norm %.3g %.0f tok/s%s", step, loss_f, lr_now,
              float(grad_norm), record["tokens_per_s"] or 0.0, " (skipped)" if skipped else "")
    return loss_f, record


def _update(opt: torch.optim.Optimizer, scaler: Optional[torch.amp.GradScaler], clip_norm: Optional[float],
            step: int) -> tuple[torch.Tensor, bool]:
    """Clip (or only measure) the gradients and step the optimizer, through the loss scaler when
    there is one; returns (the gradients' norm, whether the step was skipped: inf/nan gradients)."""
    if scaler is not None:
        scaler.unscale_(opt)     # clip (and measure) the true gradients, not the scaled ones
    params = _params(opt)
    grads = [p.grad for p in params if p.grad is not None]
    grad_norm = torch.zeros(())
    if clip_norm is not None:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip_norm)
    elif grads:
        grad_norm = torch.nn.utils.get_total_norm(grads)
    if scaler is None:
        opt.step()
        return grad_norm, False
    before = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    skipped = scaler.get_scale() < before
    if skipped:
        LOG.warning("step %d skipped: inf/nan gradients, loss scale lowered to %g", step, scaler.get_scale())
    return grad_norm, skipped


def _add_record(result: TrainResult, loss: float, record: dict, log_file: Optional[IO[str]], bar) -> None:
    """One step's record into `result`, the JSON-lines log and the progress bar."""
    result.step = record["step"]
    result.losses.append(loss)
    result.records.append(record)
    result.skipped += int(record["skipped"])
    result.tokens += record["tokens"]
    if log_file is not None:
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()
    if bar is not None:
        post = {"loss": f"{loss:.4f}", "tok/s": f"{record['tokens_per_s'] or 0:.0f}"}
        if record["peak_mem"] is not None:
            post["peak"] = f"{record['peak_mem'] / 2**20:.0f}MiB"
        bar.set_postfix(post, refresh=False)
        bar.update(1)


def _progress_bar(enabled: bool, total: int, initial: int):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:   # tqdm comes with transformers; without it, no bar
        LOG.info("tqdm is not installed: no progress bar")
        return None
    return tqdm(total=total, initial=initial, file=sys.stderr, unit="step", dynamic_ncols=True, desc="train")
