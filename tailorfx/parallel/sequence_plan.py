"""Megatron's sequence parallelism (sp="megatron") read off the graph, on top of a tensor-parallel
plan (tp_plan.py): the residual stream between the sharded groups (embedding output, norms,
residual adds) split over the tp ranks along the sequence instead of repeated on each; a region
that would need the whole sequence refuses it, named.

    before: embed -> norm -> [attention group] -> + -> norm -> [MLP group] -> + -> norm -> head
    styles: embed embedding_to_sequence:1; norms sequence_parallel:1; each group's module
            gather_sequence, its row-parallel linears rowwise_to_sequence:1; the head *_from_sequence:1
"""
from __future__ import annotations

import torch
import torch.fx as fx

from tailorfx.parallel.shapes import same, shape_of
from tailorfx.parallel.tp_plan import Group, TPPlan, linear_modules, param_names, param_only
from tailorfx.rewrite import match
from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.regions import is_param, module_paths


class SequenceParallelError(ValueError):
    """The graph has a region Megatron's sequence parallelism cannot shard; names it and why."""


def infer_sequence_parallel(gm: fx.GraphModule, example_inputs: list, model: torch.nn.Module, plan: TPPlan,
                            regions) -> dict[str, str]:
    """Megatron's sequence parallelism on top of `plan`, read off the graph: the residual stream
    between the sharded groups (embedding output, norms, residual adds) is split over the tp
    ranks along the sequence instead of repeated on each. Each group's module gathers the
    sequence on entry ("gather_sequence"), its row-parallel linears reduce-scatter back to
    sequence shards ("rowwise_to_sequence:1"), each norm on the stream computes on its shard
    ("sequence_parallel:1"), the embedding's output is split ("embedding_to_sequence:1") and the
    head takes its input from the shards. Returns the styles that replace or add to
    `plan.styles`; SequenceParallelError names a region that would need the whole sequence."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = dict(zip(placeholders, example_inputs))
    names = param_names(values, model)
    linears, owner = linear_modules(gm, values, names, model)
    fqn_nodes: dict[str, list[fx.Node]] = {}
    for n, f in linears.items():
        if f is not None:
            fqn_nodes.setdefault(f, []).append(n)
    nodes = list(gm.graph.nodes)
    embeds = [n for n in nodes if match.op_name(n) == "embedding" and any(is_param(a) for a in n.all_input_nodes)]
    ids = values.get(next((p for p in placeholders if "input_ids" in p.name), None))
    stream = [n for n in embeds if (s := shape_of(n)) and len(s) == 3 and ids is not None
              and same(s[1], ids.shape[-1])]
    if not stream:
        raise SequenceParallelError("sp='megatron' found no token embedding of shape (batch, sequence, hidden) "
                                    "fed by input_ids in the graph: it needs input_ids to split the sequence")
    styles: dict[str, str] = {}
    for n in stream:
        styles[(module_paths(n) or [n.name])[-1]] = "embedding_to_sequence:1"
    parents = []
    for g in plan.groups:
        parent = _group_module(g)
        _check_group_module(parent, g, fqn_nodes)
        parents.append(parent)
        styles[parent] = "gather_sequence"
        styles.update({f: "rowwise_to_sequence:1" for f in g.rowwise})
    head = next(iter(regions.of_kind("lm_head_loss")), None)
    inside = lambda n, p: any(q == p or q.startswith(p + ".") for q in module_paths(n))
    norms = {}
    for r in regions.of_kind("norm"):
        if any(r.path == p or r.path.startswith(p + ".") for p in parents):
            continue
        if not r.token_wise:
            raise SequenceParallelError(f"sp='megatron': the norm {r.path} mixes sequence positions, so it cannot "
                                        f"compute on a shard of the sequence; drop sp='megatron'")
        norms[r.path] = set(r.nodes)
        styles[r.path] = "sequence_parallel:1"
    head_nodes = set(head.nodes) if head is not None else set()
    on_stream = match.users_closure(stream)
    for n in on_stream:
        if (n.op != "call_function" and n.op != "call_method") or n.name in head_nodes:
            continue
        if any(inside(n, p) for p in parents) or any(n.name in ns for ns in norms.values()):
            continue
        if any(is_param(a) for a in n.all_input_nodes) and n not in stream and not _in_embedding(n, styles):
            where = (module_paths(n) or ["the model's own forward"])[-1]
            raise SequenceParallelError(f"sp='megatron': {where} computes with parameters on the residual stream "
                                        f"({n.name}) and is neither a norm nor a tensor-parallel group, so it "
                                        f"would need the whole sequence: drop sp='megatron' (tp without it "
                                        f"keeps that region whole on each rank)")
    if head is not None:
        st = plan.styles.get(head.path)
        styles[head.path] = (f"{st}_from_sequence:1" if st in ("colwise_vocab_parallel", "colwise_gather_output")
                             else "gather_sequence")
    return styles


def _in_embedding(n: fx.Node, styles: dict[str, str]) -> bool:
    return any(styles.get(p) == "embedding_to_sequence:1" for p in module_paths(n))


def _group_module(g: Group) -> str:
    """The innermost module holding every linear of the group (an attention, an MLP)."""
    parts = [f.split(".") for f in g.colwise + g.rowwise]
    common = []
    for xs in zip(*parts):
        if len(set(xs)) != 1:
            break
        common.append(xs[0])
    if len(common) == min(len(p) for p in parts):     # one linear is the whole group: its parent
        common = common[:-1]
    return ".".join(common)


def _check_group_module(parent: str, g: Group, fqn_nodes: dict) -> None:
    """The group's module must take the column-parallel inputs from outside (its entry gathers
    them) and return the row-parallel outputs without mixing them with its own tensors."""
    inside = lambda n: any(q == parent or q.startswith(parent + ".") for q in module_paths(n))
    for f in g.colwise:
        for n in fqn_nodes.get(f, []):
            x = n.args[0]
            if isinstance(x, fx.Node) and x.op != "placeholder" and inside(x) and x not in g.region:
                raise SequenceParallelError(f"sp='megatron': {f} reads {x.name}, computed inside {parent}, so "
                                            f"{parent}'s entry cannot gather the sequence for it; drop sp='megatron'")
    rows = [n for f in g.rowwise for n in fqn_nodes.get(f, [])]
    down = {n for n in match.users_closure(rows) if inside(n)} | set(rows)
    for n in down:
        for a in n.all_input_nodes:
            if a in down or not isinstance(node_value(a), torch.Tensor) or param_only(a):
                continue
            if n not in rows:
                raise SequenceParallelError(f"sp='megatron': {parent} combines the row-parallel output of "
                                            f"{g.rowwise[0]} with {a.name} at {n.name}, so it cannot return "
                                            f"sequence shards; drop sp='megatron'")
