"""Gradient accumulation: k micro-batches into the gradients of one batch holding all k.

A causal LM's loss is a mean over target tokens, so the micro-batch losses are weighed by their
target counts, through transformers' `num_items_in_batch` where the model's forward takes it.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Mapping, Optional, Sequence

import torch

IGNORE_INDEX = -100
# batch keys that describe the data and are not model inputs (PackingCollator's document_ids)
NOT_MODEL_INPUTS = ("document_ids",)


def scalar_loss(out: Any) -> torch.Tensor:
    """The loss a module returned: the tensor itself, its `.loss` or its "loss" entry (a 0-dim tensor)."""
    loss = getattr(out, "loss", out)
    if isinstance(out, Mapping):
        loss = out["loss"]
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(f"the module must return a scalar loss (or an object with .loss), got {type(loss).__name__}")
    return loss


def count_targets(batch: Mapping[str, Any]) -> Optional[int]:
    """How many labels transformers' causal-LM loss counts in `batch`: it shifts labels left inside
    the loss, so `labels[:, 0]` is never a target; a target is a label != -100 in `labels[:, 1:]`.
    None when the batch has no labels."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor):
        return None
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def accepts_num_items(model: torch.nn.Module) -> bool:
    """Whether `model.forward` takes `num_items_in_batch` (by name or through **kwargs), as
    transformers' causal LMs do: it hands it to `loss_function`, which then sums the token losses
    and divides by it instead of averaging."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "num_items_in_batch" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's first parameter lives (the CPU for a model without parameters)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _to_device(batch: Mapping[str, Any], device: torch.device, drop: Sequence[str]) -> dict:
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
            for k, v in batch.items() if k not in drop}


def _autocast(device: torch.device, precision: Optional[str], enabled: bool):
    if not enabled or precision not in ("fp16", "bf16"):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.float16 if precision == "fp16" else torch.bfloat16)


def accumulate(model: torch.nn.Module, micro_batches: Sequence[Mapping[str, Any]], *,
               scaler: Optional[torch.amp.GradScaler] = None, precision: Optional[str] = None,
               autocast: bool = False, pass_num_items: Optional[bool] = None,
               drop_keys: Sequence[str] = NOT_MODEL_INPUTS) -> tuple[torch.Tensor, Optional[int]]:
    """Forward and backward of k micro-batches into the parameters' .grad (not zeroed here), so
    that the gradients equal those of one batch holding all k.

    The loss of a causal LM is a mean over target tokens; averaging k micro-batch means would weigh
    a token of a micro-batch with few targets (more padding) more. So the total target count N of
    all k micro-batches is counted first (`count_targets`) and passed as `num_items_in_batch=N` to
    each forward (transformers' convention: the model's loss is then sum(token losses) / N), and
    the micro-batch losses add up to the token mean of the whole batch. A model whose forward does
    not take it (`pass_num_items=None` detects it) gets its mean loss scaled by n_i / N instead.

    Returns (the whole batch's loss, detached and unscaled; N, or None without labels). When N is
    0, nothing runs and no gradients are made.
    """
    device = model_device(model)
    micro = [_to_device(mb, device, drop_keys) for mb in micro_batches]
    counts = [count_targets(mb) for mb in micro]
    total = None if any(c is None for c in counts) else sum(counts)
    if pass_num_items is None:
        pass_num_items = accepts_num_items(model)
    loss_sum = torch.zeros((), device=device)
    if total == 0:
        return loss_sum, 0       # no targets at all: no gradients (rather than 0/0 = nan ones)
    for mb, n in zip(micro, counts):
        kwargs = dict(mb)
        if total is not None and pass_num_items:
            kwargs["num_items_in_batch"] = torch.tensor(total, device=device)
        elif total is not None and n == 0:
            continue                 # no targets: nothing to add (its mean loss would be nan)
        with _autocast(device, precision, autocast):
            loss = scalar_loss(model(**kwargs))
        if total is None:
            loss = loss / len(micro)                  # no labels to count: mean of the k losses
        elif not pass_num_items:
            loss = loss * (n / total) if total else loss * 0.0
        (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum += loss.detach().float()
    return loss_sum, total
