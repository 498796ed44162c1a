"""Longest sequence whose training step fits a memory budget, found on real runs.

For each variant: double the length from --start until a step no longer fits, then bisect to
--granularity tokens. "Fits" means parameter bytes + the measured peak of one forward+backward
(tailorfx.measure_peak: allocator events, gradients freed first) <= budget. All variants run in
this one process on the same model weights.

Variants: eager PyTorch; torch.compile with Inductor and its experimental auto-chunker
(torch._inductor.config.auto_chunker.enable=True, the nearest peer to mini-sequence); tailorfx
with the mini-sequence pass.
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
from tailorfx.budget import Budget, format_bytes  # noqa: E402
from common import lm_batch, measure_step, print_table, reference_model, write_json  # noqa: E402


def make_variants(base):
    out = {"eager": base}
    m = copy.deepcopy(base)
    with torch._inductor.config.patch({"auto_chunker.enable": True}):
        out["inductor + auto_chunker"] = _Patched(torch.compile(m, backend="inductor", dynamic=True),
                                                  {"auto_chunker.enable": True}, m)
    m = copy.deepcopy(base)
    out["tailorfx minisequence"] = tailorfx.optimize(m, passes=["minisequence"], example_inputs=lm_batch(64))
    return out


class _Patched(torch.nn.Module):
    """Runs a compiled module with an Inductor config patch active (compilation happens lazily)."""
    def __init__(self, compiled, patch, model):
        super().__init__()
        self.__dict__["compiled"] = compiled
        self.patch = patch
        self.model = model

    def forward(self, **kw):
        with torch._inductor.config.patch(self.patch):
            return self.compiled(**kw)


def fits(module, params, S, budget, vocab, log):
    inputs = lm_batch(S, vocab)
    t0 = time.perf_counter()
    try:
        peak = measure_step(module, params, inputs)
    except RuntimeError as e:   # an allocation failure counts as not fitting
        log(f"    S={S}: failed ({str(e).splitlines()[0][:80]})")
        return False, None
    total = sum(p.numel() * p.element_size() for p in params) + peak
    log(f"    S={S}: {format_bytes(total)} ({time.perf_counter() - t0:.1f}s) {'fits' if total <= budget else 'over'}")
    return total <= budget, total


def longest(module, params, budget, start, granularity, limit, vocab, log):
    lo, hi, S = 0, None, start
    while S <= limit:
        ok, _ = fits(module, params, S, budget, vocab, log)
        if not ok:
            hi = S
            break
        lo, S = S, S * 2
    if hi is None:
        return lo, True
    while hi - lo > granularity:
        mid = (lo + hi) // 2 // granularity * granularity or granularity
        if mid <= lo:
            break
        ok, _ = fits(module, params, mid, budget, vocab, log)
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo, False


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--start", type=int, default=1024)
    ap.add_argument("--granularity", type=int, default=512)
    ap.add_argument("--limit", type=int, default=65536)
    ap.add_argument("--variants", nargs="*", default=None)
    a = ap.parse_args()
    budget = Budget.parse(a.budget).bytes
    base = reference_model(vocab=a.vocab, hidden=a.hidden, layers=a.layers)
    variants = make_variants(base)
    rows, out = [], {}
    for name, module in variants.items():
        if a.variants and name not in a.variants:
            continue
        params = list(base.parameters()) if module is base else list(module.model.parameters())
        print(f"{name}:", flush=True)
        fits(module, params, 256, float("inf"), a.vocab, lambda s: None)   # warm-up / compile
        S, capped = longest(module, params, budget, a.start, a.granularity, a.limit, a.vocab,
                            lambda s: print(s, flush=True))
        out[name] = {"max_seq_len": S, "capped_at_limit": capped}
    eager = out.get("eager", {}).get("max_seq_len") or None
    for name, r in out.items():
        ratio = f"{r['max_seq_len'] / eager:.1f}x" if eager else "-"
        rows.append([name, f"{r['max_seq_len']}{'+' if r['capped_at_limit'] else ''}", ratio])
    print_table(f"Longest sequence under {a.budget} (params + measured forward/backward peak); "
                f"model vocab {a.vocab}, hidden {a.hidden}, {a.layers} layers, fp32, batch 1",
                ["variant", "max seq len", "vs eager"], rows)
    print("wrote", write_json("max_seq_len.json", {"budget": a.budget, "budget_bytes": budget,
                                                   "model": vars(a), "results": out}))


if __name__ == "__main__":
    main()
