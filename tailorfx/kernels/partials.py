"""Column sums of per-program fp32 partials, rounded once into the output's dtype: the second pass
of a backward whose programs each reduce some rows (a norm's weight and bias gradients), in one
fixed order, so the result is deterministic (no atomics).

    parts (outputs * n_parts, n_cols) fp32  ->  out[j] = sum_p parts[p, j]   (out2 from the rows below)

Spec: dtype (of the outputs: "fp32" | "fp16" | "bf16"), block (columns per program, a power of
two). Grid (column blocks, outputs): program (c, 1) sums rows [n_parts, 2 n_parts) into out2, so
one launch serves a weight and a bias gradient.
"""
from __future__ import annotations

from string import Template

from tailorfx.kernels import DTYPE_NAMES, POINTER_TYPES, KernelSpec, cached_kernel

_SRC = '''"""tailorfx generated: ${name}"""
import triton
import triton.language as tl

BLOCK = tl.constexpr(${block})
ROWS = tl.constexpr(${rows})


@triton.jit
def partials_sum(part_ptr, out_ptr, out2_ptr, n_parts, n_cols):
    # rows of ROWS partials a step, summed down the rows at the end: one order for every launch
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < n_cols
    second = tl.program_id(1) == 1
    if second:
        part_ptr += n_parts * n_cols
    parts = tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for start in range(0, n_parts, ROWS):
        p = start + parts
        acc += tl.load(part_ptr + p[:, None] * n_cols + cols[None, :], mask=(p < n_parts)[:, None] & cmask[None, :],
                       other=0.0)
    total = tl.sum(acc, axis=0)
    if second:
        tl.store(out2_ptr + cols, total.to(out2_ptr.dtype.element_ty), mask=cmask)
    else:
        tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=cmask)
'''

ROWS = 16   # partial rows added per step
MAX_BLOCK = 128


def render(spec) -> str:
    block = spec["block"]
    if block & (block - 1):
        raise ValueError(f"partials block {block} is not a power of two")
    if spec.get("dtype", "fp32") not in POINTER_TYPES:
        raise ValueError(f"partials dtype {spec.get('dtype')!r}: one of {list(POINTER_TYPES)}")
    return Template(_SRC).substitute(name=spec.name, block=block, rows=ROWS)


def signatures(spec) -> dict[str, dict[str, str]]:
    t = POINTER_TYPES[spec.get("dtype", "fp32")]
    return {"partials_sum": {"part_ptr": "*fp32", "out_ptr": t, "out2_ptr": t, "n_parts": "i32", "n_cols": "i32"}}


def num_warps(spec) -> int:
    return 4


def examples() -> list:
    """A norm's weight gradient in bf16 and fp32 at the widest block, fp16 at a narrow row."""
    return [KernelSpec("partials", dtype="bf16", block=128), KernelSpec("partials", dtype="fp32", block=128),
            KernelSpec("partials", dtype="fp16", block=32)]



def _spec(dtype: str, block: int) -> KernelSpec:
    return KernelSpec("partials", dtype=dtype, block=block)


_kernel = cached_kernel(_spec)


def column_sums(parts, out, out2=None) -> None:
    """out (n_cols,) = the column sums of parts (n_parts, n_cols) fp32; with out2, parts is
    (2 n_parts, n_cols) and out2 gets the lower half's. One launch."""
    n_cols = out.shape[0]
    n_parts = parts.shape[0] // (2 if out2 is not None else 1)
    block = min(MAX_BLOCK, 1 << max(0, n_cols - 1).bit_length())
    k = _kernel(DTYPE_NAMES[out.dtype], block)
    k.fn("partials_sum")[(-(-n_cols // block), 2 if out2 is not None else 1)](
        parts, out, out2 if out2 is not None else out, n_parts, n_cols, num_warps=4)
