"""Per-rank memory and step time of each parallel layout, on CPU processes (gloo, torchrun).

One HF Llama (vocab 8000, hidden 256, 8 heads / 4 KV heads, 4 layers, fp32), one global batch
(4 x 512 tokens) for every layout; data parallel splits its rows, pipeline parallel (the step
graph cut into stages, 1F1B, 4 micro-batches) its micro-batches. Per rank: the bytes its
parameters and gradients hold (DTensor shards counted locally), the measured forward+backward
peak above that (profiler allocator events, FSDP's gathered parameters included), and the median
step time of 5 steps after 2 warm-up steps (slowest rank). Every layout is checked against the
single-process loss.

    python benchmarks/parallel.py            # launches each layout with torchrun, prints a table
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (4, 1, 1), (1, 4, 1), (2, 2, 1), (1, 1, 4)]   # (tp, dp, pp)
SCHEDULE, MICROBATCHES = "1f1b", 4


def worker(tp: int, dp: int, pp: int, seq: int, batch: int) -> None:
    import statistics
    import time

    import torch
    import torch.distributed as dist
    sys.path.insert(0, HERE)
    import tailorfx
    from common import hf_llama_model, lm_batch, measure_step
    from tailorfx import measure_peak

    model = hf_llama_model(vocab=8000, hidden=256, layers=4, heads=8, kv_heads=4)
    batch_all = lm_batch(seq, vocab=8000, B=batch)
    with torch.no_grad():
        ref_loss = float(model(**batch_all).loss)
    if tp * dp * pp == 1:
        opt, rank, rows = model, 0, batch_all
    elif pp > 1:
        opt = tailorfx.optimize(model, example_inputs=batch_all,
                                parallel=dict(pp=pp, schedule=SCHEDULE, microbatches=MICROBATCHES))
        rank, rows = dist.get_rank(), batch_all
    else:
        opt = tailorfx.optimize(model, example_inputs=batch_all if dp == 1 else {k: v[:1] for k, v in batch_all.items()},
                                parallel=dict(tp=tp, dp=dp))
        rank = dist.get_rank()
        rows = {k: v.chunk(dp)[rank // tp] for k, v in batch_all.items()}
    params = [p for _, p in opt.named_parameters()]
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in params)

    def step():
        for p in params:
            p.grad = None
        if pp > 1:
            loss = opt.step(**rows)
            return torch.zeros(()) if loss is None else loss
        loss = opt(**rows).loss
        loss.backward()
        loss = loss.detach()
        return loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    loss = step()
    step()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    if pp > 1:
        for p in params:
            p.grad = None
        peak = measure_peak(lambda: opt.step(**rows))
    else:
        peak = measure_step(opt, params, rows)
    if pp > 1:      # the loss lives on the last stage's rank
        dist.broadcast(loss, src=dist.get_world_size() - 1)
    predicted = None
    if tp > 1 and dp == 1 and pp == 1:     # the memory model on the sharded graph, at the measured batch
        predicted = opt.predict_memory().forward_backward_peak_bytes
    if dp > 1:
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    _emit({"rank": rank, "tp": tp, "dp": dp, "pp": pp, "param_bytes": local, "grad_bytes": local,
                      "fwd_bwd_peak_bytes": peak, "predicted_fwd_bwd_peak_bytes": predicted, "step_s": statistics.median(times),
                      "loss": float(loss), "single_process_loss": ref_loss})
    if dist.is_initialized():
        dist.destroy_process_group()


def _emit(row: dict) -> None:
    """One JSON file per rank (ranks share stdout, and their lines interleave)."""
    with open(os.path.join(os.environ["TAILORFX_RESULTS"], f"rank{row['rank']}.json"), "w") as f:
        json.dump(row, f)


def launch(tp: int, dp: int, pp: int, seq: int, batch: int) -> list[dict]:
    import tempfile
    n = tp * dp * pp
    results = tempfile.mkdtemp()
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]
           if n > 1 else [sys.executable])
    cmd += [os.path.abspath(__file__), "--worker", str(tp), str(dp), str(pp), "--seq", str(seq), "--batch", str(batch)]
    out = subprocess.run(cmd, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "TAILORFX_RESULTS": results})
    rows = [json.load(open(os.path.join(results, f))) for f in sorted(os.listdir(results))]
    if out.returncode != 0 or len(rows) != n:
        raise RuntimeError(f"layout tp={tp} dp={dp} pp={pp} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=3, type=int, metavar=("TP", "DP", "PP"))
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    a = ap.parse_args()
    if a.worker:
        return worker(*a.worker, a.seq, a.batch)
    sys.path.insert(0, HERE)
    from common import print_table, write_json
    mib = lambda b: f"{b / 2**20:.1f}"
    results, rows = [], []
    for tp, dp, pp in LAYOUTS:
        ranks = launch(tp, dp, pp, a.seq, a.batch)
        results.append({"tp": tp, "dp": dp, "pp": pp, "ranks": ranks})
        worst = max(ranks, key=lambda r: r["param_bytes"] + r["grad_bytes"] + r["fwd_bwd_peak_bytes"])
        base = results[0]["ranks"][0]
        total = lambda r: r["param_bytes"] + r["grad_bytes"] + r["fwd_bwd_peak_bytes"]
        name = f"pp={pp} ({SCHEDULE}, {MICROBATCHES} micro-batches)" if pp > 1 else f"tp={tp} dp={dp}"
        pred = worst.get("predicted_fwd_bwd_peak_bytes")
        rows.append([name, str(tp * dp * pp), mib(worst["param_bytes"]), mib(worst["fwd_bwd_peak_bytes"]),
                     f"{mib(pred)} ({(pred - worst['fwd_bwd_peak_bytes']) / worst['fwd_bwd_peak_bytes']:+.1%})" if pred else "-",
                     mib(total(worst)), f"{total(worst) / total(base):.2f}", f"{max(r['step_s'] for r in ranks):.3f}",
                     f"{abs(ranks[0]['loss'] - base['single_process_loss']) / base['single_process_loss']:.1e}"])
    print_table(f"Per rank, HF Llama (hidden 256, 4 layers, vocab 8000), global batch {a.batch} x {a.seq}, fp32, gloo",
                ["layout", "processes", "params MiB", "fwd+bwd peak MiB", "predicted MiB", "params+grads+peak MiB",
                 "vs 1 process", "step s (slowest rank)", "loss rel. err"], rows)
    print("wrote", write_json("parallel.json", results))


if __name__ == "__main__":
    main()
