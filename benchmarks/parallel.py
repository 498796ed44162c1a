"""Per-rank memory and step time of each parallel layout, on CPU processes (gloo, torchrun), against
the per-rank memory predicted without running (tailorfx.parallel.predict_rank_memory); then Llama-3-8B's
per-rank memory predicted for layouts of 8 and 64 GPUs.

One HF Llama (vocab 8000, hidden 256, 8 heads / 4 KV heads, 4 layers, fp32), one global batch
(4 x 512 tokens) for every layout; data parallel splits its rows, Ulysses (sp) the sequence over
the dp ranks, Megatron's sequence parallelism (tp+sp) the norms and residual stream over the tp
ranks, pipeline parallel (the step graph cut into stages, 1F1B, 4 micro-batches) its
micro-batches. Per rank: the bytes its parameters and gradients hold (DTensor shards counted
locally), the measured forward+backward peak above that (profiler allocator events, FSDP's
gathered parameters included; the smallest of three steps, as the tests take it), and the median step time of 5 steps after 2 warm-up steps
(slowest rank). Every layout is checked against the single-process loss. "Predicted" is
`predict_rank_memory` run here, in one process, from the model's config (fake tensors, a fake
process group for tp), for the worst rank, in the same terms (parameters + gradients + the
forward+backward peak above them); "in torchrun" is each rank's `opt.predict_memory()`. Tensor
parallel layouts run tailorfx's fused vocab-parallel loss (the default); "tp2:lp" and "tp4:lp" the
same layouts with the head's loss under DTensor's `loss_parallel`, as torchtitan runs it.

    python benchmarks/parallel.py                      # every layout, then the 8B table
    python benchmarks/parallel.py --layouts tp2 pp4    # some layouts (dp2:rc: FSDP2 with recompute)
    python benchmarks/parallel.py --measured out/parallel.json   # re-predict saved measurements
    python benchmarks/parallel.py --predict-8b         # only the 8B table (no launches)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# (tp, dp, pp, sp): sp=1 splits the sequence over the dp ranks (Ulysses) instead of the batch;
# sp=2 splits it over the tp ranks between the sharded layers (Megatron's sequence parallelism).
# tp2xpp2 is not run by default: on gloo its ranks held a varying number of extra collective
# buffers (its worst rank measured 82.9, 82.9, 85.4 and 99.4 MiB in four runs of the same step)
LAYOUTS = {"1": (1, 1, 1, 0), "tp2": (2, 1, 1, 0), "dp2": (1, 2, 1, 0), "pp2": (1, 1, 2, 0), "tp4": (4, 1, 1, 0),
           "dp4": (1, 4, 1, 0), "tp2xdp2": (2, 2, 1, 0), "pp4": (1, 1, 4, 0), "tp2xpp2": (2, 1, 2, 0),
           "sp2": (1, 2, 1, 1), "sp4": (1, 4, 1, 1), "tp2+sp": (2, 1, 1, 2), "tp4+sp": (4, 1, 1, 2),
           "pp2xdp2": (1, 2, 2, 0), "tp2:lp": (2, 1, 1, 0), "tp4:lp": (4, 1, 1, 0),
           "pp2:raw": (1, 1, 2, 0), "pp4:raw": (1, 1, 4, 0), "dp2:rc": (1, 2, 1, 0), "dp4:rc": (1, 4, 1, 0)}
# ":lp": the vocab-parallel head's loss under DTensor's loss_parallel (as torchtitan runs it) instead
# of tailorfx's fused vocab-parallel loss (runtime/vocab_parallel.py), the default; ":raw": pipeline
# stages cut from the step graph as captured (passes=[]), without the default rewrites (the LM head
# fused with its loss, the MLPs in mini-sequence chunks); ":rc": passes=["recompute"] under FSDP2 (each
# block checkpointed inside its fully_shard unit)


def vocab_loss(name: str) -> str:
    """The layout's variant: the head's loss ("fused", "loss_parallel"), or the passes ("raw", "recompute")."""
    return {"lp": "loss_parallel", "raw": "raw", "rc": "recompute"}.get(name.rpartition(":")[2], "fused")


def vocab_loss_of(variant: str) -> str:
    return "loss_parallel" if variant == "loss_parallel" else "fused"


def stage_passes(loss: str):
    """optimize()'s passes=: the default (None), none (":raw") or recompute (":rc")."""
    return [] if loss == "raw" else ["recompute"] if loss == "recompute" else None
