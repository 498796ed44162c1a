"""Measuring real memory: the peak bytes the CPU allocator handed out while a function ran."""
from __future__ import annotations

import contextlib
import gc
import os
import re
import sys
import tempfile
from typing import Any, Callable

from torch.profiler import ProfilerActivity, profile

from tailorfx import compat

_PROFILER_NOISE = re.compile(r"^(USDT|STAGE):.*\]\s*profiler_(start|stop)\s*$")


@contextlib.contextmanager
def quiet_profiler():
    """Drops the "USDT: ... profiler_start / profiler_stop" lines torch's profiler (kineto, in C++)
    writes straight to the process's stdout/stderr file descriptors each time a profile starts and
    stops (KINETO_LOG_LEVEL=6 silences them too, but only when set before torch is imported).
    Anything else written meanwhile is passed on to the stream it was written to."""
    streams = {1: sys.stdout, 2: sys.stderr}
    for s in streams.values():
        s.flush()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        saved = {}
        try:
            for fd, tmp in ((1, out), (2, err)):
                saved[fd] = os.dup(fd)
                os.dup2(tmp.fileno(), fd)
            yield
        finally:
            for s in streams.values():
                s.flush()
            for fd, old in saved.items():
                os.dup2(old, fd)
                os.close(old)
            for fd, tmp in ((1, out), (2, err)):
                tmp.seek(0)
                rest = [line for line in tmp.read().decode("utf-8", "replace").splitlines(keepends=True)
                        if not _PROFILER_NOISE.match(line.strip())]
                if rest:
                    streams[fd].write("".join(rest))
                    streams[fd].flush()


def measure_peak(fn: Callable[[], Any], return_result: bool = False):
    """Peak bytes allocated during `fn()` above what was live when it started, eager or compiled.

    Uses the profiler's allocator events, which see Inductor's buffers and custom ops alike (a
    Python dispatch mode would miss them). Memory freed during `fn` that was allocated before it
    shows as negative, so the result is the high-water mark of the net change.
    """
    gc.collect()
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                                   record_shapes=False) as prof:
        result = fn()
    total = peak = 0
    for _, nbytes in compat.profiler_memory_events(prof):
        total += nbytes
        peak = max(peak, total)
    return (peak, result) if return_result else peak
