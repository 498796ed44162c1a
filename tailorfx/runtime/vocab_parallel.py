"""The vocab-parallel LM head fused with its cross-entropy, for tensor parallelism.

Each tensor-parallel rank holds V/tp rows of the head. The loss runs over row chunks of the
hidden states: a chunk's logits against this rank's rows (chunk x V/tp, the only logits-sized
buffer), then per token the max, the sum of exponentials and the target's logit, exchanged by
two all-reduces; the gradients are taken in the same pass (as in `linear_ops`). No rank holds
logits over the whole vocabulary, and nothing logits-sized is kept for backward (DTensor's
`loss_parallel`, which Megatron and torchtitan use, keeps the log-softmax of the logits shard).

    HF forward:  logits = lm_head(h)        (vocab-parallel DTensor)
                 loss = model.loss_function(logits=logits, labels=labels, ...)
    installed:   model.loss_function = FusedVocabParallelLoss: the loss from (h, this rank's W rows)

The loss function is the one Hugging Face lets a model instance replace (its `loss_function`
setter); the head's input is taken by a forward hook. A logits tensor that is not the head's
output (through the soft-cap or scale the plan read off the graph) goes to the model's own loss
under `loss_parallel`, unchanged.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from tailorfx.runtime import linear_ops
from tailorfx.runtime.linear_ops import lce_chunks, loss_dtype

_GROUPS: dict[str, "dist.ProcessGroup"] = {}


def register_group(group) -> str:
    """The name the ops find `group` under (custom ops take strings, not process groups)."""
    _GROUPS[group.group_name] = group
    return group.group_name


def _run(hidden, weight, labels, vocab_start, group_name, ignore_index, reduction, num_chunks, softcap,
         logit_scale, need_hidden, need_weight, grad_weight_fp32=False):
    """linear_ops' chunked loss over this rank's rows, the row statistics all-reduced over the group."""
    loss, grad_h, grad_w, _ = lce_chunks(hidden, weight, None, labels, ignore_index, reduction, num_chunks, softcap,
                                         logit_scale, need_hidden, need_weight, False, vocab_start=vocab_start,
                                         group=_GROUPS[group_name], grad_weight_fp32=grad_weight_fp32)
    return loss, grad_h, grad_w


@torch.library.custom_op("tailorfx::vocab_parallel_cross_entropy", mutates_args=())
def _loss_only(hidden: Tensor, weight: Tensor, labels: Tensor, vocab_start: int, group_name: str,
               ignore_index: int, reduction: str, num_chunks: int, logit_softcap: Optional[float],
               logit_scale: Optional[float]) -> Tensor:
    """The loss of the vocab-parallel head, no gradients (eval, no_grad)."""
    return _run(hidden, weight, labels, vocab_start, group_name, ignore_index, reduction, num_chunks,
                logit_softcap, logit_scale, False, False)[0]


@_loss_only.register_fake
def _loss_only_fake(hidden, weight, labels, vocab_start, group_name, ignore_index, reduction, num_chunks,
                    logit_softcap, logit_scale):
    return hidden.new_empty((), dtype=loss_dtype(hidden, weight))


@torch.library.custom_op("tailorfx::vocab_parallel_cross_entropy_with_grads", mutates_args=())
def _with_grads(hidden: Tensor, weight: Tensor, labels: Tensor, vocab_start: int, group_name: str,
                ignore_index: int, reduction: str, num_chunks: int, logit_softcap: Optional[float],
                logit_scale: Optional[float], grad_hidden: bool, grad_weight: bool,
                grad_weight_fp32: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, this rank's part of grad_hidden, grad of this rank's weight rows) in one pass;
    `grad_weight_fp32`: a 16-bit weight's gradient summed over the chunks in fp32."""
    return _run(hidden, weight, labels, vocab_start, group_name, ignore_index, reduction, num_chunks,
                logit_softcap, logit_scale, grad_hidden, grad_weight, grad_weight_fp32)


@_with_grads.register_fake
def _with_grads_fake(hidden, weight, labels, vocab_start, group_name, ignore_index, reduction, num_chunks,
                     logit_softcap, logit_scale, grad_hidden, grad_weight, grad_weight_fp32=False):
    return (hidden.new_empty((), dtype=loss_dtype(hidden, weight)),
            torch.empty_like(hidden) if grad_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if grad_weight else weight.new_empty(0))


def _setup(ctx, inputs, output):
    _, grad_h, grad_w = output
    ctx.mark_non_differentiable(grad_h, grad_w)
    # eager autograd would hand the backward zero-filled gradients for those two outputs
    # (hidden- and weight-sized) unless told not to
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(grad_h, grad_w)
    ctx.computed = inputs[10:12]