SP = {0: None, 1: "ulysses", 2: "megatron"}
SCHEDULE = "1f1b"


def rank_rows(dp: int, pp: int, sp: int, batch: int) -> int:
    """Rows of one rank's micro-batch: a pipeline's are one row each, Ulysses' every row."""
    return 1 if pp > 1 else batch if sp == 1 else batch // dp


def microbatches(batch: int, dp: int) -> int:
    """A pipeline's micro-batches: one row each of the dp rank's rows (4 under pp alone)."""
    return batch // dp


def worker(tp: int, dp: int, pp: int, sp: int, seq: int, batch: int, loss: str = "fused") -> None:
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
    elif pp > 1:    # mesh (pp, dp, tp): each dp rank's rows go through its pipeline
        rank = int(os.environ["RANK"])
        rows = {k: v.chunk(dp)[(rank // tp) % dp] for k, v in batch_all.items()}
        opt = tailorfx.optimize(model, example_inputs=rows, passes=stage_passes(loss), parallel=dict(
            tp=tp, pp=pp, dp=dp, schedule=SCHEDULE, microbatches=microbatches(batch, dp)))
    elif sp == 1:   # every rank takes every row, and its slice of the sequence
        opt = tailorfx.optimize(model, example_inputs=batch_all, parallel=dict(dp=dp, sp="ulysses"))
        rank, rows = dist.get_rank(), batch_all
    else:           # each dp rank's rows are its example (its predictions are at their shape)
        rank = int(os.environ["RANK"])
        rows = {k: v.chunk(dp)[rank // tp] for k, v in batch_all.items()}
        opt = tailorfx.optimize(model, example_inputs=rows, passes=stage_passes(loss), parallel=dict(
            tp=tp, dp=dp, sp=SP[sp], vocab_loss=vocab_loss_of(loss)))
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
    # the smallest of three measured steps, as the tests take it: on gloo a step sometimes holds
    # collective buffers a little longer (a few hidden-state-sized buffers, varying between steps)
    peaks = []
    for _ in range(3):
        if pp > 1:
            for p in params:
                p.grad = None
            peaks.append(measure_peak(lambda: opt.step(**rows)))
        else:
            peaks.append(measure_step(opt, params, rows))
    peak = min(peaks)
    if pp > 1:      # the loss lives on the last stage's ranks (one per dp rank): their mean
        dist.all_reduce(loss)
        loss /= dp * tp
    predicted = None
    if tp * dp * pp > 1:     # this rank's prediction, inside torchrun, at the measured batch
        predicted = opt.predict_memory().forward_backward_peak_bytes
    if dp > 1 and pp == 1:
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    _emit({"rank": rank, "tp": tp, "dp": dp, "pp": pp, "sp": sp, "param_bytes": local, "grad_bytes": local,
                      "fwd_bwd_peak_bytes": peak, "fwd_bwd_peak_bytes_steps": peaks, "predicted_fwd_bwd_peak_bytes": predicted, "step_s": statistics.median(times),
                      "step_s_all": times,
                      "loss": float(loss), "single_process_loss": ref_loss})
    if dist.is_initialized():
        dist.destroy_process_group()


def calibrate_worker() -> None:
    """One rank of the calibration (tailorfx.parallel.calibrate): rank 0 writes the DeviceClass."""
    import torch.distributed as dist
    from tailorfx.parallel.calibrate import calibrate
    dist.init_process_group("gloo")
    dev = calibrate()
    if dist.get_rank() == 0:
        _emit({"rank": 0, **dev.as_dict()})
    dist.destroy_process_group()


def calibrated(world: int):
    """This machine's step-time figures, measured on `world` gloo processes."""
    import tempfile
    from tailorfx.parallel.devices import DeviceClass
    results = tempfile.mkdtemp()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           os.path.abspath(__file__), "--calibrate-worker"]
    out = subprocess.run(cmd, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "TAILORFX_RESULTS": results})
    if out.returncode != 0:
        raise RuntimeError(f"calibration failed:\n{out.stderr[-3000:]}")
    return DeviceClass.from_dict(json.load(open(os.path.join(results, "rank0.json"))))


def spearman(xs: list, ys: list) -> float:
    """Spearman's rank correlation (ties take their mean rank)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def predict_time(tp: int, dp: int, pp: int, sp: int, seq: int, batch: int, loss: str, device):
    """The layout's forward+backward time, predicted (tailorfx.parallel.predict_step_time)."""
    from tailorfx.parallel import predict_step_time
    rows = rank_rows(dp, pp, sp, batch)
    return predict_step_time(small_config(), tp=tp, dp=dp, pp=pp, sp=SP[sp], schedule=SCHEDULE,
                             microbatches=microbatches(batch, dp) if pp > 1 else None, seq_len=seq, batch_size=rows,
                             setup="fp32", vocab_loss=vocab_loss_of(loss), passes=stage_passes(loss), device=device)


def _emit(row: dict) -> None:
    """One JSON file per rank (ranks share stdout, and their lines interleave)."""
    with open(os.path.join(os.environ["TAILORFX_RESULTS"], f"rank{row['rank']}.json"), "w") as f:
        json.dump(row, f)


def launch(tp: int, dp: int, pp: int, sp: int, seq: int, batch: int, loss: str = "fused") -> list[dict]:
    import tempfile
    n = tp * dp * pp
    results = tempfile.mkdtemp()
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]
           if n > 1 else [sys.executable])
    cmd += [os.path.abspath(__file__), "--worker", str(tp), str(dp), str(pp), str(sp), "--seq", str(seq),
            "--batch", str(batch), "--vocab-loss", loss]
    out = subprocess.run(cmd, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "TAILORFX_RESULTS": results})
    rows = [json.load(open(os.path.join(results, f))) for f in sorted(os.listdir(results))]
    if out.returncode != 0 or len(rows) != n:
        raise RuntimeError(f"layout tp={tp} dp={dp} pp={pp} sp={sp} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return rows


def small_config():
    """The launched model's config (what hf_llama_model builds)."""
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=int(256 * 2.6875), num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4)


