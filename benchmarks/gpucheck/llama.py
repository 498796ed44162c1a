"""The HF Llama the memory, nccl and hf sections train: built from a config (random weights),
optimize()d once per configuration and cached on the run, since compiling costs most of the time."""
from __future__ import annotations

import copy
import time

from gpucheck.record import Run, bench_module


def llama_shape(run: Run, seq: int) -> dict:
    if run.dry:
        return dict(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, seq=32)
    return dict(vocab=32000, hidden=1024, layers=4, heads=16, kv_heads=4, seq=seq)


def make_llama(run: Run, dtype_name: str, seq: int, window: bool = False):
    """The Llama of `llama_shape`; `window`: Mistral's architecture at the same shape with a sliding
    window of a quarter of the sequence (a mask SDPA has no kernel for: the attention pass's choice
    between the Triton flash kernel and FlexAttention)."""
    import torch
    common = bench_module("common")
    hf_llama_model, lm_batch = common.hf_llama_model, common.lm_batch
    shape = llama_shape(run, seq)
    model = hf_llama_model(vocab=shape["vocab"], hidden=shape["hidden"], layers=shape["layers"],
                           heads=shape["heads"], kv_heads=shape["kv_heads"])
    if window:
        from transformers import MistralConfig, MistralForCausalLM
        cfg = MistralConfig(**{k: v for k, v in model.config.to_dict().items() if k in MistralConfig().to_dict()})
        cfg.sliding_window = max(8, shape["seq"] // 4)
        torch.manual_seed(0)
        model = MistralForCausalLM(cfg)
        shape = dict(shape, window=cfg.sliding_window)
    model = model.to(device=run.device, dtype=getattr(torch, dtype_name)).train()
    batch = {k: v.to(run.device) for k, v in lm_batch(shape["seq"], shape["vocab"]).items()}
    return model, batch, shape


def trained(run: Run, key: str, dtype_name: str = "bfloat16", seq: int = 2048, **optimize_kw) -> dict:
    """optimize() of a fresh Llama (cached under `key`): model, opt, batch, optimizer, step(), timings."""
    if key in run.shared:
        return run.shared[key]
    import torch
    import tailorfx
    model, batch, shape = make_llama(run, dtype_name, seq, window=key.startswith("mistral"))
    eager = copy.deepcopy(model)   # the reference, with the same weights
    t0 = time.time()
    opt = tailorfx.optimize(model, example_inputs=batch, **optimize_kw)
    entry = {"model": model, "opt": opt, "batch": batch, "eager": eager, "shape": shape, "dtype": dtype_name,
             "optimize_s": time.time() - t0, "kw": optimize_kw, "optimizer": None}
    if opt.setup.optimizer_in_backward:   # the updates run inside backward: registered before it runs
        entry["optimizer"] = tailorfx.SetupOptimizer(model.parameters(), opt.setup)

    def step():
        out = opt(**batch)   # held through backward and the step, as a training loop holds it
        out.loss.backward()
        if entry["optimizer"] is not None:
            entry["optimizer"].step()
            entry["optimizer"].zero_grad()
        return out.loss.detach()
    entry["step"] = step
    run.shared[key] = entry
    if run.cuda:
        torch.cuda.synchronize()
    return entry


def optimizer_of(entry: dict):
    """The entry's tailorfx.SetupOptimizer for opt.setup, made on first use."""
    if entry["optimizer"] is None:
        import tailorfx
        entry["optimizer"] = tailorfx.SetupOptimizer(entry["model"].parameters(), entry["opt"].setup)
    return entry["optimizer"]
