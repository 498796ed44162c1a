"""Saved activations moved to host memory after the forward's last use and back before the backward's
first (ALST's checkpoint offload; rewrite/offload.py puts the ops into the partitioned graphs).

On a GPU both copies run on a copy stream of their own, so they overlap the compute:
- `offload` copies into pinned memory (CUDA's caching host allocator, outside the device's) after
  the compute stream's work so far; the device tensor is kept from reuse until the copy has read it
  (`record_stream`);
- `reload` allocates the device tensor in the compute stream's order and copies into it on the
  copy stream, recording an event; the backward issues it one block early (a prefetch);
- `reloaded` makes the compute stream wait for that event, just before the first reader.
On the CPU, host and device are one memory; there the copy lives in NumPy's heap, outside torch's
CPU allocator, whose allocations are what `measure_peak` reads as the device's: the CPU plays a
device whose host is NumPy's memory, so the rewrite, its prefetch and its memory model are tested
where CI runs (the copies are synchronous there, and `reloaded` does nothing).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

_copy_streams: dict = {}   # device index -> the stream both copies run on
_arrivals: dict = {}       # data_ptr of a reloaded device tensor -> the event its copy records


def _copy_stream(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _copy_streams:
        _copy_streams[index] = torch.cuda.Stream(index)
    return _copy_streams[index]


@torch.library.custom_op("tailorfx::offload", mutates_args=())
def offload(x: Tensor, wait: bool = False) -> Tensor:
    """A copy of `x` in host memory (pinned on a GPU, copied on the copy stream). `wait`: the
    compute stream's later work waits for the copy (Inductor's generated code reuses x's buffer
    right after its last use, which record_stream cannot hold back; the eager lowering frees x
    through the allocator, which it does)."""
    if x.device.type == "cpu":
        host = torch.from_numpy(np.empty(x.numel() * x.element_size(), np.uint8)).view(x.dtype).view(x.shape)
        host.copy_(x)
        return host
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    stream = _copy_stream(x.device)
    compute = torch.cuda.current_stream(x.device)
    stream.wait_stream(compute)   # after the compute that made x
    with torch.cuda.stream(stream):
        host.copy_(x, non_blocking=True)
    x.record_stream(stream)   # x's memory is not handed out again before the copy has read it
    if wait:
        compute.wait_stream(stream)
    return host


@offload.register_fake
def _offload_fake(x: Tensor, wait: bool = False) -> Tensor:
    return x.new_empty(x.shape, device="cpu")


@torch.library.custom_op("tailorfx::reload", mutates_args=())
def reload(x: Tensor, device: torch.device) -> Tensor:
    """A copy of the host tensor `x` on `device`, allocated by the device's allocator; on a GPU the
    copy is in flight when this returns (`reloaded` waits for it)."""
    if device.type == "cpu":
        return x.clone(memory_format=torch.contiguous_format)
    out = torch.empty(x.shape, dtype=x.dtype, device=device)
    stream = _copy_stream(out.device)
    # out's memory is free in the compute stream's order: the copy starts after that stream's work so far
    stream.wait_stream(torch.cuda.current_stream(out.device))
    with torch.cuda.stream(stream):
        out.copy_(x, non_blocking=True)
        arrived = torch.cuda.Event()
        arrived.record(stream)
    _arrivals[out.data_ptr()] = arrived
    return out


@reload.register_fake
def _reload_fake(x: Tensor, device: torch.device) -> Tensor:
    return x.new_empty(x.shape, device=device)


@torch.library.custom_op("tailorfx::reloaded", mutates_args=("x",))
def reloaded(x: Tensor) -> None:
    """The compute stream waits until `x`'s copy (`reload`) has arrived. Declared as writing `x` so
    that graphs keep it before x's readers; it writes nothing."""
    arrived = _arrivals.pop(x.data_ptr(), None) if x.device.type == "cuda" else None
    if arrived is not None:
        torch.cuda.current_stream(x.device).wait_event(arrived)


@reloaded.register_fake
def _reloaded_fake(x: Tensor) -> None:
    return None


OFFLOAD = torch.ops.tailorfx.offload.default
RELOAD = torch.ops.tailorfx.reload.default
RELOADED = torch.ops.tailorfx.reloaded.default
