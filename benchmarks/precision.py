"""Precision pass: bf16/fp16 training vs fp32 (loss curves), memory at seq 4096, LM-head gradients.

1. Loss curves: the reference model (a small HF LlamaForCausalLM) trained 200 steps with AdamW on a generated
   corpus, fp32 (eager) vs bf16 vs fp16 + GradScaler (tailorfx precision pass), same init, same
   batches. Relative gap |loss - loss_fp32| / loss_fp32 at every logged step.
2. Memory at seq 4096 (batch 1), initial weights: measured peak of forward + backward above what was live before,
   gradients freed first (tailorfx.measure_peak, the allocator's events), and the memory model's
   prediction, for fp32 / bf16 / minisequence / bf16 + minisequence and policy overrides.
3. LM-head weight gradient at seq 4096, bf16 + minisequence vs fp32 (relative norm), on the
   initial weights and on the fp32-trained ones: issue 7's acceptance figure (within 1%), with
   torch.autocast's bf16 error alongside, and policy overrides whose memory section 2 measures:
   matmul_output "low" (every op of attention and MLP in bf16, as autocast; the default "auto"
   runs only their matmuls in bf16, attention always and the MLP when mini-sequence chunks it),
   fp32 MLP, and a bf16 head (which mini-sequence still fuses with the fp32 master weight).

Writes benchmarks/out/precision.json and benchmarks/out/precision_loss.png.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import tailorfx  # noqa: E402
from tailorfx.runtime.train import Trainer  # noqa: E402
from common import OUT_DIR, measure_step, mib, print_table, write_json  # noqa: E402

CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=2)
BATCH, SEQ, LR, WARMUP, LOG_EVERY = 4, 256, 2e-3, 20, 10


def reference_model(seed: int = 0, **overrides) -> torch.nn.Module:
    """HF LlamaForCausalLM from a config (random weights); it returns logits with the loss."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**CONFIG, **overrides}))


