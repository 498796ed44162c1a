"""Tensor parallel and FSDP2 applied with torch.distributed: DTensor plans and `fully_shard`.

Each parallelism is one `apply_*` function; the plan (which module gets which style) comes from
`tailorfx/parallel/plan.py`, read off the graph, and arrives here as plain strings.
"""
from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from tailorfx.compat import tree_map

STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    # the LM head: vocab split over the ranks, logits gathered so any loss runs unchanged
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    # the LM head feeding a loss: logits stay split over the vocab (DTensor); the loss is fused
    # with the head (runtime/vocab_parallel.py) or runs under loss_parallel (LossParallelScope):
    # no rank ever holds the whole logits
    "colwise_vocab_parallel": lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    # the token embedding where the head is split by vocabulary: each rank holds and looks up its
    # rows of the table, and the outputs are summed (as torchtitan shards tok_embeddings)
    "rowwise_embedding": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
}


def rank_device(env: Optional[dict] = None, cuda_available: Optional[bool] = None) -> torch.device:
    """This process's device: `cuda:LOCAL_RANK` (torchrun's local rank, 0 without one) when CUDA
    is available, else the CPU."""
    env = os.environ if env is None else env
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    return torch.device("cuda", int(env.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")


def device_mesh(*, tp: int = 1, dp: int = 1, pp: int = 1, device: Optional[torch.device] = None) -> DeviceMesh:
    """A ("pp", "dp", "tp") mesh over the torchrun world on this rank's device (rank_device: the
    current CUDA device is set to it first, so NCCL and every `.cuda()` use it, not GPU 0);
    initializes the process group if torchrun started us and nobody has yet (gloo on CPU, NCCL on
    CUDA)."""
    want = tp * dp * pp
    device = device or rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RuntimeError(f"parallel=dict(tp={tp}, dp={dp}, pp={pp}) needs {want} processes: launch with "
                               f"`torchrun --nproc-per-node {want} your_script.py`")
        # a dead peer must end the job: collectives give up after 60 s instead of torch's 10-30 min
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=60))
    world = dist.get_world_size()
    if want != world:
        raise ValueError(f"parallel=dict(tp={tp}, dp={dp}, pp={pp}) needs tp*dp*pp = {want} processes, but the "
                         f"world has {world}: launch with --nproc-per-node {want} or change tp/dp/pp")
    return init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))


def on_device(tree, device: torch.device):
    """Tensors of a (nested) batch or args tuple moved to `device` (those already there as they are)."""
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) and t.device != device else t, tree)


def apply_tp(model: nn.Module, *, styles: dict[str, str], mesh: DeviceMesh, scatter: bool = True) -> nn.Module:
    """Shard `model` in place: each named module gets its style; the rest stays replicated.
    `scatter=False`: each rank cuts its shards from its own copy, nothing is sent from rank 0 (a
    fake copy sharded inside torchrun must not run collectives on fake tensors)."""
    if mesh.size() > 1 and styles:
        plan = {fqn: _style(s) for fqn, s in styles.items()}
        for style in plan.values():
            if not scatter and hasattr(style, "src_data_rank"):
                style.src_data_rank = None
        parallelize_module(model, mesh, plan)
    return model


# Megatron sequence parallelism (sp="megatron"): the residual stream is split over the tp ranks
# along dim D; "NAME:D" styles move between that and what the tensor-parallel groups compute on
SEQUENCE_STYLES = {
    # the norms on the stream: compute on the shard, parameters replicated (gradients summed)
    "sequence_parallel": lambda d: SequenceParallel(sequence_dim=d),
    # a row-parallel linear that returns the stream: reduce-scatter instead of all-reduce
    "rowwise_to_sequence": lambda d: RowwiseParallel(output_layouts=Shard(d), use_local_output=False),
    # the token embedding (replicated): its output split, each rank keeps its slice
    # the same, split by vocabulary: the looked-up rows reduce-scattered onto the stream's shards
    "rowwise_embedding_to_sequence": lambda d: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(d),
                                                               use_local_output=False),
    "embedding_to_sequence": lambda d: PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(d),
                                                           use_local_output=False),
    # the LM head: the sequence gathered on entry, then as without sp
    "colwise_vocab_parallel_from_sequence": lambda d: ColwiseParallel(input_layouts=Shard(d), output_layouts=Shard(-1),
                                                                      use_local_output=False),
    "colwise_gather_output_from_sequence": lambda d: ColwiseParallel(input_layouts=Shard(d),
                                                                     output_layouts=Replicate()),
    # "sharded_input:D": the module's input is this rank's shard along D (a per-head norm inside
    # the sharded heads) and its parameters are replicated, so their gradients are summed
    "sharded_input": lambda d: SequenceParallel(sequence_dim=d, use_local_output=True),
}


