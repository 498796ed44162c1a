"""Run under torchrun: optimize(parallel=dict(pp=..., schedule=...)) on a tiny HF model equals one
process: the loss and every gradient of the rank's stages (fp32, rtol 1e-4). Writes one JSON file
per rank and run to $TAILORFX_RESULTS (results.write); exits 1 on a mismatch."""
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tailorfx  # noqa: E402
from tailorfx.passes.attention.rules import SDPA_ARGS  # noqa: E402
from tailorfx.rewrite.match import named_args  # noqa: E402
from models import hf_family  # noqa: E402
from results import grad_mismatches, leave, measured_and_predicted, write  # noqa: E402


def main(family: str, schedule: str, microbatches: int, tp: int = 1, dp: int = 1, memory: bool = False,
         recompute: bool = False, budget60: bool = False, tokens: int = 32, vocab: int = 512,
         hidden: Optional[int] = None) -> int:
    kw = dict(num_layers=4, vocab_size=vocab, **({"hidden_size": hidden} if hidden else {}))
    ref = hf_family(family, **kw)
    model = hf_family(family, **kw)
    ids = torch.randint(0, vocab, (dp * microbatches, tokens), generator=torch.Generator().manual_seed(1))
    rank = int(os.environ["RANK"])
    pp = int(os.environ["WORLD_SIZE"]) // (tp * dp)
    # mesh (pp, dp, tp): each dp rank runs its own rows through the pipeline; FSDP averages the
    # gradients over dp, which is the whole batch's mean (every micro-batch has as many tokens)
    rows = ids.chunk(dp)[(rank // tp) % dp]
    out = ref(input_ids=ids, labels=ids)
    out.loss.backward()
    own_loss = ref(input_ids=rows, labels=rows).loss.detach() if dp > 1 else out.loss.detach()
    layout = dict(pp=pp, tp=tp, dp=dp, schedule=schedule, microbatches=microbatches)
    # ":budget60": 60% of the layout's predicted peak without rewrites (no optimizer state: no step is taken)
    budget = int(0.6 * _peak(model, layout, rows)) if budget60 else None
    opt = tailorfx.optimize(model, example_inputs=dict(input_ids=rows, labels=rows), parallel=layout,
                            passes=["minisequence", "recompute"] if recompute else None,
                            minisequence_chunks=2 if recompute else None, budget=budget,
                            optimizer=None if budget60 else "adamw")
    for _ in range(2):     # twice: the second step must not see state the first one left
        for p in model.parameters():
            p.grad = None
        loss = opt.step(input_ids=rows, labels=rows)
    mine = dict(opt.named_parameters())
    bad = grad_mismatches(mine.items(), ref)
    measured = predicted = None
    steps = []
    if memory:   # this rank's peak over one pipelined step: the memory model walked through the schedule
        # three steps: under dp gloo sometimes frees a stage's all-gather output late (README), so the
        # least; without dp the median (zero-bubble's last rank once held 9% less in one loaded CI run)
        steps, predicted = measured_and_predicted(opt, model, lambda: opt.step(input_ids=rows, labels=rows),
                                                  repeats=3)
        measured = min(steps) if dp > 1 else sorted(steps)[1]
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, sorted(mine))
    covered = sorted({n for c in counts for n in c})
    ok = (not bad and covered == sorted(dict(ref.named_parameters()))
          and (loss is None or torch.allclose(loss, own_loss, rtol=1e-4)))
    write({"rank": rank, "family": family, "schedule": schedule, "ok": bool(ok),
           "loss": None if loss is None else float(loss), "eager_loss": float(own_loss), "dp": dp,
           "num_params": len(mine), "bad": bad, "sharded": sum(hasattr(p, "full_tensor") for p in mine.values()),
           "stages": opt.session.parallel.report.stage_blocks, "bubble": opt.session.parallel.report.bubble,
           "measured": measured, "predicted": predicted, "measured_steps": steps,
           "stage_param_bytes": sum(p.numel() * p.element_size() for p in mine.values()),
           "budget": budget, "rewrites": list(opt.session.parallel.report.passes),
           "resident": sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in mine.values()),
           "report": str(opt.report()), "sdpa_masks": _sdpa_masks(opt)},
          family, schedule + (":rc" if recompute else "") + (":budget60" if budget60 else "")
          + (f":s{tokens}" if tokens != 32 else "") + (f":v{vocab}" if vocab != 512 else "")
          + (f":h{hidden}" if hidden else ""), f"{tp}x{dp}")
    return 0 if ok else 1


def _sdpa_masks(opt) -> list:
    """attn_mask and enable_gqa of each SDPA call of the graph the stages were cut from (tp=1):
    "None/True" where the mask transformers traces was proved causal and dropped, and k, v left
    grouped, as its eager forward calls it."""
    captured = opt.session.parallel.runtime.pipeline.captured
    if captured is None:
        return []
    calls = [named_args(n, SDPA_ARGS) for n in captured.graph.nodes
             if n.target is torch.nn.functional.scaled_dot_product_attention]
    return [f"{a.get('attn_mask')}/{a.get('enable_gqa', False)}" for a in calls]


def _peak(model, layout: dict, rows: torch.Tensor) -> int:
    """The layout's predicted peak per rank (the worst) without rewrites, no optimizer state."""
    from tailorfx.parallel import predict_rank_memory
    from tailorfx.setup import resolve
    return predict_rank_memory(model, **layout, seq_len=rows.shape[1], batch_size=rows.shape[0] // layout["microbatches"],
                               setup=resolve(None, param_dtype=torch.float32, optimizer=None), passes=[]).peak_bytes


if __name__ == "__main__":     # pipeline_check.py TP[xDP] MICROBATCHES FAMILY:SCHEDULE[:mem] [...]: one launch, several runs
    tp, _, dp = sys.argv[1].partition("x")
    m = int(sys.argv[2])
    # FAMILY:SCHEDULE[:mem][:rc][:budget60][:sN][@TPxDP]: with ":mem", also this rank's measured and
    # predicted peak; ":rc", the MLPs in 2 chunks and each block recomputed; ":budget60", planned under 60%
    # of the layout's peak without rewrites; ":s256", rows of 256 tokens (default 32); ":v8192", that
    # vocabulary (default 512); ":h256", that hidden size;
    # "@TPxDP", a layout other than the launch's (one launch, several layouts: a start costs seconds)
    failed = 0
    for run in sys.argv[3:]:
        spec, _, layout = run.partition("@")
        rtp, _, rdp = (layout or f"{tp}x{dp or 1}").partition("x")
        flags = spec.split(":")[2:]
        tokens, vocab, hidden = (next((int(f[1:]) for f in flags if f[:1] == k and f[1:].isdigit()), d)
                                 for k, d in (("s", 32), ("v", 512), ("h", None)))
        failed += main(*spec.split(":")[:2], m, int(rtp), int(rdp or 1), "mem" in flags, "rc" in flags,
                       "budget60" in flags, tokens, vocab, hidden)
    leave(1 if failed else 0)
