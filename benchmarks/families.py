"""Every family at the limit: the default plan on transformers families whose forms the analyses
must find in general (scaled logits, soft-caps, ALiBi, sliding windows, multi-input MLPs, dropout).

Per family (tiny config from tests/models.py sizes: hidden 64, 2 layers, vocab 16384, 2048 tokens,
batch 1, fp32, random weights): eager's measured peak of forward + backward (output held, as a
training loop holds it) against `tailorfx.optimize(model)` with no passes named; the memory
model's prediction error; what was rewritten (attentions swapped, the LM head fused, MLPs chunked)
and what was left, with the pass's reason; the step time against eager's (median of interleaved
rounds); and exactness at 48 tokens (loss and every gradient against eager, fp32, dropout off).
Peak = tailorfx.measure_peak (the allocator's events).

    python benchmarks/families.py [--families granite bloom ...] [--seq 2048] [--vocab 16384]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import tailorfx  # noqa: E402
from common import print_table, write_json  # noqa: E402
from harness import compare_with_eager, peak_of_step  # noqa: E402
from models import _COMMON, FAMILIES, batch  # noqa: E402
from table_models import TableLM  # noqa: E402

# name -> (model_type, overrides of tests/models.py's sizes). The five first, then families
# not named there that carry the same forms.
WINDOW = 1024   # sliding windows shorter than the sequence, so the window hides keys
CASES = {
    "granite": ("granite", FAMILIES["granite"]),                     # logits / logits_scaling
    "bloom": ("bloom", FAMILIES["bloom"]),                           # ALiBi (baddbmm); MLP takes the residual
    "gemma2": ("gemma2", FAMILIES["gemma2"]),                        # soft-caps; sliding layers (window 4096)
    "falcon": ("falcon", FAMILIES["falcon"]),                        # parallel attention, multi-query, SDPA mask
    "seed_oss": ("seed_oss", {"residual_dropout": 0.0, "attention_dropout": 0.0}),
    "seed_oss+dropout": ("seed_oss", {"residual_dropout": 0.1, "attention_dropout": 0.1}),
    "falcon-alibi": ("falcon", {**FAMILIES["falcon"], "alibi": True}),   # ALiBi folded into SDPA's mask
    "gemma3_text": ("gemma3_text", {**FAMILIES["gemma3_text"], "sliding_window": WINDOW,
                                    "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}),
    "cohere2": ("cohere2", {"logit_scale": 0.5, "sliding_window": WINDOW}),   # scaled logits, windows
    "granitemoe": ("granitemoe", {"logits_scaling": 8.0, "num_local_experts": 4, "num_experts_per_tok": 2,
                                  "intermediate_size": 64}),
    "exaone4": ("exaone4", {"sliding_window": WINDOW}),
    "mistral-window": ("mistral", {"sliding_window": WINDOW}),
    # tables built once at a maximum length (4096) and sliced to the sequence
    "mpt": ("mpt", {"max_seq_len": 4096, "attn_config": {"alibi": True}}),   # ALiBi sliced to the last s keys
    "tables-mask": ("TableLM", {"form": "mask", "max_len": 4096}),      # tests/table_models.py: M x M mask
    "tables-alibi": ("TableLM", {"form": "alibi", "max_len": 4096}),    # ALiBi table, rotary cache buffers
}
DROPOUT = {"seed_oss+dropout"}


def build(name: str, vocab: int):
    from transformers import AutoConfig, AutoModelForCausalLM
    model_type, overrides = CASES[name]
    torch.manual_seed(0)
    if model_type == "TableLM":
        return TableLM(vocab=vocab, hidden=_COMMON["hidden_size"], layers=_COMMON["num_hidden_layers"],
                       heads=_COMMON["num_attention_heads"], **overrides).train()
    kw = {k: v for k, v in {**_COMMON, **overrides, "vocab_size": vocab}.items() if v is not None}
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw)).train()


def exactness(name: str) -> float:
    """Max gradient relative error against eager at 48 tokens (dropout off), loss checked too."""
    holder = {}
    inputs = batch(S=48, pad=5)

    def wrap(m):
        holder["opt"] = tailorfx.optimize(m, example_inputs=inputs)
        return holder["opt"]
    return compare_with_eager(build(name, 512), inputs, wrap, rtol=1e-4, atol=1e-6).max_grad_rel_err


def step_time_ratio(opt, model, eager, inputs, reps: int) -> float:
    """Median over `reps` rounds of (tailorfx step time / eager step time), the two interleaved
    in each round (forward + backward, gradients dropped first)."""
    def step(module, params):
        for p in params.parameters():
            p.grad = None
        t = time.perf_counter()
        module(**inputs).loss.backward()
        return time.perf_counter() - t
    ratios = []
    for _ in range(reps):
        e = step(eager, eager)
        ratios.append(step(opt, model) / e)
    return statistics.median(ratios)


def measure(name: str, S: int, vocab: int, reps: int) -> dict:
    model = build(name, vocab)
    ids = torch.randint(0, vocab, (1, S), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    eager = copy.deepcopy(model)
    eager_peak = peak_of_step(eager, eager, inputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = tailorfx.optimize(model, example_inputs=inputs)
    peak = peak_of_step(opt, model, inputs)
    predicted = opt.predict_memory(S).forward_backward_peak_bytes
    # eager's step predicted from the capture as eager runs it (the output held, as peak_of_step does)
    predicted_eager = opt.predict_memory(S, rewritten=False, as_eager=True).forward_backward_peak_bytes
    time_ratio = step_time_ratio(opt, model, eager, inputs, reps)
    records = {r.name: r for g in opt.graph_records for r in g.records}
    attention = records.get("attention")
    ms = records.get("minisequence")
    touched = list(ms.touched) if ms else []
    row = {
        "family": name, "eager_peak_mib": eager_peak / 2**20, "peak_mib": peak / 2**20,
        "ratio": peak / eager_peak, "prediction_error": (predicted - peak) / peak, "time_ratio": time_ratio,
        "eager_prediction_error": (predicted_eager - eager_peak) / eager_peak,
        "attention_swapped": len(attention.touched) if attention else 0,
        "attention_specs": sorted({s["spec"] for s in attention.stats.values()}) if attention else [],
        "head_fused": any(t.startswith(("lm_head", "output")) for t in touched),
        "mlps_chunked": sum(1 for t in touched if not t.startswith(("lm_head", "output"))),
        "left": [s for r in records.values() for s in r.skipped],
        "warned": [str(w.message) for w in caught if "left as captured" in str(w.message)],
    }
    row["max_grad_rel_err"] = None if name in DROPOUT else exactness(name)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="*", default=list(CASES))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds of eager and tailorfx steps")
    args = ap.parse_args()
    rows = []
    for name in args.families:
        row = measure(name, args.seq, args.vocab, args.reps)
        rows.append(row)
        print(f"{name}: {row['ratio']:.2f}x eager's peak, prediction {row['prediction_error']:+.2%} "
              f"(eager's {row['eager_prediction_error']:+.2%}), "
              f"{row['time_ratio']:.2f}x eager's step time", flush=True)
    print_table(f"Default plan, vocab {args.vocab}, {args.seq} tokens (tiny configs, fp32)",
                ["family", "eager MiB", "eager pred err", "tailorfx MiB", "x eager", "pred err", "time x eager",
                 "attention", "head",
                 "MLPs", "grad err (48 tok)", "left"],
                [[r["family"], f"{r['eager_peak_mib']:.1f}", f"{r['eager_prediction_error']:+.2%}",
                  f"{r['peak_mib']:.1f}", f"{r['ratio']:.2f}",
                  f"{r['prediction_error']:+.2%}", f"{r['time_ratio']:.2f}",
                  f"{r['attention_swapped']} {','.join(r['attention_specs'])}",
                  "fused" if r["head_fused"] else "-", r["mlps_chunked"],
                  "dropout on" if r["max_grad_rel_err"] is None else f"{r['max_grad_rel_err']:.1e}",
                  "; ".join(r["left"])[:90]] for r in rows])
    print("wrote", write_json("families.json", {"seq": args.seq, "vocab": args.vocab, "rows": rows}))


if __name__ == "__main__":
    main()
