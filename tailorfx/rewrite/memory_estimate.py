"""What the memory model returns: live bytes after each simulated op (Timeline) and one training
step's peak split into what holds it (MemoryEstimate)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tailorfx.setup import TrainingSetup


@dataclass
class Timeline:
    """Live bytes after each op of the simulated step (above what existed before the step)."""
    points: list[tuple[str, str, int]] = field(default_factory=list)   # (phase, node, bytes)
    grads: list[int] = field(default_factory=list)                     # gradient bytes live at each point
    host_peak: int = 0      # the most bytes held in host memory at once (offloaded activations)
    extras: list[int] = field(default_factory=list)   # each point's transient inside its op (part of its bytes)
    hosts: list[int] = field(default_factory=list)    # host bytes live at each point

    def peak(self) -> tuple[int, str, str]:
        if not self.points:
            return 0, "", ""
        phase, node, b = max(self.points, key=lambda p: p[2])
        return b, phase, node

    def grads_at_peak(self) -> int:
        if not self.points:
            return 0
        i = max(range(len(self.points)), key=lambda i: self.points[i][2])
        return self.grads[i]


@dataclass
class MemoryEstimate:
    """Predicted memory of one training step.

    static (held across steps: weights, master weights, optimizer state, DDP's gradient buckets) + dynamic peak (above
    static during the step: gradients, activations, transients) = peak.
    """
    peak_bytes: int            # static + dynamic peak: what a device must hold
    static_bytes: int          # parameters, buffers, master weights, optimizer state and DDP's buckets
    param_bytes: int
    grad_bytes: int            # gradients held after backward (0 with the optimizer in backward)
    optimizer_bytes: int       # optimizer state (0 when no optimizer is modelled)
    dynamic_peak_bytes: int    # peak above static during the step (what measure_peak sees)
    saved_bytes: int           # activations saved for backward, at the end of forward
    peak_phase: str
    peak_node: str
    timeline: Timeline
    master_bytes: int = 0      # fp32 master weights
    grads_at_peak: int = 0     # gradient bytes live at the peak (part of the dynamic peak)
    setup: Optional[TrainingSetup] = None
    device_bytes: int = 0      # a CUDA device's workspaces the graphs do not show (setup.device; part of peak)
    host_bytes: int = 0        # the most bytes of offloaded activations in host memory at once (not in peak)
    bucket_bytes: int = 0      # DDP's gradient buckets, a copy of the gradients (setup.ddp; part of static)

    @property
    def forward_backward_peak_bytes(self) -> int:
        """Peak above static during forward and backward only (what measure_peak sees around
        `loss.backward()`; in-backward optimizer steps included, the separate step not)."""
        pts = [b for phase, _, b in self.timeline.points if phase.startswith(("forward", "backward"))]
        return max(pts, default=0)

    def summary(self) -> dict[str, int]:
        return {"peak": self.peak_bytes, "static": self.static_bytes, "params": self.param_bytes,
                "master_weights": self.master_bytes, "grads": self.grad_bytes,
                "optimizer_state": self.optimizer_bytes, "dynamic_peak": self.dynamic_peak_bytes,
                "grads_at_peak": self.grads_at_peak, "saved_activations": self.saved_bytes,
                "cuda_workspaces": self.device_bytes, "host_offloaded": self.host_bytes,
                "ddp_buckets": self.bucket_bytes}

    def breakdown(self) -> dict[str, int]:
        """The peak split into what it is made of (sums to peak_bytes; DDP's buckets only inside DDP)."""
        return {"weights": self.param_bytes, "master weights": self.master_bytes,
                "optimizer state": self.optimizer_bytes,
                **({"DDP gradient buckets": self.bucket_bytes} if self.bucket_bytes else {}),
                "gradients": self.grads_at_peak,
                "activations and transients": self.dynamic_peak_bytes - self.grads_at_peak,
                "CUDA workspaces": self.device_bytes}
