"""Pipeline stages cut from the captured graph, run by torch.distributed.pipelining with a
tailorfx schedule (codegen/schedule.py).

The whole training step's graph (static shapes) is cut at block boundaries: a node runs on the
stage of its block, or, outside blocks, on the latest stage among its inputs (the embedding and
rotary tables on the first, norm, head and loss on the last). Each stage sends on every value a
later stage needs (hidden states, rotary tables, masks) and receives the earlier stage's; graph
inputs a later stage reads (labels) reach every stage as keyword arguments. A stage's
parameters are the model's own Parameter objects, so gradients land on the model.
"""
from __future__ import annotations

import re
from typing import Optional

import torch
import torch.fx as fx
import torch.nn as nn

from tailorfx.rewrite.passes import own, owned


class StageModule(nn.Module):
    """One stage: `forward(*received, **graph_inputs)` runs its slice of the graph and returns the
    values later stages need (the last stage: the loss)."""

    def __init__(self, gm: fx.GraphModule, kw_names: list[str]):
        super().__init__()
        self.gm = gm
        self.kw_names = kw_names

    def forward(self, *received, **graph_inputs):
        return self.gm(*received, *[graph_inputs[k] for k in self.kw_names])


def _is_tensor(n: fx.Node) -> bool:
    v = n.meta.get("example_value", n.meta.get("val"))
    return isinstance(v, torch.Tensor)


def stage_of_nodes(gm: fx.GraphModule, block_stage: dict[str, int]) -> dict[fx.Node, int]:
    """Node -> stage. Block nodes: their block's. Nodes that depend on a block or a parameter:
    the latest stage among their inputs. The rest (label shifts, rotary tables, masks: made from
    graph inputs and buffers alone) run on the earliest stage that uses them, so integer tensors
    never cross a stage; a node nobody uses (a grad-mode switch) stays with the node after it."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    stage: dict[fx.Node, int] = {}
    free = set()
    for n in nodes:
        if n.name in block_stage:
            stage[n] = block_stage[n.name]
            continue
        anchored = [a for a in n.all_input_nodes if a in stage or
                    (a.op == "placeholder" and isinstance(a.meta.get("example_value"), nn.Parameter))]
        if anchored:
            stage[n] = max((stage[a] for a in anchored if a in stage), default=0)
        else:
            free.add(n)
    following = None
    for n in reversed(nodes):
        if n in free:
            used = [stage[u] for u in n.users if u in stage]
            stage[n] = min(used) if used else (stage[following] if following is not None else 0)
        following = n
    return stage


class StagePieces(nn.Module):
    """Consecutive stages run as one (a pipeline stage made of a piece per block, each of which
    can be checkpointed): `forward(*received, **graph_inputs)` feeds each piece the values the one
    before it returns, and returns the last's."""

    def __init__(self, pieces: list[StageModule]):
        super().__init__()
        self.pieces = nn.ModuleList(pieces)

    def forward(self, *received, **graph_inputs):
        values = received
        for piece in self.pieces:
            values = piece(*values, **graph_inputs)
        return values


