"""Mini-sequence vs eager: step time, measured peak and predicted peak on HF LlamaForCausalLM
(benchmarks/common.py reference_model).

Both variants run in the same process, interleaved, so the time ratio is measured under the same
load. Peak = bytes allocated during one forward+backward above what existed before it
(tailorfx.measure_peak, the profiler's allocator events); parameters are the same in both.
"""
from __future__ import annotations

import argparse
import copy
import sys
import os

import torch

sys.path.insert(0, os.path.dirname(__file__))
import tailorfx  # noqa: E402
from common import lm_batch, measure_step, mib, print_table, reference_model, time_it, train_step, write_json  # noqa: E402


def run(seqs, reps, chunks=None, layers=4):
    base = reference_model(layers=layers)
    rows, out = [], []
    for S in seqs:
        inputs = lm_batch(S)
        eager = base
        model = copy.deepcopy(base)
        opt = tailorfx.optimize(model, passes=["minisequence"], minisequence_chunks=chunks,
                                example_inputs=lm_batch(64))
        plain = tailorfx.optimize(copy.deepcopy(base), passes=[], example_inputs=lm_batch(64))
        variants = {"eager": (eager, list(eager.parameters())),
                    "tailorfx, no pass": (plain, list(plain.parameters())),
                    "tailorfx minisequence": (opt, list(model.parameters()))}
        steps = {k: train_step(m, ps, inputs) for k, (m, ps) in variants.items()}
        for f in steps.values():
            f()   # warm-up (compiles)
        peaks = {k: measure_step(m, ps, inputs) for k, (m, ps) in variants.items()}
        times = {k: 0.0 for k in steps}
        for _ in range(reps):   # interleave the variants so load affects all alike
            for k, f in steps.items():
                times[k] += time_it(f, 1) / reps
        pred = opt.predict_memory(seq_len=S).forward_backward_peak_bytes
        pred_plain = plain.predict_memory(seq_len=S).forward_backward_peak_bytes
        chunks_used = sorted({v["num_chunks"] for g in opt.session.graphs for r in g.records
                              for v in r.stats.values()})
        rec = {"seq": S, "peak_bytes": peaks, "seconds": times,
               "predicted_peak_bytes": {"tailorfx, no pass": pred_plain, "tailorfx minisequence": pred},
               "num_chunks": chunks_used}
        out.append(rec)
        for k in steps:
            p = rec["predicted_peak_bytes"].get(k)
            rows.append([S, k, mib(peaks[k]), mib(p) if p else "-",
                         f"{(p - peaks[k]) / peaks[k] * 100:+.1f}%" if p else "-",
                         f"{peaks[k] / peaks['eager']:.2f}", f"{times[k]:.2f}", f"{times[k] / times['eager']:.2f}"])
    print_table("Mini-sequence on HF LlamaForCausalLM (vocab 32000, hidden 512, 4 layers, fp32, batch 1)",
                ["seq", "variant", "measured peak MiB", "predicted MiB", "pred err", "peak / eager",
                 "step s", "time / eager"], rows)
    print("chunks per seq:", {r["seq"]: r["num_chunks"] for r in out})
    print("wrote", write_json("minisequence.json", out))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunks", type=int, default=None, help="fixed M (default: chosen per region)")
    ap.add_argument("--quick", action="store_true", help="small run: seq 512 and 1024, 1 rep")
    a = ap.parse_args()
    if a.quick:
        run([512, 1024], 1, a.chunks, layers=2)
    else:
        run(a.seqs, a.reps, a.chunks)
