"""Longest sequence whose training step fits a memory budget, found on real runs.

For each variant: double the length from --start until a step no longer fits, then bisect to
--granularity tokens. "Fits" means parameter bytes + the measured peak of one forward+backward
(tailorfx.measure_peak: allocator events, gradients freed first) <= budget. All variants run in
this one process on the same model weights.

Variants: eager PyTorch; torch.utils.checkpoint around every decoder layer (torch's
checkpoint_wrapper); torch.compile with Inductor and its experimental auto-chunker
(auto_chunker.enable=True, the nearest peer to mini-sequence); torch.compile with
torch._functorch.config.activation_memory_budget=0 (the min-cut partitioner saving as little as
it can); tailorfx with the mini-sequence pass; tailorfx's planner given the budget (re-planned
for each length, optimizer=None since the budget here has no optimizer state).
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
    """name -> factory(S) returning (module, params); most modules serve every length."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from tailorfx.models.llama import DecoderLayer
    out = {"eager": lambda S, m=base: (m, list(m.parameters()))}
    ck = copy.deepcopy(base)
    apply_activation_checkpointing(ck, check_fn=lambda mod: isinstance(mod, DecoderLayer))
    out["eager + checkpoint per block"] = lambda S, m=ck: (m, list(m.parameters()))
    m = copy.deepcopy(base)
    ac = _Patched(torch.compile(m, backend="inductor", dynamic=True), "inductor", {"auto_chunker.enable": True}, m)
    out["inductor + auto_chunker"] = lambda S, a=ac: (a, list(a.model.parameters()))
    m = copy.deepcopy(base)
    mb = _Patched(torch.compile(m, backend="inductor", dynamic=True), "functorch",
                  {"activation_memory_budget": 0.0}, m)
    out["inductor + activation_memory_budget=0"] = lambda S, a=mb: (a, list(a.model.parameters()))
    m = copy.deepcopy(base)
    ms = tailorfx.optimize(m, passes=["minisequence"], example_inputs=lm_batch(64))
    out["tailorfx minisequence"] = lambda S, o=ms: (o, list(o.model.parameters()))
    return out


def planner_variant(base, budget):
    def make(S):
        torch._dynamo.reset()
        m = copy.deepcopy(base)
        try:
            opt = tailorfx.optimize(m, budget=budget, optimizer=None, example_inputs=lm_batch(S, m.config.vocab_size))
        except tailorfx.BudgetError:
            return None, list(m.parameters())
        return opt, list(m.parameters())
    return make


class _Patched(torch.nn.Module):
    """Runs a compiled module with a config patch active (compilation happens lazily)."""
    def __init__(self, compiled, which, patch, model):
        super().__init__()
        self.__dict__["compiled"] = compiled
        self.which, self.patch = which, patch
        self.model = model

    def forward(self, **kw):
        cfg = torch._inductor.config if self.which == "inductor" else torch._functorch.config
        with cfg.patch(self.patch):
            return self.compiled(**kw)


def fits(make, S, budget, vocab, log):
    module, params = make(S)
    if module is None:
        log(f"    S={S}: no plan fits")
        return False, None
    inputs = lm_batch(S, vocab)
    t0 = time.perf_counter()
    try:
        module(**inputs).loss.backward()   # warm-up at this length (compiles where needed)
        peak = measure_step(module, params, inputs)
    except RuntimeError as e:   # an allocation failure counts as not fitting
        log(f"    S={S}: failed ({str(e).splitlines()[0][:80]})")
        return False, None
    total = sum(p.numel() * p.element_size() for p in params) + peak
    log(f"    S={S}: {format_bytes(total)} ({time.perf_counter() - t0:.1f}s) {'fits' if total <= budget else 'over'}")
    return total <= budget, total


def longest(make, budget, start, granularity, limit, vocab, log):
    lo, hi, S = 0, None, start
    while S <= limit:
        ok, _ = fits(make, S, budget, vocab, log)
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
        ok, _ = fits(make, mid, budget, vocab, log)
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
    variants["tailorfx planner (budget)"] = planner_variant(base, budget)
    rows, out = [], {}
    for name, make in variants.items():
        if a.variants and name not in a.variants:
            continue
        print(f"{name}:", flush=True)
        # compiled variants of the same model class would otherwise reuse each other's graphs
        # (Dynamo's cache ignores config patches such as auto_chunker or activation_memory_budget)
        torch._dynamo.reset()
        S, capped = longest(make, budget, a.start, a.granularity, a.limit, a.vocab,
                            lambda s: print(s, flush=True))
        out[name] = {"max_seq_len": S, "capped_at_limit": capped}
    eager = out.get("eager", {}).get("max_seq_len") or None
    peers = [r["max_seq_len"] for n, r in out.items() if not n.startswith("tailorfx")]
    best_peer = max(peers) if peers else None
    for name, r in out.items():
        ratio = f"{r['max_seq_len'] / eager:.1f}x" if eager else "-"
        vs_peer = f"{r['max_seq_len'] / best_peer:.2f}x" if best_peer else "-"
        rows.append([name, f"{r['max_seq_len']}{'+' if r['capped_at_limit'] else ''}", ratio, vs_peer])
    print_table(f"Longest sequence under {a.budget} (params + measured forward/backward peak); "
                f"model vocab {a.vocab}, hidden {a.hidden}, {a.layers} layers, fp32, batch 1",
                ["variant", "max seq len", "vs eager", "vs best non-tailorfx"], rows)
    print("wrote", write_json("max_seq_len.json", {"budget": a.budget, "budget_bytes": budget,
                                                   "model": vars(a), "results": out}))


if __name__ == "__main__":
    main()
