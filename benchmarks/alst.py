"""The ALST recipe (Arctic Long Sequence Training, Snowflake / DeepSpeed) on one device, applied to
an unmodified Hugging Face causal LM as its authors apply it, for benchmarks/max_seq_len.py.

Three parts, all from DeepSpeed 0.19.8 (`deepspeed.runtime.sequence_parallel.ulysses_sp`) and HF:
- HF activation checkpointing of every decoder layer (non-reentrant, transformers' default);
- `TiledMLP`: each decoder layer's `mlp` attribute is replaced by `TiledMLPBlock`, whose forward
  calls `TiledMLP.apply` on the original module (forward under no_grad, backward recomputes each
  shard), with the tutorial's shard count ceil(S / hidden);
- `TiledFusedLogitsLoss`: the loss is computed from `model.model(..., use_cache=False)`'s last
  hidden state through `TiledFusedLogitsLoss.apply` with the LM head, as ArcticTraining's
  SFTTrainer does: labels shifted once up front (`shift_labels`), each shard's loss from
  `model.loss_function(..., shift_labels=...)`, "sum" reduction; shards
  ceil(B * S * vocab * 4 B / slice), ArcticTraining's rule (its `slice_size_in_gb = 1` is the
  default slice). Each shard's gradients are computed inside the forward (autograd.backward per
  shard), so the S x V logits never exist at once.

One difference from ArcticTraining, for exactness: each shard's loss is divided by the batch's
counted tokens inside the shard function (HF's `num_items_in_batch`), so the function's output is
the mean loss itself. ArcticTraining returns the sum and divides it afterwards; but the LM head's
gradient is accumulated inside TiledFusedLogitsLoss's forward with an incoming gradient of 1 and
its backward rescales only the hidden states' gradient, so that division never reaches the head:
its gradient comes out (number of counted tokens) times too large (a 1023x error at 1024 tokens).

Gemma-2's `final_logit_softcapping` is applied inside the shard's loss function (without it the
recipe trains another model). Other logit transforms (Cohere's logit_scale, Granite's
logits_scaling) are refused, not silently dropped.

`min_shards` raises both shard counts to at least that many (a short sequence has one shard of
each, so a check at 512 tokens passes min_shards=2 to run the sharded paths).

Trained with the optimizer step in backward, ALST needs `LastShardOptimizer`: TiledMLP and
TiledFusedLogitsLoss call autograd.backward once per shard, so a post-accumulate-grad hook would
update a parameter after every shard.

`counts` (a Counter owned by the returned module) records what fired: TiledMLP applications and
shard calls, TiledFusedLogitsLoss applications and shard calls, and attention calls (a forward
pre-hook on each layer's `self_attn`: with checkpointing each runs twice per step, once more in
the recompute, since HF checkpoints the layer's `forward` and the recompute calls the attention
module again).

DeepSpeed is an optional dependency (the `alst` extra): `make bench-deps` installs it with none of
its ops built (DS_BUILD_OPS=0) and without build isolation, so pip builds it against the installed
torch and keeps it.
"""
from __future__ import annotations

import functools
import math
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

import tailorfx

ARCTIC_LOGITS_SLICE = 1 << 30   # ArcticTraining's slice_size_in_gb = 1: fp32 logits per loss shard
IGNORE_INDEX = -100


def require_deepspeed():
    """(TiledMLP, TiledFusedLogitsLoss), or an ImportError saying how to install DeepSpeed."""
    try:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP
    except ImportError as e:
        raise ImportError(f"the ALST variant needs DeepSpeed ({e}); install it with `make bench-deps` "
                          "(deepspeed==0.19.8 into .venv, no ops built, the installed torch kept)") from e
    return TiledMLP, TiledFusedLogitsLoss


def mlp_shards(seq_len: int, hidden: int) -> int:
    """The ALST tutorial's TiledMLP shard count: ceil(seqlen / hidden)."""
    return max(1, math.ceil(seq_len / hidden))


def logits_shards(batch: int, seq_len: int, vocab: int, slice_bytes: int) -> int:
    """ArcticTraining's TiledFusedLogitsLoss shard count: fp32 logits split into slices of `slice_bytes`."""
    return max(1, math.ceil(batch * seq_len * vocab * 4 / slice_bytes))


def count_attention_calls(model: nn.Module, counts: Counter) -> list:
    """Counts each decoder layer's attention call in counts["attention_calls"] (a forward pre-hook,
    so a checkpoint's recompute is counted too); returns the hook handles."""
    return [layer.self_attn.register_forward_pre_hook(lambda *_: counts.update(attention_calls=1))
            for layer in model.model.layers]


