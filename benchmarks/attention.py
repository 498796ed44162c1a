"""Attention kernels on CPU: forward+backward time and peak memory against dense baselines.

    python benchmarks/attention.py --seqs 1024 4096 16384      # full run
    python benchmarks/attention.py --quick                      # S=512 and 1024

B=1, H=8, H_kv=2, D=64, fp32, causal; every kernel also with document_ids (4 documents of
random length). Time: median fwd+bwd wall time over --reps runs after a warm-up. Memory: peak
of the cumulative allocator bytes (profiler ``[memory]`` events in time order) over one
fwd+bwd, excluding q/k/v. Dense masked attention is skipped where its model says > --dense-gb.
"model MiB" is the spec's ``extra_bytes`` plus out and the grads (what the peak should match).
Writes benchmarks/out/attention.json.

Times are wall clock: on a shared 2-core box another busy process makes each OpenMP barrier
stall, which hurts the many-small-op kernels most; compare runs from a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tailorfx.attention import BigBird, Dilated, Exact, SlidingWindow, dense_extra_bytes, masked_attention  # noqa: E402

B, H, H_KV, D = 1, 8, 2, 64


def peak_bytes(fn) -> int:
    """Peak cumulative allocator bytes while fn runs (exact for eager and compiled code)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def documents(seq: int, seed: int = 0) -> torch.Tensor:
    """(1, S) ids of 4 documents with random boundaries."""
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(seq - 1, generator=gen)[:3] + 1).values
    return torch.bucketize(torch.arange(seq), cuts, right=True)[None]


def dense_masked(q, k, v, doc):
    return masked_attention(q, k, v, Exact().dense_mask(q.shape[2], 1, doc, q.device))


def sdpa(q, k, v, doc):
    if doc is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    mask = Exact().dense_mask(q.shape[2], 1, doc, q.device)  # documents need an explicit S x S mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def kernels(seq: int):
    """(name, attend(q, k, v, doc), modelled peak bytes: extra + out and grads, or None)."""
    specs = {
        "exact": Exact(),
        "window512": SlidingWindow(512),
        "bigbird": BigBird(block=64, window=1, num_global=1, num_random=2),
        "dilated": Dilated(segments=[512, 2048, 8192], rates=[1, 4, 16]),
    }
    io = B * (3 * H + 2 * H_KV) * seq * D * 4  # out, its grad, dq, dk, dv
    yield "dense_masked", dense_masked, io + dense_extra_bytes(B, H, seq, D, 4)
    yield "sdpa", sdpa, None
    for name, spec in specs.items():
        yield name, spec, io + spec.extra_bytes(B, H, seq, D, 4)


def measure(attend, seq: int, doc, reps: int) -> dict:
    gen = torch.Generator().manual_seed(seq)
    q = torch.randn(B, H, seq, D, generator=gen).requires_grad_()
    k, v = (torch.randn(B, H_KV, seq, D, generator=gen).requires_grad_() for _ in range(2))

    def step():
        out = attend(q, k, v, doc)
        out.backward(torch.ones_like(out))

    step()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"ms": 1e3 * statistics.median(times), "peak_bytes": peak_bytes(step)}


def print_table(rows: list[dict]) -> None:
    header = ["S", "kernel", "docs", "fwd+bwd ms", "peak MiB", "model MiB", "note"]
    cells = [
        [str(r["seq"]), r["kernel"], "yes" if r["docs"] else "no",
         "-" if r["ms"] is None else f"{r['ms']:.1f}",
         "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f}",
         "-" if r["model_bytes"] is None else f"{r['model_bytes'] / 2**20:.1f}", r["note"]]
        for r in rows
    ]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(c[i]) for c in [header, *cells]) for i in range(len(header))]
        for line in [header, *cells]:
            print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
        return
    table = Table(title=f"attention fwd+bwd on CPU (B={B}, H={H}, H_kv={H_KV}, D={D}, fp32)")
    for name in header:
        table.add_column(name, justify="left" if name in ("kernel", "note") else "right")
    for line in cells:
        table.add_row(*line)
    Console(width=120).print(table)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--reps", type=int, default=3, help="timed runs per case (median)")
    parser.add_argument("--quick", action="store_true", help="S=512 and 1024 only")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--dense-gb", type=float, default=8.0, help="skip dense kernels modelled above this")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "attention.json")
    args = parser.parse_args(argv)
    seqs, reps = ([512, 1024], args.reps) if args.quick else (args.seqs, args.reps)
    if args.threads:
        torch.set_num_threads(args.threads)

    rows = []
    for seq in seqs:
        for name, attend, model in kernels(seq):
            for doc in (None, documents(seq)):
                row = {"seq": seq, "kernel": name, "docs": doc is not None, "model_bytes": model,
                       "ms": None, "peak_bytes": None, "note": ""}
                if name == "dense_masked" and model > args.dense_gb * 2**30:
                    row["note"] = f"skipped: model {model / 2**30:.0f} GB > {args.dense_gb:g} GB"
                else:
                    row.update(measure(attend, seq, doc, reps))
                rows.append(row)
                print(f"S={seq} {name} docs={doc is not None}: {row['ms'] or 0:.1f} ms", file=sys.stderr, flush=True)
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {"B": B, "H": H, "H_kv": H_KV, "D": D, "dtype": "float32", "reps": reps,
              "threads": torch.get_num_threads(), "torch": torch.__version__}
    args.out.write_text(json.dumps({"config": config, "rows": rows}, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
