"""TRL's fused LM head, served by tailorfx: what `trl.trainer.utils.add_fused_lm_head` made,
read off its function (`trl_fused_head`), and the step it describes as one module tailorfx
captures (`LogProbStep`): the backbone with the planner's rewrites, then tailorfx's chunked
log-prob head (runtime/log_prob_ops.py), sized by the budget and counted by the memory model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch.nn as nn

from tailorfx.runtime.log_prob_ops import chunked_token_log_probs

# TRL's per-token outputs this head computes (every one TRL 1.16's head offers; a later one is refused)
SUPPORTED_OUTPUTS = frozenset({"log_probs", "entropy", "is_top1", "log_sum_sq_probs", "mean_logits"})


def adapted_model(model: nn.Module) -> nn.Module:
    """The model under an adapter wrapper (peft's PeftModel: `get_base_model()`, the causal LM with
    its adapters injected in place), else `model`: its `base_model` is the backbone, as TRL reads it."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@dataclass(frozen=True)
class TrlHead:
    """What TRL's fused forward computes, read off the function `add_fused_lm_head` made."""
    patched: Callable            # TRL's function, bound to the module it patched
    output_type: type            # trl's FusedCausalLMOutput
    temperature: float
    softcap: Optional[float]
    logit_scale: float
    outputs: tuple
    cast_to_fp32: bool


def trl_fused_head(fn: Any, model: nn.Module) -> Union[TrlHead, str, None]:
    """A TrlHead when `fn` is the forward TRL's `add_fused_lm_head` made; the reason it cannot be
    served (a str) when it is one with options this head lacks; None when it is not TRL's."""
    func = getattr(fn, "__func__", fn)
    code = getattr(func, "__code__", None)
    # TRL wraps it as the model class's forward (functools.wraps): its own code and module tell it
    if code is None or code.co_name != "_fused_forward" or \
            not getattr(func, "__globals__", {}).get("__name__", "").startswith("trl."):
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in func.__closure__ or ())))
    needed = {"temperature", "final_logit_softcapping", "logit_scale", "outputs", "cast_lm_head_to_fp32",
              "backbone_attr", "text_config"}
    output_type = func.__globals__.get("FusedCausalLMOutput")
    if not needed <= cells.keys() or output_type is None:
        return f"TRL's fused forward keeps {sorted(cells)}, not what this TRL release's was read for"
    outputs = tuple(cells["outputs"])
    if not set(outputs) <= SUPPORTED_OUTPUTS:
        return f"TRL asked for {sorted(set(outputs) - SUPPORTED_OUTPUTS)}, which tailorfx's head does not compute"
    if cells["backbone_attr"] != "base_model":
        return f"TRL reads the backbone as {cells['backbone_attr']!r} (a vision-language model)"
    if getattr(cells["text_config"], "output_router_logits", False):
        return "the model returns router logits (MoE auxiliary loss), which tailorfx's head does not add"
    model = adapted_model(model)
    if not (hasattr(model, "base_model") and hasattr(model, "get_output_embeddings")):
        return "the model has no base_model / get_output_embeddings"
    return TrlHead(fn, output_type, float(cells["temperature"]), cells["final_logit_softcapping"],
                   float(cells["logit_scale"]), outputs, bool(cells["cast_lm_head_to_fp32"]))


class LogProbStep(nn.Module):
    """The step TRL's fused forward describes, as one module tailorfx captures: the backbone, then
    per-token log-probs of the next-token labels (and the other outputs TRL asked for). Returns
    (log_probs, entropy, is_top1, log_sum_sq_probs, mean_logits, label_mask), each (B, S - 1) (or
    the shape of `shift_labels`), None where not asked for; the loss is left to the caller, as TRL
    computes it."""

    def __init__(self, model: nn.Module, head: TrlHead):
        super().__init__()
        self.model = model
        self.head = head

    def forward(self, *args, labels=None, shift_labels=None, **kwargs):
        kwargs["use_cache"] = False
        model = adapted_model(self.model)   # a LoRA model's backbone runs its adapters
        hidden = model.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        lm_head = model.get_output_embeddings()
        if self.head.cast_to_fp32:
            hidden = hidden.float()
        h = self.head
        per_token = chunked_token_log_probs(
            hidden.reshape(-1, hidden.shape[-1]), lm_head.weight, lm_head.bias, labels.reshape(-1),
            softcap=h.softcap, logit_scale=h.logit_scale, temperature=h.temperature,
            entropy="entropy" in h.outputs, top1="is_top1" in h.outputs,
            log_sum_sq_probs="log_sum_sq_probs" in h.outputs, mean_logits="mean_logits" in h.outputs)
        mask = labels != -100
        return (*(None if x is None else x.view(mask.shape) for x in per_token), mask)


def trl_output(head: TrlHead, log_probs, entropy, is_top1, log_sum_sq_probs, mean_logits, mask, num_items_in_batch):
    """TRL's FusedCausalLMOutput from LogProbStep's values, its loss as TRL's forward makes it."""
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return head.output_type(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy,
                            log_sum_sq_probs=log_sum_sq_probs, mean_logits=mean_logits, is_top1=is_top1,
                            label_mask=mask, aux_loss=None)
