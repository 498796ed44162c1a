"""Budget: how much memory one training step may hold, parsed from "24GB", "512MiB" or a preset.

A preset names a CUDA device; a plan for it is modelled for CUDA (CudaCosts): the memory model
traces torch-level tensors, and a CUDA step also holds cuBLAS workspaces, flash attention's
backward scratch and the caching allocator's slack, which no graph shows.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional, Union

from tailorfx.progress import progress

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

# Usable memory of common devices: the marketed size in GiB minus the CUDA context (driver,
# kernels' modules, NCCL's and cuDNN's handles; outside torch's allocator, about 1.5 GiB on
# 80 GB parts), so a plan that fits here fits the device.
PRESETS = {
    "A100-80GB": 80 * 2**30 - 3 * 2**29,
    "A100-40GB": 40 * 2**30 - 3 * 2**29,
    "H100-80GB": 80 * 2**30 - 3 * 2**29,
    "H200-141GB": 141 * 2**30 - 3 * 2**29,
    "RTX4090-24GB": 24 * 2**30 - 2**30,
    "L4-24GB": 24 * 2**30 - 2**30,
}
ARCH = {"A100-80GB": "sm80", "A100-40GB": "sm80", "H100-80GB": "sm90", "H200-141GB": "sm90",
        "RTX4090-24GB": "sm89", "L4-24GB": "sm89"}


def cublas_workspace_bytes(arch: str, handles: int = 2) -> int:
    """cublas_workspace: torch gives each (cuBLAS handle, stream) a workspace from the caching
    allocator, CUBLAS_WORKSPACE_CONFIG's default ':4096:8' (32 MiB) on sm90, ':4096:2:16:8'
    (8.125 MiB) before; cuBLASLt shares it (TORCH_CUBLASLT_UNIFIED_WORKSPACE). Handles are
    per thread: the forward's and autograd's device thread each hold one."""
    per = 4096 * 8 * 1024 if arch == "sm90" else 4096 * 1024 * 2 + 16 * 1024 * 8
    return handles * per


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def flash_backward_scratch_bytes(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int,
                                 itemsize: int) -> int:
    """flash_backward_scratch: what FlashAttention-2's backward (torch's flash SDPA) allocates
    besides its gradients, for one attention layer (layers run one at a time): the fp32 dq
    accumulator (batch, seq rounded to 128, heads, head_dim rounded to 32) and softmax_d (batch,
    heads, seq rounded to 128), plus, with grouped KV heads, dk and dv expanded to every head
    before they are summed per group."""
    s, d = _round_up(seq, 128), _round_up(head_dim, 32) if head_dim <= 192 else 256
    scratch = 4 * batch * s * heads * d + 4 * batch * heads * s
    if kv_heads != heads:
        scratch += 2 * batch * seq * heads * head_dim * itemsize
    return scratch


@dataclass(frozen=True)
class CudaCosts:
    """What a CUDA training step holds that the traced graphs do not show (the formulas above),
    and `allocator_headroom`: the fraction of the budget left to the caching allocator's
    rounding and fragmentation (blocks of 512 B, 2 MiB segments, cached blocks of one size not
    reusable for another), never planned on. `attention`: (batch, heads, kv_heads, head_dim,
    itemsize) of the model's attention layers, None when unknown (no flash scratch counted)."""
    arch: str
    attention: Optional[tuple[int, int, int, int, int]] = None
    allocator_headroom: float = 0.05

    def terms(self, seq: int) -> dict[str, int]:
        out = {"cublas_workspace": cublas_workspace_bytes(self.arch)}
        if self.attention is not None:
            b, h, kv, d, item = self.attention
            out["flash_backward_scratch"] = flash_backward_scratch_bytes(b, h, kv, seq, d, item)
        return out

    def bytes(self, seq: int) -> int:
        return sum(self.terms(seq).values())

    def describe(self, seq: int) -> str:
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.terms(seq).items())
        return (f"modelled for CUDA ({self.arch}): {parts} at {seq:,} tokens, allocator_headroom "
                f"{self.allocator_headroom:.0%} of the budget (tailorfx/budget.py; validated by "
                f"benchmarks/gpu_check.py)")

    @classmethod
    def for_model(cls, arch: str, model, batch: int) -> "CudaCosts":
        """The attention shape read off a transformers config (num_attention_heads,
        num_key_value_heads, head_dim); a model without one gets no flash term."""
        cfg = getattr(model, "config", None)
        heads = getattr(cfg, "num_attention_heads", None)
        hidden = getattr(cfg, "hidden_size", None)
        if not heads or not hidden:
            return cls(arch)
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or hidden // heads
        p = next(iter(model.parameters()), None)
        item = p.element_size() if p is not None and p.is_floating_point() else 2
        return cls(arch, (batch, heads, kv, head_dim, item))


@dataclass(frozen=True)
class Budget:
    """A memory budget in bytes, with the text it came from."""
    bytes: int
    label: str = ""
    arch: Optional[str] = None    # a CUDA preset's architecture: plans for it are modelled for CUDA

    @classmethod
    def parse(cls, value: Union[str, int, "Budget"]) -> "Budget":
        if isinstance(value, Budget):
            return value
        if isinstance(value, int):
            if value <= 0:
                raise ValueError(f"budget must be positive, got {value} bytes")
            return cls(value, f"{value}B")
        text = str(value).strip()
        for name, nbytes in PRESETS.items():
            if text.lower() == name.lower():
                return cls(nbytes, name, ARCH[name])
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-zA-Z]*)", text)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot parse budget {value!r}: use a size like '24GB', '512MiB', "
                             f"'123456B', or a preset: {', '.join(PRESETS)}")
        nbytes = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        if nbytes <= 0:
            raise ValueError(f"budget must be positive, got {value!r}")
        return cls(nbytes, text)

    def __str__(self) -> str:
        return f"{self.label} ({format_bytes(self.bytes)})"


def format_bytes(n: float) -> str:
    """Human-readable binary size: '1.50 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def longest_fitting(peak: Callable[[int], int], usable: float, limit: int, granularity: int) -> int:
    """The longest length whose predicted peak fits `usable` (peak grows with length): doubling
    from 1024, then bisection to `granularity` tokens; `limit` caps the search."""
    with progress(desc="longest sequence that fits", unit="length") as bar:
        def fits(n: int) -> bool:
            bar.set_postfix_str(f"{n} tokens", refresh=False)
            ok = peak(n) <= usable
            bar.update(1)
            return ok
        lo, hi = 1, 1024
        while hi <= limit and fits(hi):
            lo, hi = hi, hi * 2
        if hi > limit:
            return lo
        while hi - lo > granularity:
            mid = (lo + hi) // 2 // granularity * granularity or granularity
            if mid <= lo:
                break
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
