"""Compositions of a rank's tagged simulation (profile.py) into its peak under a layout: tensor
parallel as traced, FSDP2's gathers, prefetch and reduce-scatters over dp ranks, and a pipeline
rank's walk through its schedule's actions (see memory.py's docstring)."""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch

from tailorfx.codegen.pipeline import stage_of_nodes
from tailorfx.parallel.profile import Point, grad_burst
from tailorfx.parallel.trace import RankCapture
from tailorfx.rewrite.capture import node_value

_PARTS = ("activations", "gradients", "gathered parameters", "communication buffers")


def _best(cands) -> tuple[int, dict]:
    """The largest (activations, gradients, gathered, comm) candidate, as (total, parts)."""
    best, parts = -1, {}
    for c in cands:
        t = sum(c)
        if t > best:
            best, parts = t, dict(zip(_PARTS, c))
    return max(best, 0), parts


def shard_bytes(shapes, n: int) -> tuple[int, int]:
    """(rank 0's shard, the padded whole) bytes of parameters FSDP2 splits over n ranks on dim 0."""
    shard = padded = 0
    for shape, itemsize in shapes:
        d0 = shape[0] if shape else 1
        rest = math.prod(shape[1:]) if len(shape) > 1 else 1
        rows = -(-d0 // n)
        shard += rows * rest * itemsize
        padded += rows * n * rest * itemsize
    return shard, padded


def shard_shapes(shapes, n: int) -> list[tuple[tuple[int], int]]:
    """Each parameter as rank 0's FSDP2 shard over n ranks: ((elements,), itemsize)."""
    return [((shard_bytes([sh], n)[0] // sh[1],), sh[1]) for sh in shapes]


def tp_peak(points: list[Point]) -> tuple[int, dict]:
    return _best((sum(p.live) - sum(p.grads), sum(p.grads), 0, 0) for p in points if p.kind in ("f", "b"))


def _summary(cap: RankCapture, points: list[Point]) -> list[tuple]:
    """Per point of forward and backward, what the dp compositions read, computed once:
    (kind, part, activations, gradients, gradients of finished blocks, attention layers live).
    Layers live: whose attention ran forward and has not run backward (Ulysses)."""
    key = ("summary", id(points))
    if key in cap.profiles:
        return cap.profiles[key]
    L = len(cap.blocks)
    out = []
    passed, in_attn, prev_group = False, False, None
    for p in points:
        if p.kind not in ("f", "b"):
            continue
        g = p.group
        block = 1 <= g <= L
        if g != prev_group:
            passed, in_attn, prev_group = False, False, g
        if p.attn:
            in_attn = True
            passed = passed or p.kind == "f"
        elif in_attn and p.kind == "b":
            passed = True          # its attention's backward is done
        layers = (g - 1 + (passed if p.kind == "f" else not passed)) if block else (L if g == L + 1 else 0)
        gtot = sum(p.grads)
        finished = sum(p.grads[1:L + 1]) - (p.grads[g] if block else 0)
        out.append((p.kind, g, sum(p.live) - gtot, gtot, finished, layers))
    cap.profiles[key] = out
    return out


def fsdp_peak(cap: RankCapture, points: list[Point], dp: int, attn_comm: int = 0,
              gloo: bool = False) -> tuple[int, dict]:
    """The step's peak above resident under FSDP2 over dp ranks (see memory.py's docstring).
    `gloo`: the collectives run on gloo, whose reduce-scatter holds a copy of its input."""
    L = len(cap.blocks)
    shard, pad = zip(*(shard_bytes(cap.params[g], dp) for g in range(L + 2)))
    full_blocks = sum(cap.group_bytes(g) for g in range(1, L + 1))
    ratio = sum(shard[1:L + 1]) / full_blocks if full_blocks else 0.0    # finished blocks keep their shards
    root_pad = pad[0] + pad[L + 1]
    p_ = lambda g: pad[g] if 1 <= g <= L else 0
    cands = []
    last_b: dict[int, tuple] = {}
    for kind, g, act, gtot, finished, layers in _summary(cap, points):
        block = 1 <= g <= L
        comm = attn_comm * layers
        if kind == "f":
            held_ag = p_(g) if block else (root_pad if g == 0 else pad[L])
            cands.append((act, gtot, root_pad + p_(g), held_ag + comm))
            continue
        grads = gtot - finished * (1 - ratio)
        last_b[g] = (act, grads)
        prefetch = p_(g - 1) if block else (pad[L] if g == L + 1 else 0)
        rs_held = p_(g + 1) if block else (pad[1] if g == 0 and L else 0)
        cands.append((act, grads, root_pad + p_(g), prefetch + rs_held + comm))
    for g, (act, grads) in last_b.items():    # post-backward: whole gradients copied into the reduce-scatter input
        if 1 <= g <= L:
            if gloo:    # the whole gradients freed once copied; gloo's copy of the input
                cands.append((act, grads - cap.group_bytes(g) + shard[g], root_pad, 2 * pad[g] + p_(g - 1)))
            else:
                cands.append((act, grads + shard[g], root_pad, pad[g] + p_(g - 1)))
        elif g == 0:                   # the root's, at the end of backward
            if gloo:    # as a block's; the root's largest gradient was measured still held then
                whole = cap.group_bytes(0) + cap.group_bytes(L + 1)
                largest = max((math.prod(s) * b for s, b in cap.params[0] + cap.params[L + 1]), default=0)
                cands.append((act, grads - whole + largest + shard[0] + shard[L + 1], 0, 2 * root_pad))
            else:
                cands.append((act, grads + shard[0] + shard[L + 1], 0, root_pad))
    return _best(cands)


@dataclass
class _Stage:
    groups: set
    fwd: list           # (non-gradient bytes, gradient bytes) of its own tensors at each forward point
    bwd: list
    kept: int
    grads: int
    wgrad: int = 0      # what a zero-bubble input-gradient pass keeps for the weight pass (beside `kept`)
    # a zero-bubble input-gradient pass runs with retain_graph (torch's stage_backward_input):
    # the saved tensors a plain backward frees as it goes stay held, at each backward point
    bwd_retained: list = field(default_factory=list)
    # per backward point, the most gradient bytes a later micro-batch has new there (stage_profiles)
    bwd_fresh: list = field(default_factory=list)


def stage_groups(cap: RankCapture, stage_blocks: list[list[str]]) -> list[set[int]]:
    """Each stage's parts: its blocks', the root before the first block on the first stage and
    the root after the last on the last."""
    L = len(cap.blocks)
    index = {b: i for i, b in enumerate(cap.blocks)}
    n = len(stage_blocks)
    groups = []
    for k, blocks in enumerate(stage_blocks):
        gs = {1 + index[b] for b in blocks}
        if k == 0:
            gs.add(0)
        if k == n - 1:
            gs.add(L + 1)
        groups.append(gs)
    return groups


def stage_profiles(cap: RankCapture, points: list[Point], stage_blocks: list[list[str]], setup) -> list[_Stage]:
    groups = stage_groups(cap, stage_blocks)
    stage_of = {g: k for k, gs in enumerate(groups) for g in gs}
    burst, chunk_grad = grad_burst(cap, setup)
    fw_points = [p for p in points if p.kind == "f"]
    out = []
    for k, gs in enumerate(groups):
        own = lambda p: (sum(p.live[g] - p.grads[g] for g in gs), sum(p.grads[g] for g in gs))
        fwd = [own(p) for p in fw_points if p.group in gs]
        bwd = [own(p) for p in points if p.kind == "b" and p.group in gs]
        retained = [(ng + sum(p.saved_freed[g] for g in gs), g_) for (ng, g_), p in
                    zip(bwd, [p for p in points if p.kind == "b" and p.group in gs])]
        nxt = next((p for p in fw_points if stage_of.get(p.group, -1) > k), None)
        end = nxt if nxt is not None else next((p for p in points if p.kind == "e"), None)
        kept = sum(own(end)) if end is not None else 0
        ratio = setup.grads.itemsize / setup.param_dtype.itemsize
        shapes = [s for g in gs for s in cap.params[g]]
        gbytes = int(sum(math.prod(s) * b for s, b in shapes) * ratio)
        wgrad = sum(cap.wgrad[g] for g in gs) if cap.wgrad else 0     # activation gradients: their own dtype
        # a later micro-batch's new gradient bytes at each point: its part's (a block's, a root's)
        # largest weight's, or where one op makes several at once (a chunked region's backward: its
        # weights' gradient buffers) those and the largest weight gradient one chunk makes through
        # autograd before it is added in (none where the chunk sums each weight's share in place:
        # runtime/chunk_backward.py). torch adds each new gradient into the held one as it is made:
        # the stage's largest (the embedding's) is not new inside a block
        part = {grp: int(max([math.prod(x) * b for x, b in cap.params[grp]] + [0]) * ratio) for grp in gs}
        fresh = [(part[g] if chunk_grad[g] is None else chunk_grad[g]) + burst[g]
                 if burst[g] > part[g] else part[g]
                 for g in (p.group for p in points if p.kind == "b" and p.group in gs)]
        out.append(_Stage(gs, fwd, bwd, kept, gbytes, wgrad, retained, fresh))
    return out


def pipeline_walk(stages: list[_Stage], io: list, schedule, rank: int,
                   fsdp: Optional[dict] = None) -> tuple[int, dict]:
    """The rank's actions in order; the largest (kept + running + gradients + gathered
    parameters + sends held) total. What a stage sends (its outputs after a forward, its input
    gradients after a backward) stays until the step ends: torch's runtime waits on every send
    there. `fsdp` (pp with dp: each stage one fully_shard unit), stage -> (padded whole
    parameters, padded whole gradients, gradient shard): the runtime gathers a stage's
    parameters before its first action and keeps them to its last (reshard_after_forward=False);
    its gradients stay whole until the reduce-scatter after its last backward: FSDP2 copies them
    into the reduce-scatter input, frees them, then allocates the output (the shard it keeps)."""
    held: dict[int, int] = defaultdict(int)
    pending_w: dict[int, list] = defaultdict(list)   # zero-bubble: what each micro-batch holds from I to W
    done: set = set()
    fsdp = fsdp or {}
    gathered = sum(fsdp[t][0] for t in {a.stage for a in schedule.actions[rank]} if t in fsdp)
    left = defaultdict(int)     # backward actions (B, or W) each stage has still to run
    for a in schedule.actions[rank]:
        left[a.stage] += a.kind in ("B", "W")
    reduced: set = set()
    sends = 0
    cands = []
    def held_now() -> tuple[int, int]:
        """(activations kept, gradients held) between actions."""
        kept = sum(held[t] * stages[t].kept for t in held) + sum(sum(v) for v in pending_w.values())
        return kept, sum(fsdp[t][2] if t in reduced else stages[t].grads for t in done)

    for a in schedule.actions[rank]:
        s = a.stage
        st = stages[s]
        kept, grads = held_now()
        if a.kind == "F":
            ng, g = max(st.fwd, key=sum, default=(0, 0))
            cands.append((kept + ng, grads + g, gathered, sends))
            held[s] += 1
        elif a.kind == "I" and s == 0:
            # the first stage has no input to take a gradient for: torch's runtime defers its whole
            # backward to the "W", the micro-batch's activations held until then
            held[s] -= 1
            pending_w[s].append(st.kept)
            sends += io[s][2] + io[s][3]
        elif a.kind in ("B", "I") or (a.kind == "W" and s == 0):
            first_w = a.kind == "W"
            if first_w:
                kept -= pending_w[s].pop(0)
            else:
                kept -= st.kept    # this micro-batch's own activations are inside the backward's profile
            profile = st.bwd_retained if a.kind == "I" and st.bwd_retained else st.bwd
            if s in done:      # a later micro-batch: each new gradient is added into the held one
                ng, g = max(((ng, min(g, f)) for (ng, g), f in zip(profile, st.bwd_fresh)), key=sum, default=(0, 0))
            else:
                ng, g = max(profile, key=sum, default=(0, 0))
            if not first_w:
                sends += io[s][2]              # this micro-batch's sent outputs: kept (above) until now
            cands.append((kept + ng, grads + g, gathered, sends))
            if not first_w:
                sends += io[s][3]
                held[s] -= 1
            if a.kind != "I":
                done.add(s)
            else:   # "I" (zero-bubble): the input gradient only; until its "W" the stage keeps the
                # gradient of each op output a parameter's gradient is computed from, and the
                # micro-batch's autograd graph below those ops with its saved activations (counted
                # whole: torch frees the part above the last weight op, the loss's on the last
                # stage, once it detaches the stage's output: over by that, the safe side)
                pending_w[s].append(st.kept + st.wgrad)
        elif a.kind == "W":
            cands.append((kept, grads + st.grads if s not in done else grads, gathered, sends))
            if pending_w[s]:
                pending_w[s].pop(0)
            done.add(s)
        left[s] -= a.kind in ("B", "W")
        if s in fsdp and a.kind in ("B", "W") and left[s] == 0:    # REDUCE_GRAD, then RESHARD
            kept, grads = held_now()
            cands.append((kept, grads, gathered, sends + fsdp[s][1]))
            reduced.add(s)
            gathered -= fsdp[s][0]
    return _best(cands)


def stage_io(cap: RankCapture, stage_blocks: list[list[str]]) -> list[tuple[int, int, int, int]]:
    """Per stage, bytes of one micro-batch's: values it receives, gradients it receives back for
    what it sends (torch allocates buffers for both, for every micro-batch, once), values it
    makes and sends, and gradients it sends back for what it received and that requires grad
    (the runtime keeps every send until the step ends)."""
    n = len(stage_blocks)
    stage_of_block = {b: k for k, bs in enumerate(stage_blocks) for b in bs}
    block_stage = {name: stage_of_block[r.path] for r in cap.regions.of_kind("block") for name in r.nodes}
    stage = stage_of_nodes(cap.gm, block_stage)
    users = {nd: max((stage[u] for u in nd.users if u in stage), default=-1) for nd in stage}   # as cut_stages
    recv, grad_recv, sent, grad_sent = [0] * n, [0] * n, [0] * n, [0] * n
    for nd, k in stage.items():
        v = node_value(nd)
        if not isinstance(v, torch.Tensor) or users[nd] <= k:
            continue
        nbytes = v.numel() * v.element_size()
        sent[k] += nbytes
        for j in range(k + 1, users[nd] + 1):
            recv[j] += nbytes
            if v.is_floating_point():
                grad_recv[j - 1] += nbytes
            if v.requires_grad:
                grad_sent[j] += nbytes
    return list(zip(recv, grad_recv, sent, grad_sent))
