"""The step-time model (`tailorfx.parallel.predict_step_time`) against what a GPU measured: Llama-3-8B
trained on one H200 on 2026-12-04 (`results/gpu_scale_speed_h200_2026-12-04b.json`, the speed rows
of benchmarks/gpu_scale.py with each step's kernels profiled by kind).

    python benchmarks/steptime_gpu.py          # predicted against measured, each row and kind; JSON
    python benchmarks/steptime_gpu.py --fit    # the device fractions the fit row implies
    python benchmarks/steptime_gpu.py --measured PATH   # a later gpu_scale.py JSON (its profiled rows)

What the model can be held to: the rows whose recipe it represents as `passes=["recompute"]` on
tailorfx's capture of the same model (pure-bf16-fused-optimizer, batch 1). HF gradient
checkpointing: the whole step and each kind of kernel (GEMM, attention, the rest with the
optimizer's). Liger-Kernel + HF checkpointing: its GEMMs and attention only (the same matmuls, its
fused head's chunks included, and the same SDPA kernels; its own Triton kernels replace the rest).
The ALST recipe recomputes its MLPs once more and is left out. `--fit` takes one row (FIT_ROW) and
scales each datasheet fraction by predicted / measured of its kind: every other row is held out.

A later run's tailorfx rows (`--measured`) are held to the predictions committed before it
(`results/gpu_scale_predicted.json`, `gpu_scale.py --predict`: `plan_step_time` on each plan as
lowered), where a row has one: its step and each kind of kernel. The 12-04 run came before them
(and its tailorfx rows ran an fp32 GEMM on CUDA cores, fixed since).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import print_table, write_json  # noqa: E402
from paper_table import MODELS  # noqa: E402

MEASURED = os.path.join(os.path.dirname(__file__), "results", "gpu_scale_speed_h200_2026-12-04b.json")
PREDICTED = os.path.join(os.path.dirname(__file__), "results", "gpu_scale_predicted.json")
FIT_ROW = ("hf-checkpointing", 16384)
# provider -> the kinds of kernel the model is held to for it
KINDS = {"hf-checkpointing": ("step", "gemm", "attention", "other"), "liger+hf-checkpointing": ("gemm", "attention")}
SETUP = "pure-bf16-fused-optimizer"
# the fractions of Hopper's datasheets (989 TFLOP/s bf16; 3.35 or 4.8 TB/s) the model took before this check
DATASHEET = {"matmul_flops": 0.45, "attention_flops": 0.35, "memory_bandwidth": 0.8}
PEAKS = {"H100": {"matmul_flops": 989e12, "attention_flops": 989e12, "memory_bandwidth": 3.35e12},
         "H200": {"matmul_flops": 989e12, "attention_flops": 989e12, "memory_bandwidth": 4.8e12}}
KIND_OF = {"gemm": "matmul_flops", "attention": "attention_flops", "other": "memory_bandwidth"}


def gpu_of(path: str = MEASURED) -> str:
    """The device class of the GPU a gpu_scale.py JSON was measured on."""
    with open(path) as f:
        gpu = json.load(f)["meta"].get("gpu", "")
    name = next((k for k in PEAKS if k in gpu), None)
    if name is None:
        raise ValueError(f"{path} was measured on {gpu!r}: this check has Hopper's figures ({sorted(PEAKS)}) only")
    return name


def measured_rows(path: str = MEASURED, providers=KINDS) -> list[dict]:
    """The speed rows of `providers` with a step time and a profile: provider, tokens, step_s, kernel
    seconds by kind (copies counted with the other kernels)."""
    with open(path) as f:
        checks = json.load(f)["sections"]["speed"]["checks"]
    rows = []
    for c in checks:
        if c.get("provider") in providers and "step_s" in c and c.get("profile"):
            k = c["profile"]["by_kind_s"]
            rows.append({"provider": c["provider"], "tokens": c["tokens"], "step": c["step_s"],
                         "gemm": k.get("gemm", 0.0), "attention": k.get("attention", 0.0),
                         "other": k.get("other", 0.0) + k.get("copy", 0.0)})
    return rows


def predicted(S: int, device) -> dict:
    """Seconds by kind of one step of Llama-3-8B at S tokens with every block recomputed, on `device`
    (the optimizer's pass counted with the other ops, as the profile counts its kernels)."""
    from tailorfx.parallel.steptime import predict_step_time
    st = predict_step_time(MODELS["Llama-3-8B"](), seq_len=S, device=device, setup=SETUP, passes=["recompute"])
    kinds = dict(st.by_kind)
    return {"step": st.total_s, "gemm": kinds["gemm"], "attention": kinds["attention"],
            "other": kinds["other"] + st.optimizer_s}


def datasheet_class(gpu: str = "H200"):
    """The GPU's class with the fractions the model took before this check."""
    from tailorfx.parallel.devices import DEVICE_CLASSES
    return dataclasses.replace(DEVICE_CLASSES[gpu], **{k: f * PEAKS[gpu][k] for k, f in DATASHEET.items()},
                               source=f"{gpu} datasheet x the fractions assumed before 2026-12-06")


def compare(devices: dict, rows: list[dict]) -> list[dict]:
    """Each row's kinds: measured, and predicted on each device class with its error."""
    preds = {(name, S): predicted(S, dev) for name, dev in devices.items() for S in sorted({r["tokens"] for r in rows})}
    out = []
    for r in rows:
        for kind in KINDS[r["provider"]]:
            e = {"provider": r["provider"], "tokens": r["tokens"], "kind": kind, "measured_s": r[kind],
                 "fit_row": (r["provider"], r["tokens"]) == FIT_ROW}
            for name in devices:
                p = preds[(name, r["tokens"])][kind]
                e[name] = {"predicted_s": p, "error": p / r[kind] - 1}
            out.append(e)
    return out


def plan_predictions(path: str = PREDICTED) -> dict:
    """(provider, tokens) -> {gpu: seconds by kind and step} of each tailorfx row gpu_scale.py --predict
    priced (the optimizer's pass counted with the other kernels, as the profile counts it)."""
    with open(path) as f:
        speed = json.load(f)["speed"]
    out = {}
    for S, row in speed.items():
        entries = [("tailorfx", row)] + [(k, v) for k, v in row.items() if isinstance(v, dict)]
        for provider, e in entries:
            if "predicted_time" in e:
                out[(provider, int(S))] = {gpu: {"step": t["step_s"], "gemm": t["gemm"], "attention": t["attention"],
                                                 "other": t["other"] + t["optimizer_s"]}
                                           for gpu, t in e["predicted_time"].items()}
    return out


def compare_plans(gpu: str, measured: str, predicted: str = PREDICTED) -> list[dict]:
    """Each measured tailorfx row that has a prediction: its step and kinds against it, on `gpu`'s class."""
    preds = plan_predictions(predicted)
    rows = measured_rows(measured, providers={p for p, _ in preds})
    return [{"provider": r["provider"], "tokens": r["tokens"], "kind": kind, "measured_s": r[kind],
             "predicted_s": p[kind], "error": p[kind] / r[kind] - 1}
            for r in rows if (r["provider"], r["tokens"]) in preds
            for p in [preds[(r["provider"], r["tokens"])][gpu]] for kind in ("step", "gemm", "attention", "other")]


def fit(rows: list[dict]) -> dict:
    """Each datasheet fraction scaled by predicted / measured of its kind on FIT_ROW."""
    row = next(r for r in rows if (r["provider"], r["tokens"]) == FIT_ROW)
    p = predicted(row["tokens"], datasheet_class())
    return {field: round(DATASHEET[field] * p[kind] / row[kind], 3) for kind, field in KIND_OF.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fit", action="store_true", help="print the fractions FIT_ROW implies, and stop")
    ap.add_argument("--measured", default=MEASURED, help="a gpu_scale.py JSON with profiled speed rows")
    args = ap.parse_args(argv)
    rows = measured_rows(args.measured)
    if not rows:
        ap.error(f"{args.measured} has no profiled speed row of {sorted(KINDS)} (gpu_scale.py --section speed writes them)")
    t0 = time.time()
    if args.fit:
        print(json.dumps({"fit_row": FIT_ROW, "fractions": fit(rows)}))
        return 0
    from tailorfx.parallel.devices import DEVICE_CLASSES
    gpu = gpu_of(args.measured)
    devices = {"datasheet": datasheet_class(gpu), gpu: DEVICE_CLASSES[gpu]}
    res = compare(devices, rows)
    print_table(f"Llama-3-8B, {os.path.basename(args.measured)}: the step-time model against the profile, seconds",
                ["provider", "tokens", "kind", "measured", "datasheet class", "error", f"{gpu} class", "error"],
                [[e["provider"] + (" (fit)" if e["fit_row"] else ""), f"{e['tokens']:,}", e["kind"],
                  f"{e['measured_s']:.3f}", f"{e['datasheet']['predicted_s']:.3f}", f"{e['datasheet']['error']:+.1%}",
                  f"{e[gpu]['predicted_s']:.3f}", f"{e[gpu]['error']:+.1%}"] for e in res])
    held = [abs(e[gpu]["error"]) for e in res if not e["fit_row"]]
    print(f"held-out rows: worst error {max(held, default=0):.1%} on the {gpu} class ({time.time() - t0:.0f} s)")
    plans = compare_plans(gpu, args.measured) if args.measured != MEASURED else []   # 12-04's came first
    if plans:
        print_table(f"tailorfx's plans against {os.path.basename(PREDICTED)} (predicted before the run), seconds",
                    ["provider", "tokens", "kind", "measured", "predicted", "error"],
                    [[e["provider"], f"{e['tokens']:,}", e["kind"], f"{e['measured_s']:.3f}",
                      f"{e['predicted_s']:.3f}", f"{e['error']:+.1%}"] for e in plans])
    name = "steptime_h200_2026-12-06.json" if args.measured == MEASURED else "steptime_vs_" + os.path.basename(args.measured)
    path = write_json(name, {
        "measured": os.path.basename(args.measured), "fit_row": FIT_ROW, "setup": SETUP,
        "classes": {name: d.as_dict() for name, d in devices.items()}, "rows": res, "plans": plans})
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
