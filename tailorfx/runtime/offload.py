"""Saved activations moved to host memory after the forward's last use and back before the backward's
first (ALST's checkpoint offload; rewrite/offload.py puts the ops into the partitioned graphs).

On a GPU the host copy is pinned memory (CUDA's caching host allocator, outside the device's
allocator) and both copies run on the compute stream: exact, and freed in stream order. On the CPU,
host and device are one memory; there the copy lives in NumPy's heap, outside torch's CPU
allocator, whose allocations are what `measure_peak` reads as the device's: the CPU plays a device
whose host is NumPy's memory, so the rewrite and its memory model are tested where CI runs.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


@torch.library.custom_op("tailorfx::offload", mutates_args=())
def offload(x: Tensor) -> Tensor:
    """A copy of `x` in host memory (pinned on a GPU)."""
    if x.device.type == "cpu":
        host = torch.from_numpy(np.empty(x.numel() * x.element_size(), np.uint8)).view(x.dtype).view(x.shape)
    else:
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=x.device.type != "cpu")
    return host


@offload.register_fake
def _offload_fake(x: Tensor) -> Tensor:
    return x.new_empty(x.shape, device="cpu")


@torch.library.custom_op("tailorfx::reload", mutates_args=())
def reload(x: Tensor, device: torch.device) -> Tensor:
    """A copy of the host tensor `x` on `device`, allocated by the device's allocator."""
    if device.type == "cpu":
        return x.clone(memory_format=torch.contiguous_format)
    return x.to(device, non_blocking=True)


@reload.register_fake
def _reload_fake(x: Tensor, device: torch.device) -> Tensor:
    return x.new_empty(x.shape, device=device)


OFFLOAD = torch.ops.tailorfx.offload.default
RELOAD = torch.ops.tailorfx.reload.default
