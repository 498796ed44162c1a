"""Numerics harness: run a model eagerly and through tailorfx with the same weights and inputs."""
from __future__ import annotations

import copy
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

U = 2.0 ** -24     # float32 unit roundoff
C = 8              # see check_exact: equally rounded orders of summation differ by a small factor

# one entry per exact comparison of the session: conftest writes them to $TAILORFX_RATIO_LOG
RATIO_LOG: list[dict] = []


def loss_of(model: nn.Module, inputs: dict) -> torch.Tensor:
    """The step's loss of an HF-style model: `model(**inputs).loss`."""
    return model(**inputs).loss


class _Float64(TorchFunctionMode):
    """Float32 asked for inside a model (HF norms, softmax and rotary embeddings upcast with
    `.float()` or `dtype=torch.float32`) or made by default (a Python float times an integer
    tensor) is float64; counts the ops that still return float32, so a reference that is not all
    float64 says so. A half-precision step a model takes on purpose (Falcon's bfloat16 ALiBi
    slopes) is part of its definition, the same in its float32 run, and is kept."""

    def __init__(self):
        super().__init__()
        self.num_float32_ops = 0

    def __enter__(self):
        self._default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_default_dtype(self._default_dtype)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        wide = lambda a: torch.float64 if a is torch.float32 else a   # noqa: E731
        out = func(*map(wide, args), **{k: wide(v) for k, v in (kwargs or {}).items()})
        self.num_float32_ops += any(isinstance(t, torch.Tensor) and t.dtype == torch.float32
                                    for t in tree_flatten(out)[0])
        return out


def reduction_length(model: nn.Module, inputs: dict) -> int:
    """K, the longest reduction of a step that check_exact's floor assumes: the number of tokens
    (the largest integer input's size, or a float input's size over its last dim: a weight
    gradient sums one term per token) or the largest dim of a weight matrix (a hidden,
    intermediate or vocabulary dot product), whichever is larger. An embedding table's rows (a
    lookup, a gradient scattered per token) count only where the table is also a linear layer's
    weight (a tied LM head reduces over the vocabulary)."""
    leaves = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
    tokens = [t.numel() if not t.is_floating_point() else t.numel() // max(t.shape[-1], 1)
              for t in leaves if t.dim()]
    lookup = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    dims = [max(p.shape) for p in model.parameters() if p.dim() >= 2 and (id(p) not in lookup or id(p) in linear)]
    return max(tokens + dims + [1])


@dataclass(frozen=True)
class Reference:
    """The float64 truth of one step (`values`: "loss" and each parameter's gradient by name; None
    when the model does not run in float64) and K (reduction_length)."""
    values: dict | None
    reduction: int
    kind: str          # "float64", or "analytic (<why float64 did not run>)"


def float64_reference(model: nn.Module, inputs: dict, loss_fn: Callable = loss_of) -> Reference:
    """`loss_fn(copy, inputs).backward()` on a float64 copy of `model`, float inputs cast to
    float64, under _Float64 (the model's own float32 upcasts widened too); the RNG is left as it was."""
    k = reduction_length(model, inputs)
    m = copy.deepcopy(model).double()
    m.zero_grad(set_to_none=True)
    if getattr(m, "_can_set_experts_implementation", lambda: False)():
        m.set_experts_implementation("eager")   # MoE: grouped_mm has no float64 kernel; the same sums
    x = tree_map(lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, inputs)
    mode = _Float64()
    try:
        with torch.random.fork_rng(devices=[]), mode:
            loss = loss_fn(m, x)
            loss.backward()
    except Exception as e:   # an op without a float64 kernel: check_exact falls back to its bound
        return Reference(None, k, f"analytic ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
    if mode.num_float32_ops:
        return Reference(None, k, f"analytic ({mode.num_float32_ops} ops of the float64 run returned float32)")
    values = {"loss": loss.detach()}
    values.update((name, p.grad) for name, p in m.named_parameters() if p.grad is not None)
    return Reference(values, k, "float64")


def step_values(model: nn.Module, loss: torch.Tensor) -> dict:
    """What check_exact compares of a step: its loss and every parameter's gradient (None: none)."""
    return {"loss": loss.detach(), **{name: p.grad for name, p in model.named_parameters()}}


@dataclass(frozen=True)
class TensorCheck:
    name: str
    err: float        # ||got - truth||_inf
    err_eager: float  # ||eager - truth||_inf
    floor: float      # U * sqrt(K) * ||truth||_inf
    tol: float        # C * max(err_eager, floor)

    @property
    def ratio(self) -> float:
        return self.err / self.tol if self.tol else (0.0 if self.err == 0 else math.inf)


@dataclass
class Comparison:
    loss_ref: float
    loss_opt: float
    max_grad_rel_err: float      # max over parameters of ||g - g_ref||_inf / ||g_ref||_inf (fp32 eager)
    worst_param: str
    worst_ratio: float = 0.0     # max over loss and gradients of error / derived tolerance
    worst_tensor: str = ""
    reference: str = "float64"
    checks: list = field(default_factory=list)


def _current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]