def llama3_8b_config():
    """Llama-3-8B's architecture (no download)."""
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, rope_theta=500000, max_position_embeddings=8192,
                       tie_word_embeddings=False)


def predict_layout(tp: int, dp: int, pp: int, sp: int, seq: int, batch: int, loss: str = "fused"):
    """The worst rank of a launched layout, predicted in this process: (its prediction, the
    benchmark's measure of it: parameters + gradients + the forward+backward peak above them)."""
    from tailorfx.parallel import predict_rank_memory
    rows = rank_rows(dp, pp, sp, batch)
    rm = predict_rank_memory(small_config(), tp=tp, dp=dp, pp=pp, sp=SP[sp], schedule=SCHEDULE,
                             microbatches=microbatches(batch, dp) if pp > 1 else None, seq_len=seq, batch_size=rows,
                             setup="fp32", vocab_loss=vocab_loss_of(loss),
                             passes=stage_passes(loss))
    if pp > 1:     # per pipeline rank, in the benchmark's terms
        totals = [2 * params + fb for _, fb, params in rm.pipeline_ranks]
        return rm, max(totals), totals
    return rm, 2 * rm.param_bytes + rm.forward_backward_peak_bytes, None


PLANS_8B = [(8, dict(dp=8)), (8, dict(dp=8, passes=["recompute"])), (8, dict(dp=8, sp="ulysses")), (8, dict(tp=8)), (8, dict(tp=8, vocab_loss="loss_parallel")),
            (8, dict(tp=8, sp="megatron")),
            (8, dict(tp=2, dp=4)),
            (8, dict(tp=4, dp=2)), (8, dict(tp=4, pp=2)), (8, dict(pp=2, dp=4)), (8, dict(pp=8)),
            (64, dict(dp=64)), (64, dict(dp=64, passes=["recompute"])), (64, dict(tp=8, dp=8)), (64, dict(tp=8, dp=8, sp="megatron")), (64, dict(tp=4, dp=16)), (64, dict(tp=8, pp=8)),
            (64, dict(tp=8, pp=2, dp=4)), (64, dict(tp=4, pp=4, dp=4)), (64, dict(pp=64)), (64, dict(tp=16, dp=4))]


