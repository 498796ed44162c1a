"""A long-running process: many optimize() calls on fresh models, one after another.

    python benchmarks/one_process.py                 # 50 calls (5 configs x 10), writes benchmarks/out/one_process.json
    python benchmarks/one_process.py --calls 20

Each call builds a fresh HF model from one of five configs (Llama at three sizes and two
`rms_norm_eps`, Qwen3, Mistral), optimize()s it at 128 tokens, trains one step, checks it was
rewritten (the head fused with the loss: logits None; no fallback or recompile-limit warning),
then drops it. Printed every 10 calls: the process's RSS, the tailorfx sessions still alive and
Dynamo's cache entries on transformers' shared forward code. Nothing is reset in between.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings
import weakref

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import OUT_DIR  # noqa: E402

VOCAB = 2048
CONFIGS = [
    ("llama", dict(hidden_size=64, intermediate_size=128)),
    ("llama", dict(hidden_size=128, intermediate_size=256)),
    ("llama", dict(hidden_size=96, intermediate_size=192, rms_norm_eps=1e-5)),
    ("qwen3", dict(hidden_size=64, intermediate_size=128, head_dim=16)),
    ("mistral", dict(hidden_size=64, intermediate_size=160, sliding_window=None)),
]
FALLBACK = ("runs as captured", "handed no graph", "recompile", "eagerly")


def make(family: str, overrides: dict, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(family, vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, pad_token_id=0, bos_token_id=0, eos_token_id=0, **overrides)
    return AutoModelForCausalLM.from_config(cfg).train()


def cache_entries() -> int:
    """Dynamo's cache entries on the forward code every transformers model shares."""
    from transformers import LlamaForCausalLM
    code = LlamaForCausalLM.forward.__code__
    count = getattr(torch._C._dynamo.eval_frame, "_get_total_cache_entry_count", None)
    return count(code) if count else len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code))


def rss_mib() -> float:
    """This process's resident set size (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    import tailorfx
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", default=os.path.join(OUT_DIR, "one_process.json"))
    args = ap.parse_args()
    sessions, rows, t0 = [], [], time.time()
    for i in range(args.calls):
        family, overrides = CONFIGS[i % len(CONFIGS)]
        model = make(family, overrides, seed=i)
        ids = torch.randint(0, VOCAB, (2, 128), generator=torch.Generator().manual_seed(i))
        batch = {"input_ids": ids, "labels": ids.clone()}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = tailorfx.optimize(model, example_inputs=batch)
            out = opt(**batch)
            out.loss.backward()
        fell_back = [str(w.message)[:200] for w in caught if any(f in str(w.message) for f in FALLBACK)]
        rewritten = out.logits is None and not fell_back and not any(g.failed for g in opt.session.graphs)
        sessions.append(weakref.ref(opt.session))
        del opt, model, out
        gc.collect()
        row = {"call": i + 1, "family": family, "overrides": overrides, "rewritten": rewritten, "warnings": fell_back}
        if (i + 1) % 10 == 0 or i == 0:
            row.update(rss_mib=rss_mib(), sessions_alive=sum(r() is not None for r in sessions),
                       dynamo_cache_entries=cache_entries(), seconds=time.time() - t0)
            print(f"call {i + 1:3d}  RSS {row['rss_mib']:7.1f} MiB  sessions alive {row['sessions_alive']}  "
                  f"Dynamo cache entries {row['dynamo_cache_entries']:3d}  {row['seconds']:6.1f} s", flush=True)
        rows.append(row)
    rss = {r["call"]: r["rss_mib"] for r in rows if "rss_mib" in r}
    summary = {"calls": args.calls, "all_rewritten": all(r["rewritten"] for r in rows),
               "not_rewritten": [r for r in rows if not r["rewritten"]],
               "rss_mib_after_call_10": rss.get(10), "rss_mib_after_last_call": rss[max(rss)],
               "growth_mib_10_to_last": rss[max(rss)] - rss[10] if 10 in rss else None,
               "torch": torch.__version__, "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"every call rewritten: {summary['all_rewritten']}; RSS after call 10: {summary['rss_mib_after_call_10']:.1f} MiB, "
          f"after call {args.calls}: {summary['rss_mib_after_last_call']:.1f} MiB "
          f"(+{summary['growth_mib_10_to_last']:.1f} MiB); wrote {args.out}")


if __name__ == "__main__":
    main()
