"""Shared helpers for benchmarks: the reference model, one training step, tables and JSON."""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Callable

import torch


OUT_DIR = os.path.join(os.path.dirname(__file__), "out")


def cuda_peak(fn: Callable, return_result: bool = False):
    """Peak bytes the CUDA caching allocator held during `fn()` above what was allocated when it
    started (synchronized on both sides); tailorfx.measure_peak's counterpart for a GPU."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    return (peak, result) if return_result else peak


def reference_model(vocab=32000, hidden=512, layers=4, heads=8, kv_heads=2, seed=0):
    """The benchmarks' default model: HF LlamaForCausalLM, vocab 32000, hidden 512, 4 layers, 8 heads /
    2 KV heads, fp32 (random weights). It returns logits with the loss, as users' models do."""
    return hf_llama_model(vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, seed=seed)


def hf_llama_model(vocab=32000, hidden=512, layers=4, heads=None, kv_heads=None, seed=0):
    """An unmodified Hugging Face LlamaForCausalLM from a config (random weights, fp32): what users train."""
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    heads = heads or max(1, hidden // 64)
    kv_heads = kv_heads or max(1, heads // 4)
    return LlamaForCausalLM(HFLlamaConfig(vocab_size=vocab, hidden_size=hidden,
                                          intermediate_size=int(hidden * 2.6875), num_hidden_layers=layers,
                                          num_attention_heads=heads, num_key_value_heads=kv_heads))


def lm_batch(S: int, vocab: int = 32000, B: int = 1, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def train_step(module, params, inputs) -> Callable[[], float]:
    """forward + backward with gradients set to None first (what a training loop does)."""
    def step():
        for p in params:
            p.grad = None
        loss = module(**inputs).loss
        loss.backward()
        return loss.item()
    return step


def measure_step(module, params, inputs) -> int:
    """Peak bytes of forward + backward above what was live before, gradients freed first, with
    the model's output held through backward as a training loop holds it.

    Freeing the previous step's gradients happens outside the measured region: the profiler
    would count those frees against blocks it never saw allocated.
    """
    import tailorfx
    for p in params:
        p.grad = None

    def fwd_bwd():
        out = module(**inputs)
        out.loss.backward()
        return out
    return tailorfx.measure_peak(fwd_bwd)


def time_it(fn: Callable, reps: int) -> float:
    """Median seconds over reps (after the caller's warm-up)."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def write_json(name: str, payload) -> str:
    os.makedirs(OUT_DIR, exist_ok=True)
    path = os.path.join(OUT_DIR, name)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=title)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*[str(x) for x in r])
    Console(width=160).print(t)


def mib(n) -> str:
    return f"{n / 2**20:.1f}"
