"""The optimizer step a TrainingSetup describes, for real training.

    opt = SetupOptimizer(model.parameters(), "pure-bf16-fused-optimizer", lr=1e-3)
    loss = model(**batch).loss; loss.backward(); opt.step(); opt.zero_grad()

Each parameter gets its own torch.optim optimizer (single-tensor AdamW/SGD), so one parameter can
be updated on its own: in a loop after backward (normal step), or as soon as its gradient is
complete (optimizer in backward: a `register_post_accumulate_grad_hook` in eager code, or a
`grad_ready` call that tailorfx's lowering places inside the compiled backward graph, right after
the gradient's last use; under Inductor, the `tailorfx::grad_ready` op, which its generated code
calls there). Either way the gradient is freed at once, so full gradients never
coexist. With master weights the update runs on an fp32 copy and is copied back.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Callable, Iterable, List, Optional, Union

import torch

from tailorfx.setup import TrainingSetup, resolve, short


class SetupOptimizer:
    """AdamW or SGD per `setup`: master weights, state dtype, and the step in backward.
    Hyperparameters default to torch.optim's. `ready(p)`, with the step in backward, says whether
    p's accumulated gradient is complete: a function that calls backward once per shard (DeepSpeed's
    tiled MLP and loss) leaves it to accumulate until its last shard."""

    def __init__(self, params: Iterable[torch.nn.Parameter], setup: Union[str, TrainingSetup],
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: Optional[float] = None,
                 ready: Optional[Callable[[torch.Tensor], bool]] = None):
        self.setup = s = resolve(setup)
        self.ready = ready
        if s.optimizer == "adamw8bit":
            raise ValueError("8-bit AdamW is modelled for planning only; train it with "
                             "bitsandbytes.optim.AdamW8bit (and optimizer_in_backward=False)")
        if s.optimizer is None:
            raise ValueError(f"setup {s.name!r} has no optimizer to run")
        derived = torch.float32 if s.master_weights else s.param_dtype
        if s.optimizer == "adamw" and s.state != derived:
            raise ValueError(f"{short(s.state)} optimizer state with {short(s.param_dtype)} parameters "
                             f"{'and' if s.master_weights else 'without'} master weights is modelled but not run: "
                             f"torch.optim keeps state in the dtype it updates ({short(derived)} here)")
        self.params = [p for p in params if p.requires_grad]
        wrong = [tuple(p.shape) for p in self.params if p.dtype != s.param_dtype]
        if wrong:
            raise ValueError(f"setup {s.name!r} trains {short(s.param_dtype)} parameters but {len(wrong)} are not "
                             f"(first: shape {wrong[0]}); call model.to({s.param_dtype}) first")
        if weight_decay is None:   # torch.optim's defaults: AdamW 0.01, SGD 0
            weight_decay = 0.01 if s.optimizer == "adamw" else 0.0
        self.master: dict[int, torch.Tensor] = {}
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        for p in self.params:
            target = p
            if s.master_weights:
                target = torch.nn.Parameter(p.detach().float().clone())
                self.master[id(p)] = target
            if s.optimizer == "adamw":
                opt = torch.optim.AdamW([target], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                        foreach=False)
            else:
                opt = torch.optim.SGD([target], lr=lr, weight_decay=weight_decay, foreach=False)
            self.optimizers[id(p)] = opt
        self._hooks = []
        if s.optimizer_in_backward:
            for p in self.params:
                _IN_BACKWARD[id(p)] = (weakref.ref(p), self)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook))
        elif s.master_weights and s.grads == torch.float32:
            for p in self.params:   # fp32 gradients: accumulate into the master's .grad, free the low one
                self._hooks.append(p.register_post_accumulate_grad_hook(self._to_master_grad))
        self.num_updates = 0

    # ---- one parameter ------------------------------------------------------------------------
    @torch.no_grad()
    def update(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Update `p` with `grad` now (the gradient may be freed right after)."""
        target = self.master.get(id(p), p)
        target.grad = grad if grad.dtype == target.dtype else grad.to(target.dtype)
        self.optimizers[id(p)].step()
        target.grad = None
        if target is not p:
            p.copy_(target)
        self.num_updates += 1

    def _hook(self, p: torch.Tensor) -> None:
        if p.grad is None:   # updated inside a compiled backward already (grad_ready)
            return
        if self.ready is not None and not self.ready(p):
            return
        self.update(p, p.grad)
        p.grad = None

    @torch.no_grad()
    def _to_master_grad(self, p: torch.Tensor) -> None:
        m = self.master[id(p)]
        if m.grad is None:
            m.grad = p.grad.float()
        else:
            m.grad.add_(p.grad)
        p.grad = None

    # ---- the usual optimizer interface ------------------------------------------------------
    def step(self) -> None:
        """Update every parameter that has a gradient, one at a time (no-op in backward mode,
        where the updates already happened)."""
        for p in self.params:
            m = self.master.get(id(p))
            if m is not None and m.grad is not None:   # fp32 gradients accumulated in the master
                g, m.grad = m.grad, None
                self.update(p, g)
            elif p.grad is not None:
                g, p.grad = p.grad, None
                self.update(p, g)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
            m = self.master.get(id(p))
            if m is not None:
                m.grad = None

    def set_lr(self, lr: float) -> None:
        for opt in self.optimizers.values():
            for g in opt.param_groups:
                g["lr"] = lr

    def state_bytes(self) -> int:
        """Bytes of optimizer state and master weights actually allocated (measured, not modelled)."""
        n = sum(t.numel() * t.element_size() for opt in self.optimizers.values()
                for st in opt.state.values() for t in st.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
        return n + sum(m.numel() * m.element_size() for m in self.master.values())

    def close(self) -> None:
        """Remove the hooks (the parameters train normally again)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for p in self.params:
            if _IN_BACKWARD.get(id(p), (None, None))[1] is self:
                del _IN_BACKWARD[id(p)]


# id(param) -> (weakref to it, the SetupOptimizer updating it in backward)
_IN_BACKWARD: dict[int, tuple[weakref.ref, SetupOptimizer]] = {}


def updater_for(p: torch.Tensor) -> Optional[SetupOptimizer]:
    entry = _IN_BACKWARD.get(id(p))
    return entry[1] if entry is not None and entry[0]() is p else None


class GraphInputs:
    """What a compiled backward graph needs to update parameters in place: the forward's inputs
    (the parameters themselves, recorded at each forward call) and which other graphs use them."""

    _ids = itertools.count()

    def __init__(self, shared: dict):
        self.handle = next(self._ids)
        self.inputs: list = []
        self.shared = shared        # id(param) -> set of handles that read it (one per session)
        _GRAPHS[self.handle] = self

    def record(self, args: list) -> None:
        self.inputs = [a if isinstance(a, torch.nn.Parameter) else None for a in args]
        for a in args:
            if isinstance(a, torch.nn.Parameter):
                self.shared.setdefault(id(a), set()).add(self.handle)


_GRAPHS: "weakref.WeakValueDictionary[int, GraphInputs]" = weakref.WeakValueDictionary()


def grad_ready(handle: int, slot: int, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Called inside a compiled backward graph once input `slot`'s gradient is final and the
    weight is read no more: update the parameter now and return None (autograd then has no
    gradient to accumulate), or return the gradient when no in-backward optimizer owns it or
    another graph reads the same parameter (its gradients must be summed first)."""
    g = _GRAPHS.get(handle)
    if grad is None or g is None or slot >= len(g.inputs):
        return grad
    p = g.inputs[slot]
    opt = updater_for(p) if p is not None else None
    if opt is None or len(g.shared.get(id(p), ())) > 1:
        return grad
    opt.update(p, grad)
    return None


_KEPT: dict = {}   # handle -> {slot: gradient} that tailorfx::grad_ready left to autograd (kept_grads)


@torch.library.custom_op("tailorfx::grad_ready", mutates_args=("grad", "weights"), tags=(torch.Tag.flexible_layout,))
def grad_ready_op(handle: int, slot: int, grad: torch.Tensor, after: List[torch.Tensor],
                  weights: List[torch.Tensor]) -> None:
    """grad_ready as an op Inductor's generated code calls. It updates the parameter in place, so it
    is declared to write `weights` (the parameter's inputs to the backward: Inductor schedules
    their reads first) and takes `after` (values computed from the parameter that later kernels
    read); it is declared to write `grad` too (its last use; an op that writes nothing would be
    dropped). A gradient it does not consume is kept, as a copy, for the backward's caller to hand
    to autograd (kept_grads): after its last use Inductor may reuse the gradient's buffer."""
    g = grad_ready(handle, slot, grad)
    if g is not None:
        _KEPT.setdefault(handle, {})[slot] = g.clone()


@grad_ready_op.register_fake
def _grad_ready_fake(handle: int, slot: int, grad: torch.Tensor, after: List[torch.Tensor],
                     weights: List[torch.Tensor]) -> None:
    return None


GRAD_READY_OP = torch.ops.tailorfx.grad_ready.default


def kept_grads(handle: int) -> dict:
    """{slot: gradient} that graph `handle`'s last backward left to autograd (taken once)."""
    return _KEPT.pop(handle, {})
