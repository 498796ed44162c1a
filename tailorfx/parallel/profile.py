"""One rank's step (trace.py's RankCapture) simulated by the memory model, every storage counted
in the part of the model that made it: the root before the first block, each block, the root
after the last. What compose.py and memory.py compose: per point of the step, live bytes and
gradient bytes per part.

    points = profile(capture_rank(config, tp=2, rows=1, seq=4096, dtype=torch.bfloat16), setup)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.fx as fx

from tailorfx import compat
from tailorfx.parallel.trace import RankCapture
from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite import memory
from tailorfx.setup import TrainingSetup


@dataclass
class Point:
    kind: str            # "f" forward, "b" backward, "e" the forward ended (its outputs released)
    group: int
    attn: bool
    live: tuple          # bytes live per part (transient of the running op in its part)
    grads: tuple         # gradient bytes live per part
    saved_freed: tuple = ()   # bytes per part of the forward's saved tensors backward has freed so far


class _TaggedPool(memory.Pool):
    """The memory model's pool, also counting live bytes per part of the model."""

    def __init__(self, cap: RankCapture):
        super().__init__(memory.Timeline())
        self.cap = cap
        n = cap.num_groups
        self.live, self.glive = [0] * n, [0] * n
        self.sid_group: dict[int, int] = {}
        self.current = n - 1
        self.points: list[Point] = []
        self.saved_sids: set[int] = set()
        self.saved_freed = [0] * n
        # per part, the most gradient bytes one op makes at once (a chunked region's backward makes
        # all its weights' gradients together): what a later micro-batch adds beside the held ones
        self.grad_burst = [0] * n
        # and the largest weight gradient that op's chunks make through autograd beside them (None:
        # not a chunked op, or unknown)
        self.burst_chunk_grad: list = [None] * n
        self._burst_of: tuple = (None, 0)
        self.rng: dict[int, int] = {}     # checkpointed block -> its saved RNG state's storage

    def alloc(self, nbytes: int, holder, grad: bool = False, host: bool = False) -> int:
        sid = super().alloc(nbytes, holder, grad, host)
        if host:   # host memory: no part of the device's bytes
            return sid
        g = self.cap.node_group.get(holder, self.current) if isinstance(holder, fx.Node) else self.current
        self.sid_group[sid] = g
        self.live[g] += nbytes
        if grad:
            self.glive[g] += nbytes
            node, run = self._burst_of
            run = (run if node is holder else 0) + nbytes
            self._burst_of = (holder, run)
            if run > self.grad_burst[g]:
                self.grad_burst[g] = run
                self.burst_chunk_grad[g] = _chunk_grad(holder)
        return sid

    def hold(self, sid: int, holder) -> None:
        super().hold(sid, holder)
        if isinstance(holder, tuple) and holder[0] == "saved" and sid in self.bytes:
            self.saved_sids.add(sid)

    def release(self, sid: int, holder) -> None:
        nbytes, was_grad = self.bytes.get(sid), sid in self.grad_sids
        host = sid in self.host_sids
        super().release(sid, holder)
        if nbytes is not None and sid not in self.bytes and not host:
            g = self.sid_group.pop(sid)
            self.live[g] -= nbytes
            if was_grad:
                self.glive[g] -= nbytes
            if sid in self.saved_sids:
                self.saved_sids.discard(sid)
                self.saved_freed[g] += nbytes

    def mark(self, phase: str, node: str, extra: int = 0) -> None:
        super().mark(phase, node, extra)
        kind = "f" if phase.startswith("forward") else "b" if phase.startswith("backward") else "o"
        if kind != "o":
            names = self.cap.fw_group if kind == "f" else self.cap.bw_group
            self.current = names.get(node, self.current)
            self._rng_state(kind)
            attn = node in (self.cap.fw_attn if kind == "f" else self.cap.bw_attn)
            self.snapshot(kind, attn, extra)

    def _rng_state(self, kind: str) -> None:
        """A checkpointed block saves the RNG state as its forward starts; its backward frees it."""
        g = self.current
        if not self.cap.rng_bytes or not 1 <= g <= len(self.cap.blocks):
            return
        if kind == "f" and g not in self.rng:
            self.rng[g] = self.alloc(self.cap.rng_bytes, ("rng", g))
        elif kind == "b" and g in self.rng:
            self.release(self.rng.pop(g), ("rng", g))

    def forward_done(self, k: int) -> None:
        super().forward_done(k)
        # what the forward leaves: a last stage keeps this per micro-batch (its logits are gone)
        self.snapshot("e")

    def snapshot(self, kind: str, attn: bool = False, extra: int = 0) -> None:
        """A point of the profile: what is live now, per part (`extra` more in the running one)."""
        live = list(self.live)
        live[self.current] += extra
        self.points.append(Point(kind, self.current, attn, tuple(live), tuple(self.glive), tuple(self.saved_freed)))


def profile(cap: RankCapture, setup: TrainingSetup, keep_outputs: bool = True) -> list[Point]:
    """The step simulated under `setup`, each point's live bytes split by part (cached).
    `keep_outputs`: the caller holds the model's outputs (logits) through backward, as a training
    loop does; a pipeline's last stage returns only the loss."""
    key = (*_setup_key(setup), keep_outputs)
    if key not in cap.profiles:
        s = setup.with_(grad_accum_steps=1)
        pool = _TaggedPool(cap)
        memory.simulate_step([cap.steps], cap.seq, setup=s, pool=pool,
                             hold=memory.all_outputs if keep_outputs else memory.scalar_outputs)
        cap.profiles[key] = pool.points
        cap.profiles[("grad_burst", *_setup_key(setup))] = pool.grad_burst, pool.burst_chunk_grad
    return cap.profiles[key]


def _chunk_grad(node) -> Optional[int]:
    """What chunk_memory.chunk_weight_grad_bytes says of a backward node making gradients."""
    name = compat.tailorfx_op_name(node.target) if isinstance(node, fx.Node) else None
    if name is None:
        return None
    from tailorfx.runtime.chunk_memory import chunk_weight_grad_bytes
    return chunk_weight_grad_bytes(name, list(fx.node.map_arg(node.args, node_value)), compat.size_hint)


def _setup_key(setup: TrainingSetup) -> tuple:
    """What of a setup the simulated step depends on."""
    return setup.param_dtype, setup.grads, setup.optimizer, setup.optimizer_in_backward, setup.master_weights


def grad_burst(cap: RankCapture, setup: TrainingSetup) -> tuple[list[int], list]:
    """Per part, the most gradient bytes one backward op makes at once, and the largest weight
    gradient that op's chunks make through autograd beside them (None: not a chunked op) (after
    profile())."""
    return cap.profiles.get(("grad_burst", *_setup_key(setup)), ([0] * cap.num_groups, [None] * cap.num_groups))

