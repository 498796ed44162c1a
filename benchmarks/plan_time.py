"""How long optimize() under a budget takes to plan a deep HF model: from a shallow capture of its
config (tailorfx/shallow.py: the planner traces the model's own step once, for the hinted plan)
against the search over the whole graph (the same model, the hint left out: until 2026-12-05 the
model had one extra, unused parameter, which the hint refuses, and for which optimize() warned that
the step was not whole). Each row runs in a process of its own, after a warm-up (until 2026-12-05
both ran in one process, one after the other: traces the first made served the second); each
chosen plan's predicted peak as the planner saw it, and the AOTAutograd traces each made of the
model's step (the lowering's included) and of the shallow capture's.

    python benchmarks/plan_time.py                         # Llama, 32 layers, hidden 256, 2,048 tokens
    python benchmarks/plan_time.py --layers 16 --seq 1024 --out /tmp/plan_time.json
    python benchmarks/plan_time.py --kernels triton --layers 17 --hidden 64 --seq 256   # Triton's interpreter
    python benchmarks/plan_time.py --lowering inductor --layers 17 --hidden 64 --seq 256  # CUDA's default lowering
    python benchmarks/plan_time.py --lowering inductor --hint-lowering eager --layers 32 --hidden 64 --seq 256

With --lowering inductor every candidate is traced through Inductor's code generation (its own
AOTAutograd call, which the trace counts leave out), and the shallow capture's plan stands only
where its blocks' kernels repeat alike (rewrite/depth.py); the row's `hint_stood` says whether it did.
With --hint-lowering eager the shallow capture is planned under the eager lowering, as a CUDA model's
under lowering="auto" is (its capture on fake CPU tensors, where "auto" is eager), and the model's
step lowered by Inductor: the row counts the times Inductor generated code only for the memory model
(`inductor_traces`: the search's candidates; a hint checked on the lowering's own compile makes none).

With --kernels the example forward runs the Triton kernels (on the CPU under the interpreter, which
dominates there): each row also times a second forward, which the planning does not include.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
ROWS = ("shallow hint", "whole search")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--kernels", choices=["triton"], default=None)
    ap.add_argument("--lowering", choices=["eager", "inductor"], default="eager")
    ap.add_argument("--hint-lowering", choices=["same", "eager"], default="same",
                    help="the shallow capture's lowering: eager, as a CUDA model's under lowering='auto'")
    ap.add_argument("--row", choices=ROWS, default=None, help=argparse.SUPPRESS)   # one row, in this process
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.row:
        print(json.dumps(one_row(args)))
        return
    rows = {}
    for name in ROWS:   # each in a process of its own: the traces one row made would serve the other
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--row", name]   # a row writes no --out
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        r = rows[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{name:>13}: {r['seconds']:7.1f} s ({r['shallow_capture_s']:.1f} s in the shallow capture, a second "
              f"forward {r['a_second_forward_s']:.1f} s), {r['traces_of_the_model']:2d} traces of the model's step, "
              f"{r['traces_of_the_shallow_capture']:2d} of the shallow capture's, {r['inductor_traces']:2d} Inductor "
              f"code generations for the memory model ({r['inductor_traces_s']:.1f} s), chosen: {r['chosen']}"
              f"{'' if name == 'whole search' or r['hint_stood'] else ' (the hint did not stand)'}", flush=True)
    same = rows["shallow hint"]["chosen"] == rows["whole search"]["chosen"]
    hint_s, whole_s = (rows[k]["seconds"] - rows[k]["a_second_forward_s"] for k in ROWS)
    print(f"same plan: {same}; the hint's optimize() took {hint_s:.1f} s against {whole_s:.1f} s ({hint_s / whole_s:.2f}x), "
          f"{'less a second forward each' if args.kernels else 'the example forward included'}")
    meta = rows["shallow hint"].pop("meta")
    rows["whole search"].pop("meta")
    out = {"meta": meta, "rows": rows, "same_plan": same}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def one_row(args) -> dict:
    """optimize() under the budget, planned from the shallow capture or by the whole search (`args.row`),
    after a warm-up that sets the budget: 2% under the selective-recompute plan's peak."""
    if args.kernels and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"   # before tailorfx's kernels are imported
    import tailorfx
    from models import hf_family
    from tailorfx import api, compat
    from tailorfx.planner import HEADROOM
    from tailorfx.rewrite import inductor_schedule
    torch.set_num_threads(1)
    base = hf_family("llama", num_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=2048)
    ids = torch.randint(0, 2048, (1, args.seq), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    t = time.perf_counter()
    kw = {"kernels": args.kernels} if args.kernels else {}
    kw["lowering"] = args.lowering
    sel = tailorfx.optimize(copy.deepcopy(base), recompute="selective", optimizer=None, example_inputs=inputs, **kw)
    budget = int(0.98 * sel.predict_memory(args.seq).peak_bytes / (1 - HEADROOM))   # the ladder's rungs: over selective
    warm = time.perf_counter() - t
    traces = {"model": 0, "shallow": 0, "shallow_s": 0.0, "inductor": 0, "inductor_s": 0.0}
    inside, whole = [], args.row == "whole search"
    real_aot, real_hint, real_inductor = compat.aot_module_simplified, api.shallow_hint, inductor_schedule.trace

    def counted_aot(*a, **kw):
        traces["shallow" if inside else "model"] += 1
        return real_aot(*a, **kw)

    def counted_inductor(*a, **kw):   # Inductor's code generated only for the memory model
        t0 = time.perf_counter()
        try:
            return real_inductor(*a, **kw)
        finally:
            if not inside:
                traces["inductor"] += 1
                traces["inductor_s"] += time.perf_counter() - t0

    def timed_hint(model, budget, setup, examples, options, lowering, optimize):
        if whole:
            return None
        inside.append(time.perf_counter())
        try:
            return real_hint(model, budget, setup, examples, options,
                             "auto" if args.hint_lowering == "eager" else lowering, optimize)
        finally:
            traces["shallow_s"] = time.perf_counter() - inside.pop()
    compat.aot_module_simplified, api.shallow_hint, inductor_schedule.trace = counted_aot, timed_hint, counted_inductor
    t = time.perf_counter()
    opt = tailorfx.optimize(base, budget=budget, optimizer=None, example_inputs=inputs, **kw)
    seconds = time.perf_counter() - t
    forward = 0.0
    if args.kernels:
        t = time.perf_counter()
        with torch.no_grad():
            opt(**inputs)
        forward = time.perf_counter() - t
    plan = opt.plan[0]
    return {"seconds": round(seconds, 1), "shallow_capture_s": round(traces["shallow_s"], 1),
            "a_second_forward_s": round(forward, 1), "chosen": plan.chosen.label, "reason": plan.reason,
            "hint_stood": "shallow capture" in plan.reason, "traces_of_the_model": traces["model"],
            "traces_of_the_shallow_capture": traces["shallow"], "predicted_peak": plan.chosen.peak,
            "inductor_traces": traces["inductor"], "inductor_traces_s": round(traces["inductor_s"], 1),
            "meta": {"layers": args.layers, "hidden": args.hidden, "seq": args.seq, "budget": budget,
                     "kernels": args.kernels, "lowering": args.lowering, "hint_lowering": args.hint_lowering,
                     "torch": torch.__version__, "threads": 1,
                     "warm_up_s": round(warm, 1)}}


if __name__ == "__main__":
    main()
