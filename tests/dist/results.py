"""What the torchrun checks share: a rank's gradients against one process's, and its result file
(one per rank and run: ranks share stdout, and their lines interleave)."""
import json
import os
import sys
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
    steps, _, predicted = steps_unseen_and_predicted(opt, model, step, repeats)
    return steps, predicted


def steps_unseen_and_predicted(opt, model: torch.nn.Module, step: Callable[[], object], repeats: int = 1
                               ) -> tuple[list[int], list[int], int]:
    """measured_and_predicted, with each step's bytes freed unseen: what the profiler saw allocated
    and not freed beyond the gradients and the result the step leaves (frees gloo's worker thread
    made: runtime.measure.peak_and_net). A step's true peak lies between its peak less those and
    its peak."""
    from tailorfx.runtime.measure import peak_and_net
    saved = {n: p.grad for n, p in opt.named_parameters()}
    steps, unseen = [], []
    for _ in range(repeats):
        for p in model.parameters():
            p.grad = None
        peak, net, result = peak_and_net(step)
        left = sum(_local(p.grad).nbytes for p in model.parameters() if p.grad is not None)
        values = list(result.values()) if isinstance(result, dict) else [result]   # a ModelOutput, or the loss
        left += sum(_local(t).nbytes for t in values if isinstance(t, torch.Tensor))
        steps.append(peak)
        unseen.append(max(0, net - left))
        del result, values
    predicted = opt.predict_memory().forward_backward_peak_bytes
    for n, p in opt.named_parameters():
        p.grad = saved[n]
    return steps, unseen, predicted


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def write(row: dict, *tags: str) -> None:
    """$TAILORFX_RESULTS/rank{R}_{tags}.json: what tests/test_parallel.py reads back."""
    path = os.path.join(os.environ["TAILORFX_RESULTS"], "_".join([f"rank{row['rank']}", *tags]) + ".json")
    with open(path, "w") as f:
        json.dump(row, f)


def leave(code: int) -> None:
    """End a rank: every rank past its last collective, gloo torn down, then exit without interpreter
    finalization. gloo objects freed while Python clears its modules can abort the process ("terminate
    called without an active exception", pytorch#65231; seen in CI under load with test_steptime's
    script and the torchrun example)."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
