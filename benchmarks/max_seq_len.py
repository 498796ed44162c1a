"""Longest sequence whose training step fits a memory budget, found on real runs, on unmodified
Hugging Face causal LMs, against the peers a user would reach for.

"Fits" means parameter bytes + the measured peak of one forward+backward (tailorfx.measure_peak:
allocator events, gradients freed first, the output held through backward) <= budget. Each
variant's length is searched on real steps: from a start length, steps of growing size up until a
step does not fit, then bisection to --granularity tokens. Every variant of a family runs in this
one process on the same weights, under the same budget.

Variants (the model called as HF returns it: loss and logits):
- eager PyTorch;
- HF's `model.gradient_checkpointing_enable()` (every decoder layer checkpointed);
- torch.compile with Inductor, static shapes, torch._functorch.config.activation_memory_budget 0.5
  and 0.0 (the min-cut partitioner told to save half / as little as it can);
- torch.compile with Inductor's auto_chunker (static shapes: it refuses symbolic sizes), with a
  check that it chunked (torch._inductor.metrics.num_auto_chunking): a row whose chunker never fired
  says so;
- tailorfx `passes=["minisequence"]`; tailorfx's planner given the budget (re-planned per length,
  optimizer=None as the budget here holds no optimizer state).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import tailorfx  # noqa: E402
from tailorfx.budget import Budget, format_bytes  # noqa: E402
from common import lm_batch, measure_step, print_table, write_json  # noqa: E402


def build(family: str, vocab: int, hidden: int, layers: int):
    from models import hf_family
    size = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.6875),
                num_attention_heads=max(1, hidden // 64), num_key_value_heads=1,
                max_position_embeddings=1 << 18)
    return hf_family(family, num_layers=layers, **size)


class Compiled(torch.nn.Module):
    """torch.compile(model) with static shapes, compiled under a config patch; one compile per length."""
    def __init__(self, model, patch: dict):
        super().__init__()
        self.model, self.patch = model, patch
        self.__dict__["compiled"] = torch.compile(model, backend="inductor", dynamic=False)

    def forward(self, **kw):
        with torch._inductor.config.patch({k: v for k, v in self.patch.items() if "." in k}), \
                torch._functorch.config.patch({k: v for k, v in self.patch.items() if "." not in k}):
            return self.compiled(**kw)


def variants(base, budget: int, start: int, vocab: int) -> dict:
    """name -> factory(S) returning the module to run at length S (None: no plan fits)."""
    def same(m):
        return lambda S: m
    out = {"eager": same(base)}
    ck = copy.deepcopy(base)
    ck.gradient_checkpointing_enable()
    out["HF gradient_checkpointing_enable()"] = same(ck)
    for b in (0.5, 0.0):
        out[f"torch.compile, activation_memory_budget={b}"] = same(
            Compiled(copy.deepcopy(base), {"activation_memory_budget": b}))
    out["torch.compile, Inductor auto_chunker"] = same(
        Compiled(copy.deepcopy(base), {"auto_chunker.enable": True}))
    out["tailorfx minisequence"] = same(
        tailorfx.optimize(copy.deepcopy(base), passes=["minisequence"], example_inputs=lm_batch(start, vocab)))

    def planned(S):
        torch._dynamo.reset()
        try:
            return tailorfx.optimize(copy.deepcopy(base), budget=budget, optimizer=None,
                                     example_inputs=lm_batch(S, vocab))
        except tailorfx.BudgetError:
            return None
    out["tailorfx planner (budget)"] = planned
    return out


def fits(make, S: int, budget: int, vocab: int, params_bytes: int, log) -> bool:
    module = make(S)
    if module is None:
        log(f"    S={S}: no plan fits")
        return False
    inputs = lm_batch(S, vocab)
    params = list(module.parameters())
    t0 = time.perf_counter()
    try:
        module(**inputs).loss.backward()   # warm-up at this length (compiles where needed)
        peak = measure_step(module, params, inputs)
    except RuntimeError as e:              # an allocation failure counts as not fitting
        log(f"    S={S}: failed ({str(e).splitlines()[0][:80]})")
        return False
    total = params_bytes + peak
    log(f"    S={S}: {format_bytes(total)} ({time.perf_counter() - t0:.1f}s) {'fits' if total <= budget else 'over'}")
    return total <= budget


def longest(check, start: int, granularity: int, limit: int) -> tuple[int, bool]:
    """Largest S (a multiple of granularity) with check(S), searched from `start`; True if capped at limit."""
    start = max(granularity, start // granularity * granularity)
    lo, hi, step = 0, None, granularity
    if check(start):
        lo = start
        while hi is None:
            S = lo + step
            if S > limit:
                return lo, True
            if check(S):
                lo, step = S, step * 2
            else:
                hi = S
    else:
        hi = start
        while lo == 0 and hi > granularity:
            S = max(granularity, hi - step)
            if check(S):
                lo = S
            else:
                hi, step = S, step * 2
        if lo == 0:
            return 0, False
    while hi - lo > granularity:
        mid = (lo + hi) // 2 // granularity * granularity
        if mid <= lo:
            break
        lo, hi = (mid, hi) if check(mid) else (lo, mid)
    return lo, False


def run_family(family: str, a, budget: int) -> dict:
    from torch._inductor import metrics
    base = build(family, a.vocab, a.hidden, a.layers)
    params_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    out = {}
    predicted = {}
    for name, make in variants(base, budget, a.start, a.vocab).items():
        if a.variants and name not in a.variants:
            continue
        print(f"{family}: {name}", flush=True)
        torch._dynamo.reset()   # Dynamo's cache ignores config patches: no variant reuses another's graphs
        metrics.num_auto_chunking = 0
        start = a.start
        if name.startswith("tailorfx"):   # start where the memory model says (the search then measures)
            passes = ["minisequence"] if "minisequence" in name else None
            predicted[name] = tailorfx.max_seq_len(base, budget, passes=passes, optimizer=None,
                                                   granularity=a.granularity)
            start = predicted[name]
        S, capped = longest(lambda s: fits(make, s, budget, a.vocab, params_bytes, lambda m: print(m, flush=True)),
                            start, a.granularity, a.limit)
        out[name] = {"max_seq_len": S, "capped_at_limit": capped, "predicted": predicted.get(name)}
        if "auto_chunker" in name:
            out[name]["chunker_fired"] = metrics.num_auto_chunking
    return {"params_bytes": params_bytes, "results": out}


def table(family: str, a, res: dict) -> None:
    out = res["results"]
    eager = out.get("eager", {}).get("max_seq_len") or None
    peers = [r["max_seq_len"] for n, r in out.items() if not n.startswith("tailorfx")]
    best = max(peers) if peers else None
    rows = []
    for name, r in out.items():
        note = ""
        if "chunker_fired" in r:
            note = f"chunked {r['chunker_fired']} graphs" if r["chunker_fired"] else "never chunked"
        if r.get("predicted"):
            note = f"memory model: {r['predicted']}"
        rows.append([name, f"{r['max_seq_len']}{'+' if r['capped_at_limit'] else ''}",
                     f"{r['max_seq_len'] / eager:.1f}x" if eager else "-",
                     f"{r['max_seq_len'] / best:.2f}x" if best else "-", note])
    print_table(f"HF {family}: longest sequence under {a.budget} (params + measured forward/backward peak); "
                f"vocab {a.vocab}, hidden {a.hidden}, {a.layers} layers, fp32, batch 1",
                ["variant", "max seq len", "vs eager", "vs best peer", "note"], rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budget", default="512MiB")
    ap.add_argument("--families", nargs="+", default=["llama", "qwen2"])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--start", type=int, default=512)
    ap.add_argument("--granularity", type=int, default=256)
    ap.add_argument("--limit", type=int, default=1 << 16)
    ap.add_argument("--variants", nargs="*", default=None)
    ap.add_argument("--out", default="max_seq_len.json", help="file name under benchmarks/out/")
    a = ap.parse_args()
    budget = Budget.parse(a.budget).bytes
    torch._dynamo.config.recompile_limit = 64   # static-shape peers compile once per length
    result = {"budget": a.budget, "budget_bytes": budget, "model": vars(a), "families": {}}
    for family in a.families:
        result["families"][family] = run_family(family, a, budget)
        table(family, a, result["families"][family])
        write_json(a.out, result)
    print("wrote", write_json(a.out, result))


if __name__ == "__main__":
    main()
