"""What the torchrun checks share: a rank's gradients against one process's, and its result file
(one per rank and run: ranks share stdout, and their lines interleave)."""
import json
import os
from typing import Callable, Iterable, Optional

import torch


def grad_mismatches(named_params: Iterable, ref: torch.nn.Module) -> dict[str, Optional[float]]:
    """Name -> max |grad - reference| (None: no gradient) for each parameter whose gradient, whole
    (a DTensor's full_tensor()), differs from the single process's (fp32, rtol 1e-4)."""
    ref_params = dict(ref.named_parameters())
    bad = {}
    for name, p in named_params:
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        r = ref_params[name].grad
        if g is None or not torch.allclose(g, r, rtol=1e-4, atol=1e-6):
            bad[name] = None if g is None else float((g - r).abs().max())
    return bad


def measured_and_predicted(opt, model: torch.nn.Module, step: Callable[[], object], repeats: int = 1
                           ) -> tuple[list[int], int]:
    """This rank's peak over each of `repeats` calls of `step()` (allocator events, its gradients
    cleared first) and the forward+backward peak `opt.predict_memory()` predicts for it; the
    gradients are put back."""
    import tailorfx
    saved = {n: p.grad for n, p in opt.named_parameters()}
    measured = []
    for _ in range(repeats):
        for p in model.parameters():
            p.grad = None
        measured.append(tailorfx.measure_peak(step))
    predicted = opt.predict_memory().forward_backward_peak_bytes
    for n, p in opt.named_parameters():
        p.grad = saved[n]
    return measured, predicted


def write(row: dict, *tags: str) -> None:
    """$TAILORFX_RESULTS/rank{R}_{tags}.json: what tests/test_parallel.py reads back."""
    path = os.path.join(os.environ["TAILORFX_RESULTS"], "_".join([f"rank{row['rank']}", *tags]) + ".json")
    with open(path, "w") as f:
        json.dump(row, f)