def predict_8b(seq: int = 8192, match: str = "") -> tuple[list[list], list[dict]]:
    """Llama-3-8B per rank under each plan (those whose row names `match`): amp-bf16 (bf16 weights,
    fp32 master weights, fp32 AdamW state), seq `seq`, micro-batch 1 (pipelines: pp micro-batches
    of 1 row, 1F1B)."""
    import time
    from tailorfx import planner
    from tailorfx.budget import Budget
    from tailorfx.parallel import describe_layout, predict_rank_memory
    cfg = llama3_8b_config()
    gib = lambda b: f"{b / 2**30:.1f}"
    usable = planner.usable(Budget.parse("80GB").bytes)
    rows, out = [], []
    for world, plan in PLANS_8B:
        tp, dp, pp, sp = plan.get("tp", 1), plan.get("dp", 1), plan.get("pp", 1), plan.get("sp")
        name = describe_layout(tp, pp, dp, sp) + (" (loss_parallel)" if plan.get("vocab_loss") == "loss_parallel" else "") + (
            ", recompute" if plan.get("passes") else "")
        if match not in name:
            continue
        t = time.time()
        try:
            rm = predict_rank_memory(cfg, **plan, seq_len=seq, batch_size=1, setup="amp-bf16")
        except ValueError as e:      # what optimize(parallel=...) would refuse, and why
            reason = re.sub(r"^parallel=\{.*?\}: ", "", str(e).splitlines()[0]).split(" (read from")[0]
            rows.append([str(world), name] + ["-"] * 7 + [f"refused: {reason}"])
            out.append({"world": world, **plan, "refused": str(e)})
            continue
        b = rm.breakdown()
        rows.append([str(world), name, gib(rm.peak_bytes), gib(b["parameters"]), gib(b["gradients"]),
                     gib(b["optimizer state"]), gib(b["activations"]), gib(b["communication buffers"]),
                     f"{rm.bubble:.0%}" if pp > 1 else "-", "yes" if rm.peak_bytes <= usable else "no"])
        out.append({"world": world, **plan, "peak_bytes": rm.peak_bytes, "breakdown": b, "rank": rm.rank,
                    "bubble": rm.bubble, "seconds": round(time.time() - t, 1),
                    "stages": [{"stage": st.stage, "blocks": len(st.blocks), "peak_inflight": st.peak_inflight,
                                "kept_bytes": st.kept_bytes} for st in rm.stages]})
    return rows, out


SEQS_8B = (8192, 32768, 131072)


def frugal_passes(c) -> tuple[str, ...]:
    """The most frugal rewrites a world candidate's layout takes (parallel.fit's last candidate)."""
    from tailorfx.parallel.fit import candidates
    from tailorfx.parallel.spec import ParallelSpec
    return candidates(ParallelSpec(tp=c.tp, dp=c.dp, pp=c.pp, sp=c.sp), None)[-1]


