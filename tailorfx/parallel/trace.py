"""The graph one rank of a parallel layout runs: the model (a config, a factory or a module) built
or copied on fake tensors, sharded for tp as the rank's is (shard.py), captured for one
micro-batch, rewritten as the layout's step graph is, traced by AOTAutograd, and each node
tagged with the part of the model it belongs to (the root before the first block, each block,
the root after the last) for profile.py. Captures are cached per (model, tp, rows, sequence
slice, head style, rewrites).

    cap = capture_rank(config, tp=2, rows=1, seq=4096, dtype=torch.bfloat16)
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import math
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from tailorfx import compat
from tailorfx.codegen.lower import partition_for
from tailorfx.codegen.pipeline import capture_static, loss_only
from tailorfx.errors import PredictionError
from tailorfx.models.build import built_on_fake_tensors, fake_copy, fake_mode_of
from tailorfx.parallel.plan import accepts_use_cache, plan_tensor_parallel, rewrite_step, skips_logits, tp_styles
from tailorfx.parallel.shard import chunk_mlps, shard_model
from tailorfx.parallel.stages import StageCosts, block_costs
from tailorfx.parallel.recompute_order import recompute_first
from tailorfx.parallel.tp_plan import TPPlan
from tailorfx.passes.attention.rules import drop_causal_sdpa_masks
from tailorfx.rewrite import match, memory
from tailorfx.rewrite.capture import isolated_captures, node_value, seq_info
from tailorfx.rewrite.regions import find_regions, is_param, param_source, stack_paths
from tailorfx.runtime.accumulation import model_device


def _source_key(src: Any) -> tuple:
    """The cache key of a model source: a config by its contents, a module or factory by identity
    (checked against a weak reference, so a new object at a recycled id is not mistaken for it)."""
    if isinstance(src, nn.Module) or callable(src) and not hasattr(src, "to_dict"):
        return ("object", id(src))
    if hasattr(src, "to_json_string"):
        return ("hf", src.to_json_string(use_diff=False))
    return ("config", repr(src))


def param_dtype(src: Any) -> Optional[torch.dtype]:
    """The dtype a module's parameters have, or a Hugging Face config asks for (its `dtype`)."""
    if isinstance(src, nn.Module):
        p = next(src.parameters(), None)
        return p.dtype if p is not None else None
    dtype = getattr(src, "dtype", None) if hasattr(src, "to_dict") else None
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else None


@contextlib.contextmanager
def _fake_model(src: Any, dtype: torch.dtype):
    """A fresh module to shard and capture, on fake tensors, inside their FakeTensorMode. A
    config is built in `dtype` (the setup's), whatever dtype it names itself."""
    if not isinstance(src, nn.Module):
        if hasattr(src, "to_dict") and getattr(src, "dtype", None) is not None:
            src = copy.deepcopy(src)
            src.dtype = dtype
        with built_on_fake_tensors(src, dtype) as model:
            yield model
        return
    model = fake_copy(src)
    with fake_mode_of(model):
        if any(p.is_floating_point() and p.dtype != dtype for p in model.parameters()):
            model = model.to(dtype)       # the setup's weights
        yield model


# ---- one capture: the rank's step graph, its parts and their parameters ------------------------------
@dataclass
class RankCapture:
    steps: memory.StepGraphs
    seq: Any
    gm: fx.GraphModule
    regions: Any
    blocks: list[str]
    fw_group: dict[str, int]
    bw_group: dict[str, int]
    node_group: dict
    fw_attn: frozenset
    bw_attn: frozenset
    params: list[list[tuple[tuple[int, ...], int]]]   # per group: (tp-local shape, itemsize) of each parameter
    attn_bytes: int                 # q, k, v and output of one attention
    heads: tuple[int, int]          # its query and key/value heads (this tp rank's)
    scope: Callable                 # the context the graph is traced under (loss_parallel)
    profiles: dict = field(default_factory=dict)
    owner: Any = None               # a weak reference to the module or factory captured (None: a config)
    wgrad: list = field(default_factory=list)   # per group: output bytes of its ops that take a parameter
    stage_costs: Optional[StageCosts] = None   # block_costs of the graph as captured, before any pass
    rng_bytes: int = 0              # a checkpointed block's saved RNG state, from its forward to its backward

    @property
    def num_groups(self) -> int:
        return len(self.blocks) + 2

    def group_bytes(self, g: int) -> int:
        return sum(math.prod(s) * b for s, b in self.params[g])


