"""Tensor parallelism applied to a module: DTensor's styles, then the vocab-parallel LM head's loss,
fused with it or under loss_parallel. One rewrite for the rank's own model (apply.py) and for
the fake copy a prediction traces (trace.py), so the traced graph is the one the rank runs.

    head = shard_model(model, styles=tp_styles(plan, 2, "vocab"), mesh=mesh["tp"],
                       head_loss=plan.head_loss, vocab_loss="fused")
    head.note    -> "loss fused with it (8 row chunks, no logits-sized tensor kept for backward)"
    chunk_mlps(model, plan.mlps, options)     # mini-sequence under tp: each MLP in sequence chunks
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.nn as nn

from tailorfx.passes.minisequence import auto_chunks
from tailorfx.passes.minisequence.chunks import MIN_CHUNK_TOKENS
from tailorfx.runtime.chunked_modules import chunk_modules
from tailorfx.runtime.tensor_parallel import LossParallelScope, apply_loss_parallel, apply_tp
from tailorfx.runtime.vocab_parallel import FusedVocabParallelLoss, install_fused_loss


@dataclass(frozen=True)
class VocabHead:
    """A vocab-parallel LM head as sharded: its logits stay split over the tp ranks."""
    fqn: str
    scope: LossParallelScope                   # its logits leave loss_parallel once their gradient is done
    fused: Optional[FusedVocabParallelLoss]    # its loss fused with it, or None: under loss_parallel
    note: str                                  # how its loss runs, and why (for the report)


def shard_model(model: nn.Module, *, styles: dict[str, str], mesh, head_loss: Any, vocab_loss: str = "fused",
                scatter: bool = True, skip_logits: bool = False, grad_weight_fp32: bool = False) -> Optional[VocabHead]:
    """Shard `model` in place by `styles` (plan.tp_styles) on the tp `mesh`; a vocab-parallel head
    then gets its loss scope and, as `vocab_loss` asks, its loss fused with it (fuse_head_loss,
    `head_loss` the plan's; `skip_logits`: no logits in training with labels). Returns that head,
    or None. `scatter`: as runtime.apply_tp's; `grad_weight_fp32`: the fused loss sums its rows'
    gradient in fp32 (TrainingSetup.head_grad_dtype)."""
    apply_tp(model, styles=styles, mesh=mesh, scatter=scatter)
    head = next((f for f, st in styles.items() if st.startswith("colwise_vocab_parallel")), None)
    if head is None:
        return None
    # the scope's hook before the fused loss's: the loss must see the head's output as the caller does
    scope = apply_loss_parallel(model, head=head)
    fused, note = fuse_head_loss(model, head, head_loss, vocab_loss, skip_logits, grad_weight_fp32)
    return VocabHead(head, scope, fused, note)


def fuse_head_loss(model: nn.Module, head: str, transform: Any, choice: str = "fused", skip_logits: bool = False,
                   grad_weight_fp32: bool = False):
    """Give the vocab-parallel `head`'s loss the fused form (runtime/vocab_parallel.py) when the
    graph shows it computes one (`transform`: the plan's (softcap, scale), else why not); returns
    it (or None) and a line for the report."""
    if choice != "fused":
        return None, "loss under DTensor's loss_parallel (vocab_loss='loss_parallel')"
    if isinstance(transform, str):
        return None, f"loss under DTensor's loss_parallel: {transform}"
    mod = dict(model.named_modules())[head]
    rows = mod.weight.to_local().shape[0] if hasattr(mod.weight, "to_local") else mod.weight.shape[0]
    chunks = auto_chunks(rows, mod.weight.shape[1])   # a chunk's logits <= its hidden states
    softcap, scale = transform
    fused = install_fused_loss(model, head=head, num_chunks=chunks, logit_softcap=softcap, logit_scale=scale,
                               skip_logits=skip_logits, grad_weight_fp32=grad_weight_fp32)
    if fused is None:
        return None, "loss under DTensor's loss_parallel: the model's loss is not transformers' ForCausalLMLoss"
    return fused, (f"loss fused with it ({chunks} row chunks, no logits-sized tensor kept for backward"
                   + ("; its weight's gradient summed in fp32" if grad_weight_fp32 else "")
                   + ("; logits=None in training with labels, no logits shard built)" if skip_logits else ")"))


CHUNKED_MLP = "sequence chunks, each checkpointed (its intermediates one chunk's at a time, in forward and backward)"


def chunk_mlps(model: nn.Module, mlps, options: Optional[dict] = None) -> list[tuple[str, int]]:
    """Mini-sequence on a sharded model: each token-wise MLP (plan.mlps) runs in sequence chunks,
    each chunk checkpointed (runtime/chunked_modules.py); `options`: minisequence_chunks and
    minisequence_min_tokens as the graph pass reads them. The ideal count makes one chunk's
    intermediates (the outputs of the linears that read the MLP's input, as this rank holds them)
    no larger than its input. Returns (path, how many chunks) per MLP, for the report."""
    options = options or {}
    mods = dict(model.named_modules())
    ideal = {}
    for path in mlps:
        linears = [m for m in mods[path].modules() if isinstance(m, nn.Linear)]
        hidden = linears[0].in_features if linears else 1
        ideal[path] = auto_chunks(sum(_local_rows(m.weight) for m in linears if m.in_features == hidden), hidden)
    given, min_tokens = options.get("minisequence_chunks"), options.get("minisequence_min_tokens") or MIN_CHUNK_TOKENS
    chunk_modules(model, list(mlps), ideal=ideal, num_chunks=given, min_tokens=min_tokens)
    return [(p, f"{given} chunk(s)" if given else f"up to {m} chunk(s) of {min_tokens} tokens or more")
            for p, m in ideal.items()]


def _local_rows(weight) -> int:
    return weight.to_local().shape[0] if hasattr(weight, "to_local") else weight.shape[0]
