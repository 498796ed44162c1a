"""Unmodified Hugging Face causal LMs: measured peak and step time per variant, and the memory
model's error across families, lengths and plans.

Part 1 (HF LlamaForCausalLM, vocab 32000, hidden 256, 2 layers, fp32, batch 1): eager, tailorfx
with no pass, mini-sequence, mini-sequence + recompute, and the planner under a budget of 45% of
eager's step (weights + AdamW state + eager's measured forward+backward peak) and under a loose
budget (twice eager's step), and under the smallest budget BudgetError names when asked for 5%.
Variants run in one
process, timings interleaved. Part 2: predicted vs measured forward+backward peak for tiny configs
of several families (vocab 8000, hidden 128, 2 layers) at three lengths and five plans. Part 3:
capture alone (passes=[]) against eager on 17 families (same tiny sizes), peak and step time.

Peak = tailorfx.measure_peak (the allocator's events) of `out = model(**batch); out.loss.backward()`
(the output held through backward, as a training loop holds it), gradients freed before.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import tailorfx  # noqa: E402
from tailorfx.runtime import measure  # noqa: E402
from common import OUT_DIR, hf_llama_model, lm_batch, measure_step, mib, print_table, time_it, train_step, write_json  # noqa: E402


def static_bytes(model) -> int:
    """Weights + fp32 AdamW state (two moments), what a training step holds besides its peak."""
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters())


def part1(S: int, reps: int) -> dict:
    base = hf_llama_model(hidden=256, layers=2)
    inputs = lm_batch(S)
    eager_peak = measure_step(base, list(base.parameters()), inputs)
    budget = int(0.45 * (static_bytes(base) + eager_peak))
    variants, budgets = {"eager": base}, {}
    for name, kw in (("tailorfx, no pass", {"passes": []}),
                     ("tailorfx minisequence", {"passes": ["minisequence"]}),
                     ("tailorfx minisequence + recompute", {"passes": ["minisequence", "recompute"]}),
                     ("tailorfx planner, budget 45% of eager", {"budget": budget}),
                     ("tailorfx planner, loose budget (2x eager)", {"budget": int(budget / 0.45 * 2)})):
        variants[name] = tailorfx.optimize(copy.deepcopy(base), example_inputs=inputs, **kw)
        budgets[name] = kw.get("budget")
    # an infeasible budget (5% of eager's step) names the smallest that works: that one must be met
    try:
        tailorfx.optimize(copy.deepcopy(base), example_inputs=inputs, budget=int(budget / 0.45 * 0.05))
        raise AssertionError("5% of eager's step was accepted")
    except tailorfx.BudgetError as e:
        smallest = e.suggested_bytes
    name = f"tailorfx planner, the smallest budget BudgetError names for 5% of eager ({mib(smallest)} MiB)"
    variants[name] = tailorfx.optimize(copy.deepcopy(base), example_inputs=inputs, budget=smallest)
    budgets[name] = smallest
    params = {k: list(m.parameters()) for k, m in variants.items()}
    steps = {k: train_step(m, params[k], inputs) for k, m in variants.items()}
    for f in steps.values():
        f()
    peaks = {k: measure_step(m, params[k], inputs) for k, m in variants.items()}
    times = {k: 0.0 for k in steps}
    for _ in range(reps):
        for k, f in steps.items():
            times[k] += time_it(f, 1) / reps
    rows, out = [], {"seq": S, "budget_bytes": budget, "static_bytes": static_bytes(base), "variants": {}}
    for k, m in variants.items():
        pred = m.predict_memory(S).forward_backward_peak_bytes if k != "eager" else None
        plan = [(g.plan.chosen.label if g.plan.chosen else list(g.plan.passes), g.lowering)
                for g in m.session.graphs] if k != "eager" else "-"
        total = static_bytes(base) + peaks[k]
        out["variants"][k] = {"peak_bytes": peaks[k], "predicted_bytes": pred, "seconds": times[k],
                              "step_total_bytes": total, "plan": plan}
        rows.append([k, "; ".join(f"{p} ({lw})" for p, lw in plan) if k != "eager" else "-",
                     mib(peaks[k]), mib(pred) if pred else "-",
                     f"{(pred - peaks[k]) / peaks[k] * 100:+.2f}%" if pred else "-",
                     f"{peaks[k] / peaks['eager']:.3f}", f"{times[k]:.2f}", f"{times[k] / times['eager']:.2f}",
                     f"{mib(total)} ({'meets' if total <= budgets[k] else 'over'} {mib(budgets[k])})"
                     if budgets.get(k) else mib(total)])
    print_table(f"HF LlamaForCausalLM (vocab 32000, hidden 256, 2 layers, fp32), S={S}, batch 1",
                ["variant", "plan (lowering)", "measured fwd+bwd MiB", "predicted MiB", "pred err", "peak / eager", "step s",
                 "time / eager", "step total (weights + AdamW state + peak) MiB"], rows)
    return out


PLANS = {"none": [], "minisequence": ["minisequence"], "recompute": ["recompute"],
         "minisequence + recompute": ["minisequence", "recompute"]}


def part2(families, seqs) -> list:
    from models import hf_family
    rows, out = [], []
    for family in families:
        size = {"n_embd": 128} if family == "gpt2" else {"hidden_size": 128, "intermediate_size": 352}
        model = hf_family(family, vocab_size=8000, **size)
        params = list(model.parameters())
        plans = dict(PLANS)
        for name, passes in plans.items():
            torch._dynamo.reset()
            opt = tailorfx.optimize(model, passes=passes)
            errs = []
            for S in seqs:
                inputs = lm_batch(S, vocab=8000)
                train_step(opt, params, inputs)()
                measured = measure_step(opt, params, inputs)
                predicted = opt.predict_memory(S).forward_backward_peak_bytes
                errs.append((predicted - measured) / measured)
                out.append({"family": family, "plan": name, "seq": S, "measured_bytes": measured,
                            "predicted_bytes": predicted})
            rows.append([family, name] + [f"{e * 100:+.2f}%" for e in errs])
        # the planner's choice at a budget between the smallest plan and no plan, at the middle length
        S = seqs[len(seqs) // 2]
        torch._dynamo.reset()
        inputs = lm_batch(S, vocab=8000)
        smallest = [r for r in out if r["family"] == family and r["seq"] == S]
        budget = static_bytes(model) + (min(r["measured_bytes"] for r in smallest)
                                        + max(r["measured_bytes"] for r in smallest)) // 2
        opt = tailorfx.optimize(model, budget=budget, example_inputs=inputs)
        measured = measure_step(opt, params, inputs)
        predicted = opt.predict_memory(S).forward_backward_peak_bytes
        out.append({"family": family, "plan": "planner", "seq": S, "measured_bytes": measured,
                    "predicted_bytes": predicted, "passes": [g.plan.passes for g in opt.session.graphs]})
        rows.append([family, f"planner ({'+'.join(opt.session.graphs[0].plan.passes) or 'none'})"]
                    + [f"{(predicted - measured) / measured * 100:+.2f}%" if s == S else "" for s in seqs])
    print_table("Memory model on HF families: (predicted - measured) / measured, forward+backward peak",
                ["family", "plan"] + [f"S={s}" for s in seqs], rows)
    return out


def interleaved_ratios(steps: dict, reps: int) -> dict:
    """Per round, each step once, in alternating order (ABC, CBA, ...); the median over rounds of
    (step / eager's step in the same round), so slow drifts of the machine cancel."""
    samples = {k: [] for k in steps}
    keys = list(steps)
    for r in range(reps):
        for k in (keys if r % 2 == 0 else keys[::-1]):
            samples[k].append(time_it(steps[k], 1))
    return {k: statistics.median(a / b for a, b in zip(samples[k], samples["eager"])) for k in keys}, samples


def part3(families, S: int, reps: int, overhead_seq: int = 16, overhead_reps: int = 201) -> list:
    """Capture alone (passes=[]) against eager on every family: peak and step time, one process.

    Time at S (interleaved_ratios); a second copy of the eager model is timed the same way: its
    ratio is the noise floor of the measurement. What a step's time is made of, measured apart:
    its kernels (the ATen ops it runs, compared op by op: equal means the same work) and its
    fixed per-step overhead (the step at `overhead_seq` tokens, where kernels take little,
    `overhead_reps` rounds)."""
    from models import hf_family
    rows, out = [], []
    for family in families:
        size = {"n_embd": 128} if family == "gpt2" else {"hidden_size": 128, "intermediate_size": 352}
        torch._dynamo.reset()
        eager = hf_family(family, vocab_size=8000, **size)
        opt = tailorfx.optimize(copy.deepcopy(eager), passes=[])
        inputs = lm_batch(S, vocab=8000)
        mods = {"eager": eager, "eager (a second copy)": copy.deepcopy(eager), "passes=[]": opt}
        steps = {k: train_step(m, list(m.parameters()), inputs) for k, m in mods.items()}
        for f in steps.values():
            f()
            f()
        peaks = {k: measure_step(m, list(m.parameters()), inputs) for k, m in mods.items()}
        ratio, samples = interleaved_ratios(steps, reps)
        ops = {k: measure.kernel_ops(steps[k]) for k in ("eager", "passes=[]")}
        diff = {n: ops["passes=[]"][n] - ops["eager"][n] for n in set(ops["eager"]) | set(ops["passes=[]"])
                if ops["passes=[]"][n] != ops["eager"][n]}
        small = lm_batch(overhead_seq, vocab=8000)
        small_steps = {k: train_step(m, list(m.parameters()), small) for k, m in mods.items()}
        for f in small_steps.values():
            f()
            f()
        overhead, _ = interleaved_ratios(small_steps, overhead_reps)
        graphs = [g.lowering for g in opt.session.graphs]
        out.append({"family": family, "seq": S, "peak_bytes": peaks, "seconds": samples, "time_ratio": ratio,
                    "lowerings": graphs, "kernel_ops": sum(ops["eager"].values()), "kernel_ops_differ": diff,
                    "overhead_seq": overhead_seq, "overhead_ratio": overhead})
        rows.append([family, "+".join(graphs), mib(peaks["eager"]), mib(peaks["passes=[]"]),
                     f"{peaks['passes=[]'] / peaks['eager']:.3f}", f"{ratio['passes=[]']:.2f}",
                     f"{ratio['eager (a second copy)']:.2f}",
                     "same" if not diff else "; ".join(f"{n} {d:+d}" for n, d in sorted(diff.items())),
                     f"{overhead['passes=[]']:.3f} ({overhead['eager (a second copy)']:.3f})"])
    print_table(f"Capture alone (passes=[]) vs eager, S={S}, vocab 8000, hidden 128, 2 layers, fp32, batch 1",
                ["family", "lowering", "eager MiB", "passes=[] MiB", "peak / eager", "time / eager",
                 "eager copy / eager (noise)", "ATen ops vs eager", f"S={overhead_seq} step / eager (copy)"], rows)
    return out


ALL_FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "stablelm", "starcoder2", "gpt_neox", "falcon",
                "gemma2", "gemma3_text", "cohere", "mixtral", "qwen2_moe", "olmoe", "gpt2"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--families", nargs="*", default=["llama", "gpt2", "qwen2", "gemma2", "mixtral", "phi3"])
    ap.add_argument("--seqs", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--skip-part1", action="store_true")
    ap.add_argument("--capture-families", nargs="*", default=ALL_FAMILIES,
                    help="part 3: capture alone vs eager on each family (none: skip)")
    ap.add_argument("--capture-seq", type=int, default=1024)
    ap.add_argument("--capture-reps", type=int, default=15, help="part 3: rounds of interleaved steps")
    a = ap.parse_args()
    previous = os.path.join(OUT_DIR, "hf_models.json")
    result = json.load(open(previous)) if os.path.exists(previous) else {}   # parts not run keep their figures
    if not a.skip_part1:
        result["llama"] = part1(a.seq, a.reps)
    if a.families:
        result["families"] = part2(a.families, a.seqs)
    if a.capture_families:
        result["capture"] = part3(a.capture_families, a.capture_seq, a.capture_reps)
    print("wrote", write_json("hf_models.json", result))
