"""The host path of the Triton runtime ops: per eager call, forward and backward apart, the ATen
ops dispatched and the Triton kernels launched, under Triton's CPU interpreter, against ceilings
derived from what each op's math needs; and a warm call loads no kernel (the KernelSpec and its
kernel are cached per static arguments).

Measurement: a TorchDispatchMode counts every ATen op dispatched while a call runs, the ops inside
tailorfx's own ops included (they run below the Python key with the mode re-entered) and the ops
themselves not; Triton's launcher is wrapped to count launches, and what the interpreter dispatches
to run a kernel (copying its arguments) is not counted. Inside an op the dispatcher runs below
autograd, so no-op views and casts (`reshape`, `.to` of the same dtype) count as the dispatcher
calls they are. Backward is `torch.autograd.grad` with explicit output grads (no AccumulateGrad).
"""
import os

os.environ["TRITON_INTERPRET"] = "1"   # before triton or the kernel modules are imported

import collections  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from tailorfx import kernels as tt  # noqa: E402
from tailorfx.runtime import triton_ops as ops  # noqa: E402

_BELOW_PYTHON = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)


class HostCounts(TorchDispatchMode):
    """ATen ops dispatched (by name) and Triton kernels launched (by name) while active."""

    def __init__(self):
        super().__init__()
        self.aten, self.launches = collections.Counter(), collections.Counter()
        self.in_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "tailorfx":   # run its implementation with this mode active again
            tensor = next(a for a in args if isinstance(a, torch.Tensor))
            with self:
                return func.redispatch(torch._C._dispatch_keys(tensor) & _BELOW_PYTHON, *args, **kwargs)
        if not self.in_kernel:
            self.aten[str(func)] += 1
        return func(*args, **kwargs)

    @property
    def num_launches(self) -> int:
        return sum(self.launches.values())

    @property
    def num_aten_ops(self) -> int:
        return sum(self.aten.values())


@pytest.fixture
def measure(monkeypatch):
    """`measure(fn) -> HostCounts` of one call of fn. The interpreter calls no launch hook
    (triton.knobs.runtime.launch_enter_hook is the compiled launcher's): every launch passes
    through InterpretedFunction.run, wrapped here for the test."""
    active = []
    run = InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        if not active:
            return run(self, *args, **kwargs)
        counts = active[-1]
        counts.launches[self.fn.__name__] += 1
        counts.in_kernel += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            counts.in_kernel -= 1
    monkeypatch.setattr(InterpretedFunction, "run", counted_run)

    def measure_one(fn) -> HostCounts:
        counts = HostCounts()
        active.append(counts)
        try:
            with counts:
                fn()
        finally:
            active.pop()
        return counts
    return measure_one


# ---- the calls: (call() -> outputs, the inputs taking a gradient) ---------------------------

def _norm(kind):
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(64, dtype=torch.bfloat16, requires_grad=True) if kind == "layer" else None
    return (lambda: (ops.triton_norm(x, w, b, eps=1e-6, kind=kind),)), [t for t in (x, w, b) if t is not None]