def check_exact(got: dict, eager: dict, ref: Reference) -> Comparison:
    """Asserts that a rewrite that is exact in real arithmetic computed `got` (name -> tensor: the
    loss, gradients, outputs) as closely as eager fp32 computed `eager`, both measured against the
    float64 truth `ref`. Records the worst ratio error / tolerance in RATIO_LOG.

    Derivation. An exact rewrite changes only the order and grouping of float32 roundings, so its
    distance from the true result is of the order of eager's own. Per tensor, in the max norm:
      truth  t = the float64 run (float64_reference: the model's float32 upcasts widened too);
      e_eager = ||eager - t||,  e_opt = ||got - t||: each run's rounding noise at this shape, order,
                thread count and ISA, cancellation and conditioning included (a tied embedding's
                gradient that sums two paths is as noisy in eager as in the rewrite);
      floor  = U * sqrt(K) * ||t||, U = 2**-24: the probabilistic rounding error of a sum of K
                terms (Higham & Mary 2019), so that a tensor eager happens to get (nearly) exact
                does not make the tolerance zero; K = reduction_length (tokens, or the largest
                hidden / intermediate / vocabulary dimension). Measured on the tiny HF families,
                e_eager / floor is 0.01-1.04 per tensor (median 0.3-0.6): the floor is the
                order of eager's error, and binds for most tensors;
      tol    = C * max(e_eager, floor), C = 8: a reordering as well rounded as eager's has
                e_opt ~ max(e_eager, floor), a ratio near 1/C (the suite's exact rewrites: at most
                0.15 across thread counts, ISAs and test orders); the factor C covers the constant
                of blocked, tiled or online-softmax orders (Triton kernels, chunked heads, flash
                attention) and a small tensor's (a scalar loss's) luck, and tol stays ~1e-5 of
                ||t|| at K ~ 500, so a wrong mask, scale or dropped term (O(||t||)) fails by 1e4x.
                A kernel whose elementary functions are less accurate than torch's shows as a
                ratio well above 1/C.
    The comparison is normwise: an element that is a small difference of large terms has a large
    relative error in every order, and is judged against its tensor's scale, as its error is.
    Where the model does not run in float64 (ref.values is None), the truth is eager itself and
    tol = C * 2 * floor (each run within floor of the truth): an analytic bound that ignores
    cancellation, named in the record."""
    checks = []
    for name, e in eager.items():
        g = got.get(name)
        assert (g is None) == (e is None), f"gradient presence differs for {name}"
        if e is None:
            continue
        assert g.shape == e.shape, f"{name}: shape {tuple(g.shape)} != {tuple(e.shape)}"
        t = ref.values.get(name) if ref.values is not None else e.detach().double()
        assert t is not None, f"{name}: no gradient in the float64 run"
        t = t.to(torch.float64)
        err = (g.detach().double() - t).abs().max().item() if t.numel() else 0.0
        err_eager = (e.detach().double() - t).abs().max().item() if t.numel() else 0.0
        floor = U * math.sqrt(ref.reduction) * (t.abs().max().item() if t.numel() else 0.0)
        tol = C * (max(err_eager, floor) if ref.values is not None else 2 * floor)
        checks.append(TensorCheck(name, err, err_eager, floor, tol))
    worst = max(checks, key=lambda c: c.ratio)
    RATIO_LOG.append({"test": _current_test(), "tensor": worst.name, "ratio": worst.ratio,
                      "err": worst.err, "tol": worst.tol, "reference": ref.kind, "num_tensors": len(checks)})
    top = sorted(checks, key=lambda c: -c.ratio)[:5]
    assert worst.ratio <= 1, (f"{worst.name}: error {worst.err:.3g} > tolerance {worst.tol:.3g} "
                              f"(reference {ref.kind}, K={ref.reduction}); worst tensors:\n" +
                              "\n".join(f"  {c.name}: err {c.err:.3g}, eager err {c.err_eager:.3g}, "
                                        f"floor {c.floor:.3g}, ratio {c.ratio:.3g}" for c in top))
    grads = [c for c in checks if c.name != "loss"]
    rel = [((got[c.name] - eager[c.name]).abs().max() / eager[c.name].abs().max().clamp_min(1e-30)).item()
           for c in grads]
    i = max(range(len(rel)), key=rel.__getitem__) if rel else None
    return Comparison(float(eager["loss"]) if "loss" in eager else math.nan,
                      float(got["loss"]) if "loss" in got else math.nan,
                      rel[i] if rel else 0.0, grads[i].name if rel else "",
                      worst.ratio, worst.name, ref.kind, checks)


