"""Ulysses sequence parallelism (DeepSpeed-Ulysses): each rank holds a slice of the sequence;
attention swaps it for a slice of the heads with one all-to-all, attends over the whole sequence,
and swaps back. The all-to-all is torch.distributed's autograd-aware `all_to_all_single`.

    q, k, v (b, heads, S/p, d) --all-to-all--> (b, heads/p, S, d) --causal attention-->
    (b, heads/p, S, d) --all-to-all--> (b, heads, S/p, d)
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single

from tailorfx.runtime.flash_cpu import grouped_sdpa

ATTENTION_NAME = "tailorfx_ulysses"


def _seq_to_heads(x: torch.Tensor, p: int, group) -> torch.Tensor:
    """(b, h, s, d) with this rank's sequence slice -> (b, h/p, p*s, d) with its head slice."""
    b, h, s, d = x.shape
    x = x.reshape(b, p, h // p, s, d).permute(1, 0, 2, 3, 4).contiguous()   # chunk i -> rank i
    x = all_to_all_single(torch.empty_like(x), x, group=group)               # chunk j <- rank j's sequence
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * s, d)


def _heads_to_seq(x: torch.Tensor, p: int, group) -> torch.Tensor:
    """(b, h/p, p*s, d) -> (b, h, s, d): the inverse of _seq_to_heads."""
    b, hp, S, d = x.shape
    x = x.reshape(b, hp, p, S // p, d).permute(2, 0, 1, 3, 4).contiguous()
    x = all_to_all_single(torch.empty_like(x), x, group=group)
    return x.permute(1, 0, 2, 3, 4).reshape(b, hp * p, S // p, d)


def ulysses_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: Optional[float] = None, *, group, size: int, **kwargs):
    """A transformers attention function (AttentionInterface): causal attention over the whole
    sequence, each rank computing heads/size of the heads. Returns (b, S/size, heads, d)."""
    if dropout:
        raise ValueError("sp='ulysses' runs attention without dropout; set the config's attention_dropout=0")
    for what in ("softcap", "sliding_window", "s_aux"):
        if kwargs.get(what) is not None:
            raise ValueError(f"sp='ulysses' computes exact causal attention, but this model's attention uses "
                             f"{what}={kwargs[what]!r}: use tp/dp/pp for it")
    for name, t in (("query", query), ("key/value", key)):
        if t.shape[1] % size:
            good = [d for d in range(1, t.shape[1] + 1) if t.shape[1] % d == 0]
            raise ValueError(f"sp='ulysses' over {size} ranks must divide the {t.shape[1]} {name} heads: "
                             f"use dp in {good}")
    q, k, v = (_seq_to_heads(t, size, group) for t in (query, key, value))
    out = grouped_sdpa(q, k, v, is_causal=True, scale=scaling)
    return _heads_to_seq(out, size, group).transpose(1, 2).contiguous(), None


def register(*, group, size: int) -> str:
    """Register the attention for this process group with transformers; returns its name."""
    from transformers import AttentionInterface
    AttentionInterface.register(ATTENTION_NAME, functools.partial(ulysses_attention, group=group, size=size))
    return ATTENTION_NAME


def shard_batch(kwargs: dict, *, rank: int, size: int) -> dict:
    """This rank's slice of a causal-LM batch: input_ids, position_ids of the whole sequence, and
    labels shifted over the whole sequence first (a slice's last token predicts the next slice's
    first), counted over the whole batch (`num_items_in_batch`), as transformers' loss reads them."""
    ids = kwargs["input_ids"]
    S = ids.shape[1]
    if S % size:
        raise ValueError(f"sp={size} needs a sequence length divisible by {size}, got {S}: pad the batch")
    n = S // size
    part = slice(rank * n, (rank + 1) * n)
    out = {k: v for k, v in kwargs.items() if k not in ("input_ids", "labels", "attention_mask", "position_ids")}
    if kwargs.get("attention_mask") is not None and not bool(kwargs["attention_mask"].all()):
        raise ValueError("sp='ulysses' runs causal attention over unpadded sequences: pack them instead of padding")
    pos = kwargs.get("position_ids")
    pos = torch.arange(S, device=ids.device).expand(ids.shape[0], S) if pos is None else pos
    out.update(input_ids=ids[:, part], position_ids=pos[:, part])
    labels = kwargs.get("labels")
    if labels is not None:
        shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
        out.update(labels=labels[:, part], shift_labels=shifted[:, part].contiguous(),
                   num_items_in_batch=(shifted != -100).sum())
    return out