def _backward(ctx, grad_loss, *_):
    needs = ctx.needs_input_grad[:2]
    if any(need and not done for need, done in zip(needs, ctx.computed)):
        raise RuntimeError(f"vocab-parallel LM head: an input needs a grad that was not computed in the forward "
                           f"(needed {needs}, computed {ctx.computed})")
    grads = [g * grad_loss if need else None for g, need in zip(ctx.saved_tensors, needs)]
    return (*grads, *[None] * 11)


_with_grads.register_autograd(_backward, setup_context=_setup)


def transient_bytes(op_name: str, args: list, as_int) -> int:
    """Bytes the op allocates and frees inside itself: linear_ops' chunked loss on this rank's
    rows (see ops.transient_bytes); the all-reduced row statistics are a few floats a row."""
    if not op_name.startswith("vocab_parallel_cross_entropy"):
        return 0
    hidden, weight, labels, _, _, ignore_index, reduction, num_chunks, softcap, scale = args[:10]
    if op_name.endswith("_with_grads"):
        return linear_ops.transient_bytes("chunked_linear_cross_entropy_with_grads", [
            hidden, weight, None, labels, ignore_index, reduction, num_chunks, softcap, scale, *args[10:12], False,
            *args[12:13]], as_int)
    return linear_ops.transient_bytes("chunked_linear_cross_entropy", [
        hidden, weight, None, labels, ignore_index, reduction, num_chunks, softcap, scale], as_int)


def vocab_parallel_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *, vocab_start: int, group_name: str,
                                 ignore_index: int = -100, reduction: str = "mean", num_chunks: int = 8,
                                 logit_softcap: Optional[float] = None, logit_scale: Optional[float] = None,
                                 grad_weight_fp32: bool = False) -> Tensor:
    """``cross_entropy(softcap(scale * hidden @ W.T), labels)`` where each rank of `group` holds
    rows `vocab_start:vocab_start + len(weight)` of W (the group registered by `register_group`):
    plain (local) tensors in, the loss (the same on every rank) out; `hidden`'s gradient is this
    rank's share, to be summed over the group."""
    needs = (hidden.requires_grad, weight.requires_grad)
    args = (hidden, weight, labels, vocab_start, group_name, ignore_index, reduction, num_chunks,
            logit_softcap, logit_scale)
    if not (torch.is_grad_enabled() and any(needs)):
        return torch.ops.tailorfx.vocab_parallel_cross_entropy(*args)
    return torch.ops.tailorfx.vocab_parallel_cross_entropy_with_grads(*args, *needs, grad_weight_fp32)[0]


