"""Memory model accuracy: predicted vs measured peak of one training step at several lengths.

One capture per variant (at a short length); predictions at every length come from the same
symbolic graph. Measured: tailorfx.measure_peak over forward+backward (allocator events), with
gradients freed first. Also prints the Llama-3-8B prediction (model built under FakeTensorMode).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import tailorfx  # noqa: E402
from tailorfx.budget import format_bytes  # noqa: E402
from tailorfx.models import LlamaConfig  # noqa: E402
from common import lm_batch, measure_step, mib, print_table, reference_model, write_json  # noqa: E402


def accuracy(seqs):
    base = reference_model()
    rows, out = [], []
    for passes in ([], ["minisequence"]):
        model = copy.deepcopy(base)
        opt = tailorfx.optimize(model, passes=passes, example_inputs=lm_batch(64))
        params = list(model.parameters())
        for S in seqs:
            inputs = lm_batch(S)
            opt(**inputs).loss.backward()
            measured = measure_step(opt, params, inputs)
            predicted = opt.predict_memory(seq_len=S).dynamic_peak_bytes
            err = (predicted - measured) / measured
            name = "+".join(passes) or "no pass"
            rows.append([name, S, mib(measured), mib(predicted), f"{err * 100:+.2f}%"])
            out.append({"passes": passes, "seq": S, "measured": measured, "predicted": predicted})
    print_table("Predicted vs measured peak of forward+backward (reference model, fp32, batch 1)",
                ["passes", "seq", "measured MiB", "predicted MiB", "error"], rows)
    return out


def llama3_8b(seq_len: int):
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8)
    t0 = time.perf_counter()
    res = {}
    for passes in ([], ["minisequence"]):
        opt = tailorfx.api.capture_for_prediction(cfg, passes, seq_len=1024, dtype=torch.bfloat16)
        est = opt.predict_memory(seq_len=seq_len, optimizer="adamw")
        res["+".join(passes) or "no pass"] = est.summary()
        print(f"Llama-3-8B, bf16 weights+grads+AdamW state, seq {seq_len}, passes={passes}: peak "
              f"{format_bytes(est.peak_bytes)} (params {format_bytes(est.param_bytes)}, grads "
              f"{format_bytes(est.grad_bytes)}, AdamW {format_bytes(est.optimizer_bytes)}, step peak "
              f"{format_bytes(est.dynamic_peak_bytes)} at {est.peak_phase} {est.peak_node})")
    print(f"both predictions took {time.perf_counter() - t0:.1f}s")
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--llama3-seq", type=int, default=8192)
    a = ap.parse_args()
    acc = accuracy(a.seqs)
    big = llama3_8b(a.llama3_seq)
    print("wrote", write_json("memory_model.json", {"accuracy": acc, "llama3_8b": big}))
