"""Saved activations offloaded to host memory between forward and backward (ALST's checkpoint offload).

A pass tags Dynamo nodes (``node.meta["custom"][OFFLOAD_TAG]``; the recompute pass tags each
block's input, the checkpoint the block is recomputed from); AOTAutograd copies the tag onto the
ATen nodes traced from them. After partitioning, every tagged tensor the forward saves is copied
to host memory after its last use in the forward, and back where the backward first reads it:

    fw: add_3 = add(...); ...; return (loss, add_3)
    --> fw: add_3 = add(...); ...(last use of add_3); add_3_host = offload(add_3); return (loss, add_3_host)
    bw: add_3 (placeholder)  -->  bw: add_3 (placeholder, on host); add_3_dev = reload(add_3, device)

Values are unchanged (a copy each way). The device holds the tensor from its making to its last
forward use and from its reload to its last backward use; the host holds the copy in between. The
memory model counts the copies as host bytes (rewrite/memory_graph.py), apart from the device's.
The reload is not prefetched: on a GPU each copy waits for the compute before it (no overlap yet).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from tailorfx.rewrite import match
from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.optimizer_step import aliases_input
from tailorfx.rewrite.saved_route import Route, reroute_saved
from tailorfx.runtime.offload import OFFLOAD, RELOAD

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
    wait for the backward in host memory."""
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
    return reroute_saved(fw, bw, num_fwd_outputs, route)