def worlds_8b(worlds=(8, 64), seqs=SEQS_8B) -> tuple[list[list], list[dict], list[list]]:
    """`tailorfx plan --world N --budget H100-80GB --seq S` for Llama-3-8B (amp-bf16, one row per
    rank's micro-batch): every layout with the rewrites it takes, its per-rank peak, predicted
    step time and tokens per second; then, on the first world, the longest sequence each layout
    reaches with its most frugal rewrites (`frugal_passes`: without sp the MLPs chunked and each
    block recomputed, but under zero-bubble or tp inside pipeline stages): the predicted peaks at
    `seqs` fitted as a + b * seq (flash attention: activations grow linearly) and solved for the
    budget, marked "extrapolated" beyond the longest sequence planned."""
    import time
    from tailorfx import planner
    from tailorfx.budget import Budget
    from tailorfx.errors import BudgetError
    from tailorfx.parallel import plan_world, predict_rank_memory
    cfg, gib = llama3_8b_config(), lambda b: f"{b / 2**30:.1f}"
    usable = planner.usable(Budget.parse("H100-80GB").bytes)
    rows, out, frugal = [], [], {}
    for world in worlds:
        for seq in seqs:
            t = time.time()
            try:
                cands = plan_world(cfg, world=world, budget="H100-80GB", seq_len=seq, setup="amp-bf16")
            except BudgetError as e:
                cands = e.candidates
            print(f"world {world}, seq {seq}: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
            for c in cands:
                if c.memory is None:
                    continue
                rows.append([str(world), str(seq), c.layout(), "+".join(c.passes) or "-", gib(c.peak_bytes),
                             f"{c.step_s * 1e3:.0f}", f"{c.tokens_per_s:,.0f}",
                             "chosen" if c.chosen else c.status])
                out.append({"world": world, "seq": seq, "layout": c.layout(), "tp": c.tp, "pp": c.pp, "dp": c.dp,
                            "sp": c.sp, "passes": list(c.passes), "peak_bytes": c.peak_bytes,
                            "step_s": c.step_s, "tokens_per_s": c.tokens_per_s, "status": c.status,
                            "chosen": c.chosen, "step": c.step.breakdown()})
                if world == worlds[0]:
                    passes = list(frugal_passes(c))
                    peak = c.peak_bytes if passes == list(c.passes) else predict_rank_memory(
                        cfg, tp=c.tp, dp=c.dp, pp=c.pp, sp=c.sp, seq_len=seq, batch_size=1, setup="amp-bf16",
                        passes=passes).peak_bytes
                    frugal.setdefault((c.layout(), "+".join(passes) or "-"), []).append((seq, peak))
    longest = []
    for (layout, rewrites), pts in frugal.items():
        if len(pts) < 2:
            continue
        n = len(pts)
        mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
        b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        a = my - b * mx
        worst = max(abs(a + b * x - y) / y for x, y in pts)
        reach = int((usable - a) / b) if b > 0 else 0
        where = "extrapolated" if reach > max(x for x, _ in pts) else "interpolated"
        longest.append([layout, rewrites, f"{reach:,}" if reach > 0 else "none", where, f"{worst:.1%}"])
    return rows, out, sorted(longest, key=lambda r: -int(r[2].replace(",", "")) if r[2] != "none" else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=4, type=int, metavar=("TP", "DP", "PP", "SP"))
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab-loss", default="fused", choices=["fused", "loss_parallel", "raw", "recompute"])
    ap.add_argument("--layouts", nargs="+", default=[k for k in LAYOUTS if k != "tp2xpp2"], choices=list(LAYOUTS))
    ap.add_argument("--measured", default=None, help="a JSON this benchmark wrote: re-predict its measurements")
    ap.add_argument("--predict-8b", action="store_true", help="only the Llama-3-8B table (no launches)")
    ap.add_argument("--skip-8b", action="store_true", help="no Llama-3-8B table")
    ap.add_argument("--match-8b", default="", help="only the Llama-3-8B rows whose layout names this")
    ap.add_argument("--calibrate-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worlds-8b", action="store_true", help="only tailorfx plan --world 8 and 64 for Llama-3-8B on "
                                                             "H100-80GB at 8K, 32K and 128K tokens (no launches)")
    ap.add_argument("--worlds", nargs="+", type=int, default=[8, 64], help="with --worlds-8b: these worlds only")
    a = ap.parse_args()
    if a.worker:
        return worker(*a.worker, a.seq, a.batch, a.vocab_loss)
    if a.calibrate_worker:
        return calibrate_worker()
    if a.worlds_8b:
        return print_worlds_8b(tuple(a.worlds))
    sys.path.insert(0, HERE)
    from common import print_table, write_json
    mib = lambda b: f"{b / 2**20:.1f}"
    err = lambda p, m: f"{(p - m) / m:+.1%}"
    results = []
    if not a.predict_8b:
        loaded = json.load(open(a.measured)) if a.measured else []
        saved = {r["layout"]: r for r in (loaded["layouts"] if isinstance(loaded, dict) else loaded)}
        saved["_step_time"] = loaded.get("step_time") if isinstance(loaded, dict) else None
        rows = []
        total = lambda r: r["param_bytes"] + r["grad_bytes"] + r["fwd_bwd_peak_bytes"]
        for name in a.layouts:
            tp, dp, pp, sp = LAYOUTS[name]
            ranks = saved[name]["ranks"] if name in saved else launch(tp, dp, pp, sp, a.seq, a.batch, vocab_loss(name))
            rm, predicted, per_rank = predict_layout(tp, dp, pp, sp, a.seq, a.batch, vocab_loss(name))
            worst = max(ranks, key=total)
            inrun = [r["param_bytes"] + r["grad_bytes"] + r["predicted_fwd_bwd_peak_bytes"] for r in ranks
                     if r.get("predicted_fwd_bwd_peak_bytes") is not None]
            results.append({"layout": name, "tp": tp, "dp": dp, "pp": pp, "sp": sp, "ranks": ranks,
                            "predicted_worst_bytes": predicted, "predicted_per_pipeline_rank": per_rank,
                            "predicted_fwd_bwd_peak_bytes": rm.forward_backward_peak_bytes,
                            "predicted_in_torchrun_worst_bytes": max(inrun) if inrun else None,
                            "predicted_breakdown": rm.breakdown()})
            base = next((r["ranks"][0] for r in results if r["layout"] == "1"), None)
            if pp > 1:
                label = (f"tp={tp} x " if tp > 1 else "") + f"pp={pp} ({SCHEDULE} x{microbatches(a.batch, dp)})" + (
                    f" x dp={dp}" if dp > 1 else "") + (", passes=[]" if vocab_loss(name) == "raw" else "")
            elif sp == 1:
                label = f"sp={dp} (Ulysses)"
            elif sp == 2:
                label = f"tp={tp} + Megatron SP"
            else:
                label = " x ".join(f"{k}={v}" for k, v in (("tp", tp), ("dp", dp)) if v > 1) or "1 process"
                label += {"loss_parallel": " (loss_parallel)", "recompute": ", recompute"}.get(vocab_loss(name), "")
            ref = ranks[0]["single_process_loss"]
            rows.append([label, str(tp * dp * pp), mib(worst["param_bytes"]), mib(worst["fwd_bwd_peak_bytes"]),
                         mib(total(worst)), f"{mib(predicted)} ({err(predicted, total(worst))})",
                         f"{mib(max(inrun))} ({err(max(inrun), total(worst))})" if inrun else "-",
                         f"{total(worst) / total(base):.2f}" if base else "-", f"{max(r['step_s'] for r in ranks):.3f}",
                         f"{abs(ranks[0]['loss'] - ref) / ref:.1e}"])
            print(f"{name}: measured {mib(total(worst))} MiB, predicted {mib(predicted)} MiB", file=sys.stderr,
                  flush=True)
        print_table(f"Per rank (the largest), HF Llama (hidden 256, 4 layers, vocab 8000), global batch {a.batch} x "
                    f"{a.seq}, fp32, gloo", ["layout", "processes", "params MiB", "fwd+bwd peak MiB", "params+grads+peak MiB",
                                    "predicted MiB (error)", "in torchrun MiB (error)", "vs 1 process",
                                    "step s (slowest rank)", "loss rel. err"], rows)
    timing = step_times(results, a, saved if not a.predict_8b else {}) if results else None
    llama = None
    if not a.skip_8b:
        rows, llama = predict_8b(match=a.match_8b)
        print_table("Llama-3-8B per rank, predicted: amp-bf16 (bf16 weights, fp32 master + AdamW state), seq 8192, "
                    "micro-batch 1, pipelines 1F1B with pp micro-batches",
                    ["world", "layout", "peak GiB", "params", "grads", "optimizer", "activations", "comm",
                     "bubble", "fits 80GB (less 4% headroom)"], rows)
    print("wrote", write_json("parallel.json", {"layouts": results, "step_time": timing, "llama3_8b": llama}))


def print_worlds_8b(worlds=(8, 64)) -> None:
    sys.path.insert(0, HERE)
    from common import print_table, write_json
    rows, out, longest = worlds_8b(worlds)
    print_table("Llama-3-8B on H100-80GB, predicted (amp-bf16, 1 row per rank's micro-batch): each layout with its "
                "rewrites, fastest first (tokens/s)", ["GPUs", "seq", "layout", "rewrites", "peak GiB", "step ms",
                                                       "tokens/s", "status"], rows)
    print_table(f"The longest sequence each layout of {worlds[0]} H100-80GB reaches, predicted (peaks at 8K, 32K and "
                "128K fitted linearly)", ["layout", "rewrites", "longest sequence", "", "fit's largest error"], longest)
    name = "parallel_worlds_8b.json" if worlds == (8, 64) else f"parallel_worlds_8b_{'_'.join(map(str, worlds))}.json"
    print("wrote", write_json(name, {"plans": out, f"longest_{worlds[0]}": longest}))


def step_times(results: list, a, saved: dict) -> dict:
    """Per world size with two layouts or more: each layout's measured step time (the slowest
    rank's median of 5, and the spread of those 5 as noise) against predict_step_time on this
    machine's calibrated figures, and Spearman's correlation of the two rankings."""
    from common import print_table
    from tailorfx.parallel.devices import DeviceClass
    out = {}
    worlds = {}
    for r in results:
        worlds.setdefault(r["tp"] * r["dp"] * r["pp"], []).append(r)
    for world, rs in sorted(worlds.items()):
        if world < 2 or len(rs) < 2:
            continue
        known = (saved.get("_step_time") or {}).get(str(world))
        try:
            dev = DeviceClass.from_dict(known["device"]) if known else calibrated(world)
        except (KeyError, TypeError):     # saved by an older version of the model: measured again
            dev = calibrated(world)
        rows, table = [], []
        for r in rs:
            slowest = max(r["ranks"], key=lambda x: x["step_s"])
            times = slowest.get("step_s_all") or [slowest["step_s"]]
            noise = (max(times) - min(times)) / slowest["step_s"]
            st = predict_time(r["tp"], r["dp"], r["pp"], r["sp"], a.seq, a.batch, vocab_loss(r["layout"]), dev)
            rows.append({"layout": r["layout"], "measured_s": slowest["step_s"], "steps_s": times, "noise": noise,
                         "predicted_s": st.forward_backward_s, "predicted": st.breakdown()})
        rho = spearman([x["measured_s"] for x in rows], [x["predicted_s"] for x in rows])
        for x in sorted(rows, key=lambda x: x["measured_s"]):
            table.append([x["layout"], f"{x['measured_s']:.3f}", f"{x['noise']:.0%}", f"{x['predicted_s']:.3f}",
                          f"{x['predicted_s'] / x['measured_s']:.2f}",
                          ", ".join(f"{k} {v * 1e3:.0f}" for k, v in x["predicted"].items() if v and k != "optimizer")])
        print_table(f"Step time (forward + backward) on {world} gloo processes, measured (fastest first) vs predicted on "
                    f"this machine's calibration; Spearman {rho:.2f}", ["layout", "measured s", "noise (max-min)/median",
                                                                     "predicted s", "predicted/measured",
                                                                     "predicted parts, ms"], table)
        out[str(world)] = {"device": dev.as_dict(), "layouts": rows, "spearman": rho}
    return out


if __name__ == "__main__":
    main()
