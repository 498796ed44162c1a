"""Measuring real memory: the peak bytes the CPU allocator handed out while a function ran."""
from __future__ import annotations

import gc
from typing import Any, Callable

from torch.profiler import ProfilerActivity, profile

from tailorfx import compat


def measure_peak(fn: Callable[[], Any], return_result: bool = False):
    """Peak bytes allocated during `fn()` above what was live when it started, eager or compiled.

    Uses the profiler's allocator events, which see Inductor's buffers and custom ops alike (a
    Python dispatch mode would miss them). Memory freed during `fn` that was allocated before it
    shows as negative, so the result is the high-water mark of the net change.
    """
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        result = fn()
    total = peak = 0
    for _, nbytes in compat.profiler_memory_events(prof):
        total += nbytes
        peak = max(peak, total)
    return (peak, result) if return_result else peak
