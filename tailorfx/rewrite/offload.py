"""Saved activations offloaded to host memory between forward and backward (ALST's checkpoint offload).

A pass tags Dynamo nodes (``node.meta["custom"][OFFLOAD_TAG]``; the recompute pass tags each
block's input, the checkpoint the block is recomputed from); AOTAutograd copies the tag onto the
ATen nodes traced from them. After partitioning, every tagged tensor the forward saves is copied
to host memory after its last use in the forward, and back where the backward first reads it:

    fw: add_3 = add(...); ...; return (loss, add_3)
    --> fw: add_3 = add(...); ...(last use of add_3); add_3_host = offload(add_3); return (loss, add_3_host)
    bw: add_3 (placeholder)  -->  bw: add_3 (placeholder, on host); add_3_dev = reload(add_3, device)

Values are unchanged (a copy each way). Each reload is issued one block early, when the backward
first reads the reload before it, and `reloaded` (a wait) stands before its own first reader: on a
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


def tag(node: fx.Node) -> None:
    """Ask that what `node` computes be kept in host memory while it waits for the backward."""
    node.meta.setdefault("custom", {})[OFFLOAD_TAG] = True


def tagged(node: fx.Node) -> bool:
    return bool((node.meta.get("custom") or {}).get(OFFLOAD_TAG))


def _offloadable(o: fx.Node) -> bool:
    """A tagged value that owns its storage: not a view (its base would stay), contiguous (the
    backward reads the same strides)."""
    v = node_value(o)
    src = o.args[0] if match.is_getitem(o) and isinstance(o.args[0], fx.Node) else o
    return (isinstance(v, torch.Tensor) and v.is_contiguous() and v.is_floating_point()
            and (tagged(o) or tagged(src)) and not (o.op == "call_function" and aliases_input(o)))


def offload_saved(fw: fx.GraphModule, bw: Optional[fx.GraphModule], num_fwd_outputs: int) -> int:
    """Rewrite `fw` and `bw` in place (and recompile them); returns how many saved tensors now
    wait for the backward in host memory. The backward reloads them one block ahead."""
    out = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    outs = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    user_outputs = {o for o in outs[:num_fwd_outputs] if isinstance(o, fx.Node)}
    order = {n: i for i, n in enumerate(fw.graph.nodes)}

    def route(o: fx.Node) -> Optional[Route]:
        if o in user_outputs or o.op == "placeholder" or not _offloadable(o):
            return None
        v = node_value(o)
        readers = [u for u in o.users if u is not out]    # the copy goes out after the last of them
        return Route(max(readers, key=order.__getitem__) if readers else o, OFFLOAD, (),
                     v.new_empty(v.shape, device="cpu") if v.device.type != "cpu" else v, RELOAD, (v.device,))
    count = reroute_saved(fw, bw, num_fwd_outputs, route)
    if count:
        prefetch_reloads(bw)
    return count


def prefetch_reloads(bw: fx.GraphModule) -> None:
    """Put a `reloaded` wait before each reload's first reader, then move each reload but the first
    to just after the previous one's wait: the copy of the next block's checkpoint is issued when the
    current block's backward starts (a reload's inputs are a placeholder and a device, so it can
    move anywhere after the placeholders)."""
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    reloads = [n for n in bw.graph.nodes if n.target is RELOAD and n.users]
    reloads.sort(key=lambda r: min(order[u] for u in r.users))
    waits = []
    for r in reloads:
        with bw.graph.inserting_before(min(r.users, key=order.__getitem__)):
            wait = bw.graph.call_function(RELOADED, (r,))
        wait.meta["val"] = None
        waits.append(wait)
    for wait, nxt in zip(waits, reloads[1:]):
        wait.append(nxt)
    bw.graph.lint()
    bw.recompile()