_CAPTURES: dict[tuple, RankCapture] = {}
_TP_PLANS: dict[tuple, Any] = {}
_CACHE_SIZE = 16


def clear_cache() -> None:
    """Forget cached captures (each holds a traced graph of the model)."""
    _CAPTURES.clear()
    _TP_PLANS.clear()


_MESH_IDS = itertools.count()


def capture_rank(src: Any, *, tp: int, rows: int, seq: int, dtype: torch.dtype, head: str = "vocab",
                 vocab_loss: str = "fused", mesh=None, passes: tuple = (),
                 graph: Optional[fx.GraphModule] = None, options: tuple = (), cut: str = "") -> RankCapture:
    """The rank's step graph (sharded for `tp` on a fake process group, the LM head as
    plan.head_style `head` says and its loss as `vocab_loss`), rewritten by `passes` as a
    layout's step graph is (plan.rewrite_step), traced and tagged by part; cached. `graph`: that
    step graph already captured at this shape (a pipeline's or a chain's, tp=1), used instead of a
    capture of a fake copy when `src` is a module in `dtype`. `options`: the passes' (plan.step_options,
    as items); `cut`: how the runtime runs the step graph cut at its blocks, "pipeline" (stages,
    which return no cache) or "chain" (spec.runs_chain: its loss alone, no cache), "" not cut."""
    key = (_source_key(src), tp, rows, seq, (head, vocab_loss) if tp > 1 else "", dtype, tuple(passes), options, cut)
    hit = _CAPTURES.get(key)
    if hit is not None and (hit.owner is None or hit.owner() is src):
        return hit
    if graph is not None and tp == 1 and isinstance(src, nn.Module) and param_dtype(src) == dtype:
        cap = _traced(graph, local_params(src), passes, contextlib.nullcontext, dict(options))
        return _remember(key, src, cap)
    own_group = False
    if tp > 1 and mesh is None:
        if dist.is_initialized():
            raise RuntimeError(f"predicting tp={tp} needs a process group of {tp} ranks to shard a fake copy "
                               f"on, and this process already has one (world {dist.get_world_size()}): call it "
                               f"outside torchrun, or through opt.predict_memory() of the sharded model")
        compat.init_fake_process_group(tp)
        own_group = True
    try:
        if own_group:
            on = model_device(src).type if isinstance(src, nn.Module) else "cpu"
            # a new name each time: DTensor caches sharding decisions by mesh equality, and a decision
            # cached from an earlier capture's (destroyed) mesh leaks that mesh into this graph, where
            # AOTAutograd then fails ("Node tangents_4 was invalid, but is output")
            mesh = init_device_mesh(on if on == "cpu" or torch.cuda.is_available() else "cpu", (tp,),
                                    mesh_dim_names=(f"tp_capture{next(_MESH_IDS)}",))
        cap = _capture_on(src, tp=tp, rows=rows, seq=seq, head=head, vocab_loss=vocab_loss, dtype=dtype, mesh=mesh,
                          passes=passes, options=dict(options), cut=cut)
    finally:
        if own_group:
            dist.destroy_process_group()
    return _remember(key, src, cap)


def _remember(key: tuple, src: Any, cap: RankCapture) -> RankCapture:
    if key[0][0] == "object":
        try:
            cap.owner = weakref.ref(src)
        except TypeError:     # not weakly referenceable: not cached
            return cap
    while len(_CAPTURES) >= _CACHE_SIZE:
        _CAPTURES.pop(next(iter(_CAPTURES)))
    _CAPTURES[key] = cap
    return cap


