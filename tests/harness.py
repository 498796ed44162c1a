"""Numerics harness: run a model eagerly and through tailorfx with the same weights and inputs."""
from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn


@dataclass
class Comparison:
    loss_ref: float
    loss_opt: float
    max_grad_rel_err: float      # max over parameters of |g - g_ref| / max(|g_ref|, tiny)
    worst_param: str


def compare_with_eager(model: nn.Module, inputs: dict, wrap: Callable[[nn.Module], nn.Module],
                       rtol: float = 1e-5, atol: float = 1e-6, steps: int = 1) -> Comparison:
    """Loss and every parameter gradient of `wrap(copy)` vs eager `model`; asserts closeness."""
    ref = model
    test = copy.deepcopy(model)
    opt = wrap(test)
    for _ in range(steps):
        ref.zero_grad(set_to_none=True)
        test.zero_grad(set_to_none=True)
        loss_ref = ref(**inputs).loss
        loss_ref.backward()
        loss = opt(**inputs).loss
        loss.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=rtol, atol=atol)
    worst, worst_name = 0.0, ""
    ref_params = dict(ref.named_parameters())
    for name, p in test.named_parameters():
        g_ref = ref_params[name].grad
        assert (p.grad is None) == (g_ref is None), f"gradient presence differs for {name}"
        if g_ref is None:
            continue
        torch.testing.assert_close(p.grad, g_ref, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
        err = ((p.grad - g_ref).abs().max() / g_ref.abs().max().clamp_min(1e-30)).item()
        if err >= worst:
            worst, worst_name = err, name
    return Comparison(loss_ref.item(), loss.item(), worst, worst_name)


def peak_of_step(module: nn.Module, model: nn.Module, inputs: dict) -> int:
    """The measured peak of forward + backward through `module`, the output held through backward
    as a training loop holds it; a first step runs unmeasured (compiles), gradients dropped before each."""
    import tailorfx

    def step():
        out = module(**inputs)
        out.loss.backward()
        return out
    model.zero_grad(set_to_none=True)
    step()
    model.zero_grad(set_to_none=True)
    return tailorfx.measure_peak(step)


def step_total(module: nn.Module, model: nn.Module, inputs: dict, optimizer) -> int:
    """Weights + the optimizer state that exists + the measured peak of a later training step
    (forward, backward, update): what a budget covers. `optimizer`: a torch.optim optimizer or a
    tailorfx.SetupOptimizer (its state_bytes(), master weights included)."""
    import tailorfx

    def step():
        out = module(**inputs)
        out.loss.backward()
        optimizer.step()
    step()   # the optimizer state is allocated here
    for p in model.parameters():
        p.grad = None
    peak = tailorfx.measure_peak(step)
    state = (optimizer.state_bytes() if hasattr(optimizer, "state_bytes") else
             sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                 if torch.is_tensor(t) and t.dim() > 0))
    return sum(p.numel() * p.element_size() for p in model.parameters()) + state + peak


def tailorfx_ops(fn: Callable[[], object]) -> Counter:
    """The tailorfx custom ops one call of fn runs (profiler events by name): what was rewritten."""
    from torch.profiler import ProfilerActivity, profile

    from tailorfx.runtime.measure import quiet_profiler
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return Counter(e.name for e in prof.events() if e.name.startswith("tailorfx::"))
