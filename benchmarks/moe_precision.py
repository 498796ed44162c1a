"""bf16 on MoE families: the router as an fp32 island against the router in bf16 and torch.autocast.

Per family (Mixtral, Qwen2-MoE, OLMoE: tiny configs, 2 layers, fp32 weights, S=64, batch 2) and
seed, the relative L2 error of every parameter gradient against the fp32 eager step. Reports the
routers' gradient error (median and worst over layers and seeds) and the worst over all parameters.

    python benchmarks/moe_precision.py [--seeds 3]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import tailorfx  # noqa: E402
from common import print_table, write_json  # noqa: E402
from models import batch, hf_family  # noqa: E402

FAMILIES = ["mixtral", "qwen2_moe", "olmoe"]


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def errors(family: str, seed: int, variant: str) -> dict:
    torch._dynamo.reset()
    model = hf_family(family, seed=seed)
    test = copy.deepcopy(model)
    inputs = batch(S=64)
    model(**inputs).loss.backward()
    if variant == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = test(**inputs).loss
    else:
        policy = {"router": "low"} if variant == "router-bf16" else None
        loss = tailorfx.optimize(test, passes=["precision"], precision="bf16", precision_policy=policy)(**inputs).loss
    loss.backward()
    ref = dict(model.named_parameters())
    return {n: rel(p.grad, ref[n].grad) for n, p in test.named_parameters() if p.grad is not None}


def main(seeds: int) -> list:
    rows, out = [], []
    for variant, label in (("router-fp32", "tailorfx bf16 (router fp32, default)"),
                           ("router-bf16", 'tailorfx bf16, policy {"router": "low"}'),
                           ("autocast", "torch.autocast(bf16)")):
        for family in FAMILIES:
            gates, worst = [], []
            for seed in range(seeds):
                e = errors(family, seed, variant)
                gates += [v for k, v in e.items() if k.endswith("mlp.gate.weight")]
                worst.append(max(e.values()))
            rec = {"variant": variant, "family": family, "router_grad_err": gates, "worst_grad_err": worst}
            out.append(rec)
            rows.append([label, family, f"{100 * statistics.median(gates):.2f}%", f"{100 * max(gates):.2f}%",
                         f"{100 * statistics.median(worst):.2f}%"])
            print(rows[-1], flush=True)
    print_table(f"bf16 gradient error on MoE families (relative L2 vs fp32 eager, {seeds} seeds, 2 layers, S=64)",
                ["variant", "family", "router grad: median", "router grad: worst", "worst param: median over seeds"],
                rows)
    write_json("moe_precision", out)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=3)
    main(ap.parse_args().seeds)