def synthetic_corpus(num_seqs: int, seq_len: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """(num_seqs, seq_len) tokens of a generated language with structure a small model can learn.

    Each token has 8 possible successors (a fixed random table) drawn with Zipf weights 1/k, so
    a bigram model reaches ~1.7 nats against ln(vocab) for a uniform guess; and each sequence's
    last quarter repeats a span of its first half, which only attention (an induction head) can
    predict. Deterministic in `seed`.
    """
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 8), generator=g)
    weights = 1.0 / torch.arange(1, 9, dtype=torch.float64)
    ids = torch.empty(num_seqs, seq_len, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (num_seqs,), generator=g)
    for t in range(1, seq_len):
        k = torch.multinomial(weights.expand(num_seqs, 8), 1, generator=g).squeeze(1)
        ids[:, t] = successors[ids[:, t - 1], k]
    span = seq_len // 4
    starts = torch.randint(0, seq_len // 2 - span, (num_seqs,), generator=g)
    rows = torch.arange(num_seqs)[:, None]
    ids[:, seq_len - span:] = ids[rows, starts[:, None] + torch.arange(span)]
    return ids


def lr_lambda(step: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to 10%."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / max(1, steps - WARMUP)))


def fresh_copy(base: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(base)
    model.zero_grad(set_to_none=True)
    return model


def train(variant: str, base: torch.nn.Module, data: torch.Tensor, steps: int) -> dict:
    """Train a copy of `base` on `data`; returns losses per step, skipped steps and seconds."""
    torch._dynamo.reset()
    model = fresh_copy(base)
    precision = None if variant == "fp32" else variant
    module = model if precision is None else tailorfx.optimize(model, passes=["precision"], precision=precision)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, steps))
    trainer = Trainer(module, opt, precision=precision, max_grad_norm=1.0, scheduler=sched)
    losses, skipped = [], []
    t0 = time.perf_counter()
    for step in range(steps):
        ids = data[step * BATCH:(step + 1) * BATCH]
        r = trainer.step({"input_ids": ids, "labels": ids})
        losses.append(r.loss)
        if r.skipped:
            skipped.append(step)
    seconds = time.perf_counter() - t0
    return {"losses": losses, "skipped_steps": skipped, "seconds": seconds, "model": model,
            "final_scale": trainer.scaler.get_scale() if trainer.scaler is not None else None}


def loss_curves(steps: int) -> tuple[dict, torch.nn.Module]:
    base = reference_model()
    data = synthetic_corpus(steps * BATCH, SEQ, CONFIG["vocab_size"], seed=1)
    runs = {v: train(v, base, data, steps) for v in ("fp32", "bf16", "fp16")}
    ref = runs["fp32"]["losses"]
    logged = [s for s in range(steps) if s % LOG_EVERY == 0 or s == steps - 1]
    rows, gaps = [], {v: [] for v in runs}
    for s in logged:
        row = [s]
        for v, r in runs.items():
            gap = abs(r["losses"][s] - ref[s]) / ref[s]
            gaps[v].append(gap)
            row += [f"{r['losses'][s]:.4f}"] + ([f"{gap * 100:.2f}%"] if v != "fp32" else [])
        rows.append(row)
    print_table(f"Loss, reference model {CONFIG}, batch {BATCH} x seq {SEQ}, AdamW lr {LR}",
                ["step", "fp32", "bf16", "bf16 gap", "fp16+scaler", "fp16 gap"], rows)
    after = [i for i, s in enumerate(logged) if s >= WARMUP]
    summary = {v: {"max_gap_after_warmup": max(gaps[v][i] for i in after), "seconds": r["seconds"],
                   "skipped_steps": r["skipped_steps"], "final_scale": r["final_scale"],
                   "final_loss": r["losses"][-1]} for v, r in runs.items()}
    for v, s in summary.items():
        print(f"{v}: max gap to fp32 at logged steps >= {WARMUP}: {s['max_gap_after_warmup'] * 100:.2f}%, "
              f"final loss {s['final_loss']:.4f}, {s['seconds']:.0f} s, skipped steps {s['skipped_steps']}")
    out = {"config": CONFIG, "batch": BATCH, "seq": SEQ, "steps": steps, "lr": LR, "warmup": WARMUP,
           "logged_steps": logged, "losses": {v: r["losses"] for v, r in runs.items()}, "summary": summary}
    _plot(out)
    return out, runs["fp32"]["model"]


def _plot(out: dict) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ref = out["losses"]["fp32"]
    colors = {"fp32": "black", "bf16": "tab:orange", "fp16": "tab:blue"}
    for v, losses in out["losses"].items():
        ax.plot(losses, label=v if v == "fp32" else f"{v} (tailorfx precision)", lw=1, color=colors[v],
                ls="-" if v == "fp32" else "--")
        if v != "fp32":
            ax2.plot([100 * (a - b) / b for a, b in zip(losses, ref)], label=v, lw=1, color=colors[v])
    ax.set_ylabel("training loss")
    ax.set_title(f"tailorfx precision pass: {out['steps']} AdamW steps, same init and batches")
    ax.legend()
    ax2.axhline(2, color="grey", ls="--", lw=0.8)
    ax2.axhline(-2, color="grey", ls="--", lw=0.8)
    ax2.set_ylabel("% vs fp32")
    ax2.set_ylim(-2.5, 2.5)
    ax2.set_xlabel("step")
    ax2.legend()
    fig.tight_layout()
    os.makedirs(OUT_DIR, exist_ok=True)
    path = os.path.join(OUT_DIR, "precision_loss.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print("wrote", path)
    return path


LOW_OUT = {"matmul_output": "low"}     # every op of a low region in bf16, as torch.autocast
VARIANTS = {"fp32": dict(passes=[]), "bf16": dict(passes=["precision"], precision="bf16"),
            "bf16, matmul_output fp32": dict(passes=["precision"], precision="bf16",
                                             precision_policy={"matmul_output": "fp32"}),
            "bf16, matmul_output low": dict(passes=["precision"], precision="bf16", precision_policy=LOW_OUT),
            "minisequence": dict(passes=["minisequence"]),
            "bf16 + minisequence": dict(passes=["precision", "minisequence"], precision="bf16"),
            "bf16 + minisequence, matmul_output low": dict(passes=["precision", "minisequence"], precision="bf16",
                                                           precision_policy=LOW_OUT),
            "bf16 + minisequence, fp32 MLP": dict(passes=["precision", "minisequence"], precision="bf16",
                                                  precision_policy={"mlp": "fp32", **LOW_OUT}),
            "bf16 + minisequence, bf16 head": dict(passes=["precision", "minisequence"], precision="bf16",
                                                   precision_policy={"lm_head_loss": "low"})}
ACCEPTANCE = 0.01   # issue 7: bf16 + minisequence LM-head weight grad within 1% of fp32


def _inputs(seq: int) -> tuple[dict, dict]:
    ids = torch.randint(0, CONFIG["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, "labels": ids}, {"input_ids": ids[:, :64].clone(), "labels": ids[:, :64].clone()}


def _compiled(base: torch.nn.Module, variant: str, example: dict):
    torch._dynamo.reset()   # one compiled variant at a time (Dynamo's recompile limit is per code object)
    model = fresh_copy(base)
    return model, tailorfx.optimize(model, **VARIANTS[variant], example_inputs=example)


def memory(base: torch.nn.Module, seq: int) -> dict:
    """Measured and predicted peak of forward + backward at `seq` tokens, per variant."""
    inputs, example = _inputs(seq)
    out, rows = {"seq": seq, "peak_bytes": {}, "predicted_peak_bytes": {}}, []
    for name in VARIANTS:
        model, opt = _compiled(base, name, example)
        params = list(model.parameters())
        opt(**inputs).loss.backward()   # warm-up at this length
        out["peak_bytes"][name] = measure_step(opt, params, inputs)
        out["predicted_peak_bytes"][name] = opt.predict_memory(seq_len=seq).forward_backward_peak_bytes
    base_peak = out["peak_bytes"]["fp32"]
    for name in VARIANTS:
        peak, pred = out["peak_bytes"][name], out["predicted_peak_bytes"][name]
        rows.append([name, mib(peak), f"{1 - peak / base_peak:.1%}" if name != "fp32" else "-",
                     mib(pred), f"{(pred - peak) / peak:+.1%}"])
    print_table(f"Forward + backward at seq {seq}, batch 1 (measured: allocator events, gradients freed first)",
                ["variant", "measured peak MiB", "saved vs fp32", "predicted MiB", "pred err"], rows)
    return out


def head_grads(models: dict, seq: int) -> dict:
    """Relative-norm error of the LM-head weight gradient vs fp32, per variant and weights."""
    inputs, example = _inputs(seq)
    errs = {}
    for weights, base in models.items():
        grads = {}
        for name in (n for n in VARIANTS if n != "minisequence"):   # fp32 chunking is exact (tests)
            model, opt = _compiled(base, name, example)
            opt(**inputs).loss.backward()
            grads[name] = model.lm_head.weight.grad.clone()
        model = fresh_copy(base)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**inputs).loss
        loss.backward()
        grads["torch.autocast bf16 (for comparison)"] = model.lm_head.weight.grad.clone()
        ref = grads.pop("fp32")
        errs[weights] = {k: ((g - ref).norm() / ref.norm()).item() for k, g in grads.items()}
        # chunking alone: the same policy with and without mini-sequence
        same = grads["bf16, matmul_output fp32"]
        errs[weights]["bf16 + minisequence vs bf16, matmul_output fp32"] = (
            (grads["bf16 + minisequence"] - same).norm() / same.norm()).item()
    names = list(next(iter(errs.values())))
    print_table(f"LM-head weight gradient at seq {seq}: |g - g_fp32| / |g_fp32|",
                ["variant"] + list(errs), [[k] + [f"{errs[w][k]:.3%}" for w in errs] for k in names])
    for weights, e in errs.items():
        got, ac = e["bf16 + minisequence"], e["torch.autocast bf16 (for comparison)"]
        print(f"issue 7 acceptance, {weights}: bf16 + minisequence {got:.3%} "
              f"({'within' if got <= ACCEPTANCE else 'NOT within'} {ACCEPTANCE:.0%}; torch.autocast {ac:.3%}; "
              f"matmul_output low {e['bf16 + minisequence, matmul_output low']:.3%})")
    return errs


def main(steps: int, seq: int) -> dict:
    t0 = time.perf_counter()
    curves, trained = loss_curves(steps)
    mem = memory(reference_model(), seq)
    grads = head_grads({"initial weights": reference_model(), f"after {steps} fp32 steps": trained}, seq)
    payload = {"loss_curves": curves, "memory": mem, "lm_head_grad_rel_err": grads}
    payload["seconds"] = time.perf_counter() - t0
    print("wrote", write_json("precision.json", payload), f"({payload['seconds']:.0f} s)")
    return payload


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--quick", action="store_true", help="30 steps, seq 1024")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads (default 1: on a shared 2-core machine OpenMP spin-waiting "
                         "made 2 threads 10x slower; no figure here is a speed)")
    ap.add_argument("--memory-only", action="store_true",
                    help="only the measured vs predicted peaks (kept with the other parts' figures)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.memory_only:
        path = os.path.join(OUT_DIR, "precision.json")
        payload = json.load(open(path)) if os.path.exists(path) else {}
        payload["memory"] = memory(reference_model(), a.seq)
        print("wrote", write_json("precision.json", payload))
    else:
        main(30, 1024) if a.quick else main(a.steps, a.seq)
