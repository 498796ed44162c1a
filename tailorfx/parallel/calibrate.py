"""The step-time model's figures for this machine (a steptime.DeviceClass), measured inside a
process group:

    # in each of N torchrun processes (gloo):
    dev = calibrate()          # the same DeviceClass on every rank (rank 0's figures)

One core's figures, measured by rank 0 while the others wait: matmul rate (a 1024 x 512 x 1024
matmul), fused attention's rate (causal SDPA, forward and backward), memory bandwidth (an
elementwise op over 16 MiB), the dispatch overhead of an op on a tiny tensor and its extra on a
replicated DTensor; the cores the ranks share (this process's CPU
affinity). Each collective kind's latency per ring step and bandwidth, with every rank in it, for
steps * latency + fraction * bytes / bandwidth (steptime.RING: an all-reduce takes 2(n-1) steps
and moves 2(n-1)/n of its bytes): the latency from a call of a few bytes, the bandwidth from
two large ones.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from tailorfx import compat
from tailorfx.parallel.devices import DeviceClass
from tailorfx.parallel.steptime import RING


def _median_s(fn: Callable, repeats: int, inner: int = 1) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t) / inner)
    return statistics.median(times)


def _attention_rate(repeats: int) -> float:
    """FLOP/s of causal scaled_dot_product_attention's forward and backward (8 heads of 32, 512
    tokens), counted as steptime counts them: 4 + 10 FLOPs per attended pair and head dim."""
    q, k, v = (torch.randn(1, 8, 512, 32, requires_grad=True) for _ in range(3))

    def step():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    return 14 * 8 * 512 * 256 * 32 / _median_s(step, repeats, inner=5)


def _collective_fit(kind: str, n: int, repeats: int) -> tuple[str, float, float]:
    """(kind, latency s per ring step, bandwidth bytes/s) of one collective over the world, as
    steptime models it: the latency from a small call, the bandwidth from the difference
    between a 16 MiB and a 4 MiB one (a least-squares fit of three sizes is at the noise's mercy)."""
    steps, fraction = RING[kind](n)
    pts = []
    for numel in (64 * n, 2 ** 20, 2 ** 22):
        x = torch.ones(numel)
        if kind == "all_reduce":
            call = lambda: dist.all_reduce(x)
        elif kind == "all_gather_into_tensor":       # numel: the gathered output's
            out, part = torch.empty(numel), torch.ones(numel // n)
            call = lambda: compat.all_gather_single(out, part)
        elif kind == "reduce_scatter_tensor":
            part = torch.empty(numel // n)
            call = lambda: compat.reduce_scatter_single(part, x)
        else:
            out = torch.empty(numel)
            call = lambda: dist.all_to_all_single(out, x)
        dist.barrier()
        pts.append((fraction * numel * 4, _median_s(call, repeats)))
    (_, small), (b1, t1), (b2, t2) = pts
    return kind, small / steps, (b2 - b1) / max(t2 - t1, 1e-9)


def calibrate(name: str = "cpu-gloo", repeats: int = 9) -> DeviceClass:
    """This machine's DeviceClass, measured in every rank of the default process group (gloo on
    CPU); the same on every rank."""
    if not dist.is_initialized():
        raise RuntimeError("calibrate() measures collectives: call it in every rank of a process group "
                           "(torchrun, then torch.distributed.init_process_group)")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    core = torch.zeros(5, dtype=torch.float64)
    if dist.get_rank() == 0:          # one core's figures, the other ranks waiting
        a, b = torch.randn(1024, 512), torch.randn(512, 1024)
        x, tiny = torch.randn(2 ** 22), torch.randn(8)
        op = _median_s(lambda: tiny.add(1.0), repeats, inner=200)
        core[:] = torch.tensor([2 * 1024 * 512 * 1024 / _median_s(lambda: torch.mm(a, b), repeats, inner=10),
                                _attention_rate(repeats), 2 * x.numel() * 4 / _median_s(lambda: x.mul(1.5), repeats,
                                                                                       inner=10), op, 0.0])
    dt = distribute_tensor(torch.randn(8), mesh, [Replicate()], src_data_rank=None)
    if dist.get_rank() == 0:
        core[4] = max(_median_s(lambda: dt.add(1.0), repeats, inner=50) - float(core[3]), 0.0)
    dist.broadcast(core, 0)
    fits = [_collective_fit(kind, n, repeats) for kind in RING]
    link = torch.tensor([[f[1], f[2]] for f in fits], dtype=torch.float64)
    dist.broadcast(link, 0)
    fits = tuple((f[0], float(a), float(b)) for f, (a, b) in zip(fits, link.tolist()))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return DeviceClass(name, matmul_flops=float(core[0]), attention_flops=float(core[1]),
                       memory_bandwidth=float(core[2]), op_overhead=float(core[3]), dtensor_overhead=float(core[4]),
                       link_bandwidth=fits[0][2], network_bandwidth=fits[0][2],
                       latency=fits[0][1], ranks_per_node=n, overlap_fsdp=False, shared_cores=cores, fits=fits,
                       source=f"measured by tailorfx.parallel.calibrate on {n} {dist.get_backend()} processes sharing "
                              f"{cores} cores, {torch.get_num_threads()} thread(s) each")


__all__ = ["calibrate"]
