"""A deep model predicted from a shallow capture: a config's decoder layers repeat, so the step of
its `layers` blocks is captured with a few of them (the first, runs of three periods of the
repeating pattern, the last), and the memory model's timeline is composed for the real depth by
repeating each run's middle period's events (each op's change in live, gradient and host bytes,
and its transient) as many times as the real model has more periods.

This is exact where the periods' events are the same, which `compose` checks on each run (the
middle period's events must be a neighbour's): a step whose periods differ is not composed (the
caller captures the whole model: NotComposable). Only the model families whose composed steps
the tests prove equal to the whole model's are reduced (FAMILIES).
"""
from __future__ import annotations

import copy
import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

# families whose composed predictions tests/test_depth.py checks against the whole model's
FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "mistral")


def _cache_outside_blocks(config: Any) -> bool:
    """Whether a step of `config` builds a KV cache with a tensor per sliding-window layer outside
    the layers (transformers' DynamicSlidingWindowLayer, with use_cache): no block owns it, so
    the repeats would miss it (8 bytes a layer)."""
    types = getattr(config, "layer_types", None)
    sliding = getattr(config, "sliding_window", None) and (types is None or "sliding_attention" in types)
    return bool(getattr(config, "use_cache", False) and sliding)


class NotComposable(ValueError):
    """The captured step's blocks do not repeat alike: predict from the whole model instead (a
    ValueError, so the backend raises it rather than running the graph as captured)."""


