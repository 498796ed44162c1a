"""Memory model accuracy: predicted vs measured peak of one training step at several lengths.

One capture per variant (at a short length); predictions at every length come from the same
symbolic graph. Measured: tailorfx.measure_peak over forward+backward (allocator events), with
gradients freed first, the output held through backward; the model is HF LlamaForCausalLM
(benchmarks/common.py). Also prints the HF Llama-3-8B prediction (model built under FakeTensorMode).

`--setups`: the full step (forward, backward, optimizer) under each TrainingSetup preset that runs
on CPU, trained with tailorfx.SetupOptimizer. Measured = bytes of the weights, buffers, optimizer
state and master weights that exist (summed from the real tensors) + measure_peak of forward,
backward and step on the third step (the state exists).
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
            predicted = opt.predict_memory(seq_len=S).forward_backward_peak_bytes
            err = (predicted - measured) / measured
            name = "+".join(passes) or "no pass"
            rows.append([name, S, mib(measured), mib(predicted), f"{err * 100:+.2f}%"])
            out.append({"passes": passes, "seq": S, "measured": measured, "predicted": predicted})
    print_table("Predicted vs measured peak of forward+backward (HF LlamaForCausalLM, fp32, batch 1)",
                ["passes", "seq", "measured MiB", "predicted MiB", "error"], rows)
    return out


def llama3_8b(seq_len: int):
    from transformers import LlamaConfig
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0)
    t0 = time.perf_counter()
    res = {}
    for passes in ([], ["minisequence"]):
        opt = tailorfx.sizing.capture_for_prediction(cfg, passes, seq_len=1024, dtype=torch.bfloat16,
                                                  setup="pure-bf16")
        est = opt.predict_memory(seq_len=seq_len)
        res["+".join(passes) or "no pass"] = est.summary()
        print(f"Llama-3-8B, bf16 weights+grads+AdamW state, seq {seq_len}, passes={passes}: peak "
              f"{format_bytes(est.peak_bytes)} (params {format_bytes(est.param_bytes)}, grads "
              f"{format_bytes(est.grad_bytes)}, AdamW {format_bytes(est.optimizer_bytes)}, step peak "
              f"{format_bytes(est.dynamic_peak_bytes)} at {est.peak_phase} {est.peak_node})")
    print(f"both predictions took {time.perf_counter() - t0:.1f}s")
    return res


def full_steps(seqs, passes):
    """Predicted vs measured full training step per setup preset (see the module docstring)."""
    rows, out = [], []
    for name in ("fp32", "amp-bf16", "pure-bf16", "pure-bf16-fused-optimizer"):
        setup = tailorfx.PRESETS[name]
        torch._dynamo.reset()
        model = reference_model().to(setup.param_dtype)
        opt = tailorfx.optimize(model, setup=setup, passes=passes, example_inputs=lm_batch(64))
        optim = tailorfx.SetupOptimizer(model.parameters(), setup, lr=1e-4)
        for S in seqs:
            inputs = lm_batch(S)

            def step():
                out = opt(**inputs)    # held through backward and the step, as a training loop holds it
                out.loss.backward()
                optim.step()
                optim.zero_grad()
            step()
            step()
            held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
            measured = held + optim.state_bytes() + tailorfx.measure_peak(step)
            est = opt.predict_memory(seq_len=S)
            err = (est.peak_bytes - measured) / measured
            rows.append([name, S, mib(measured), mib(est.peak_bytes), f"{err * 100:+.2f}%",
                         mib(est.static_bytes), mib(est.dynamic_peak_bytes), f"{est.peak_phase} {est.peak_node}"])
            out.append({"setup": name, "seq": S, "measured": measured, "predicted": est.peak_bytes,
                        **est.summary()})
    print_table(f"Full training step per setup, predicted vs measured (HF LlamaForCausalLM, passes={passes}, batch 1)",
                ["setup", "seq", "measured MiB", "predicted MiB", "error", "static MiB", "dynamic MiB",
                 "peak at"], rows)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--llama3-seq", type=int, default=8192)
    ap.add_argument("--setups", action="store_true", help="only the full step per TrainingSetup preset")
    ap.add_argument("--passes", nargs="*", default=["minisequence"])
    a = ap.parse_args()
    if a.setups:
        print("wrote", write_json("memory_model_setups.json", full_steps(a.seqs, a.passes)))
    else:
        acc = accuracy(a.seqs)
        big = llama3_8b(a.llama3_seq)
        print("wrote", write_json("memory_model.json", {"accuracy": acc, "llama3_8b": big}))
