"""A small training helper for models rewritten by the precision pass.

Parameters stay fp32 (the pass casts them inside the graph), so gradients arrive in fp32 and the
optimizer updates fp32 master weights. bf16 needs nothing more. fp16 needs loss scaling: its
gradients underflow below 6e-8 and overflow above 65504, so the loss is multiplied by a dynamic
scale before backward and the gradients divided by it before the step; a step whose gradients hold
inf/nan is skipped and the scale halved (torch.amp.GradScaler does all of it).

    trainer = Trainer(opt_model, torch.optim.AdamW(model.parameters()), precision="fp16")
    for batch in batches:
        result = trainer.step(batch)        # StepResult(loss, skipped, scale)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch


def make_scaler(precision: Optional[str], device: str = "cpu", **kwargs) -> Optional[torch.amp.GradScaler]:
    """A dynamic loss scaler for fp16; None for bf16/fp32, whose exponent range needs none."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device, **kwargs)


def _loss(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", out)
    if isinstance(out, Mapping):
        loss = out["loss"]
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(f"the module must return a scalar loss (or an object with .loss), got {type(loss).__name__}")
    return loss


def train_step(module: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Mapping[str, Any],
               scaler: Optional[torch.amp.GradScaler] = None, max_grad_norm: Optional[float] = None) -> torch.Tensor:
    """One step: zero grads, forward, backward (scaled when `scaler` is given), clip, update.

    Returns the (unscaled, detached) loss. With a scaler, a step whose gradients are not finite is
    skipped by `scaler.step` and the scale lowered by `scaler.update`.
    """
    optimizer.zero_grad(set_to_none=True)
    loss = _loss(module(**batch))
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
