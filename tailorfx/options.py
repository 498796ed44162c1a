"""The user's options, checked at the boundary: a bad one is one error naming the parameter, the
value and what is allowed. Shared by `optimize()` and `torch.compile(..., backend="tailorfx",
options={...})`."""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from tailorfx.budget import Budget

RECOMPUTE_POLICIES = (None, "full", "full-except-attention", "selective")
PRECISIONS = (None, "bf16", "fp16", "fp32")
# what torch.compile(..., backend="tailorfx", options=...) accepts: optimize()'s keywords
BACKEND_OPTIONS = ("passes", "budget", "minisequence_chunks", "minisequence", "attention", "precision", "precision_policy",
                   "setup", "recompute", "offload", "keep_logits", "strict", "lowering", "kernels",
                   "attention_kernel")


@dataclass(frozen=True)
class Options:
    passes: Optional[tuple[str, ...]] = None
    pass_options: tuple = ()          # sorted (key, value) pairs, hashable
    lowering: str = "auto"
    predict: bool = True
    verify: bool = True

    def options_dict(self) -> dict:
        return dict(self.pass_options)


def _bad(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not valid: {allowed}")


def check_passes(passes: Any) -> Optional[tuple[str, ...]]:
    """None (the planner chooses) or a tuple of pass names."""
    if passes is None:
        return None
    if isinstance(passes, str):
        raise _bad("passes", passes, f"give a list of pass names, e.g. passes=[{passes!r}]")
    if not isinstance(passes, Sequence) or not all(isinstance(p, str) for p in passes):
        raise _bad("passes", passes, "give a list of pass names (or None to let the planner choose)")
    from tailorfx import passes as registry
    for p in passes:
        if p not in registry.available():
            near = difflib.get_close_matches(p, registry.available(), n=1)
            raise ValueError(f"unknown pass {p!r}; available passes: {sorted(registry.available())}"
                             + (f" (did you mean {near[0]!r}?)" if near else ""))
    return tuple(passes)


def positive_int(name: str, value: Any, allow_none: bool = True) -> Optional[int]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(name, value, "a positive int" + (" or None" if allow_none else ""))
    return value


def check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(name, value, "True or False")
    return value


def pass_options(*, budget=None, minisequence_chunks=None, minisequence=None, attention=None, precision=None,
                 precision_policy=None, setup=None, recompute=None, offload=None, keep_logits=False,
                 strict=False, kernels=None, attention_kernel="auto") -> tuple[Optional[Budget], dict]:
    """The checked options every pass may read (ctx.options), and the parsed budget."""
    if precision not in PRECISIONS:
        raise _bad("precision", precision, "'bf16', 'fp16', 'fp32' or None")
    if recompute not in RECOMPUTE_POLICIES:
        raise _bad("recompute", recompute, "'full', 'full-except-attention', 'selective' or None")
    from tailorfx.passes.recompute import OFFLOADS
    if offload not in OFFLOADS:
        raise _bad("offload", offload, "'checkpoints' (each recomputed block's saved input waits for the backward "
                   "in host memory), 'activations' (every tensor the recomputed blocks save does) or None")
    positive_int("minisequence_chunks", minisequence_chunks)
    if minisequence not in (None, "mlp", "segments"):
        raise _bad("minisequence", minisequence, "'mlp' (MLPs and the LM head), 'segments' (each block's whole "
                   "token-wise segments around attention, and the LM head) or None (the planner's choice, else 'mlp')")
    check_flag("keep_logits", keep_logits)
    if kernels not in (None, "triton"):
        raise _bad("kernels", kernels, "'triton' (the runtime's Triton kernels) or None (torch's own ops)")
    from tailorfx.passes.attention.rewrite import KERNELS as ATTENTION_KERNELS
    if attention_kernel not in ATTENTION_KERNELS:
        raise _bad("attention_kernel", attention_kernel, "'auto' (on a GPU, the faster of the Triton flash kernel "
                   "and FlexAttention for each masked form, timed once), 'flex' or 'triton'")
    check_flag("strict", strict)
    b = Budget.parse(budget) if budget is not None else None
    return b, {"minisequence_chunks": minisequence_chunks, "minisequence_segments": minisequence == "segments",
               "budget_bytes": b.bytes if b else None,
               "budget_label": str(b) if b else None, "attention": attention, "precision": precision,
               "precision_policy": policy_items(precision, precision_policy),
               "setup": setup, "recompute_policy": recompute, "offload": offload, "keep_logits": keep_logits,
               "strict": strict, "kernels": kernels, "attention_kernel": attention_kernel}


def policy_items(precision: Optional[str], policy: Optional[dict]) -> Optional[tuple]:
    """The user's precision-policy overrides, checked now and kept hashable for the compile cache."""
    if policy is None:
        return None
    if precision is None:
        raise ValueError("precision_policy= overrides the policy of precision='bf16'|'fp16'; pass precision too")
    from tailorfx.passes.precision.policy import resolve_policy
    resolve_policy(precision, policy)   # fails now, naming the bad entry
    return tuple(sorted(dict(policy).items()))


def backend_options(options: Optional[dict]) -> tuple[Options, Optional[Budget]]:
    """`torch.compile(model, backend="tailorfx", options={...})`: optimize()'s keywords."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(BACKEND_OPTIONS))
    if unknown:
        raise ValueError(f"unknown tailorfx backend option(s) {unknown}; allowed: {list(BACKEND_OPTIONS)}")
    passes = check_passes(options.pop("passes", None))
    lowering = options.pop("lowering", "auto")
    setup = options.pop("setup", None)
    if setup is not None:
        from tailorfx.setup import resolve
        setup = resolve(setup)
    b, opts = pass_options(setup=setup, **options)
    return Options(passes=passes, pass_options=tuple(sorted(opts.items())), lowering=lowering), b


def split_examples(example_inputs: Any, example_kwargs: Optional[dict]) -> tuple[tuple, dict]:
    """optimize()'s example inputs as (args, kwargs): a dict (or a BatchEncoding) is keyword
    arguments, a tensor one positional argument, a sequence positional arguments."""
    kwargs = dict(example_kwargs or {})
    if example_inputs is None:
        return (), kwargs
    if isinstance(example_inputs, dict) or hasattr(example_inputs, "keys"):
        kwargs.update(dict(example_inputs))
        return (), kwargs
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), kwargs
    return tuple(example_inputs), kwargs


def batch_of(args: tuple, kwargs: dict) -> int:
    """The batch size of the example inputs (the first tensor's first dim), 1 without them."""
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() >= 2]
    return tensors[0].shape[0] if tensors else 1
