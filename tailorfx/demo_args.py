"""The command line of `tailorfx demo`: its options, their defaults (the full demo's or --quick's)
and the model size each picks."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from tailorfx.cli_args import ArgParser, positive, positive_float

DEFAULT_BUDGET = "60%"


@dataclass(frozen=True)
class Size:
    """The demo's model and data sizes."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


FULL = Size(hidden=256, layers=4, heads=8, kv_heads=4, intermediate=688)
QUICK = Size(hidden=64, layers=4, heads=4, kv_heads=2, intermediate=172)   # 4 blocks: 60% of eager fits


def parser() -> argparse.ArgumentParser:
    ap = ArgParser(prog="tailorfx demo", description="Train a small Llama on the Python standard library's "
                 "source, on the CPU, inside a memory budget the planner meets.")
    ap.add_argument("--minutes", type=positive_float, default=5.0,
                    help="wall-clock budget for training (default 5; data prep, compile and the eager "
                         "comparison come on top, about a minute)")
    ap.add_argument("--steps", type=positive, default=None,
                    help="train exactly this many optimizer steps (default: as many as fit --minutes)")
    ap.add_argument("--seq", type=positive, default=None, help="tokens per packed row (default 512)")
    ap.add_argument("--batch", type=positive, default=None, help="rows per batch (default 4)")
    ap.add_argument("--budget", default=None,
                    help=f"memory budget of one training step: a size ('200MiB') or a share of eager's "
                         f"measured peak ('50%%'); default {DEFAULT_BUDGET.replace('%', '%%')}")
    ap.add_argument("--out", default="demo_out", help="folder for the PNGs, logs and tokenizer (default demo_out/)")
    ap.add_argument("--vocab", type=positive, default=None, help="BPE vocabulary size (default 4096)")
    ap.add_argument("--corpus-mb", type=positive_float, default=None,
                    help="cap on the corpus, in MB of source (default 6)")
    ap.add_argument("--lr", type=positive_float, default=None, help="peak learning rate (default 2e-3)")
    ap.add_argument("--evals", type=positive, default=None,
                    help="held-out evaluations during training (default 8, plus one before)")
    ap.add_argument("--eval-batches", type=positive, default=None,
                    help="held-out batches per evaluation (default 16)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the init, the shuffle and training (default 0)")
    ap.add_argument("--quick", action="store_true", help="tiny everything, 120 fixed steps: under a minute (for tests)")
    return ap


def fill_defaults(args) -> None:
    """Fill the options left unset with the full demo's defaults, or --quick's; refuse a vocabulary
    too small for byte-level BPE."""
    quick = args.quick
    pick = lambda value, full, small: value if value is not None else (small if quick else full)  # noqa: E731
    args.seq = pick(args.seq, 512, 64)
    args.batch = pick(args.batch, 4, 8)
    args.vocab = pick(args.vocab, 4096, 384)
    args.corpus_mb = pick(args.corpus_mb, 6.0, 0.25)
    args.lr = pick(args.lr, 2e-3, 1e-2)
    args.evals = pick(args.evals, 8, 2)
    args.eval_batches = pick(args.eval_batches, 16, 4)
    args.budget = args.budget if args.budget is not None else DEFAULT_BUDGET
    if quick and args.steps is None:
        args.steps = 120
    args.size = QUICK if quick else FULL
    if args.vocab < 300:
        raise SystemExit(f"tailorfx demo: error: --vocab {args.vocab} is too small for byte-level BPE (256 "
                         f"byte tokens first): use 300 or more")
