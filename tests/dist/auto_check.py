"""Run under torchrun: optimize(parallel="auto", budget=...) on a tiny HF model equals one process.

Every rank builds the same model (same seed) and is given the same global batch; the chosen
layout must be the same on every rank, and its loss (the mean over the ranks that hold one) and
every gradient equal the single process's (fp32, rtol 1e-4). One JSON file per rank and model."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tailorfx  # noqa: E402
from models import hf_family  # noqa: E402
from results import grad_mismatches, leave, write  # noqa: E402


def main(family: str, budget: str) -> int:
    torch.manual_seed(0)
    ref = hf_family(family, vocab_size=2048)
    model = hf_family(family, vocab_size=2048)
    ids = torch.randint(0, 2048, (4, 128), generator=torch.Generator().manual_seed(1))
    out = ref(input_ids=ids, labels=ids)
    out.loss.backward()
    opt = tailorfx.optimize(model, budget=budget, example_inputs=dict(input_ids=ids, labels=ids), parallel="auto",
                            optimizer=None)
    for _ in range(2):     # twice: the second step must not see state the first one left
        for p in model.parameters():
            p.grad = None
        loss = opt.step(input_ids=ids, labels=ids)
    loss = None if loss is None else loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    held = torch.tensor([0.0 if loss is None else float(loss), 0.0 if loss is None else 1.0], dtype=torch.float64)
    dist.all_reduce(held)
    note = dict(opt.session.parallel.report.describe())["(budget)"]
    notes = [None] * dist.get_world_size()
    dist.all_gather_object(notes, note)
    spec = opt.session.parallel.runtime.spec
    bad = grad_mismatches(opt.named_parameters(), ref)
    mean = float(held[0] / held[1])
    ok = abs(mean - float(out.loss)) <= 1e-4 * abs(float(out.loss)) and not bad and len(set(notes)) == 1
    write({"rank": dist.get_rank(), "ok": bool(ok), "loss": mean, "eager_loss": float(out.loss), "bad": bad,
           "note": note, "notes_agree": len(set(notes)) == 1,
           "layout": [spec.tp, spec.pp, spec.dp, spec.sp]}, family)
    return 0 if ok else 1


if __name__ == "__main__":     # auto_check.py BUDGET FAMILY ...
    failed = sum(main(f, sys.argv[1]) for f in sys.argv[2:])
    leave(1 if failed else 0)
