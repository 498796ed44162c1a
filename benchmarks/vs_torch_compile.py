"""tailorfx against torch.compile (Inductor) in one process, on HF Qwen2 (vocab 32000, hidden 256,
MLP 688, 2 layers, fp32) at 4096 tokens: the median of interleaved training steps and the
measured forward + backward peak (output held through backward).

    python benchmarks/vs_torch_compile.py                # 5 interleaved rounds
    python benchmarks/vs_torch_compile.py --rounds 7 --seq 2048

Rows: eager; `torch.compile(model)` with default options; the same with
`torch._functorch.config.activation_memory_budget=0.5` (its min-cut partitioner trades recompute
for memory; the config is read while compiling, so that model's backend is Inductor inside the patch);
tailorfx's default `optimize()` (`lowering="auto"`: eager on CPU, Inductor on CUDA) and
`optimize(lowering="inductor")`. Each step: forward, backward, gradients dropped. Rounds
interleave the variants so machine noise hits them alike.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def qwen2(vocab: int):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model("qwen2", vocab_size=vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=0,
                               eos_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).train()


def main():
    import tailorfx
    from common import print_table, write_json
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    base = qwen2(a.vocab)
    ids = torch.randint(0, a.vocab, (1, a.seq), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    variants = {}

    def add(name, make):
        model = copy.deepcopy(base)
        t = time.perf_counter()
        module = make(model)
        out = module(**inputs)      # compiles
        out.loss.backward()
        variants[name] = {"module": module, "model": model, "first_call_s": time.perf_counter() - t,
                          "logits_none": out.logits is None, "times": []}
    add("eager", lambda m: m)
    add("torch.compile", lambda m: torch.compile(m))

    def inductor_at_half_budget(gm, example_inputs):
        """Inductor, its partitioner under the budget (read while compiling); a backend of its own,
        so Dynamo does not hand this model the plain compile's cached graph."""
        from torch._inductor.compile_fx import compile_fx
        with torch._functorch.config.patch(activation_memory_budget=0.5):
            return compile_fx(gm, example_inputs)
    add("torch.compile, activation_memory_budget=0.5", lambda m: torch.compile(m, backend=inductor_at_half_budget))
    add("tailorfx default", lambda m: tailorfx.optimize(m, example_inputs=inputs))
    add("tailorfx lowering=inductor", lambda m: tailorfx.optimize(m, lowering="inductor", example_inputs=inputs))

    def step(v):
        v["model"].zero_grad(set_to_none=True)
        out = v["module"](**inputs)
        out.loss.backward()
        return out
    for v in variants.values():
        v["peak"] = tailorfx.measure_peak(lambda: step(v))
    for _ in range(a.rounds):
        for v in variants.values():
            t = time.perf_counter()
            step(v)
            v["times"].append(time.perf_counter() - t)
    tc = variants["torch.compile"]
    tcb = variants["torch.compile, activation_memory_budget=0.5"]
    rows = []
    for name, v in variants.items():
        med = statistics.median(v["times"])
        rows.append({"variant": name, "median_step_s": med, "time_vs_torch_compile": med / statistics.median(tc["times"]),
                     "peak_bytes": v["peak"], "peak_vs_torch_compile": v["peak"] / tc["peak"],
                     "peak_vs_budget_0_5": v["peak"] / tcb["peak"], "first_call_s": v["first_call_s"],
                     "logits_none": v["logits_none"], "times": v["times"]})
    print_table(f"HF Qwen2 (vocab {a.vocab}, hidden 256, MLP 688, 2 layers, fp32), {a.seq} tokens: "
                f"median of {a.rounds} interleaved forward+backward steps, {torch.get_num_threads()} threads",
                ["variant", "median step s", "x torch.compile time", "peak MiB", "x torch.compile peak",
                 "x budget-0.5 peak", "first call s"],
                [[r["variant"], f"{r['median_step_s']:.3f}", f"{r['time_vs_torch_compile']:.2f}",
                  f"{r['peak_bytes'] / 2**20:.1f}", f"{r['peak_vs_torch_compile']:.2f}", f"{r['peak_vs_budget_0_5']:.2f}",
                  f"{r['first_call_s']:.1f}"] for r in rows])
    print("wrote", write_json("vs_torch_compile.json", {"seq": a.seq, "vocab": a.vocab, "rounds": a.rounds,
                                                         "torch": torch.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
