"""Predicted longest training sequence for 7-9B models on one A100-80GB (the MST paper's table).

Predictions come from tailorfx.max_seq_len (the memory model on fake tensors: nothing is
allocated). Assumptions, stated rather than fitted:
- every model is built as tailorfx's Llama-style LM with the published sizes (vocab, hidden,
  layers, heads, KV heads, MLP width, tied head for Gemma-2); architecture details that barely
  move memory are not modelled (Qwen2's QKV bias, Gemma-2's 256-wide heads, logit soft-capping,
  GeGLU vs SwiGLU, sliding-window layers);
- the training setup is a tailorfx.TrainingSetup preset (`--setup`, several allowed; default all):
  fp32 and amp-bf16 hold 16 B/param, pure-bf16 8 B/param, pure-bf16-fused-optimizer (the MST
  paper's A100 setup: AdamW step fused into backward) 6 B/param plus the gradients in flight;
  batch 1, steady state (the optimizer state lives through forward and backward);
- the budget is the A100-80GB preset: 80 GiB minus 1.5 GiB for the CUDA context and allocator
  headroom (tailorfx.budget.PRESETS);
- activations as the eager lowering runs them (CPU-measured transients: attention is the flash
  kernel, O(S) memory).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import tailorfx  # noqa: E402
from tailorfx.models import LlamaConfig  # noqa: E402
from common import print_table, write_json  # noqa: E402

MODELS = {
    "Llama-3-8B": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
    "Llama-2-7B": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32),
    "Mistral-7B": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
    "Qwen2-7B": LlamaConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                            num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4),
    "Gemma-2-9B": LlamaConfig(vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                              num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                              tie_word_embeddings=True),
}
PLANS = {"vanilla": [], "recompute only": ["recompute"], "mini-sequence + recompute": ["minisequence", "recompute"]}


def table(setup: str, budget: str, models: list[str]) -> dict:
    """One preset: the longest sequence per model and plan (0: the static part does not fit)."""
    rows, out = [], {}
    for name in models:
        res, note = {}, ""
        for plan, passes in PLANS.items():
            t0 = time.perf_counter()
            try:
                res[plan] = tailorfx.max_seq_len(MODELS[name], budget, passes=passes, setup=setup)
            except tailorfx.BudgetError as e:
                res[plan] = 0
                note = "static part does not fit" if e.dominant == "static" else "does not fit"
                print(f"{name} {plan}: {e}")
            print(f"{setup:26s} {name:12s} {plan:28s} {res[plan]:>8d} tokens ({time.perf_counter() - t0:.0f}s)",
                  flush=True)
            if note == "static part does not fit":   # no plan changes weights and optimizer state
                res = {p: 0 for p in PLANS}
                break
        # the planner's choice (passes=None) is the plan that saves the most: mini-sequence + recompute
        res["planner's best"] = max(res.values())
        out[name] = res
        v, best = res["vanilla"], res["planner's best"]
        rows.append([name] + [f"{res[p]:,}" for p in PLANS] + [f"{best:,}", f"{best / v:.1f}x" if v else note or "-"])
    print_table(f"Longest sequence, one {budget}, {tailorfx.PRESETS[setup].describe()}, batch 1 (predicted)",
                ["model", *PLANS, "planner's best", "best / vanilla"], rows)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budget", default="A100-80GB")
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--setup", nargs="+", default=list(tailorfx.PRESETS), choices=list(tailorfx.PRESETS))
    a = ap.parse_args()
    out = {s: table(s, a.budget, a.models) for s in a.setup}
    print("wrote", write_json("paper_table.json", {"budget": a.budget, "results": out}))


if __name__ == "__main__":
    main()
