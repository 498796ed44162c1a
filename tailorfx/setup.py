"""How a model is trained, as far as memory is concerned: dtypes, optimizer state, when it steps.

Whether a model fits depends as much on this as on the graph. Per trained parameter:

    preset                       weights  master  grads  AdamW state   bytes/param
    fp32                         4        -       4      4 + 4         16
    amp-bf16                     2        4       2      4 + 4         16  (Megatron/DeepSpeed mixed precision)
    pure-bf16                    2        -       2      2 + 2          8
    pure-bf16-fused-optimizer    2        -       (2)    2 + 2          6 + the gradients in flight

With the optimizer in backward (the MST paper's A100 setup) each parameter is updated as soon as
its gradient is complete and the gradient is freed, so full gradients never coexist.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional, Union

import torch

if TYPE_CHECKING:
    from tailorfx.budget import CudaCosts

OPTIMIZERS = ("adamw", "adamw8bit", "sgd", None)
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
# bitsandbytes' blockwise 8-bit AdamW: two uint8 states plus an fp32 absmax per 2048-element block.
BLOCK_8BIT = 2048


def _dtype(x: Union[str, torch.dtype, None], what: str) -> Optional[torch.dtype]:
    if x is None or isinstance(x, torch.dtype):
        return x
    if x in _DTYPES:
        return _DTYPES[x]
    raise ValueError(f"{what} must be a torch.dtype or one of {sorted(_DTYPES)}, got {x!r}")


def short(dtype: Optional[torch.dtype]) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
            torch.uint8: "8-bit"}.get(dtype, str(dtype))


@dataclass(frozen=True)
class TrainingSetup:
    """The training setup the memory model, the planner and the runtime optimizer assume.

    `grad_dtype`/`state_dtype` None: derived (gradients in the parameter dtype; optimizer state in
    fp32 with master weights, else in the parameter dtype, as torch.optim keeps it). `headroom`:
    fraction of the budget left to the allocator (fragmentation, CUDA context), never planned on.
    `device`: a CUDA device's costs the graphs do not show (tailorfx.budget.CudaCosts; set by
    optimize() and the sizing functions for a device preset budget such as "H100-80GB").
    `head_grad_dtype`: the dtype the fused LM head sums a 16-bit weight's gradient in over its row
    chunks. None: the weight's own (Liger-Kernel's default); fp32 (Liger's `accum_dtype`): one
    rounding instead of one per chunk, for 4 more bytes per head weight while the head runs.
    `ddp`: trained inside torch's DistributedDataParallel (optimize() sets it when it captures
    inside one): DDP's gradient buckets hold a copy of the gradients across steps (in the weights'
    dtype; with gradient_as_bucket_view too, as the gradients a backward makes are copied in), and
    the step cannot run in backward, since DDP averages the gradients over ranks after it.
    """
    param_dtype: torch.dtype = torch.float32
    grad_dtype: Optional[torch.dtype] = None
    master_weights: bool = False
    optimizer: Optional[str] = "adamw"
    state_dtype: Optional[torch.dtype] = None
    optimizer_in_backward: bool = False
    micro_batch_size: int = 1
    grad_accum_steps: int = 1
    headroom: float = 0.0
    name: str = "custom"
    device: Optional["CudaCosts"] = None
    head_grad_dtype: Optional[torch.dtype] = None
    ddp: bool = False

    def __post_init__(self):
        for f in ("param_dtype", "grad_dtype", "state_dtype", "head_grad_dtype"):
            object.__setattr__(self, f, _dtype(getattr(self, f), f))
        if self.param_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"param_dtype must be fp32, bf16 or fp16, got {self.param_dtype}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.grad_dtype not in (None, self.param_dtype) and not (
                self.master_weights and self.grad_dtype == torch.float32):
            raise ValueError(f"grad_dtype {short(self.grad_dtype)} with {short(self.param_dtype)} parameters: "
                             f"autograd makes gradients in the parameter dtype; fp32 gradients of low-precision "
                             f"parameters need master_weights=True (they accumulate into the fp32 master)")
        if self.head_grad_dtype not in (None, torch.float32):
            raise ValueError(f"head_grad_dtype must be fp32 or None (the weight's own dtype), got "
                             f"{short(self.head_grad_dtype)}")
        if self.master_weights and self.param_dtype == torch.float32:
            raise ValueError("master_weights=True with fp32 parameters: the parameters already are the "
                             "fp32 master copy; set master_weights=False")
        if self.optimizer_in_backward and self.optimizer is None:
            raise ValueError("optimizer_in_backward=True needs an optimizer (adamw, adamw8bit or sgd)")
        if self.optimizer_in_backward and self.grad_accum_steps > 1:
            raise ValueError("optimizer_in_backward=True updates each parameter as soon as its gradient is "
                             "ready, so gradients cannot be accumulated over micro-batches: set "
                             "grad_accum_steps=1 or optimizer_in_backward=False")
        if self.ddp and self.optimizer_in_backward:
            raise ValueError("optimizer_in_backward=True inside DistributedDataParallel would update each "
                             "parameter with this rank's gradient before DDP averages it over the ranks (the ranks' "
                             "weights drift apart): train with optimizer_in_backward=False under DDP, or shard "
                             "with optimize(..., parallel=dict(dp=N)) (FSDP2)")
        if self.micro_batch_size < 1 or self.grad_accum_steps < 1:
            raise ValueError("micro_batch_size and grad_accum_steps must be >= 1")
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"headroom is a fraction of the budget in [0, 1), got {self.headroom}")

    # ---- derived ----------------------------------------------------------------------------
    @property
    def head_grad_fp32(self) -> bool:
        """Whether the fused LM head sums a 16-bit weight's gradient in fp32 (head_grad_dtype)."""
        return self.head_grad_dtype == torch.float32

    @property
    def step_can_move_into_backward(self) -> bool:
        """Whether the planner may move the optimizer step into backward to fit a budget: not with
        accumulated micro-batches, nor inside DDP, which averages the gradients after backward."""
        return (self.optimizer is not None and not self.optimizer_in_backward and self.grad_accum_steps == 1
                and not self.ddp)

    @property
    def grads(self) -> torch.dtype:
        """The dtype gradients are held in between backward and the step."""
        return self.grad_dtype or self.param_dtype

    @property
    def state(self) -> Optional[torch.dtype]:
        """The dtype of the optimizer state (uint8 for 8-bit AdamW; None without state)."""
        if self.optimizer in (None, "sgd"):
            return None
        if self.optimizer == "adamw8bit":
            return torch.uint8
        return self.state_dtype or (torch.float32 if self.master_weights else self.param_dtype)

    def state_bytes(self, numel: int) -> int:
        """Optimizer state of one parameter of `numel` elements."""
        if self.state is None:
            return 0
        if self.optimizer == "adamw8bit":
            return 2 * numel + 2 * 4 * -(-numel // BLOCK_8BIT)
        return 2 * numel * self.state.itemsize

    def master_bytes(self, numel: int) -> int:
        return 4 * numel if self.master_weights else 0

    def bucket_bytes(self, numel: int) -> int:
        """DDP's gradient buckets for `numel` trained elements (0 outside DDP)."""
        return numel * self.param_dtype.itemsize if self.ddp else 0

    def update_temp_bytes(self, numel: int) -> int:
        """Temporaries of one parameter's update, as tailorfx's runtime optimizer makes them:
        AdamW's `exp_avg_sq.sqrt() / bias_correction` (two state-sized tensors, measured on CPU),
        plus the fp32 copy of the gradient a master-weight update reads. 8-bit AdamW updates in
        place in bitsandbytes' kernel; SGD adds the gradient in place."""
        temp = 2 * numel * self.state.itemsize if self.optimizer == "adamw" else 0
        if self.master_weights and self.optimizer is not None and self.grads != torch.float32:
            temp += 4 * numel
        return temp

    def static_bytes(self, num_params: int) -> int:
        """Bytes held across steps for `num_params` trained parameters: weights, master copy,
        optimizer state, gradients unless the optimizer runs in backward, and DDP's buckets."""
        grads = 0 if self.optimizer_in_backward or self.optimizer is None else num_params * self.grads.itemsize
        return (num_params * self.param_dtype.itemsize + self.master_bytes(num_params)
                + self.state_bytes(num_params) + grads + self.bucket_bytes(num_params))

    def bytes_per_param(self) -> float:
        n = BLOCK_8BIT * 1024
        return self.static_bytes(n) / n

    def describe(self) -> str:
        opt = {"adamw": "AdamW", "adamw8bit": "8-bit AdamW", "sgd": "SGD", None: "no optimizer"}[self.optimizer]
        parts = [f"{short(self.param_dtype)} weights", f"{short(self.grads)} gradients"]
        if self.master_weights:
            parts.append("fp32 master weights")
        parts.append(opt + (f" ({short(self.state)} state)" if self.state is not None else ""))
        if self.optimizer_in_backward:
            parts.append("optimizer step in backward")
        if self.head_grad_dtype is not None and self.param_dtype != self.head_grad_dtype:
            parts.append(f"LM head gradient summed in {short(self.head_grad_dtype)}")
        if self.ddp:
            parts.append("DDP gradient buckets")
        if self.device is not None:
            parts.append(f"modelled for CUDA ({self.device.arch})")
        if self.grad_accum_steps > 1:
            parts.append(f"{self.grad_accum_steps} micro-batches of {self.micro_batch_size}")
        return f"{self.name}: " + ", ".join(parts) + f" ({self.bytes_per_param():g} B/param held)"

    def held_by_loop(self, ddp: bool, accumulating: bool) -> "TrainingSetup":
        """This setup with what the training loop around the model holds (trainers/): DDP's gradient
        buckets, and the earlier micro-batches' gradients (grad_accum_steps 2, which peaks as any count
        > 1 does; not with the step in backward, which consumes them)."""
        s = self.with_(ddp=True) if ddp and not self.ddp else self
        if accumulating and s.grad_accum_steps == 1 and s.optimizer is not None and not s.optimizer_in_backward:
            s = s.with_(grad_accum_steps=2)
        return s

    def with_(self, **changes) -> "TrainingSetup":
        return replace(self, **changes)


PRESETS: dict[str, TrainingSetup] = {
    "fp32": TrainingSetup(name="fp32"),
    "amp-bf16": TrainingSetup(param_dtype=torch.bfloat16, master_weights=True, name="amp-bf16"),
    "pure-bf16": TrainingSetup(param_dtype=torch.bfloat16, name="pure-bf16"),
    "pure-bf16-fused-optimizer": TrainingSetup(param_dtype=torch.bfloat16, optimizer_in_backward=True,
                                               name="pure-bf16-fused-optimizer"),
}


def resolve(setup: Union[str, TrainingSetup, None], *, param_dtype: Optional[torch.dtype] = None,
            optimizer: Optional[str] = "adamw") -> TrainingSetup:
    """A preset name, a TrainingSetup, or None: the model's own dtype with `optimizer`."""
    if isinstance(setup, TrainingSetup):
        return setup
    if isinstance(setup, str):
        if setup not in PRESETS:
            raise ValueError(f"unknown training setup {setup!r}; presets: {', '.join(PRESETS)} "
                             f"(or pass a tailorfx.TrainingSetup)")
        return PRESETS[setup]
    if setup is not None:
        raise TypeError(f"setup must be a preset name or a TrainingSetup, got {type(setup).__name__}")
    dtype = param_dtype or torch.float32
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        dtype = torch.float32
    return TrainingSetup(param_dtype=dtype, optimizer=optimizer, name=f"{short(dtype)} weights, {optimizer}")


def with_device_costs(s: TrainingSetup, budget, model, batch: int) -> TrainingSetup:
    """`s` for a budget that names a CUDA device (a preset: budget.arch set): its costs that the
    graphs do not show (budget.CudaCosts, at `batch` sequences a step) and the allocator's
    headroom, unless the setup keeps a headroom of its own. Other budgets: `s` unchanged."""
    if budget is None or getattr(budget, "arch", None) is None:
        return s
    from tailorfx.budget import CudaCosts
    costs = CudaCosts.for_model(budget.arch, model, batch)
    return s.with_(device=costs, headroom=s.headroom or costs.allocator_headroom)


def following(s: TrainingSetup, dtypes: set, training: bool) -> TrainingSetup:
    """`s` for a graph whose trainable parameters are of `dtypes`: the default setup (resolve(None):
    the model's dtype at optimize()) follows a model cast since (`opt.to(torch.bfloat16)`: Dynamo
    captures it again); a setup the user gave, for another dtype, is an error that says so in
    training (kept for an inference graph)."""
    if len(dtypes) != 1 or (dtype := next(iter(dtypes))) == s.param_dtype:
        return s
    if replace(s, device=None, headroom=0.0) != resolve(None, param_dtype=s.param_dtype, optimizer=s.optimizer):
        if not training:
            return s
        raise ValueError(f"setup {s.name!r} trains {s.param_dtype} parameters but the model's are now {dtype} "
                         f"(cast after optimize()): cast the model back, or call tailorfx.optimize again with a "
                         f"setup for {dtype}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return s    # as optimize() plans such a model (fp32's setup)
    return s.with_(param_dtype=dtype, name=resolve(None, param_dtype=dtype, optimizer=s.optimizer).name)
