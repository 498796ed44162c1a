"""`tailorfx inspect | plan | demo | bench`: the same inspection as the Python API, from a shell."""
from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys

import torch


def _reference(args):
    """An unmodified Hugging Face LlamaForCausalLM built from a config (random weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                        intermediate_size=int(args.hidden * 2.6875), num_hidden_layers=args.layers,
                                        num_attention_heads=max(1, args.hidden // 64),
                                        num_key_value_heads=max(1, args.hidden // 256)))


def _batch(args, seq):
    ids = torch.randint(0, args.vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def cmd_inspect(args):
    import tailorfx
    opt = tailorfx.optimize(_reference(args), passes=args.passes, example_inputs=_batch(args, 64))
    print(opt.report())
    if args.graph:
        for name, gm in opt.graphs.items():
            print(f"==== {name}\n{gm.code}")


def cmd_plan(args):
    import tailorfx
    from tailorfx.budget import format_bytes
    opt = tailorfx.optimize(_reference(args), passes=args.passes, example_inputs=_batch(args, 64))
    print(f"{'seq':>8} {'as captured':>14} {'rewritten':>14}   (predicted peak of one step, AdamW)")
    for s in args.seqs:
        before = opt.predict_memory(s, optimizer="adamw", rewritten=False).peak_bytes
        after = opt.predict_memory(s, optimizer="adamw").peak_bytes
        print(f"{s:>8} {format_bytes(before):>14} {format_bytes(after):>14}")


def cmd_demo(args):
    """Train the reference model one step eagerly and through tailorfx; compare loss, grads, memory."""
    import tailorfx
    from tailorfx.budget import format_bytes
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    eager = _reference(args)
    model = copy.deepcopy(eager)
    print(f"reference model: {sum(p.numel() for p in eager.parameters()) / 1e6:.1f}M parameters, "
          f"seq {args.seq}, fp32, CPU\n")
    opt = tailorfx.optimize(model, passes=args.passes, example_inputs=_batch(args, 64))
    batch = _batch(args, args.seq)

    def peak(module, params):
        for p in params:
            p.grad = None
        holder = {}

        def step():
            holder["loss"] = module(**batch).loss
            holder["loss"].backward()
        return tailorfx.measure_peak(step), holder["loss"].item()

    opt(**batch).loss.backward()   # warm-up outside the measurement
    peak_eager, loss_eager = peak(eager, list(eager.parameters()))
    peak_opt, loss_opt = peak(opt, list(model.parameters()))
    worst = max(((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item()
                for p, q in zip(model.parameters(), eager.parameters()))
    pred = opt.predict_memory(args.seq).forward_backward_peak_bytes
    print(opt.report())
    print(f"loss: eager {loss_eager:.6f}   tailorfx {loss_opt:.6f}   max relative grad error {worst:.2e}")
    print(f"peak of forward+backward (measured, allocator events): eager {format_bytes(peak_eager)}, "
          f"tailorfx {format_bytes(peak_opt)} ({peak_opt / peak_eager:.0%} of eager); "
          f"predicted {format_bytes(pred)} ({(pred - peak_opt) / peak_opt:+.1%})")
    if args.timeline:
        print("timeline:", opt.memory_timeline(args.timeline, args.seq, measured=peak_opt))


def cmd_bench(args):
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    script = os.path.join(here, f"{args.name}.py")
    if not os.path.exists(script):
        names = sorted(f[:-3] for f in os.listdir(here) if f.endswith(".py") and f != "common.py")
        sys.exit(f"no benchmark {args.name!r}; available: {', '.join(names)}")
    sys.exit(subprocess.call([sys.executable, script, *args.rest]))


class _Parser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr, exit code 2."""

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def main(argv=None):
    ap = _Parser(prog="tailorfx", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def model_args(p):
        p.add_argument("--vocab", type=_positive, default=32000)
        p.add_argument("--hidden", type=_positive, default=512)
        p.add_argument("--layers", type=_positive, default=4)
        p.add_argument("--passes", nargs="*", default=None, help="default: the planner's choice")

    p = sub.add_parser("inspect", help="regions, passes and graphs of the reference model")
    model_args(p)
    p.add_argument("--graph", action="store_true", help="print every graph's code")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("plan", help="predicted peak per sequence length")
    model_args(p)
    p.add_argument("--seqs", type=_positive, nargs="+", default=[2048, 8192, 32768])
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("demo", help="one training step, eager vs tailorfx")
    model_args(p)
    p.add_argument("--seq", type=_positive, default=4096)
    p.add_argument("--timeline", default=None, help="write a PNG of the memory timeline here")
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("bench", help="run benchmarks/NAME.py with the remaining arguments")
    p.add_argument("name")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_bench)
    args = ap.parse_args(argv)
    if hasattr(args, "hidden"):
        heads, kv = max(1, args.hidden // 64), max(1, args.hidden // 256)
        if args.hidden % heads or heads % kv:
            ap.error(f"--hidden {args.hidden} does not split into {heads} heads of 64 with {kv} KV heads; "
                     f"use a multiple of 256 (or a size below 128)")
    try:
        args.fn(args)
    except ValueError as e:   # bad options the library refused (a budget, a pass name): one line
        ap.error(str(e).splitlines()[0])


if __name__ == "__main__":
    main()
