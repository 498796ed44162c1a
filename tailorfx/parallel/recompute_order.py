"""The backward of a traced step reordered as torch's checkpoint runs it (the runtime's recompute
under tp and dp, and a chain's or a pipeline stage's blocks): each part's forward runs again when
its backward starts, a checkpointed chunk inside a block runs twice, and a block's inputs stay held
until its backward has run. parallel/trace.py applies it to each rank's traced step."""
from __future__ import annotations

import torch
import torch.fx as fx


def recompute_first(bw: fx.GraphModule, group: dict, hold_inputs: bool = False) -> None:
    """Reorder the backward graph as torch's checkpoint runs it (the runtime's recompute under dp and
    tp): when a part's backward starts, its forward runs again before any of its gradient ops,
    where AOTAutograd's partitioner recomputes each value just before its first use. A recomputed
    op (partitioner_tag "is_forward") belongs to the part whose gradient ops first use it. An op of
    a checkpoint inside a part (a chunked MLP's chunk: PREFER_RECOMPUTE, torch's checkpoint's own
    tag, where the recompute pass tags MUST_*) stays where it is: torch runs it again when that
    chunk's backward starts."""
    from torch.utils.checkpoint import CheckpointPolicy
    nodes = list(bw.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    # a recomputed op that draws random numbers runs under run_with_rng_state, which carries no tag
    forward = {n for n in nodes if n.meta.get("partitioner_tag") == "is_forward"
               or (n.op == "call_function" and "run_with_rng_state" in str(n.target))}
    recomputed = [n for n in nodes if n.op == "call_function" and n in forward]
    part: dict = {}
    for n in reversed(recomputed):
        users = sorted(n.users, key=order.get)
        owner = next((part[u] if u in part else group.get(u) for u in users if u in part or u not in forward), None)
        if owner is not None:
            part[n] = owner
    first: dict = {}
    for n in nodes:
        if n.op == "call_function" and n not in forward:
            first.setdefault(group.get(n), n)
    moved = set()
    for n in recomputed:     # in order: a value's inputs move before it does, or it stays
        if n.meta.get("recompute") == CheckpointPolicy.PREFER_RECOMPUTE:
            continue
        anchor = first.get(part.get(n))
        if (anchor is not None and order[anchor] < order[n]
                and all(order[a] < order[anchor] or a in moved for a in n.all_input_nodes)):
            anchor.prepend(n)
            moved.add(n)
    chunks_run_again(bw, group, forward)
    if hold_inputs:
        hold_block_inputs(bw, part, group, forward)
    bw.graph.lint()
    bw.recompile()


def chunks_run_again(bw: fx.GraphModule, group: dict, forward: set) -> None:
    """A checkpointed chunk inside a recomputed block runs twice in torch's backward: once in the
    block's forward run again (its output feeds the block's later ops; its intermediates are freed
    at once, its own checkpoint saving only its input), then again when its backward starts.
    AOTAutograd recomputes it once and keeps the intermediates for the chunk's backward: each
    such op (PREFER_RECOMPUTE, read by the block's other recomputed ops) gets a copy, placed
    before the first gradient op that reads it, which those gradient ops read instead."""
    from torch.utils.checkpoint import CheckpointPolicy
    chunk = {n for n in forward if n.op == "call_function"
             and n.meta.get("recompute") == CheckpointPolicy.PREFER_RECOMPUTE}
    needed: set = set()     # chunk ops the block's forward run reads (through other chunk ops)
    for n in reversed(list(bw.graph.nodes)):
        if n in chunk and any(u in forward and (u not in chunk or u in needed) for u in n.users):
            needed.add(n)
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    late = {n: [u for u in n.users if u not in forward or (u in chunk and u not in needed)] for n in needed}
    again, todo = set(), [n for n in needed if late[n]]
    while todo:     # and the chunk ops they read
        n = todo.pop()
        if n not in again:
            again.add(n)
            todo += [a for a in n.all_input_nodes if a in needed]
    runs: dict = {}
    for n in sorted(again, key=order.get):
        runs.setdefault(n.meta.get("ac_graph_id"), []).append(n)
    for ops in runs.values():
        anchor = min((u for n in ops for u in late[n]), key=order.get)
        if any(order[a] >= order[anchor] for n in ops for a in n.all_input_nodes if a not in ops):
            continue    # the chunk's inputs come later than its backward: left as traced
        copies: dict = {}
        with bw.graph.inserting_before(anchor):
            for n in ops:
                c = copies[n] = bw.graph.node_copy(n, lambda a: copies.get(a, a))
                c.meta = dict(n.meta)
                forward.add(c)
                if n in group:
                    group[c] = group[n]
        for n in ops:
            for u in late[n]:
                u.replace_input_with(n, copies[n])


def hold_block_inputs(bw: fx.GraphModule, part: dict, group: dict, forward: set) -> None:
    """torch's checkpoint saves a block's inputs until the block's backward has run (its frame holds
    them), where AOTAutograd's graph lets a saved value go after its last use: each saved value a
    part's recomputed ops read (an attention mask, rotary tables) is read once more, as a view, by
    the part's last gradient op."""
    last: dict = {}
    for n in bw.graph.nodes:
        if n.op == "call_function" and n not in forward and group.get(n) is not None:
            last[group[n]] = n
    for g, end in last.items():
        inputs = {a: None for n, p in part.items() if p == g for a in n.all_input_nodes if a.op == "placeholder"}
        with bw.graph.inserting_after(end):
            for a in inputs:
                bw.graph.call_function(torch.ops.aten.alias.default, (a,)).meta.update(a.meta)