class TiledMLPBlock(nn.Module):
    """An MLP run through DeepSpeed's TiledMLP: the module put in place of a decoder layer's `mlp`."""

    def __init__(self, mlp: nn.Module, counts: Counter, min_shards: int = 1):
        super().__init__()
        self.mlp = mlp
        self.min_shards = min_shards
        self.__dict__["counts"] = counts   # shared with the model, not a submodule

    @staticmethod
    def _shard(block: "TiledMLPBlock", x_shard: torch.Tensor) -> torch.Tensor:
        block.counts["tiled_mlp_shard_calls"] += 1
        return block.mlp(x_shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        TiledMLP, _ = require_deepspeed()
        shards = max(self.min_shards, mlp_shards(x.shape[-2], x.shape[-1]))
        self.counts["tiled_mlp_applies"] += 1
        self.counts["tiled_mlp_max_shards"] = max(self.counts["tiled_mlp_max_shards"], shards)
        return TiledMLP.apply(TiledMLPBlock._shard, self, x, shards, list(self.mlp.parameters()))


class ALSTCausalLM(nn.Module):
    """A HF causal LM with the ALST recipe applied; forward(input_ids, labels) returns an output
    with `.loss` (and logits=None: the tiled loss never builds them)."""

    def __init__(self, model: nn.Module, logits_slice_bytes: int = ARCTIC_LOGITS_SLICE, min_shards: int = 1):
        super().__init__()
        require_deepspeed()
        cfg = model.config
        for attr in ("logit_scale", "logits_scaling"):
            if getattr(cfg, attr, None) not in (None, 1, 1.0):
                raise ValueError(f"{cfg.model_type}: config.{attr}={getattr(cfg, attr)} scales the logits; the ALST "
                                 "loss here applies only final_logit_softcapping")
        self.model = model
        self.logits_slice_bytes = logits_slice_bytes
        self.min_shards = min_shards
        self.counts: Counter = Counter()
        if hasattr(model, "activation_checkpointing_enable"):   # transformers >= 5.24 (the old name warns)
            model.activation_checkpointing_enable()
        else:
            model.gradient_checkpointing_enable()
        for layer in model.model.layers:
            layer.mlp = TiledMLPBlock(layer.mlp, self.counts, min_shards)
        self._hooks = count_attention_calls(model, self.counts)

    @staticmethod
    def _shard_loss(alst: "ALSTCausalLM", hidden: torch.Tensor, shift_labels: torch.Tensor,
                    num_items: torch.Tensor) -> torch.Tensor:
        """One shard's share of the mean loss: its token losses summed, divided by every counted
        token of the batch (HF's num_items_in_batch), soft-cap included."""
        alst.counts["tiled_loss_shard_calls"] += 1
        model = alst.model
        logits = model.lm_head(hidden)
        cap = getattr(model.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return model.loss_function(logits=logits, labels=None, vocab_size=model.config.vocab_size,
                                   shift_labels=shift_labels, num_items_in_batch=num_items)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast
        _, TiledFusedLogitsLoss = require_deepspeed()
        hidden = self.model.model(input_ids=input_ids, use_cache=False, **kwargs).last_hidden_state
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
        B, S = shift_labels.shape
        shards = max(self.min_shards, logits_shards(B, S, self.model.config.vocab_size, self.logits_slice_bytes))
        self.counts["tiled_loss_applies"] += 1
        self.counts["tiled_loss_max_shards"] = max(self.counts["tiled_loss_max_shards"], shards)
        num_items = (shift_labels != IGNORE_INDEX).sum().clamp(min=1)
        loss = TiledFusedLogitsLoss.apply(functools.partial(ALSTCausalLM._shard_loss, num_items=num_items), self,
                                          hidden, shift_labels, None, shards, [self.model.lm_head.weight], "sum")
        return CausalLMOutputWithPast(loss=loss)


class LastShardOptimizer(tailorfx.SetupOptimizer):
    """tailorfx.SetupOptimizer whose step in backward updates a parameter once a step, after its
    last shard: DeepSpeed sets `ds_grad_is_ready = False` on a tiled function's parameters for
    every shard but the last (for ZeRO, which must not reduce a partial gradient either), so until
    then the gradient accumulates."""

    def __init__(self, params, setup, **kwargs):
        super().__init__(params, setup, ready=lambda p: getattr(p, "ds_grad_is_ready", True), **kwargs)