def compare_with_eager(model: nn.Module, inputs: dict, wrap: Callable[[nn.Module], nn.Module],
                       rtol: float | None = None, atol: float | None = None, steps: int = 1) -> Comparison:
    """Loss and every parameter gradient of `wrap(copy)` vs eager `model`, judged by check_exact
    against a float64 run of the model (`rtol`, `atol`: accepted for old callers, unused: the
    tolerance is derived, see check_exact)."""
    ref64 = float64_reference(model, inputs)
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
    return check_exact(step_values(test, loss), step_values(ref, loss_ref), ref64)


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


def flops_run(module: nn.Module, inputs: dict, attention: bool = False) -> int:
    """FLOPs of the matmuls one training step of `module` runs after a first one (the profiler's ATen
    calls and their shapes, inside tailorfx's ops too: the in-place weight-gradient GEMMs, addmm_,
    are ones torch's FLOP counter leaves out). `attention`: SDPA's CPU flash forwards too, 4 FLOPs per
    pair and head dim: every pair where a mask tensor is passed (as transformers does under torch
    2.11), half of them where the call is causal."""
    from torch.profiler import ProfilerActivity, profile
    module(**inputs).loss.backward()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        module(**inputs).loss.backward()
    total = 0
    for e in prof.events():
        if e.name in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm"):
            a, b = e.input_shapes[0:2] if e.name in ("aten::mm", "aten::bmm") else e.input_shapes[1:3]
            total += 2 * math.prod(a) * b[-1]
        elif attention and e.name == "aten::_scaled_dot_product_flash_attention_for_cpu":
            q, k = e.input_shapes[0:2]
            masked = len(e.input_shapes) > 5 and bool(e.input_shapes[5])   # attn_mask; else HF's call is causal
            total += 4 * math.prod(q[:3]) * k[2] // (1 if masked else 2) * q[3]
    return total


def sweep_dynamo_limits():
    """Dynamo's limits as a process that has compiled many models sets them. transformers' models
    share one forward code object, and Dynamo counts every model compiled on it in the process
    against recompile_limit (8) and accumulated_recompile_limit (256): past them it runs the model
    eagerly (and logs why). A test worker has compiled hundreds, as a long sweep has; such a user
    raises both, as PyTorch's docs advise (optimize() does so inside its own calls), for a plain
    torch.compile(..., backend="tailorfx")."""
    import torch
    return torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=4096)


def round_bf16_to_nearest_even(monkeypatch) -> None:
    """Triton's interpreter rounding fp32 to bf16 to nearest even, as a GPU does: it truncates
    (`InterpreterBuilder.cast_impl` passes no rounding mode; `fp_downcast_rounding` is not
    reached), a bias toward zero that a sum over tokens (a bias's gradient) accumulates. For
    numerics checks that claim a GPU's rounding; pytest's monkeypatch restores it after the test."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    truncating = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            wide = torch.from_numpy(np.ascontiguousarray(src.data))
            return interpreter.TensorHandle(wide.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
                                            dst_type.scalar)
        return truncating(self, src, dst_type)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)
