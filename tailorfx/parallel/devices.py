"""Device classes: what one rank of a kind of device sustains, as the step-time model
(steptime.py) reads it. Hopper's fitted on an H200's measured steps (benchmarks/steptime_gpu.py),
a CPU machine's measured by calibrate.py."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Union


@dataclass(frozen=True)
class DeviceClass:
    """What one rank of a kind of device sustains, as the step-time model reads it."""
    name: str
    matmul_flops: float          # FLOP/s in matmuls, in the training dtype
    attention_flops: float       # FLOP/s in fused attention kernels (forward and backward)
    memory_bandwidth: float      # bytes/s read + written by the other ops
    op_overhead: float           # s per op dispatched
    dtensor_overhead: float      # s more per op on DTensors (eager tensor parallel)
    link_bandwidth: float        # bytes/s of a collective's ring traffic inside a node
    network_bandwidth: float     # the same across nodes, per rank
    latency: float               # s per step of a ring collective, and per point-to-point send
    ranks_per_node: int
    overlap_fsdp: bool           # CUDA streams: FSDP's collectives and offload's host copies hidden behind compute
    shared_cores: int = 0        # CPU: the cores all ranks share (the rates above are one core's); 0: a device each
    host_bandwidth: float = 0.0  # bytes/s each way between device and pinned host memory; 0: one memory (a CPU)
    fits: tuple = ()             # (kind, latency, bandwidth) measured per collective kind, over link_bandwidth/latency
    source: str = ""

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceClass":
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        return cls(**{**kw, "fits": tuple(tuple(f) for f in kw.get("fits", ()))})

    def link(self, kind: str, inside_node: bool) -> tuple[float, float]:
        """(latency per ring step, bandwidth) of a collective of `kind`."""
        fit = next((f for f in self.fits if f[0] == kind), None)
        if fit is not None and inside_node:
            return fit[1], fit[2]
        return self.latency, self.link_bandwidth if inside_node else self.network_bandwidth


# Datasheet figures times the fraction training sustains. Hopper's, measured on an H200 (Llama-3-8B,
# 2026-12-04, its kernels profiled by kind; benchmarks/steptime_gpu.py fits them on one row and holds
# the others out): bf16 matmuls at 75% of peak, SDPA's attention (cuDNN's sm90 kernels) at 52%, the
# other ops (with the optimizer's) at 63% of the memory bandwidth; the H100 shares the H200's compute
# and is taken at the same fractions of its own datasheet. The A100's are assumed (matmuls at 45%,
# FlashAttention-2's published 50%, memory at 80%). Collectives at NCCL's bus bandwidth on 8-GPU
# NVLink nodes and one 400 (H100) or 200 (A100) Gb/s InfiniBand port per GPU, not measured on a GPU
# (calibrate() measures a CPU machine's own, on gloo). Host copies (offload) at 80% of PCIe's rate each
# way, assumed: Gen5 x16 (64 GB/s) on Hopper, Gen4 (32 GB/s) on the A100.
_GPU = dict(op_overhead=5e-6, dtensor_overhead=40e-6, latency=15e-6, ranks_per_node=8, overlap_fsdp=True)
DEVICE_CLASSES = {
    "H100": DeviceClass("H100", matmul_flops=0.75 * 989e12, attention_flops=0.52 * 989e12,
                        memory_bandwidth=0.63 * 3.35e12, link_bandwidth=360e9, network_bandwidth=40e9, **_GPU,
                        host_bandwidth=0.8 * 64e9,
                        source="H100 SXM datasheet (989 TFLOP/s bf16, 3.35 TB/s) at the H200's measured fractions, "
                               "NVLink 4, 400 Gb/s IB per GPU, PCIe 5"),
    "H200": DeviceClass("H200", matmul_flops=0.75 * 989e12, attention_flops=0.52 * 989e12,
                        memory_bandwidth=0.63 * 4.8e12, link_bandwidth=360e9, network_bandwidth=40e9, **_GPU,
                        host_bandwidth=0.8 * 64e9,
                        source="H200 SXM datasheet (989 TFLOP/s bf16, 4.8 TB/s) at the fractions measured on one "
                               "(2026-12-04), NVLink 4, 400 Gb/s IB per GPU, PCIe 5"),
    "A100": DeviceClass("A100", matmul_flops=0.45 * 312e12, attention_flops=0.5 * 312e12,
                        memory_bandwidth=0.8 * 2.04e12, link_bandwidth=230e9, network_bandwidth=20e9, **_GPU,
                        host_bandwidth=0.8 * 32e9,
                        source="A100 SXM 80GB datasheet (312 TFLOP/s bf16, 2.04 TB/s), NVLink 3, 200 Gb/s IB per GPU, "
                               "PCIe 4"),
}


def device_class(device: Union[str, DeviceClass]) -> DeviceClass:
    """A DeviceClass, or the one a name or GPU budget names ("H100", "H100-80GB", "a100-40gb")."""
    if isinstance(device, DeviceClass):
        return device
    name = str(device).upper().split("-")[0]
    if name not in DEVICE_CLASSES:
        raise ValueError(f"no step-time figures for device {device!r}: give one of {sorted(DEVICE_CLASSES)}, a GPU "
                         f"budget such as 'H100-80GB', or a DeviceClass (calibrate() measures one on this machine)")
    return DEVICE_CLASSES[name]


__all__ = ["DEVICE_CLASSES", "DeviceClass", "device_class"]
