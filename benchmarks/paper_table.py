"""Predicted longest training sequence for 7-9B models on one 80 GB GPU (the MST paper's table), next
to the bound on every plan (tailorfx.sequence_bound) and the published figures of MST and ALST.

Predictions come from tailorfx.max_seq_len (the memory model on fake tensors: nothing is
allocated). Assumptions, stated rather than fitted:
- every model is the unmodified transformers causal LM built from a config with the published
  sizes (`--models`; default Llama-3-8B and Llama-2-7B, each takes a few minutes to capture), called
  as HF calls it in training (loss and logits; the fused head returns logits=None; use_cache=False); Gemma-2 keeps
  its soft-capped attention scores, which no exact kernel takes, so its attention is O(S^2);
- the training setup is a tailorfx.TrainingSetup preset (`--setup`, several allowed; default the
  two whose static part fits an 8B model on 80 GB):
  fp32 and amp-bf16 hold 16 B/param, pure-bf16 8 B/param, pure-bf16-fused-optimizer (the MST
  paper's A100 setup: AdamW step fused into backward) 6 B/param plus the gradients in flight;
  batch 1, steady state (the optimizer state lives through forward and backward);
- the budget is the A100-80GB preset: 80 GiB minus 1.5 GiB for the CUDA context and allocator
  headroom (tailorfx.budget.PRESETS);
- activations as the eager lowering runs them (CPU-measured transients: attention is the flash
  kernel, O(S) memory); the budget is kept less the planner's headroom for prediction error.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import tailorfx  # noqa: E402
from common import print_table, write_json  # noqa: E402
from tailorfx.sizing import plan_for_budget  # noqa: E402


def _hf(model_type: str, **kw):
    from transformers import AutoConfig
    # use_cache=False: a training step keeps no KV cache (HF builds one in train mode otherwise,
    # every layer's keys and values returned with the loss); long-context recipes set it
    return AutoConfig.for_model(model_type, use_cache=False, **kw)


# Hugging Face configs with the published sizes (transformers builds the model; fake tensors, no
# weights are downloaded or allocated).
MODELS = {
    "Llama-3-8B": lambda: _hf("llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                              rope_theta=500000.0, max_position_embeddings=8192),
    "Llama-2-7B": lambda: _hf("llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                              max_position_embeddings=4096),
    "Mistral-7B": lambda: _hf("mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                              sliding_window=None, max_position_embeddings=32768),
    "Qwen2-7B": lambda: _hf("qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                            num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                            max_position_embeddings=32768),
    "Gemma-2-9B": lambda: _hf("gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                              num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                              head_dim=256, query_pre_attn_scalar=256, final_logit_softcapping=30.0,
                              attn_logit_softcapping=50.0, max_position_embeddings=8192),
}
PLANS = {"vanilla": [], "recompute only": ["recompute"], "mini-sequence + recompute": ["minisequence", "recompute"],
         # max_seq_len's passes=None: exact attention, every block's token-wise segments chunked, full
         # recompute, the optimizer step in backward where that fits longer
         "saves the most": None,
         # the same with each block's checkpoint in host memory between forward and backward (ALST's
         # checkpoint offload); its host bytes are reported beside it
         "saves the most, checkpoints offloaded": None}
OFFLOADED = "saves the most, checkpoints offloaded"
# Published figures for Llama-3-8B (not tailorfx's): the MST paper (Luo et al., NeurIPS 2024) trains
# 60K tokens on one A100-80GB with mini-sequence + activation checkpointing; ALST (Snowflake, 2025)
# 500K on one H100-80GB with DeepSpeed ZeRO-3 offloading optimizer state and weights to host memory
# and activation checkpoints offloaded to host (bytes a device-only plan must hold on the device).
PUBLISHED = {("Llama-3-8B", "A100-80GB"): "60K (MST paper)",
             ("Llama-3-8B", "H100-80GB"): "500K (ALST, host offload)"}


def host_bytes(name: str, budget: str, setup: str, seq_len: int) -> int:
    """The planner's plan at `seq_len` under `budget` (on fake tensors), and the host memory its
    offloaded checkpoints take (the memory model's host peak)."""
    opt = plan_for_budget(MODELS[name](), budget, seq_len, setup=setup)
    print(f"{setup:26s} {name:12s} planner at {seq_len:,}: {opt.plan[0].chosen.label if opt.plan[0].chosen else opt.plan[0].reason}", flush=True)
    return opt.predict_memory().host_bytes


def table(setup: str, budget: str, models: list[str], plans: list[str], bound: bool) -> dict:
    """One preset: the longest sequence per model and plan (0: the static part does not fit)."""
    rows, out = [], {}
    for name in models:
        res, note = {}, ""
        for plan in plans:
            passes = PLANS[plan]
            t0 = time.perf_counter()
            try:
                res[plan] = tailorfx.max_seq_len(MODELS[name](), budget, passes=passes, setup=setup,
                                                 offload="checkpoints" if plan == OFFLOADED else None)
            except tailorfx.BudgetError as e:
                res[plan] = 0
                note = "static part does not fit" if e.dominant == "static" else "does not fit"
                print(f"{name} {plan}: {e}")
            print(f"{setup:26s} {name:12s} {plan:28s} {res[plan]:>8d} tokens ({time.perf_counter() - t0:.0f}s)",
                  flush=True)
            if note == "static part does not fit":   # no plan changes weights and optimizer state
                res = {p: 0 for p in plans}
                break
        res["device-only best"] = max(v for p, v in res.items() if p != OFFLOADED)
        if bound:   # the longest any plan of these rewrites could fit (tailorfx.sequence_bound), on the device alone
            t0 = time.perf_counter()
            res["bound"] = 0 if note else tailorfx.sequence_bound(MODELS[name](), budget, setup=setup,
                                                                  offload=False).seq_len
            print(f"{setup:26s} {name:12s} {'bound':28s} {res['bound']:>8d} tokens ({time.perf_counter() - t0:.0f}s)",
                  flush=True)
        if OFFLOADED in plans and res.get(OFFLOADED):
            t0 = time.perf_counter()
            res["host GiB"] = round(host_bytes(name, budget, setup, res[OFFLOADED]) / 2**30, 1)
            if bound and not note:   # with checkpoints in host memory
                res["bound, offloaded"] = tailorfx.sequence_bound(MODELS[name](), budget, setup=setup,
                                                                  offload=True).seq_len
            print(f"{setup:26s} {name:12s} {'host, offload bound':28s} {res['host GiB']} GiB "
                  f"{res.get('bound, offloaded', 0):>8d} tokens ({time.perf_counter() - t0:.0f}s)", flush=True)
        out[name] = res
        v, best = res.get("vanilla"), res["device-only best"]
        off = OFFLOADED in plans
        off_bound = res.get("bound, offloaded")
        rows.append([name] + [f"{res[p]:,}" for p in plans] + ([f"{res.get('host GiB', 0)}"] if off else [])
                    + [f"{best:,}"]
                    + ([f"{res['bound']:,}", f"{best / res['bound']:.0%}" if res["bound"] else "-"] if bound else [])
                    + ([f"{off_bound:,}" if off_bound else "-",
                        f"{res[OFFLOADED] / off_bound:.0%}" if off_bound else "-"] if bound and off else [])
                    + ([f"{best / v:.1f}x" if v else note or "-"] if v is not None else [])
                    + [PUBLISHED.get((name, budget), "-")])
    print_table(f"Longest sequence, one {budget}, {tailorfx.PRESETS[setup].describe()}, batch 1 (predicted)",
                ["model", *plans] + (["host GiB (offloaded)"] if OFFLOADED in plans else [])
                + ["device-only best"] + (["bound (device only)", "best / bound"] if bound else [])
                + (["bound, offloaded", "offloaded / its bound"] if bound and OFFLOADED in plans else [])
                + (["best / vanilla"] if "vanilla" in plans else []) + ["published (not predicted)"], rows)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budget", nargs="+", default=["A100-80GB"])
    ap.add_argument("--models", nargs="*", default=["Llama-3-8B", "Llama-2-7B"], choices=list(MODELS))
    ap.add_argument("--setup", nargs="+", default=["pure-bf16", "pure-bf16-fused-optimizer"],
                    choices=list(tailorfx.PRESETS))
    ap.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    ap.add_argument("--no-bound", dest="bound", action="store_false", help="skip tailorfx.sequence_bound")
    ap.add_argument("--out", default="paper_table.json", help="file name under benchmarks/out/")
    a = ap.parse_args()
    out = {b: {s: table(s, b, a.models, a.plans, a.bound) for s in a.setup} for b in a.budget}
    print("wrote", write_json(a.out, {"budgets": a.budget, "results": out}))


if __name__ == "__main__":
    main()