def _capture_on(src, *, tp, rows, seq, head, vocab_loss, dtype, mesh, passes, options, cut) -> RankCapture:
    scope = contextlib.nullcontext
    with _fake_model(src, dtype) as model:
        ids = torch.zeros(rows, seq, dtype=torch.long, device=model_device(model))
        batch = {"input_ids": ids, "labels": ids}
        if ("recompute" in passes or cut) and accepts_use_cache(model):    # as the runtime calls it (apply.py)
            batch["use_cache"] = False
        if tp > 1:
            plan = read_tp_plan(src, dtype, model)
            # as the rank's model is sharded (apply.py), without the scatter from rank 0
            vocab = shard_model(model, styles=tp_styles(plan, tp, head), mesh=mesh, head_loss=plan.head_loss,
                                vocab_loss=vocab_loss, scatter=False,
                                skip_logits=skips_logits(passes, options, staged=bool(cut)))
            if vocab is not None:
                scope = loss_parallel
            if "minisequence" in passes and not cut:     # as the rank's model runs its MLPs (apply.py)
                chunk_mlps(model, plan.mlps, options)
                passes = tuple(p for p in passes if p != "minisequence")
        with scope(), isolated_captures():
            gm, _, _ = capture_static(model, batch)
        local = local_params(model)
    # traced, transformers builds an S x S mask its eager forward drops when the batch is not
    # packed: without a KV cache it reads position_ids for packed sequences, and under torch < 2.13
    # Dynamo answers "exporting" to the skip's check; a chain and pipeline stages drop it too
    # (apply.apply_chain, apply_pipeline)
    gm = drop_causal_sdpa_masks(gm)
    # outside the model's fake mode, as AOTAutograd: the graph's values are Dynamo's fake tensors
    gm = loss_only(gm) if cut == "chain" else gm if cut else hold_what_outputs_save(gm)
    return _traced(gm, local, passes, scope, options, modules=not cut)


def _made_from_local(n: fx.Node) -> bool:
    """`n` is DTensor.from_local of its first argument (a plain tensor, the DTensor's local one)."""
    from torch.distributed.tensor import DTensor
    a = n.args[0] if n.args else None
    return (isinstance(node_value(n), DTensor) and isinstance(a, fx.Node)
            and type(node_value(a)) is not DTensor and isinstance(node_value(a), torch.Tensor)
            and getattr(n.target, "__name__", "").endswith("from_local"))


_SAVES_INPUTS = (torch.nn.functional.linear, torch.matmul, torch.mm, torch.bmm)