@dataclass(frozen=True)
class Depth:
    """How a captured model of `captured` blocks stands for one of `layers`. From block `start`,
    the captured blocks hold sites of three periods of `period` blocks each; the middle period of
    site j repeats `times[j]` more times in the real model (two sites let a plan recompute the
    first k blocks: the first site's periods recomputed, the second's not). `period_tensors`:
    the (numel, dtype, trained) of each parameter and buffer of one period (the weights,
    gradients and optimizer state the repeats add); `blocks_path`: the qualified name of the
    blocks' ModuleList, which the graphs' module stacks name."""
    layers: int
    captured: int
    start: int
    period: int
    times: tuple
    blocks_path: str = ""
    period_tensors: tuple = ()

    @property
    def repeats(self) -> int:
        """Periods the real model has beyond the captured ones."""
        return sum(self.times)

    def middle(self, site: int) -> range:
        """The captured blocks of site `site`'s middle period (the one that repeats)."""
        first = self.start + (3 * site + 1) * self.period
        return range(first, first + self.period)

    def site(self, site: int) -> list[range]:
        """Site `site`'s three periods, in forward order."""
        first = self.start + 3 * site * self.period
        return [range(first + j * self.period, first + (j + 1) * self.period) for j in range(3)]

    def for_recompute(self, k: Optional[int]) -> tuple[Optional[int], "Depth"]:
        """(the captured blocks to recompute, the Depth) for a plan that recomputes the real
        model's first `k` blocks (None: all, or none: the repeats all in the first site). With
        two sites, the first site's repeats are recomputed blocks, the second's are not."""
        total = self.repeats
        if k is None or len(self.times) < 2:
            return k, replace(self, times=(total,) + (0,) * (len(self.times) - 1))
        p, first = self.period, self.start + 3 * self.period
        before = max(0, min(total, (k - first) // p))
        return k - before * p, replace(self, times=(before, total - before) + (0,) * (len(self.times) - 2))

    def block_of(self, node: fx.Node) -> Optional[int]:
        """The captured block whose module made `node` (a forward op, or a backward op by the
        forward op it differentiates), None outside the blocks."""
        stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
        if not stack:
            return None
        # innermost first; the innermost may be no block's (transformers' hub-kernel function wrappers)
        for path, _ in reversed(list(stack.values())):
            if m := re.search(rf"{re.escape(self.blocks_path)}\.(\d+)(?:\.|$)", _dotted(path)):
                return int(m.group(1))
        return None

    def weight(self, node: fx.Node) -> int:
        """How many blocks of the real model a captured op stands for (1 outside the repeats)."""
        b = self.block_of(node)
        return 1 + sum(t for j, t in enumerate(self.times) if b is not None and b in self.middle(j))

def _dotted(path: str) -> str:
    """Dynamo's source path (L['args'][0].model.layers[2], L['self'].model.layers.2) as dots."""
    return re.sub(r"\[(\d+)\]", r".\1", path)


def period_of(types: Sequence[Any]) -> int:
    """The shortest period of a per-layer list (layer_types): 1 when all alike."""
    n = len(types)
    return next(p for p in range(1, n + 1) if all(types[i] == types[i + p] for i in range(n - p)))


def reduced(config: Any, sites: int = 1) -> Optional[tuple[Any, Depth]]:
    """(a copy of a transformers config with fewer decoder layers, the Depth it stands for), or
    None where the family is not one proven alike, its step builds a cache outside the blocks,
    its layers do not repeat, or it is already shallow. `sites`: how many runs of three periods
    the copy keeps (two for plans that recompute some blocks and not others)."""
    if getattr(config, "model_type", None) not in FAMILIES or not hasattr(config, "to_dict") \
            or _cache_outside_blocks(config):
        return None
    L = getattr(config, "num_hidden_layers", None)
    types = getattr(config, "layer_types", None)
    if not isinstance(L, int) or (types is not None and len(types) != L):
        return None
    p = period_of(types) if types else 1
    start = 1 + (L - 2) % p          # the first block(s), then whole periods, then the last block
    captured = start + 3 * sites * p + 1
    if L <= captured:
        return None
    small = copy.deepcopy(config)
    small.num_hidden_layers = captured
    if types:
        small.layer_types = list(types[:captured - 1]) + list(types[L - 1:])
    return small, Depth(layers=L, captured=captured, start=start, period=p,
                        times=((L - captured) // p,) + (0,) * (sites - 1))


def with_model(depth: Depth, model: nn.Module) -> Depth:
    """`depth` completed from the captured model: its blocks' ModuleList and one period's tensors
    (NotComposable when no ModuleList of the captured depth is found)."""
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) == depth.captured:
            period = m[depth.start:depth.start + depth.period]   # every period's tensors are alike
            tensors = tuple((t.numel(), t.dtype, isinstance(t, nn.Parameter) and t.requires_grad)
                            for t in [*period.parameters(), *period.buffers()])
            return replace(depth, blocks_path=name, period_tensors=tensors)
    raise NotComposable(f"no list of {depth.captured} blocks in the shallow model")


# points the memory model marks once per gradient after the backward graph (memory._accumulate):
# their number follows the depth, and they are not repeated here
PER_GRADIENT = ("optimizer_hook", "master_grad")


@dataclass
class Composed:
    """The composed step's timeline, as memory_estimate.Timeline's points, gradient bytes and
    host peak."""
    points: list
    grads: list
    host_peak: int
    extras: list
    hosts: list
    repeats: dict   # captured point -> how many more times the composed step runs it


def compose(points: Sequence[tuple[str, str, int]], extras: Sequence[int], grads: Sequence[int],
            hosts: Sequence[int], block: dict, depth: Depth) -> Optional[Composed]:
    """The timeline of the real depth from the captured one's: `points` (phase, node, live bytes
    with the op's transient), `extras` (that transient), `grads` and `hosts` (gradient and host
    bytes live) after each op; `block[(phase, node)]`: the captured block of that op (absent
    outside the blocks). Each site's middle period (in the order the phase runs its blocks) is
    repeated after itself, an op of it that runs elsewhere in place; None where a middle
    period's events differ from both neighbours' or the blocks do not run in order."""
    n = len(points)
    if any(nd in PER_GRADIENT for _, nd, _ in points):
        return None
    step = [(points[i][2] - extras[i] - (points[i - 1][2] - extras[i - 1] if i else 0), extras[i],
             grads[i] - (grads[i - 1] if i else 0), hosts[i] - (hosts[i - 1] if i else 0)) for i in range(n)]
    tag = [block.get((ph, nd)) for ph, nd, _ in points]
    out: list[int] = []     # indices of the captured points, the repeated ones as often as they run
    i = 0
    for phase in _phases(points):
        idx = [k for k in range(i, n) if points[k][0] == phase]
        if not idx or idx[0] != i or idx[-1] != i + len(idx) - 1:
            return None
        i += len(idx)
        # an op that allocates nothing (a weight's transpose the partitioner moved to the end of
        # the forward) may run outside its block: its repeats would not change a byte
        raw = [tag[k] for k in idx]
        tags = [None if step[k] == (0, 0, 0, 0) else tag[k] for k in idx]
        inserts = {}     # position in the phase -> the captured points repeated there
        for site, times in enumerate(depth.times):
            if not times or not any(t is not None for t in tags):
                continue
            cut = _site_cuts(tags, depth.site(site), phase.startswith("forward"))
            if cut is None:
                return None
            # the middle period, whose neighbours are periods too, repeats: its events must be
            # those of a neighbour (the others may differ by what the block next to them does)
            runs = [[step[idx[k]] for k in range(cut[j], cut[j + 1])] for j in range(3)]
            if runs[1] != runs[0] and runs[1] != runs[2]:
                return None
            inserts.setdefault(cut[2], []).extend([idx[k] for k in range(cut[1], cut[2])] * times)
            # an op of the middle period that runs elsewhere (a constant lifted to the graph's
            # start) runs once per repeat there too
            middle = depth.middle(site)
            for k in [*range(cut[0]), *range(cut[3], len(idx))]:
                if raw[k] is not None and raw[k] in middle:
                    inserts.setdefault(k + 1, []).extend([idx[k]] * times)
        for k in range(len(idx)):
            out += inserts.get(k, [])
            out.append(idx[k])
        out += inserts.get(len(idx), [])
    total = grad = host = 0
    c = Composed([], [], 0, [], [], {k: n - 1 for k, n in Counter(out).items() if n > 1})
    for k in out:
        d_total, extra, d_grad, d_host = step[k]
        total, grad, host = total + d_total, grad + d_grad, host + d_host
        c.points.append((points[k][0], points[k][1], total + extra))
        c.grads.append(grad)
        c.extras.append(extra)
        c.hosts.append(host)
        c.host_peak = max(c.host_peak, host)
    return c


def _phases(points) -> list[str]:
    seen: list[str] = []
    for ph, _, _ in points:
        if not seen or seen[-1] != ph:
            seen.append(ph)
    return seen


def _site_cuts(tags: list, periods: list[range], forward: bool) -> Optional[list[int]]:
    """Where each of a site's three periods starts in a phase's ops (`tags`: each op's captured
    block), and where the block after them starts (one op of another block may run early: a
    value CSE shared among the blocks); None unless each period holds only its own blocks' ops
    (and unattributed ones)."""
    order = periods if forward else periods[::-1]
    cuts = [_first(tags, order[0], 0)]
    for r in order[1:]:
        cuts.append(_first(tags, r, cuts[-1]) if cuts[-1] is not None else None)
    if cuts[-1] is None:
        return None
    inside = lambda t: t is not None and any(t in r for r in periods)   # noqa: E731
    cuts.append(next((k for k in range(cuts[-1], len(tags)) if tags[k] is not None and not inside(tags[k])), None))
    if cuts[-1] is None:
        return None
    for j, r in enumerate(order):
        if any(t is not None and t not in r for t in tags[cuts[j]:cuts[j + 1]]):
            return None
    return cuts


def _first(tags: list, blocks: range, start: int) -> Optional[int]:
    return next((k for k in range(start, len(tags)) if tags[k] is not None and tags[k] in blocks), None)


def block_tags(steps: Sequence, depth: Depth) -> dict:
    """(phase, node name) -> captured block, for the forward and backward graphs of `steps` as
    memory.simulate_step names their phases."""
    out = {}

    def users_block(n: fx.Node, saved: dict) -> Optional[int]:
        """The one block that uses `n` (a saved value: the backward's users of it), if one."""
        users = {saved.get(n.name) if u.op == "output" else depth.block_of(u) for u in n.users}
        return users.pop() if len(users) == 1 else None
    for k, st in enumerate(steps):
        saved: dict = {}
        for phase, g in ((f"backward[{k}]", st.bw), (f"forward[{k}]", st.fw)):
            if g is None:
                continue
            sched = st.bw_schedule if phase.startswith("backward") else st.fw_schedule
            if sched is not None:   # lowered by Inductor: its kernels, by the fx nodes each runs
                out.update(_kernel_tags(sched, phase, depth))
                continue
            for n in g.graph.nodes:
                b = depth.block_of(n)
                if b is None and n.op in ("call_function", "placeholder"):
                    # a constant or other op no module made (a scalar a block's backward reads): its users'
                    b = users_block(n, saved)
                if b is None:
                    continue
                if n.op == "placeholder":
                    saved[n.name] = b
                else:
                    out[(phase, n.name)] = b
    return out


def _kernel_tags(sched, phase: str, depth: Depth) -> dict:
    """(phase, kernel) -> captured block, for an Inductor schedule's kernels whose fx nodes are all
    of one block. A kernel without nodes (a fused C++ kernel on CPU), of several blocks, or whose
    name recurs (the same code called for each block) is left unattributed: the periods are cut
    at the attributed ones."""
    names = Counter(sched.names)
    out = {}
    for name, origins in zip(sched.names, sched.origins):
        blocks = {depth.block_of(o) for o in origins}
        if names[name] == 1 and len(blocks) == 1 and None not in blocks:
            out[(phase, name)] = blocks.pop()
    return out


def period_sizes(depth: Depth) -> tuple[int, list[tuple[int, torch.dtype]]]:
    """(bytes of one period's parameters and buffers, (numel, dtype) of its trained parameters)."""
    nbytes = sum(n * dt.itemsize for n, dt, _ in depth.period_tensors)
    return nbytes, [(n, dt) for n, dt, trained in depth.period_tensors if trained]