class FusedVocabParallelLoss:
    """A Hugging Face `loss_function` for a causal LM whose head is vocab-parallel: the loss from the
    head's input and this rank's rows of its weight (`vocab_parallel_cross_entropy`), with
    ForCausalLMLoss's label shift, `ignore_index` and `num_items_in_batch`. Logits that are not
    the head's last output (through `steps` ops of the soft-cap or scale) go to `original`."""

    def __init__(self, head: nn.Module, original, *, num_chunks: int, logit_softcap: Optional[float] = None,
                 logit_scale: Optional[float] = None, model: Optional[nn.Module] = None,
                 grad_weight_fp32: bool = False):
        from torch.distributed.tensor import DTensor, Shard
        weight = head.weight
        if not isinstance(weight, DTensor) or getattr(head, "bias", None) is not None:
            raise ValueError("FusedVocabParallelLoss: the head must be a bias-free linear with its weight "
                             "split over the vocabulary (a DTensor sharded on dim 0)")
        dim = next(i for i, p in enumerate(weight.placements) if isinstance(p, Shard) and p.dim == 0)
        mesh, ranks, vocab = weight.device_mesh, weight.device_mesh.size(dim), weight.shape[0]
        per = -(-vocab // ranks)      # torch.chunk's split, as DTensor's Shard(0)
        self.vocab_start = min(vocab, per * mesh.get_local_rank(dim))
        self.group_name = register_group(mesh.get_group(dim))
        self.head, self.original, self.num_chunks = head, original, num_chunks
        self.logit_softcap, self.logit_scale = logit_softcap, logit_scale
        self.grad_weight_fp32 = grad_weight_fp32    # TrainingSetup.head_grad_dtype fp32
        self.steps = (3 if logit_softcap is not None else 0) + (1 if logit_scale is not None else 0)
        self.fused = 0          # calls that ran fused (the tests' proof that it fired)
        self.unfused = 0
        self.last_fused = False
        self.skip = self.skipped = False   # this call's head computes no logits / computed none
        self._hidden = self._out_ref = self._out_fn = None
        if model is not None:    # skip_logits: in training with labels the head gets no rows
            model.register_forward_pre_hook(self._decide, with_kwargs=True)
        head.register_forward_pre_hook(self._take)
        head.register_forward_hook(self._remember)

    def _decide(self, model, args, kwargs):
        """Before each call of the model: the logits are skipped in training with labels (as on one
        device, Liger's skip_logits), where this loss, fed by the head's input, replaces them."""
        self.skip = bool(model.training and torch.is_grad_enabled() and kwargs.get("labels") is not None)
        self.skipped = False

    def _take(self, mod, args):
        """The head's input, kept for the loss; where logits are skipped the head is given one
        position of each row (B, 1, H), so no logits shard is built (DTensor's view rules divide by
        a zero-sized dim: one position, not none)."""
        self._hidden = args[0]
        if self.skip and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2:
            self.skipped = True
            return (args[0][..., :1, :], *args[1:])
        return None

    def _remember(self, mod, args, out):
        if self.skipped:   # the stand-in logits carry no gradient: none reaches the head's rows or input
            return out.detach()
        if torch.compiler.is_compiling():       # a trace for the memory model: _from_head reads no more
            return None
        # the output's identity and autograd node, not the output: holding it would keep the head's
        # logits alive through a soft-cap or scale until the loss (one logits shard more at the peak)
        self._out_ref, self._out_fn = weakref.ref(out), out.grad_fn
        return None

    def clear(self) -> None:
        """Drop the references the hook took (called after each forward)."""
        self._hidden = self._out_ref = self._out_fn = None

    def _from_head(self, logits) -> bool:
        if self._hidden is None:
            return False
        # a trace for the memory model (the plan's graph says so), or a call whose head computed only
        # the stand-in: the model's logits can come from nothing else
        if torch.compiler.is_compiling() or self.skipped:
            return True
        if self._out_ref is None:
            return False
        if logits is self._out_ref():
            return True
        fn, want = getattr(logits, "grad_fn", None), self._out_fn
        if fn is None or want is None:
            return False
        for _ in range(self.steps + 2):     # + the dtype casts a precision policy may add
            if fn is want:
                return True
            if not fn.next_functions:
                return False
            fn = fn.next_functions[0][0]
            if fn is None:
                return False
        return fn is want

    def __call__(self, logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                 shift_labels=None, **kwargs):
        from torch.distributed.tensor import DTensor, Partial
        hidden, weight = self._hidden, self.head.weight
        fused = self._from_head(logits) and isinstance(hidden, DTensor) and isinstance(weight, DTensor)
        self.last_fused = fused
        if not fused:
            self.unfused += 1
            return self.original(logits=logits, labels=labels, vocab_size=vocab_size,
                                 num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
                                 shift_labels=shift_labels, **kwargs)
        self.fused += 1
        self.clear()
        if shift_labels is None:
            labels = F.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:]
        # the hidden state's gradient from this rank's rows is partial: DTensor sums it over the ranks
        h = hidden.to_local(grad_placements=[Partial()] * len(hidden.placements))
        loss = vocab_parallel_cross_entropy(
            h.reshape(-1, h.shape[-1]), weight.to_local(), shift_labels.reshape(-1).to(h.device),
            vocab_start=self.vocab_start, group_name=self.group_name, ignore_index=ignore_index,
            reduction="sum" if num_items_in_batch is not None else "mean", num_chunks=self.num_chunks,
            logit_softcap=self.logit_softcap, logit_scale=self.logit_scale, grad_weight_fp32=self.grad_weight_fp32)
        if num_items_in_batch is not None:
            loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch)
                           else num_items_in_batch)
        return loss


def install_fused_loss(model: nn.Module, *, head: str, num_chunks: int, logit_softcap: Optional[float] = None,
                       logit_scale: Optional[float] = None, skip_logits: bool = False,
                       grad_weight_fp32: bool = False) -> Optional[FusedVocabParallelLoss]:
    """Give `model` (a Hugging Face causal LM whose `head` is vocab-parallel) the fused loss; None
    when its loss is not the default causal-LM cross-entropy (then loss_parallel stays).
    `skip_logits`: in training with labels the head computes no logits (the caller returns
    logits=None); `grad_weight_fp32`: its rows' gradient summed over the chunks in fp32."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return None
    if getattr(model, "loss_function", None) is not ForCausalLMLoss:
        return None
    loss = FusedVocabParallelLoss(dict(model.named_modules())[head], model.loss_function, num_chunks=num_chunks,
                                  logit_softcap=logit_softcap, logit_scale=logit_scale,
                                  model=model if skip_logits else None, grad_weight_fp32=grad_weight_fp32)
    model.loss_function = loss
    return loss