def hold_what_outputs_save(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` (a rank's step as Dynamo captured it) returning also what the autograd graphs of its
    outputs besides the loss hold for a backward no gradient reaches: the inputs of the matmuls
    only those outputs read (the vocab-parallel head's logits, where the fused loss reads the head's
    input: their linear's saved input lives while the caller holds them, 1 hidden state). Torch
    2.13's trace returned that input with Llama's logits, not with Gemma-2's soft-capped ones
    (-3.1%), 2.11's with neither (-2.1%). Unchanged without one 0-dim output with a gradient (the loss)."""
    out = gm.graph.find_nodes(op="output")[0]
    outs = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    graded = [o for o in outs if isinstance(o, fx.Node) and getattr(node_value(o), "requires_grad", False)]
    losses = [o for o in graded if node_value(o).dim() == 0]
    if len(losses) != 1:
        return gm
    loss = losses[0]
    on_loss = match.inputs_closure([loss])
    held, seen = [], set(on_loss)
    stack = [o for o in graded if o is not loss]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and n.target in _SAVES_INPUTS:
            for a in n.all_input_nodes:
                if _made_from_local(a):
                    a = a.args[0]
                if a in on_loss and a.op == "call_function" and a not in held:
                    held.append(a)
        stack.extend(n.all_input_nodes)
    if not held:
        return gm
    out.args = (tuple(outs) + tuple(held),)
    gm.recompile()
    return gm


def local_params(model: nn.Module) -> dict[str, tuple]:
    """name -> (shape, itemsize, trained) of each parameter, a tp shard's local one."""
    local = {}
    for name, p in model.named_parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        local[name] = (tuple(t.shape), t.element_size(), p.requires_grad)
    return local


def _traced(gm: fx.GraphModule, local: dict, passes: tuple, scope: Callable, options: Optional[dict] = None,
            modules: bool = False) -> RankCapture:
    """`gm` rewritten by `passes`, traced and tagged by part; the stages are cut by the graph as
    captured (without passes, predict_rank_memory reads the capture's own)."""
    costs = block_costs(gm, find_regions(gm, seq_info(gm, None))) if passes else None
    gm, _ = rewrite_step(gm, passes, options)
    checkpointed = "recompute" in passes
    if checkpointed:
        _save_outside_blocks(gm)
    # Under recompute each block runs its own ops again (torch's checkpoint, eager): AOTAutograd's CSE
    # would merge the blocks' identical ops (each SDPA's float mask from the one bool mask) into one
    # value the partitioner stashes at a block boundary, where the runtime passes the bool mask
    cse = contextlib.nullcontext() if not checkpointed else compat.aot_without_cse()
    with scope(), cse:     # AOTAutograd outside the model's fake mode (it makes its own), collectives still known
        try:
            steps = memory.trace_step(gm, None, partition_for("dynamo", gm), None)
        except AssertionError as e:
            if "was invalid, but is output" not in str(e):
                raise
            raise PredictionError(
                "cannot predict this rank's memory: Dynamo made the DeviceMesh a graph input (torch 2.13 does in a "
                "process that has captured other sharded models, e.g. after DTensor's loss_parallel), and "
                "AOTAutograd gives the DTensor logits' mesh a tangent no partition can place; predict in a process "
                "of its own (one model per torchrun job)") from e
    steps = replace(steps, eager_autograd=True, loss_tangent_only=modules, checkpoint_args_held=modules)
    checkpointed = "modules" if checkpointed and modules else "pieces" if checkpointed else ""
    return replace(_annotate(gm, steps, local, scope, checkpointed=checkpointed), stage_costs=costs,
                   rng_bytes=_rng_state_bytes(gm) if checkpointed else 0)


def _save_outside_blocks(gm: fx.GraphModule) -> None:
    """Under the runtime's checkpointing only the blocks run again: an op outside them (the final
    norm, the head) saves for backward what eager autograd saves, where the tag-honouring
    partitioner would recompute cheap ones on its own. Only ops that make tensors: nothing else is
    a value backward could be handed (a DeviceMesh op, once Dynamo made the mesh a graph input)."""
    from torch.utils.checkpoint import CheckpointPolicy
    for n in gm.graph.nodes:
        if (n.op in ("call_function", "call_method") and "recompute" not in n.meta
                and any(isinstance(v, torch.Tensor) for v in compat.tree_leaves(node_value(n)))):
            n.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def _rng_state_bytes(gm: fx.GraphModule) -> int:
    """What torch's checkpoint saves of the random number generators per checkpointed block:
    the CPU generator's state (a host tensor, device memory only when the model runs on the
    CPU; CUDA's state is a host tensor too)."""
    on = {v.device.type for n in gm.graph.nodes if n.op == "placeholder"
          and isinstance(v := node_value(n), torch.Tensor)}
    return torch.get_rng_state().numel() if on <= {"cpu"} else 0


def read_tp_plan(src: Any, dtype: torch.dtype, model: Optional[nn.Module] = None) -> TPPlan:
    """The TP plan read off the model's graph (plan.plan_tensor_parallel), once per model: it does
    not depend on tp. `model`: an already built fake copy to read it from."""
    key = _source_key(src)
    hit = _TP_PLANS.get(key)
    if hit is not None and (hit[1] is None or hit[1]() is src):
        return hit[0]
    ids = torch.zeros(1, 64, dtype=torch.long)    # long enough for a static capture (capture_graphs)
    with (contextlib.nullcontext(model) if model is not None else _fake_model(src, dtype)) as m:
        with isolated_captures():
            plan, _ = plan_tensor_parallel(m, (), {"input_ids": ids.to(model_device(m)), "labels": ids.to(model_device(m))})
    try:
        owner = weakref.ref(src) if key[0] == "object" else None
    except TypeError:
        return plan
    _TP_PLANS[key] = (plan, owner)
    return plan


def _groups(g: fx.GraphModule, key: str, block_index: dict[str, int], backward: bool) -> dict[fx.Node, int]:
    """Node -> part: 1 + block index inside a block; outside blocks, the root before the first
    block (0) or after the last one (L+1), in forward order (backward runs the head's first)."""
    L = len(block_index)
    nodes = [n for n in g.graph.nodes if n.op not in ("placeholder", "output")]
    found: dict[fx.Node, Optional[int]] = {}
    for n in nodes:
        found[n] = next((block_index[p] for p in stack_paths(n.meta.get(key)) if p in block_index), None)
    inside = [i for i, n in enumerate(nodes) if found[n] is not None]
    out: dict[fx.Node, int] = {}
    first, last = (inside[0], inside[-1]) if inside else (len(nodes), len(nodes))
    before, after = (L + 1, 0) if backward else (0, L + 1)
    prev = before
    for i, n in enumerate(nodes):
        if found[n] is not None:
            prev = out[n] = 1 + found[n]
        else:
            out[n] = before if i < first else after if i > last else prev
    return out


def _annotate(gm: fx.GraphModule, steps: memory.StepGraphs, local: dict, scope,
              checkpointed: str = "") -> RankCapture:
    """The traced step tagged by part. `checkpointed`: how the runtime recomputes each block, "" not
    at all, "modules" torch's checkpoint around the model's own blocks (tp, dp alone), "pieces"
    around the graph's block pieces (pipeline stages, a dp chain)."""
    seq = seq_info(gm, None)
    regions = find_regions(gm, seq)
    blocks = [r.path for r in regions.of_kind("block")]
    index = {b: i for i, b in enumerate(blocks)}
    fw = _groups(steps.fw, "nn_module_stack", index, False)
    bw = _groups(steps.bw, "fwd_nn_module_stack", index, True) if steps.bw is not None else {}
    if checkpointed and bw:
        recompute_first(steps.bw, bw, hold_inputs=checkpointed == "modules")
    attn_paths = {r.path for r in regions.of_kind("attention")}
    fw_attn = frozenset(n.name for n in fw if attn_paths & set(stack_paths(n.meta.get("nn_module_stack"))))
    bw_attn = frozenset(n.name for n in bw if attn_paths & set(stack_paths(n.meta.get("fwd_nn_module_stack"))))
    # each module's part: the part of the first forward node inside it
    module_group: dict[str, int] = {}
    for n, grp in fw.items():
        for p in stack_paths(n.meta.get("nn_module_stack")):
            module_group.setdefault(p, grp)
    L = len(blocks)
    params: list[list] = [[] for _ in range(L + 2)]
    for name, (shape, itemsize, trained) in local.items():
        if not trained:
            continue
        mod = name.rsplit(".", 1)[0] if "." in name else ""
        blk = next((i for i, b in enumerate(blocks) if name.startswith(b + ".")), None)
        grp = 1 + blk if blk is not None else module_group.get(mod, 0)
        params[grp].append((shape, itemsize))
    attn_bytes, heads, kv_heads = _attention(gm)
    return RankCapture(steps, seq, gm, regions, blocks, {n.name: v for n, v in fw.items()},
                    {n.name: v for n, v in bw.items()}, {**fw, **bw}, fw_attn, bw_attn, params,
                    attn_bytes, (heads, kv_heads), scope, wgrad=_weight_grad_inputs(gm, index))


def _weight_grad_inputs(gm: fx.GraphModule, index: dict[str, int]) -> list[int]:
    """Per group, the bytes of the outputs of ops that combine a trained parameter with an
    activation (linears, a norm's weight product): a zero-bubble input-gradient pass (torch's
    `stage_backward_input`) keeps the gradient of each until the weight pass that reads it."""
    out = [0] * (len(index) + 2)
    for n, grp in _groups(gm, "nn_module_stack", index, False).items():
        v = node_value(n)
        if n.op not in ("call_function", "call_method") or not isinstance(v, torch.Tensor) or not v.requires_grad:
            continue
        ins = [a for a in n.all_input_nodes if isinstance(node_value(a), torch.Tensor)]
        trained = [a for a in ins if is_param(a, through_casts=True) and node_value(param_source(a)).requires_grad]
        if trained and any(a not in trained and node_value(a).requires_grad for a in ins):
            t = v.to_local() if hasattr(v, "to_local") else v     # a DTensor: this rank's shard
            out[grp] += t.numel() * t.element_size()
    return out


def _attention(gm: fx.GraphModule) -> tuple[int, int, int]:
    """Bytes of q, k, v and the output of the first scaled-dot-product attention in the graph,
    and its query and key/value head counts (zeros if there is none)."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and "scaled_dot_product" in getattr(n.target, "__name__", ""):
            vals = [node_value(a) for a in n.args[:3] if isinstance(a, fx.Node)] + [node_value(n)]
            vals = [v[0] if isinstance(v, (tuple, list)) else v for v in vals]
            nbytes = sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))
            heads = [v.shape[1] if isinstance(v, torch.Tensor) and v.dim() == 4 else 0 for v in vals[:2]]
            return nbytes, *heads
    return 0, 0, 0