def _glu():
    gate, up = (torch.randn(2, 8, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    return (lambda: (ops.triton_glu(gate, up, act="silu"),)), [gate, up]


def _rope_inputs():
    """HF's q and k: (B, S, H, D) projections seen as (B, H, S, D); cos/sin (B, 1, S, D)."""
    q = torch.randn(1, 8, 4, 16, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    angle = torch.rand(1, 1, 8, 8)
    cos, sin = (torch.cat([f(angle)] * 2, -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    return q, k, cos, sin


def _rope():
    q, _, cos, sin = _rope_inputs()
    return (lambda: (ops.triton_rope(q, cos, sin),)), [q]


def _rope_qk():
    q, k, cos, sin = _rope_inputs()
    return (lambda: ops.triton_rope_qk(q, k, cos, sin)), [q, k]


def _attention():
    q = torch.randn(1, 4, 32, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 32, 16, requires_grad=True) for _ in range(2))
    return (lambda: (ops.triton_attention(q, k, v, kind="Exact", params=(), causal=True, scale=0.25),)), [q, k, v]


NUM_CHUNKS = 8


def _linear_cross_entropy():
    hidden, weight = torch.randn(16, 64, requires_grad=True), torch.randn(100, 64, requires_grad=True)
    labels = torch.randint(0, 100, (16,))
    labels[::5] = -100
    return (lambda: (ops.triton_linear_cross_entropy(hidden, weight, None, labels, num_chunks=NUM_CHUNKS),)), \
        [hidden, weight]


CALLS = {"rms_norm": lambda: _norm("rms"), "layer_norm": lambda: _norm("layer"), "glu": _glu, "rope": _rope,
         "rope_qk": _rope_qk, "attention": _attention, "linear_cross_entropy": _linear_cross_entropy}

C = NUM_CHUNKS
# name: ((forward launches, ATen ops), (backward launches, ATen ops)); an allocation is an ATen op
CEILINGS = {
    "rms_norm": (
        (1, 2),   # one row kernel; allocates y and the fp32 rstd the backward reads, nothing else
        (2, 3)),  # rows (dx, per-program fp32 dw partials), then the partials' fixed-order column sums (no atomics) into dw in w's dtype; allocates dx, partials, dw; no zeros for rstd's grad
    "layer_norm": (
        (1, 2),   # as RMSNorm, the mean stored beside rstd in one (2, rows) statistics buffer
        (2, 4)),  # as RMSNorm, db's partials below dw's and summed in the same launch: one more allocation, db
    "glu": (
        (1, 1),   # one elementwise kernel; allocates the output
        (1, 2)),  # one elementwise kernel recomputing act(gate); allocates dgate and dup
    "rope": (
        (1, 1),   # one kernel reading cos/sin where they lie (no view, no same-dtype cast); allocates the output
        (1, 1)),  # the transposed rotation, likewise
    "rope_qk": (
        (1, 2),   # q's and k's head blocks in one launch; allocates the two outputs
        (1, 2)),  # the transposed rotation of both, likewise
    "attention": (
        (1, 3),   # one kernel; allocates out and lse; autograd detaches the saved output out (lse: non-differentiable)
        (3, 5)),  # delta = rowsum(dout * out), then dq, then dk/dv (FA2's passes, no atomics); allocates delta, dq, dk, dv; detaches out; no zeros for lse's grad
    "linear_cross_entropy": (
        (C, 4 * C + 5 + 3 + 1 + 4 + 2 + 1),  # a launch a chunk; a chunk: logits GEMM, grad_h GEMM, grad_W's transposed view and GEMM; once: valid count and 1/count (ne, sum, to, clamp, reciprocal), loss rows, grad_h, grad_W, W's transpose, 4 chunk splits, loss sum and mean, the schema's empty grad_b
        (0, 2)),  # no launch: the incoming grad scales grad_h and grad_W
}


@pytest.mark.parametrize("name", list(CALLS))
def test_host_path_per_call(name, measure):
    call, inputs = CALLS[name]()
    grads = [torch.randn_like(o) for o in call()]
    torch.autograd.grad(call(), inputs, grads)   # warm: kernels rendered and loaded
    loads = tt._load.cache_info()

    fwd = measure(call)
    outputs = call()
    bwd = measure(lambda: torch.autograd.grad(outputs, inputs, grads))
    for direction, counts, ceiling in (("forward", fwd, CEILINGS[name][0]), ("backward", bwd, CEILINGS[name][1])):
        assert counts.num_launches <= ceiling[0] and counts.num_aten_ops <= ceiling[1], \
            f"{name} {direction}: {counts.num_launches} launches {dict(counts.launches)}, {counts.num_aten_ops} " \
            f"ATen ops {dict(counts.aten)}; ceilings {ceiling}"
    assert tt._load.cache_info() == loads, f"{name}: a warm call looked a KernelSpec up ({loads} before)"


def test_rope_qk_is_two_ropes():
    """triton_rope_qk's outputs and gradients equal triton_rope's of q and of k, bit for bit (the
    same arithmetic per element), also when only one output is differentiated (its grad for the
    other is not materialized)."""
    q, k, cos, sin = _rope_inputs()
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    oq, ok = ops.triton_rope_qk(q, k, cos, sin)
    rq, rk = ops.triton_rope(q, cos, sin), ops.triton_rope(k, cos, sin)
    assert torch.equal(oq, rq) and torch.equal(ok, rk)
    got = torch.autograd.grad((oq, ok), (q, k), (gq, gk))
    want = torch.autograd.grad((rq, rk), (q, k), (gq, gk))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    only_k = torch.autograd.grad(ops.triton_rope_qk(q, k, cos, sin)[1], (q, k), gk, allow_unused=True)
    assert only_k[0] is None and torch.equal(only_k[1], want[1])
