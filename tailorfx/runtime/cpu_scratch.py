"""What oneDNN allocates through torch's CPU allocator inside a 16-bit kernel (a matmul's
scratchpad), measured once per shape on this CPU rather than modelled: its size follows the ISA
oneDNN picks (AVX-512 bf16, AVX512-FP16, AMX; none on an AVX2 CPU), the intra-op threads and the
operands' shapes and layouts. On a Xeon with AMX and AVX512-FP16 an fp16 (512 x 64) @ (64 x 172)
held 148,608 bytes beyond its output, a bf16 (8192 x 4096) @ (4096 x 4096) 24 MB (linear in the
rows from 512 up). The profiler sees the calling thread's scratchpads only (each sized for every
thread), and so do these figures."""
from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
from torch import Tensor

from tailorfx import compat
from tailorfx.runtime.measure import peak_and_net

__all__ = ["SIXTEEN_BIT", "measured_once", "matmul_scratch_bytes"]

SIXTEEN_BIT = (torch.float16, torch.bfloat16)
aten = torch.ops.aten
# (op, index of its first matmul operand): the rows a probe may cut are that operand's dim -2
MATMULS = {aten.mm.default: 0, aten.addmm.default: 1, aten.bmm.default: 0, aten.baddbmm.default: 1,
           aten.addmm_.default: 1, aten.baddbmm_.default: 1}
EXACT_ROWS = 4096            # matmuls with more rows are probed at 2048 and 4096 and extended linearly
MAX_PROBE_MACS = 1 << 35     # a probe's multiply-adds at most (a few tenths of a second); larger ones are left out
_MEASURED: dict[tuple, int] = {}


def measured_once(key: tuple, measure: Callable[[], int]) -> Optional[int]:
    """`measure()` (bytes a probe held), run once per process per `key`; None while torch.profiler
    records (a probe's own profile would end the user's session) and `key` is not measured yet."""
    if key not in _MEASURED:
        if compat.profiler_running():
            warnings.warn("tailorfx: a prediction made while torch.profiler runs leaves out the scratch oneDNN's "
                          "16-bit CPU kernels allocate (measuring it would end the profiler's session); predict "
                          "outside it", stacklevel=3)
            return None
        with compat.untraced_real_tensors(), torch.no_grad():
            _MEASURED[key] = max(0, int(measure()))
    return _MEASURED[key]


def matmul_scratch_bytes(func, args) -> int:
    """Bytes a CPU mm, addmm, bmm or baddbmm (or one in place) of 16-bit operands holds beyond its
    output, from a run of the same op on real zeros of the same shapes and layouts (0 for other
    ops, dtypes and devices). Above EXACT_ROWS rows, probed at 2048 and 4096 rows and extended
    linearly in the rows: measured, the scratch is constant or linear in the rows once every
    intra-op thread has a block of them (on two threads bf16's doubled from 1024 to 2048 rows, so a
    line through fewer rows ran 2x over). Probes of more than MAX_PROBE_MACS multiply-adds are not
    run: 0 (at 4096 rows, matmuls of K x N above 8M, such as a 4096-wide model's MLP; not measured
    against a step)."""
    first = MATMULS.get(func)
    if first is None or len(args) < first + 2:
        return 0
    a, b = args[first], args[first + 1]
    if not isinstance(a, Tensor) or not isinstance(b, Tensor) or a.device.type != "cpu" or a.dtype not in SIXTEEN_BIT:
        return 0
    if not _any_scratch(a.dtype):
        return 0
    rows = compat.size_hint(a.shape[-2])
    if rows <= EXACT_ROWS:
        return _probe(func, args, rows, rows) or 0
    low, high = (_probe(func, args, rows, r) for r in (EXACT_ROWS // 2, EXACT_ROWS))
    if low is None or high is None:
        return 0
    return max(high, high + (high - low) * (rows - EXACT_ROWS) // (EXACT_ROWS // 2))


def _any_scratch(dtype: torch.dtype) -> bool:
    """Whether this CPU's 16-bit matmuls allocate scratch through torch at all (a 64-cube mm
    does on AVX-512; nothing does on AVX2), so that no larger probe runs where all are 0."""
    cube = torch.empty(64, 64, dtype=dtype, device="meta")   # its layout only: the probe runs on zeros
    return _probe(aten.mm.default, (cube, cube), 64, 64) != 0


def _probe(func, args, rows: int, probe_rows: int) -> Optional[int]:
    first = MATMULS[func]
    tensors = [a for a in args if isinstance(a, Tensor)]
    # the first operand's rows are cut, and an addmm's bias's where it has them
    layouts = tuple(_layout(t, rows, probe_rows, i in (first, 0)) for i, t in enumerate(tensors))
    (shape_a, _, _, _), (shape_b, _, _, _) = layouts[first], layouts[first + 1]
    macs = shape_a[-1]
    for d in (*shape_a[:-1], shape_b[-1]):
        macs *= d
    if macs > MAX_PROBE_MACS:
        return None

    def measure() -> int:
        real = iter([_zeros(*layout) for layout in layouts])
        probe_args = [next(real) if isinstance(x, Tensor) else x for x in args]
        out = func(*probe_args)
        new = 0 if out is probe_args[0] else out.numel() * out.element_size()   # in place: no new output
        return peak_and_net(lambda: func(*probe_args), collect=False)[0] - new
    return measured_once(("matmul", func, layouts, _scalars(args), torch.get_num_threads()), measure)


def _scalars(args) -> tuple:
    return tuple(a for a in args if not isinstance(a, Tensor))


def _layout(t: Tensor, rows: int, probe_rows: int, cut: bool) -> tuple:
    """(shape, dimension order by stride, broadcast dims, dtype) of `t`, dim -2 cut from `rows`
    to `probe_rows` where `cut` and it has that many."""
    shape, stride = [compat.size_hint(s) for s in t.shape], [compat.size_hint(s) for s in t.stride()]
    if cut and len(shape) >= 2 and shape[-2] == rows:
        shape[-2] = probe_rows
    order = tuple(sorted(range(len(shape)), key=lambda d: -stride[d]))
    return tuple(shape), order, tuple(d for d in range(len(shape)) if stride[d] == 0 and shape[d] > 1), t.dtype


def _zeros(shape: tuple, order: tuple, broadcast: tuple, dtype: torch.dtype) -> Tensor:
    """Zeros of `shape` whose dims lie in memory in `order` (outermost first), `broadcast` dims expanded."""
    dense = [1 if d in broadcast else shape[d] for d in order]
    return torch.zeros(dense, dtype=dtype).permute([order.index(d) for d in range(len(shape))]).expand(shape)
