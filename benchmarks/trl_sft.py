"""The longest sequence TRL's SFTTrainer trains under one memory budget: TRL alone vs TRL + tailorfx.

    python benchmarks/trl_sft.py [--families llama qwen2] [--cap 32768] [--out trl_sft.json]

Models: HF Llama and Qwen2 from configs (vocab 32000, hidden 256, intermediate 688, 2 layers, 4
heads / 2 KV heads, random init), fp32 weights and AdamW, on the CPU. Trainer: SFTTrainer as its
users run it: default SFTConfig but fp32 (bf16=False) and the CPU (use_cpu), so its fused LM head
(add_fused_lm_head) and gradient_checkpointing=True; batch 1, packing=False, max_length = the
length, rows of exactly that many tokens, 2 optimizer steps.

A run's memory is the weights' bytes plus the peak bytes allocated during trainer.train() above
what was allocated when it started (tailorfx.measure_peak: the profiler's allocator events), so it
holds the gradients, AdamW's state (made in the first step) and the largest step's activations.
Each (variant, length) runs in a process of its own.

The budget: TRL alone's measured run at 4,096 tokens. TRL alone is then measured at 4,096 + k x 512
tokens until a run exceeds it. TRL + tailorfx: `tailorfx.optimize(model, budget=..., example_inputs=a
row of the length)` handed to SFTTrainer; a length fits when optimize() plans it (no BudgetError)
and the measured run is within the budget; lengths double from 4,096 to --cap, then are bisected to
512 tokens. Each run checks that its feature fired (TRL: its ChunkedLogProbFunction ran and the
model was checkpointed; tailorfx: TRL's head served, one run of its graph per step), and the two
variants' logged losses at 512 tokens are compared (fp32).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

STEPS = 2
GRANULE = 512
VOCAB = 32000


def model_of(family: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(family, vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                               max_position_embeddings=1 << 20)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def one_run(variant: str, family: str, length: int, budget: int) -> dict:
    """One SFTTrainer run in this process: {"fits", "bytes", "losses", "fired"}."""
    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    import tailorfx
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = model_of(family)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, "t0")),
                                  pad_token="t0", eos_token="t1", unk_token="t0")
    g = torch.Generator().manual_seed(1)
    data = Dataset.from_list([{"input_ids": torch.randint(2, VOCAB, (length,), generator=g).tolist()}
                              for _ in range(STEPS)])
    trained = model
    if variant == "tailorfx":
        ids = torch.randint(2, VOCAB, (1, length), generator=g)
        try:
            trained = tailorfx.optimize(model, budget=budget or None, example_inputs={"input_ids": ids, "labels": ids})
        except tailorfx.BudgetError as e:
            return {"fits": False, "bytes": None, "why": str(e).splitlines()[0]}
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, per_device_train_batch_size=1, max_length=length, packing=False,
                         max_steps=STEPS, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                         disable_tqdm=True, bf16=False, seed=0)
        trainer = SFTTrainer(model=trained, args=args, train_dataset=data, processing_class=tok)
        peak = tailorfx.measure_peak(trainer.train)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    if variant == "tailorfx":
        fired = (any("TRL's fused LM head" in n for n in trained.session.notes)
                 and max(trained.session.runs.values()) == STEPS
                 and not any("without tailorfx's graph" in w for w in trained.session.warnings))
    else:   # TRL's fused forward is the model's, its metrics logged (read only from its outputs), checkpointed
        fired = (getattr(getattr(model.forward, "__func__", None), "__code__", None) is not None
                 and model.forward.__func__.__code__.co_name == "_fused_forward"
                 and all("entropy" in h for h in logs) and model.is_activation_checkpointing)
    total = weights + peak
    losses = [h["loss"] for h in logs]
    return {"fits": budget == 0 or total <= budget, "bytes": total, "losses": losses, "fired": fired}


def run(variant: str, family: str, length: int, budget: int) -> dict:
    """one_run in a process of its own."""
    p = subprocess.run([sys.executable, __file__, "--one", variant, family, str(length), str(budget)],
                       capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} {family} {length}: exit {p.returncode}\n{p.stderr[-3000:]}")
    r = json.loads(lines[-1])
    mib = f"{r['bytes'] / 2**20:.1f} MiB" if r.get("bytes") else r.get("why", "")
    print(f"  {family} {variant:>8} {length:>6}: {'fits' if r['fits'] else 'over'} {mib}"
          f"{'' if r.get('fired', True) else '  (feature did NOT fire)'}", flush=True)
    return r


def longest(variant: str, family: str, budget: int, start: int, cap: int, doubling: bool) -> tuple[int, dict]:
    """The longest length that fits, and every run."""
    runs, best, n = {}, 0, start
    while n <= cap:
        runs[n] = r = run(variant, family, n, budget)
        if not r["fits"]:
            break
        best = n
        n = n * 2 if doubling else n + GRANULE
    lo, hi = best, (n if n <= cap else None)
    while hi is not None and hi - lo > GRANULE:
        mid = (lo + hi) // 2 // GRANULE * GRANULE
        runs[mid] = r = run(variant, family, mid, budget)
        lo, hi = (mid, hi) if r["fits"] else (lo, mid)
    return lo, runs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=["llama", "qwen2"])
    ap.add_argument("--cap", type=int, default=32768, help="longest length tried for TRL + tailorfx")
    ap.add_argument("--out", default="trl_sft.json")
    ap.add_argument("--one", nargs=4, metavar=("VARIANT", "FAMILY", "LENGTH", "BUDGET"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one_run(a.one[0], a.one[1], int(a.one[2]), int(a.one[3]))))
        return
    from common import print_table, write_json
    results, rows = {}, []
    for fam in a.families:
        check = {v: run(v, fam, 512, 0) for v in ("trl", "tailorfx")}
        budget = run("trl", fam, 4096, 0)["bytes"]
        trl_len, trl_runs = longest("trl", fam, budget, 4096, 4096 + 16 * GRANULE, doubling=False)
        tfx_len, tfx_runs = longest("tailorfx", fam, budget, 4096, a.cap, doubling=True)
        worst = max(abs(x - y) / abs(y) for x, y in zip(check["tailorfx"]["losses"], check["trl"]["losses"]))
        capped = tfx_runs.get(tfx_len, {}).get("fits") and tfx_len * 2 > a.cap
        results[fam] = {"budget_bytes": budget, "trl": trl_len, "tailorfx": tfx_len, "capped": bool(capped),
                        "loss_rel_diff_at_512": worst, "fired": all(r.get("fired", True) for r in
                                                                    [*trl_runs.values(), *tfx_runs.values()]),
                        "runs": {"trl": trl_runs, "tailorfx": tfx_runs, "check": check}}
        rows.append([fam, f"{budget / 2**20:.1f} MiB", f"{trl_len:,}",
                     f"{tfx_len:,}" + (" (cap)" if capped else ""), f"{tfx_len / trl_len:.2f}x", f"{worst:.1e}"])
    print_table("Longest sequence SFTTrainer trains under TRL-alone's 4,096-token run",
                ["family", "budget", "TRL alone", "TRL + tailorfx", "ratio", "loss rel. diff @512"], rows)
    print(write_json(a.out, results))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
