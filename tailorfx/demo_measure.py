"""What the demo measures and draws: the memory and time of one training step as `train()` runs
it, the budget that sets, the held-out loss, and the loss curve."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Sequence, Tuple

import torch


@dataclass
class StepMemory:
    """The measured memory and time of one training step."""
    total: int          # weights + optimizer state + the measured peak of the step
    dynamic: int        # the measured peak of the step above weights and optimizer state
    static: int         # weights + optimizer state
    seconds: float      # wall time of one step (the mean of timed steps after the measured one)


def _make_step(module, params: List[torch.nn.Parameter], optimizer, batch: dict, clip: float) -> Callable[[], None]:
    """One training step as `tailorfx.runtime.train.train` runs it (zero grads, forward and
    backward with num_items_in_batch, clip, AdamW step)."""
    from tailorfx.runtime.train import accumulate

    def step():
        optimizer.zero_grad(set_to_none=True)
        accumulate(module, [batch])
        torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
    return step


def measure_step(module, model: torch.nn.Module, batch: dict, lr: float, clip: float = 1.0,
                 timed_steps: int = 3) -> StepMemory:
    """Weights + AdamW state + tailorfx.measure_peak of a steady-state training step (the second
    step: the optimizer state exists, gradients freed at its start), then the time of a step.
    Steps the model's weights: the caller restores them."""
    import tailorfx
    from tailorfx.runtime.train import make_optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(model, lr)
    step = _make_step(module, params, opt, batch, clip)
    step()                              # compiles (tailorfx) and creates the optimizer state
    opt.zero_grad(set_to_none=True)
    peak = tailorfx.measure_peak(step)   # its profiler's start/stop lines are dropped
    t = time.perf_counter()
    for _ in range(timed_steps):
        step()
    seconds = (time.perf_counter() - t) / max(1, timed_steps)
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0)
    static = sum(p.numel() * p.element_size() for p in model.parameters()) + state
    opt.zero_grad(set_to_none=True)
    return StepMemory(static + peak, peak, static, seconds)


def resolve_budget(text: str, eager_total: int) -> Tuple[int, str]:
    """'60%' -> that share of eager's measured step; else a size tailorfx.Budget parses."""
    from tailorfx.budget import Budget
    text = str(text).strip()
    if text.endswith("%"):
        share = float(text[:-1]) / 100
        if not 0 < share:
            raise ValueError(f"budget {text!r}: a positive percentage of eager's peak")
        return int(eager_total * share), f"{text} of eager's measured peak"
    return Budget.parse(text).bytes, text


def held_out_loss(model: torch.nn.Module, batches: Sequence[dict]) -> float:
    """Mean token loss over `batches` (eval mode, no grad), weighted by target count."""
    from tailorfx.runtime.train import NOT_MODEL_INPUTS, count_targets
    was_training = model.training
    model.eval()
    total = count = 0.0
    try:
        with torch.no_grad():
            for b in batches:
                n = count_targets(b)
                if not n:
                    continue
                out = model(**{k: v for k, v in b.items() if k not in NOT_MODEL_INPUTS})
                total += float(out.loss) * n
                count += n
    finally:
        model.train(was_training)
    return total / count if count else float("nan")


def plot_losses(path: Path, records: List[dict], held: List[Tuple[int, float]], title: str,
                vocab: int, tokens_per_step: int) -> Path:
    """Train loss per optimizer step (and its moving average) with the held-out points, as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(10, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    steps = [r["step"] for r in records if r.get("loss") is not None]
    losses = [r["loss"] for r in records if r.get("loss") is not None]
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, lw=0.8, label="train loss (per step)")
    if len(losses) >= 5:
        k = max(2, len(losses) // 40)
        smooth, acc = [], 0.0
        for i, x in enumerate(losses):   # trailing mean of k steps
            acc += x - (losses[i - k] if i >= k else 0.0)
            smooth.append(acc / min(i + 1, k))
        ax.plot(steps, smooth, color="tab:blue", lw=1.8, label=f"train loss (mean of {k} steps)")
    if held:
        ax.plot([s for s, _ in held], [v for _, v in held], "o-", color="tab:orange", lw=1.8,
                label="held-out loss (files never trained on)")
    ax.axhline(math.log(vocab), color="gray", ls=":", lw=1, label=f"uniform over {vocab} tokens (ln V)")
    ax.set_xlabel(f"optimizer step ({tokens_per_step} token slots each)")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return Path(path)
