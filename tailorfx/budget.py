"""Budget: how much memory one training step may hold, parsed from "24GB", "512MiB" or a preset."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

# Usable memory of common devices: the marketed size in GiB minus what the CUDA context and
# allocator reserve (about 1.5 GiB on 80 GB parts), so a plan that fits here fits the device.
PRESETS = {
    "A100-80GB": 80 * 2**30 - 3 * 2**29,
    "A100-40GB": 40 * 2**30 - 3 * 2**29,
    "H100-80GB": 80 * 2**30 - 3 * 2**29,
    "H200-141GB": 141 * 2**30 - 3 * 2**29,
    "RTX4090-24GB": 24 * 2**30 - 2**30,
    "L4-24GB": 24 * 2**30 - 2**30,
}


class BudgetError(ValueError):
    """A budget no plan can meet; says the smallest peak reachable (`smallest_bytes`), the budget
    that the planner accepts for it (`suggested_bytes`: that peak plus its headroom) and what
    dominates it."""

    def __init__(self, message: str, smallest_bytes: int = 0, dominant: str = "", suggested_bytes: int = 0):
        super().__init__(message)
        self.smallest_bytes = smallest_bytes
        self.suggested_bytes = suggested_bytes or smallest_bytes
        self.dominant = dominant


@dataclass(frozen=True)
class Budget:
    """A memory budget in bytes, with the text it came from."""
    bytes: int
    label: str = ""

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
                return cls(nbytes, name)
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
