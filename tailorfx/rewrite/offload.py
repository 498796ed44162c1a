"""Saved activations offloaded to host memory between forward and backward (ALST's checkpoint
offload, torchtune's activation offload).

A pass tags Dynamo nodes (``node.meta["custom"][OFFLOAD_TAG]``; the recompute pass tags each
block's input, the checkpoint the block is recomputed from, or under offload="activations" every op
of a block, with the block as the tag's group); AOTAutograd copies the tag onto the ATen nodes
traced from them. After partitioning, every tagged tensor the forward saves is copied
to host memory after its last use in the forward, and back where the backward first reads it:

    fw: add_3 = add(...); ...; return (loss, add_3)
    --> fw: add_3 = add(...); ...(last use of add_3); add_3_host = offload(add_3); return (loss, add_3_host)
    bw: add_3 (placeholder)  -->  bw: add_3 (placeholder, on host); add_3_dev = reload(add_3, device)

Values are unchanged (a copy each way). Each group's reloads (a block's tensors; an untagged
group is one tensor) are issued one group early, when the backward first reads the group before
it, and `reloaded` (a wait) stands before its own first reader: on a
GPU the copies run on a stream of their own (runtime/offload.py), so the next block's checkpoint
arrives while the current block's backward computes:

    bw: add_3_dev = reload(add_3); reloaded(add_3_dev); ...block 3...; add_2_dev = reload(add_2)  -->
    bw: add_3_dev = reload(add_3); reloaded(add_3_dev); add_2_dev = reload(add_2); ...block 3...; reloaded(add_2_dev)

The device holds the tensor from its making to its last forward use and from its reload (the
prefetch) to its last backward use; the host holds the copy in between. The memory model counts the
copies as host bytes (rewrite/memory_graph.py), apart from the device's, and the prefetched
checkpoint where the graph now holds it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from tailorfx.rewrite import match
from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.optimizer_step import aliases_input
from tailorfx.rewrite.saved_route import Route, reroute_saved
from tailorfx.runtime.offload import OFFLOAD, RELOAD, RELOADED

OFFLOAD_TAG = "tailorfx_offload"   # key in node.meta["custom"]: offload what it computes if saved
HOST_OPS = frozenset({OFFLOAD})    # ops whose outputs live in host memory


def tag(node: fx.Node, group: Optional[int] = None) -> None:
    """Ask that what `node` computes be kept in host memory while it waits for the backward;
    the tensors of one `group` (a positive int: a block) are reloaded together, one group ahead."""
    node.meta.setdefault("custom", {})[OFFLOAD_TAG] = True if group is None else int(group)


def tagged(node: fx.Node) -> bool:
    return bool((node.meta.get("custom") or {}).get(OFFLOAD_TAG))


def _group(node: fx.Node) -> Optional[int]:
    g = (node.meta.get("custom") or {}).get(OFFLOAD_TAG)
    return g if type(g) is int else None


def _offloadable(o: fx.Node) -> bool:
    """A tagged value that owns its storage: not a view (its base would stay), contiguous (the
    backward reads the same strides)."""
    v = node_value(o)
    src = o.args[0] if match.is_getitem(o) and isinstance(o.args[0], fx.Node) else o
    return (isinstance(v, torch.Tensor) and v.is_contiguous() and v.is_floating_point()
            and (tagged(o) or tagged(src)) and not (o.op == "call_function" and aliases_input(o)))


def offload_saved_waiting(fw: fx.GraphModule, bw: Optional[fx.GraphModule], num_fwd_outputs: int) -> int:
    """offload_saved for Inductor's graphs: its code reuses a buffer after its last use, so the
    compute stream waits for each copy out (runtime/offload.py)."""
    return offload_saved(fw, bw, num_fwd_outputs, wait=True)


def offload_saved(fw: fx.GraphModule, bw: Optional[fx.GraphModule], num_fwd_outputs: int, wait: bool = False) -> int:
    """Rewrite `fw` and `bw` in place (and recompile them); returns how many saved tensors now
    wait for the backward in host memory. The backward reloads them one block ahead. `wait`: the
    offload op's (the compute stream waits for the copy)."""
    out = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    outs = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    user_outputs = {o for o in outs[:num_fwd_outputs] if isinstance(o, fx.Node)}
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    groups: dict = {}   # the name of a saved tensor (its backward placeholder's) -> its group

    def route(o: fx.Node) -> Optional[Route]:
        if o in user_outputs or o.op == "placeholder" or not _offloadable(o):
            return None
        src = o.args[0] if match.is_getitem(o) and isinstance(o.args[0], fx.Node) else o
        groups[o.name] = _group(o) if _group(o) is not None else _group(src)
        v = node_value(o)
        readers = [u for u in o.users if u is not out]    # the copy goes out after the last of them
        return Route(max(readers, key=order.__getitem__) if readers else o, OFFLOAD, (True,) if wait else (),
                     v.new_empty(v.shape, device="cpu") if v.device.type != "cpu" else v, RELOAD, (v.device,))
    count = reroute_saved(fw, bw, num_fwd_outputs, route)
    if count:
        prefetch_reloads(bw, groups)
    return count


def prefetch_reloads(bw: fx.GraphModule, groups: Optional[dict] = None) -> None:
    """Put a `reloaded` wait before each reload's first reader, then move each group's reloads but
    the first group's to just after the previous group's first wait: the copies of the next block's
    tensors are issued when the current block's backward starts (a reload's inputs are a placeholder
    and a device, so it can move anywhere after the placeholders). `groups`: a placeholder's name ->
    its group (None, or a name absent: a group of its own)."""
    groups = groups or {}
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    reloads = [n for n in bw.graph.nodes if n.target is RELOAD and n.users]
    reloads.sort(key=lambda r: min(order[u] for u in r.users))
    waits = {}
    for r in reloads:
        with bw.graph.inserting_before(min(r.users, key=order.__getitem__)):
            wait = bw.graph.call_function(RELOADED, (r,))
        wait.meta["val"] = None
        waits[r] = wait
    runs: list = []   # the reloads grouped, in the order the backward first reads each group
    firsts: dict = {}
    for r in reloads:
        g = groups.get(r.args[0].name)
        key = ("group", g) if g is not None else ("one", r)
        if key not in firsts:
            firsts[key] = len(runs)
            runs.append([])
        runs[firsts[key]].append(r)
    for prev, nxt in zip(runs, runs[1:]):
        at = waits[prev[0]]
        for r in reversed(nxt):
            at.append(r)
    # each copy and wait counts as part of the op it is issued before (its module: the block whose
    # backward the copy overlaps), so a block's timeline holds the prefetch it issues (rewrite/depth.py)
    stack = None
    for n in reversed(list(bw.graph.nodes)):
        if n.target in (RELOAD, RELOADED):
            if stack is not None:
                n.meta["fwd_nn_module_stack"] = stack
        elif n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack"):
            stack = n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack")
    bw.graph.lint()
    bw.recompile()
