"""A model from what a user names (a module, a config, tailorfx's or Hugging Face's, or a
zero-argument factory), built or copied on fake tensors: what the memory model captures to
predict a step, however large the model, without holding its weights."""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn

from tailorfx import compat
from tailorfx.models.llama import LlamaConfig, LlamaLM


def build_model(model_or_config: Any, dtype: Optional[torch.dtype]) -> nn.Module:
    """A model from a config (ours or Hugging Face's) or a zero-argument factory, its floating-point
    tensors made in `dtype` (the default dtype while it is built; a Hugging Face config's own
    `dtype` wins)."""
    old = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        if isinstance(model_or_config, LlamaConfig):
            return LlamaLM(model_or_config)
        if hasattr(model_or_config, "to_dict") and hasattr(model_or_config, "model_type"):
            from transformers import AutoModelForCausalLM
            return AutoModelForCausalLM.from_config(model_or_config)
        if callable(model_or_config):
            return model_or_config()
    finally:
        torch.set_default_dtype(old)
    raise TypeError(f"expected a model, a config or a factory, got {type(model_or_config).__name__}")


@contextlib.contextmanager
def built_on_fake_tensors(model_or_config: Any, dtype: Optional[torch.dtype]) -> Iterator[nn.Module]:
    """build_model() under a FakeTensorMode, which stays entered inside the block: the model and
    everything made there are fake tensors (no memory)."""
    with compat.FakeTensorMode(allow_non_fake_inputs=True):
        yield build_model(model_or_config, dtype)


def fake_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers are fake tensors (no memory), in the fake
    mode of those already fake, else a new one (fake_mode_of). Other tensor attributes are
    copied as they are (small)."""
    mode = fake_mode_of(model) or compat.FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict = {}
    for t in [*model.parameters(), *model.buffers()]:
        if isinstance(t, compat.FakeTensor):
            memo[id(t)] = t
            continue
        f = mode.from_tensor(t)
        memo[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
    return copy.deepcopy(model, memo)


def fake_mode_of(model: nn.Module):
    """The FakeTensorMode of the model's fake parameters and buffers, or None."""
    return compat.detect_fake_mode([*model.parameters(), *model.buffers()])
