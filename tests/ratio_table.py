"""Merge exact-comparison ratio logs (TAILORFX_RATIO_LOG, one per run configuration) into a markdown
table: per test, the worst error / tolerance of each configuration and over all of them.

    python tests/ratio_table.py default=/tmp/r_default.json threads2=/tmp/r_t2.json ...

A LABEL=PATH argument names its column (a bare PATH: the file's name); PATH's xdist worker logs
(PATH.gw0, PATH.gw1, ...) are merged with it. A test that ran in one configuration and not in
another shows "-" there. A comparison whose reference is not the float64 run is marked with *.
"""
from __future__ import annotations

import glob
import json
import os
import sys


def load(path: str) -> list[dict]:
    comparisons = []
    for p in sorted({*glob.glob(path), *glob.glob(glob.escape(path) + ".gw*")}):
        with open(p) as f:
            comparisons += json.load(f)["comparisons"]
    if not comparisons and not os.path.exists(path):
        raise SystemExit(f"{path}: no log (nor {path}.gw*)")
    return comparisons


def worst_by_test(comparisons: list[dict]) -> dict[str, dict]:
    worst = {}
    for c in comparisons:
        if c["test"] not in worst or c["ratio"] > worst[c["test"]]["ratio"]:
            worst[c["test"]] = c
    return worst


def table(runs: dict[str, list[dict]]) -> str:
    per_run = {label: worst_by_test(cs) for label, cs in runs.items()}
    tests = sorted({t for w in per_run.values() for t in w})
    head = ["test", *per_run, "max", "worst tensor"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in tests:
        cells, top = [], None
        for w in per_run.values():
            c = w.get(t)
            cells.append("-" if c is None else f"{c['ratio']:.3f}" + ("" if c["reference"] == "float64" else "*"))
            if c is not None and (top is None or c["ratio"] > top["ratio"]):
                top = c
        lines.append(f"| {t} | " + " | ".join(cells) + f" | **{top['ratio']:.3f}** | {top['tensor']} |")
    overall = max((c for w in per_run.values() for c in w.values()), key=lambda c: c["ratio"])
    lines.append(f"\nworst of all: {overall['ratio']:.3f} ({overall['test']}, {overall['tensor']}); "
                 f"{sum(len(cs) for cs in runs.values())} comparisons in {len(runs)} configurations")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    runs = {}
    for arg in argv:
        label, _, path = arg.rpartition("=") if "=" in arg else (os.path.basename(arg), "", arg)
        runs[label] = load(path)
    print(table(runs))


if __name__ == "__main__":
    main(sys.argv[1:])