class StageChain(StagePieces):
    """Stages run one after another in this process (a pipeline of one rank): `forward(**batch)`
    returns the loss. The graph was captured at one shape (`shapes`); another is refused."""

    def __init__(self, stages: list[StageModule], shapes: dict[str, tuple]):
        super().__init__(stages)
        self.shapes = shapes

    @property
    def stages(self) -> nn.ModuleList:
        return self.pieces

    def forward(self, **batch) -> torch.Tensor:
        got = {k: tuple(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        if got != self.shapes:
            raise ValueError(f"the step graph was captured for inputs of shapes {self.shapes}, got {got}: give "
                             f"every batch that shape (a static graph cut at its blocks runs at one shape)")
        return super().forward(**batch)[0].clone()    # not a view: FSDP's root hooks its output for backward


def loss_only(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a step graph that returns its loss alone, what nothing else needs removed (the
    logits, a KV cache: a chain's caller gets the loss, as a pipeline's last stage returns it)."""
    g, env = fx.Graph(), {}
    g.graph_copy(gm.graph, env)     # the nodes' meta shared, not copied (it holds the parameters)
    g.output((env[_loss_node(gm)],))
    g.eliminate_dead_code()
    return fx.GraphModule(gm, g)


def chain_stages(gm: fx.GraphModule, block_nodes: list[list[str]]) -> dict[str, int]:
    """Node name -> stage for a StageChain: block i's nodes on stage i + 1, every node after the
    last block's (norm, head, loss) on the stage after it; the rest as stage_of_nodes places them
    (the embedding on stage 0)."""
    stage = {name: i + 1 for i, names in enumerate(block_nodes) for name in names}
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    last = max((i for i, n in enumerate(nodes) if n.name in stage), default=len(nodes))
    stage.update({n.name: len(block_nodes) + 1 for n in nodes[last + 1:]})
    return stage


def cut_stages(gm: fx.GraphModule, example_inputs: list, model: nn.Module, block_stage: dict[str, int],
               num_stages: int, kwargs: dict, shared: bool = False) -> list[StageModule]:
    """The graph cut into `num_stages` StageModules (see the module docstring); `kwargs` are the
    model's keyword inputs the graph was captured with (their names are the stages' keywords).
    `shared`: a parameter may be read on two stages (one process runs them all: its gradient
    accumulates on the one Parameter)."""
    kw_name = {id(t): k for k, t in kwargs.items() if isinstance(t, torch.Tensor)}
    buffers = {id(b): n for n, b in model.named_buffers(remove_duplicate=False)}
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    value = dict(zip(phs, example_inputs))
    stage = stage_of_nodes(gm, block_stage)
    # the stages that read a value; the graph's other outputs (logits, a KV cache the model returns
    # in training) are not among them: the last stage returns the loss alone, so they never travel
    users_stage = {n: max((stage[u] for u in n.users if u in stage), default=-1) for n in gm.graph.nodes}
    aliases: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    if not shared:
        _check_shared_params(phs, value, aliases, stage)
    loss = _loss_node(gm)
    carried: list[fx.Node] = []      # values received by the stage being built, in order
    out = []
    for k in range(num_stages):
        mine = [n for n in gm.graph.nodes if stage.get(n) == k]
        g, env, holder = fx.Graph(), {}, nn.Module()
        for n in carried:
            env[n] = g.placeholder(f"in_{n.name}")
        kw = []
        for ph in phs:
            if not any(stage.get(u) == k for u in ph.users) or ph in env:
                continue
            t = value[ph]
            name = aliases[id(t)][0] if id(t) in aliases else buffers.get(id(t))
            if name is not None:
                attr = re.sub(r"\W", "_", name)
                if isinstance(t, nn.Parameter):
                    holder.register_parameter(attr, t)
                else:
                    holder.register_buffer(attr, t)
                env[ph] = g.get_attr(attr)
            elif id(t) in kw_name:
                kw.append(ph)
            elif not isinstance(t, torch.Tensor):
                # an object Dynamo lifted (a DTensor hook's mesh or layout): held as a constant
                attr = f"const_{ph.name}"
                setattr(holder, attr, t)
                env[ph] = g.get_attr(attr)
            else:
                raise ValueError(f"graph input {ph.name} is neither a parameter, a buffer nor a keyword input")
        for ph in kw:
            env[ph] = g.placeholder(ph.name)
        for n in mine:
            env[n] = g.node_copy(n, lambda a: env[a])
        if k == num_stages - 1:
            # (1,): torch merges micro-batch outputs. A new tensor, not a view: torch's runtime
            # detaches the last stage's output after its backward to free the micro-batch's autograd
            # graph, which it cannot do to a view (zero-bubble kept every graph to the step's end)
            g.output(g.call_function(torch.stack, ([env[loss]],)))
            sends = []
        else:
            sends = [n for n in [*carried, *mine] if users_stage.get(n, -1) > k]
            bad = [n.name for n in sends if not _is_tensor(n)]
            if bad:
                raise ValueError(f"cannot cut the graph before stage {k + 1}: {bad} cross it and are not tensors")
            g.output(tuple(env[n] for n in sends))
        stage_gm = fx.GraphModule(holder, g)
        for key, obj in owned(gm).items():    # regions a rewritten graph's ops run by key
            own(stage_gm, key, obj)
        out.append(StageModule(stage_gm, [kw_name[id(value[ph])] for ph in kw]))
        carried = sends
    return out


def _check_shared_params(phs: list, value: dict, params: dict, stage: dict) -> None:
    """A parameter read on two stages (tied embeddings) would get two partial gradients."""
    for ph in phs:
        t = value.get(ph)
        if isinstance(t, nn.Parameter):
            on = sorted({stage[u] for u in ph.users if u in stage})
            if len(on) > 1:
                names = " = ".join(params.get(id(t), [ph.name]))
                raise ValueError(f"parameter {names} is read on pipeline stages {on} (tied weights): untie them "
                                 f"(e.g. tie_word_embeddings=False) or use pp=1")


def _loss_node(gm: fx.GraphModule) -> fx.Node:
    """The graph output that is the loss (a 0-dim float tensor)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for a in output.all_input_nodes:
        v = a.meta.get("example_value")
        if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point():
            return a
    raise ValueError("the captured step returns no loss: pass labels in example_inputs (pipeline stages "
                     "end in the loss)")


def capture_static(model: nn.Module, kwargs: dict) -> tuple[fx.GraphModule, list, dict]:
    """The model's step as one Dynamo graph with static shapes (pipeline stages exchange fixed
    shapes; gloo aborts on a change); returns the graph, its example inputs, and the keyword
    inputs it was captured with: copies, since a tensor optimize() captured before carries
    Dynamo's mark of a dynamic sequence dim, which would make this graph symbolic. A model
    captured before at the same shapes (another schedule, another instance of one config) reuses
    its graph (rewrite.capture.run_recorded)."""
    from tailorfx.rewrite.capture import run_recorded
    kwargs = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    ((gm, example),), _ = run_recorded(model, (), kwargs, fullgraph=True)
    return gm, example, kwargs


def pipeline_runtime(stages: list[StageModule], *, rank: int, num_ranks: int, name: str, microbatches: int,
                     virtual: int = 1, device: Optional[torch.device] = None, group=None):
    """This rank's PipelineStages (stage s on pipeline rank s % num_ranks, in process group
    `group`, default the world) under torch's schedule runtime, running tailorfx's schedule
    `name` (its per-rank action lists, exported)."""
    from torch.distributed.pipelining import PipelineStage
    from tailorfx import compat
    from tailorfx.codegen.schedule import build_schedule, to_pipelining
    num_stages = len(stages)
    schedule = build_schedule(name, num_ranks, microbatches, virtual)
    device = device or torch.device("cpu")
    mine = [PipelineStage(stages[s], s, num_stages, device, group=group) for s in range(rank, num_stages, num_ranks)]
    return compat.pipelining_runtime(mine, microbatches, lambda out, target: out.sum(), to_pipelining(schedule))
