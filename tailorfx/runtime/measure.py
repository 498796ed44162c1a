"""Measuring real memory: the peak bytes the CPU allocator handed out while a function ran."""
from __future__ import annotations

import contextlib
import gc
import os
import re
import sys
import tempfile
from collections import Counter
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


# ops that only relabel a tensor's metadata (no kernel, no bytes), and dropout with p=0 (an
# identity in eager; optimize() removes it before capture)
NO_KERNEL = frozenset({
    "aten::view", "aten::reshape", "aten::_unsafe_view", "aten::transpose", "aten::t", "aten::expand",
    "aten::permute", "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select", "aten::alias",
    "aten::as_strided", "aten::detach", "aten::lift_fresh", "aten::_reshape_alias", "aten::dropout",
    "aten::contiguous", "aten::split", "aten::chunk", "aten::unbind", "aten::narrow", "aten::view_as",
    "aten::expand_as", "aten::flatten", "aten::unflatten", "aten::transpose_", "aten::resolve_conj",
    "aten::resolve_neg", "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense"})


def kernel_ops(fn: Callable[[], Any], exclude: frozenset = NO_KERNEL) -> Counter:
    """The ATen ops `fn()` runs (the profiler's, by name and count) but those in `exclude` (by
    default the ones that neither compute nor allocate): what its kernel time is made of. Equal
    counts for two steps mean the same work."""
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return Counter(e.name for e in prof.events() if e.name.startswith("aten::") and e.name not in exclude)


def measure_peak(fn: Callable[[], Any], return_result: bool = False):
    """Peak bytes allocated during `fn()` above what was live when it started, eager or compiled.

    Uses the profiler's allocator events, which see Inductor's buffers and custom ops alike (a
    Python dispatch mode would miss them). Memory freed during `fn` that was allocated before it
    shows as negative, so the result is the high-water mark of the net change. The profiler records
    the calling thread's events only: a tensor whose last reference a collective library's thread
    drops (gloo's worker, holding an all-reduce's tensor until it has finished) is never seen
    freed, so a step under gloo can read high, never low: take the least of several steps, or
    bound what went unseen with peak_and_net.
    """
    peak, _, result = peak_and_net(fn)
    return (peak, result) if return_result else peak


def peak_and_net(fn: Callable[[], Any], collect: bool = True) -> tuple[int, int, Any]:
    """(peak, net, fn's result): measure_peak's peak, and the bytes the profiler saw allocated in
    `fn` and not freed. A net above what `fn` leaves (its gradients, its result) is frees another
    thread made unseen: the true peak lies between peak less that excess and peak. `collect`:
    collect garbage first (0.1 s), so that no cycle's tensors are freed inside `fn`."""
    if collect:
        gc.collect()
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                                   record_shapes=False) as prof:
        result = fn()
    total = peak = 0
    for _, nbytes in compat.profiler_memory_events(prof):
        total += nbytes
        peak = max(peak, total)
    return peak, total, result