class GatherSequence(ParallelStyle):
    """A module that needs the whole sequence (a tensor-parallel group's attention or MLP, a
    replicated head) under sp="megatron": each DTensor argument (the stream's sequence shards)
    is all-gathered into a plain tensor on entry; in backward the gradient, whole on every
    rank, is cut back to this rank's shard. PrepareModuleInput needs each argument's layout by
    position or keyword; the graph only says which values are on the stream."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import DTensor

        def whole(x):
            return x.redistribute(device_mesh, [Replicate()]).to_local() if isinstance(x, DTensor) else x

        def gather(mod, args, kwargs):
            return tuple(whole(a) for a in args), {k: whole(v) for k, v in kwargs.items()}
        module.register_forward_pre_hook(gather, with_kwargs=True)
        return module


def _style(name: str):
    """A ParallelStyle by name: STYLES, "gather_sequence", or a SEQUENCE_STYLES name with its dim
    ("sequence_parallel:1")."""
    base, _, dim = name.partition(":")
    if base in SEQUENCE_STYLES and dim.lstrip("-").isdigit():
        return SEQUENCE_STYLES[base](int(dim))
    if name == "gather_sequence":
        return GatherSequence()
    if name not in STYLES:
        raise ValueError(f"unknown tensor-parallel style {name!r}; known: {sorted(STYLES)}, 'gather_sequence' and "
                         f"{sorted(SEQUENCE_STYLES)} with ':DIM'")
    return STYLES[name]()


def apply_checkpoint(model: nn.Module, *, blocks: list[str]) -> nn.Module:
    """Each repeated block one activation-checkpointing unit (torch's composable `checkpoint`:
    hooks on the block, no wrapper, so parameter names stay the model's): it saves only its
    input, and backward runs its forward again. Exact: the same ops on the same values."""
    if not blocks:
        raise ValueError("recompute under parallel= checkpoints the repeated blocks, and the graph has none")
    from torch.distributed._composable import checkpoint
    mods = dict(model.named_modules())
    for path in blocks:
        checkpoint(mods[path])
    return model


def apply_fsdp(model: nn.Module, *, blocks: list[str], mesh: DeviceMesh) -> nn.Module:
    """FSDP2: each repeated block is one `fully_shard` unit (its parameters gathered only while it
    runs), then the root takes what is left (embeddings, final norm, head)."""
    from torch.distributed.fsdp import fully_shard
    if mesh.size() == 1:
        return model
    mods = dict(model.named_modules())
    for path in blocks:
        fully_shard(mods[path], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def apply_fsdp_stages(stages: list[nn.Module], *, model: nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2 over the dp ranks of a pipeline: each of this rank's stages is one `fully_shard`
    unit, gathered once per step and resharded after its last backward (torch's pipeline runtime
    adds the UNSHARD, RESHARD and REDUCE_GRAD actions for FSDP modules). The stages hold the
    model's own Parameters; the sharded ones FSDP registers in their place are put back on the
    model's modules under every name the model gives them, so `model.named_parameters()` is
    the rank's shards and `p.grad.full_tensor()` the whole gradient (as under dp alone)."""
    from torch.distributed.fsdp import fully_shard
    if mesh.size() == 1:
        return
    with _onto_model(model, stages):
        for stage in stages:
            # resharding after each micro-batch's forward would gather the stage again for every one
            fully_shard(stage, mesh=mesh, reshard_after_forward=False)


def apply_fsdp_chain(chain: nn.Module, *, units: list[nn.Module], model: nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2 on a StageChain as apply_fsdp shards a model: each of `units` (a block's stage) one
    `fully_shard` unit, then the chain the root's (the embedding's and the head's stages); the
    sharded Parameters put back on the model's modules (apply_fsdp_stages)."""
    from torch.distributed.fsdp import fully_shard
    if mesh.size() == 1:
        return
    with _onto_model(model, [chain]):
        for unit in units:
            fully_shard(unit, mesh=mesh)
        fully_shard(chain, mesh=mesh)


@contextlib.contextmanager
def _onto_model(model: nn.Module, holders: list[nn.Module]):
    """Around fully_shard of modules that hold `model`'s Parameters: each sharded Parameter FSDP
    registers in a holder is put on the model's modules in the place of the one it replaced."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, mod in model.named_modules(remove_duplicate=False):
        for leaf, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((mod, leaf))
    before = [dict(h.named_parameters()) for h in holders]
    yield
    for h, was in zip(holders, before):
        for name, sharded in h.named_parameters():
            for mod, leaf in owners.get(id(was[name]), ()):
                mod._parameters[leaf] = sharded


class LossParallelScope:
    """DTensor's `loss_parallel()` around the loss of a vocab-parallel head, in forward and in the
    caller's backward: the model's output enters it when its gradient starts flowing back
    (`enter_on_backward(loss)`) and the head's output leaves it once its gradient is done
    (`exit_on_backward(logits)`, a forward hook on the head). Counted, so micro-batches whose
    backwards overlap share one scope."""

    def __init__(self):
        self.depth = 0
        self._cm = None

    def enter(self) -> None:
        from torch.distributed.tensor.parallel import loss_parallel
        if self.depth == 0:
            self._cm = loss_parallel()
            self._cm.__enter__()
        self.depth += 1

    def exit(self) -> None:
        if self.depth == 0:     # logits backpropagated after a fused loss: no scope was entered
            return
        self.depth -= 1
        if self.depth == 0 and self._cm is not None:
            cm, self._cm = self._cm, None
            cm.__exit__(None, None, None)

    def enter_on_backward(self, loss: torch.Tensor) -> torch.Tensor:
        return _OnBackward.apply(loss, self.enter)

    def exit_on_backward(self, logits: torch.Tensor) -> torch.Tensor:
        return _OnBackward.apply(logits, self.exit)


class _OnBackward(torch.autograd.Function):
    """Identity whose backward calls `fn` before passing the gradient on."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.fn()
        return grad, None


def apply_loss_parallel(model: nn.Module, *, head: str) -> LossParallelScope:
    """Make `head`'s sharded logits leave the loss scope once their gradient is computed."""
    scope = LossParallelScope()
    def hook(mod, args, out):
        # a graph traced for the memory model never runs backward: no scope to leave
        if torch.is_grad_enabled() and out.requires_grad and not torch.compiler.is_compiling():
            return scope.exit_on_backward(out)
        return out
    dict(model.named_modules())[head].register_forward_hook(hook)
    return scope
