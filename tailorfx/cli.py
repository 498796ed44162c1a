"""`tailorfx inspect | plan | train | kernels | demo | bench`: the library from a shell, for any
Hugging Face causal LM.

CONFIG names the model: a transformers model type with KEY=VALUE overrides
(`llama hidden_size=4096 num_hidden_layers=32`), a local config.json (or the folder holding one),
or `module:factory`. Without CONFIG: a small Llama (vocab 32000, hidden 512, 4 layers).
Nothing is downloaded; inspect, plan and kernels build the model on fake tensors (nothing
allocated, however large); train builds it for real, with random weights.

    tailorfx inspect llama hidden_size=1024 num_hidden_layers=8 --seq 2048
    tailorfx plan llama hidden_size=4096 intermediate_size=14336 num_hidden_layers=32 \\
        num_key_value_heads=8 vocab_size=128256 --budget 80GB --seq 32768
    tailorfx plan llama ... --world 8 --budget 80GB --seq 32768      # tp/pp/dp/sp of 8 devices
    tailorfx train llama hidden_size=256 num_hidden_layers=4 --steps 200 --seq 256 --batch 4
    tailorfx kernels llama ... --arch 90 --seq 4096                    # the Triton kernels it runs
    tailorfx demo                                                      # `make demo`

Bad arguments print one line and exit with code 2; a budget no plan meets exits with code 1.
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from tailorfx.cli_args import ArgParser, positive, positive_float

REFERENCE = ["llama", "vocab_size=32000", "hidden_size=512", "intermediate_size=1376", "num_hidden_layers=4",
             "num_attention_heads=8", "num_key_value_heads=2"]
INSPECT_PASSES = ["attention", "minisequence", "recompute"]


def note(text: str) -> None:
    """Progress of a long step, on stderr (stdout keeps the results)."""
    sys.stderr.write(f"tailorfx: {text}\n")
    sys.stderr.flush()


def _config(args):
    from tailorfx.configs import load_config
    spec = args.config or REFERENCE
    return load_config(spec[0], spec[1:]), spec[0]


def _describe(cfg, name: str) -> str:
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")
    fields = ", ".join(f"{k} {getattr(cfg, k)}" for k in keys if getattr(cfg, k, None) is not None)
    return f"{name} ({fields})" if fields else name


def _n_params(module, n: Optional[int] = None) -> str:
    n = sum(p.numel() for p in module.parameters()) if n is None else n
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


# ---- inspect -----------------------------------------------------------------------------------

def cmd_inspect(args):
    from tailorfx import sizing
    from tailorfx.options import check_passes
    cfg, name = _config(args)
    passes = list(check_passes(INSPECT_PASSES if args.passes is None else args.passes))
    note(f"capturing {name} at {args.batch} x {args.seq} tokens on fake tensors ...")
    opt = sizing.capture_for_prediction(cfg, passes, seq_len=args.seq, batch_size=args.batch,
                                        kernels=args.kernels)
    print(f"{_describe(cfg, name)}: {_n_params(opt.model)} parameters, passes {passes}, "
          f"{args.batch} x {args.seq} tokens (fake tensors: nothing allocated)")
    print(opt.report())
    if args.graph:
        for gname, gm in opt.graphs.items():
            print(f"==== {gname}\n{gm.code}")


# ---- plan --------------------------------------------------------------------------------------

def cmd_plan(args):
    if args.world is not None:
        return cmd_plan_world(args)
    from tailorfx import sizing
    from tailorfx.budget import Budget, format_bytes
    from tailorfx.errors import BudgetError
    from tailorfx.progress import stage
    from tailorfx.setup import resolve
    if args.budget is None:
        raise ValueError("plan needs --budget SIZE (e.g. --budget 80GB), and --world N to lay the model out "
                         "on N devices")
    budget = Budget.parse(args.budget)
    setup = resolve(args.setup)
    cfg, name = _config(args)
    print(f"{_describe(cfg, name)}: a training step of {args.batch} x {args.seq} tokens under {budget}, setup "
          f"{setup.name} (predicted on fake tensors, nothing allocated)", flush=True)
    note("capturing and planning; the longest sequence that fits beside it, in a second process ...")
    t = time.perf_counter()
    # the two predictions are independent and each runs on one core: the longest sequence in a
    # forked process (before any thread of this one starts) while this one plans; where there is
    # no fork (Windows), one after the other. Leaving the block ends the second process.
    forks = "fork" in multiprocessing.get_all_start_methods()
    with _forked(_longest, cfg, budget, args.batch, setup) if forks else contextlib.nullcontext() as longest_later:
        try:
            opt = sizing.plan_for_budget(cfg, budget, args.seq, setup=setup, batch_size=args.batch)
        except BudgetError as e:
            sys.stderr.write(f"tailorfx plan: {str(e).splitlines()[0]}\n")
            sys.exit(1)
        note(f"planned in {time.perf_counter() - t:.0f}s")
        with stage("longest sequence that fits (the second process)") if longest_later else contextlib.nullcontext():
            longest = longest_later() if longest_later else None
        if longest is None:
            longest = sizing.max_seq_len(cfg, budget, batch_size=args.batch, setup=setup)
    print(f"{_n_params(opt.model, sizing.parameter_count(opt))} parameters\n")
    tables = [(gp, ([gp.chosen] if gp.chosen is not None else []) + list(gp.runners_up)) for gp in opt.plan]
    w = max([48] + [len(c.label) for _, rows in tables for c in rows])
    print(f"  {'plan':<{w}} {'predicted peak':>15} {'added FLOPs':>12}  fits")
    for graph_plan, rows in tables:
        chosen = graph_plan.chosen
        for c in rows:
            flops = f"+{c.added_flops / 1e9:.1f}G" if c.added_flops else "0"
            print(f"{'*' if c is chosen else ' '} {c.label:<{w}} {format_bytes(c.peak):>15} {flops:>12}  "
                  f"{'yes' if c.fits else 'no'}")
        print(f"\nchosen: passes {list(graph_plan.passes)} ({graph_plan.reason})")
    if opt.setup.device is not None:
        print(f"predictions {opt.setup.device.describe(args.seq)}")
    blocked = ", attention backward in blocks" if opt.setup.device is None else ""   # on the CPU only
    print(f"longest sequence under {budget}: {longest:,} tokens at batch {args.batch}, device-only "
          f"(the plan that saves the most: segments + full recompute{blocked})")
    # each bound beside the plans of its own kind: the longest sequence above is device-only
    for offload in (False, True) if opt.setup.device is not None else (False,):
        limit = opt.limit(offload=offload)
        if limit is None:
            continue
        here, bound_len = limit
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in here.parts.items())
        reach = (f"the best device-only plan reaches {longest / bound_len:.0%} of it" if not offload else
                 "tailorfx.max_seq_len(..., offload='checkpoints') gives the best such plan's")
        print(f"the {here.kind} limit: no {here.kind} plan of these rewrites fits more than {bound_len:,} tokens "
              f"({reach}); at {args.seq:,} tokens no {here.kind} plan peaks below {format_bytes(here.peak_bytes)} "
              f"(static {format_bytes(here.static_bytes)} + {parts}; dominated by {here.dominant})")


@contextlib.contextmanager
def _forked(fn, *args):
    """`fn(*args)` in a forked process, killed when the block is left; yields a wait for its answer, None
    where autograd refused to run in the child (torch 2.11's CUDA build, after a backward in this process).
    No helper threads here (a Pool's handlers wait on locks its worker shares)."""
    ctx = multiprocessing.get_context("fork")
    answer, send = ctx.Pipe(duplex=False)

    def child():
        try:
            send.send((True, fn(*args)))
        except BaseException as e:   # raised in the parent, by result()
            send.send((False, e))
    process = ctx.Process(target=child, daemon=True)
    process.start()
    send.close()   # only the child's end is left open: its exit ends the pipe

    def result():
        try:
            ok, value = answer.recv()
        except EOFError:
            process.join()
            raise RuntimeError(f"the second process ended (exit code {process.exitcode}) without an answer") from None
        if not ok and not (isinstance(value, RuntimeError) and "fork-based multiprocessing" in str(value)):
            raise value
        return value if ok else None
    try:
        yield result
    finally:
        if process.is_alive():
            process.kill()
        process.join()
        answer.close()


def _longest(cfg, budget, batch, setup) -> int:
    """sizing.max_seq_len in `plan`'s second process, its progress bars off (two processes would
    draw over each other's lines; the first shows a bar while it waits for this one)."""
    os.environ["TAILORFX_PROGRESS"] = "0"
    import torch
    # one thread, so no OpenMP region runs here: GNU OpenMP's thread team does not survive a fork,
    # and where this process's parent had started one, the child's first parallel op (a real
    # tril the mask code makes) waited on that team's barrier for ever
    torch.set_num_threads(1)
    from tailorfx import sizing
    return sizing.max_seq_len(cfg, budget, batch_size=batch, setup=setup)


def cmd_plan_world(args):
    """`plan CONFIG --world N --budget B --seq S`: the layout of N ranks that fits, by prediction."""
    from tailorfx.budget import Budget, format_bytes
    from tailorfx.errors import BudgetError
    from tailorfx.parallel import plan_world
    from tailorfx.setup import resolve
    if args.budget is None:
        raise ValueError("plan --world needs --budget SIZE (e.g. --world 8 --budget 80GB)")
    Budget.parse(args.budget)       # bad values fail before the captures
    resolve(args.setup)
    cfg, name = _config(args)
    print(f"{name} on {args.world} ranks, budget {args.budget}, seq {args.seq}, micro-batch "
          f"{args.batch}, setup {args.setup} (predicted per rank, nothing allocated)", flush=True)
    note("capturing each tensor-parallel width and predicting every layout ...")
    try:
        cands = plan_world(cfg, world=args.world, budget=args.budget, seq_len=args.seq, batch_size=args.batch,
                           setup=args.setup, schedule=args.schedule, microbatches=args.microbatches,
                           device=args.device)
    except BudgetError as e:
        _print_candidates(getattr(e, "candidates", []))
        sys.stderr.write(f"tailorfx plan: {e}\n")
        sys.exit(1)
    best = cands[0]
    rm = best.memory
    sp = best.sp or "-"
    print(f"\nchosen: tp={best.tp} pp={best.pp} dp={best.dp} sp={sp}   ({best.layout()}; {rm.rank}), the fastest "
          f"that fits: {best.tokens_per_s:,.0f} tokens/s, {best.step}")
    print(f"per-rank peak {format_bytes(rm.peak_bytes)}:")
    for part, nbytes in rm.breakdown().items():
        print(f"  {part:<22} {format_bytes(nbytes):>12}")
    print(f"pipeline bubble: {rm.bubble:.1%}" + (f" ({rm.schedule}, {rm.microbatches} micro-batches)"
                                                 if best.pp > 1 else " (no pipeline)"))
    for line in rm.notes:
        print(f"note: {line}")
    print()
    _print_candidates(cands)


def _print_candidates(cands) -> None:
    from tailorfx.budget import format_bytes
    if not cands:
        return
    dev = next((c.step.device for c in cands if c.step is not None), "-")
    print(f"{'':2}{'layout':<22} {'tp':>3} {'pp':>4} {'dp':>5} {'sp':>8} {'rewrites':>12} {'peak/rank':>12} "
          f"{'bubble':>7} {'step (' + dev + ')':>13} {'tokens/s':>10}  status")
    for c in cands:
        peak = format_bytes(c.peak_bytes) if c.peak_bytes is not None else "-"
        bubble = f"{c.bubble:.0%}" if c.memory is not None and c.pp > 1 else "-"
        status = ("chosen: fits" if c.chosen else c.status) + (f" ({c.reason})" if c.reason else "")
        rewrites = "+".join(c.passes) or "-"
        step = f"{c.step_s * 1e3:.1f} ms" if c.step is not None else "-"
        rate = f"{c.tokens_per_s:,.0f}" if c.step is not None else "-"
        print(f"{'*' if c.chosen else ' ':2}{c.layout():<22} {c.tp:>3} {c.pp:>4} {c.dp:>5} {c.sp or '-':>8} "
              f"{rewrites:>12} {peak:>12} {bubble:>7} {step:>13} {rate:>10}  {status}")


# ---- train -------------------------------------------------------------------------------------

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")


def _read_texts(paths: list[str]) -> list[str]:
    """One document per file: the files named, and those under the folders named (text suffixes)."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"--data {str(p)!r}: no such file or folder")
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"--data {' '.join(paths)}: no text files ({', '.join(TEXT_SUFFIXES)}) found")
    return texts


def cmd_train(args):
    import tailorfx
    from tailorfx.budget import Budget
    from tailorfx.options import check_passes
    from tailorfx import demo
    from tailorfx.runtime.packing import PackedBatches
    from tailorfx.runtime.train import NOT_MODEL_INPUTS, count_targets, train
    from transformers import AutoModelForCausalLM
    check_passes(args.passes)
    if args.budget is not None:
        Budget.parse(args.budget)
    cfg, name = _config(args)
    if getattr(cfg, "vocab_size", None) is None:
        raise ValueError(f"{name}: the config has no vocab_size; train needs one to size the tokenizer")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.data:
        texts, source = _read_texts(args.data), " ".join(args.data)
    else:
        texts, _ = demo.build_corpus(int(args.corpus_mb * 1e6))
        source = "the Python standard library's source"
    note(f"tokenizer: byte-level BPE of at most {cfg.vocab_size} tokens on {len(texts)} documents of {source} ...")
    tok, tok_path, _ = demo.train_tokenizer(texts, cfg.vocab_size, out)
    docs = [e.ids for e in tok.encode_batch(texts)]
    data = PackedBatches(docs, seq_len=args.seq, batch_size=args.batch, shuffle=True, seed=args.seed, drop_last=True)
    if len(data) == 0:
        raise ValueError(f"the data fill no batch of {args.batch} x {args.seq} tokens: give more text or a "
                         "smaller --seq / --batch")
    print(f"{_describe(cfg, name)}: data {source}, {sum(map(len, docs)):,} tokens ({tok_path.name}); "
          f"packing: {data.stats}", flush=True)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg).float().train()
    example = {k: v for k, v in data[0].items() if k not in NOT_MODEL_INPUTS}
    example["num_items_in_batch"] = torch.tensor(count_targets(example))   # as train() calls it
    note(f"{_n_params(model)} parameters; capturing and planning ...")
    opt = tailorfx.optimize(model, budget=args.budget, passes=args.passes, example_inputs=example)
    print(opt.report(), flush=True)
    result = train(opt, data, steps=args.steps, grad_accum=args.grad_accum, lr=args.lr, warmup=args.warmup,
                   checkpoint_dir=out / "checkpoints", save_every=args.save_every, resume=args.resume,
                   log_path=out / "train.jsonl", progress=True, seed=args.seed)
    if not result.losses:
        print(f"nothing to do: the checkpoint in {out / 'checkpoints'} is at step {result.step} >= --steps")
        return
    print(f"steps {result.start_step + 1}-{result.step}: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}, "
          f"{result.tokens / max(result.elapsed, 1e-9):,.0f} tokens/s; log {out / 'train.jsonl'}"
          + (f"; checkpoint {result.checkpoints[-1]}" if result.checkpoints else ""))


# ---- kernels -----------------------------------------------------------------------------------

def cmd_kernels(args):
    from tailorfx import sizing
    from tailorfx.budget import format_bytes
    from tailorfx.kernels import compile_many
    from tailorfx.kernels.flash_launch import first_launches
    cfg, name = _config(args)
    note(f"capturing {name} at {args.batch} x {args.seq} tokens on fake tensors with kernels='triton' ...")
    opt = sizing.capture_for_prediction(cfg, ["attention", "minisequence"], seq_len=args.seq, batch_size=args.batch,
                                        dtype=torch.bfloat16 if args.dtype == "bf16" else None, kernels="triton")
    launches = opt.kernel_launches()
    if not launches:
        raise ValueError(f"{name}: no region became a Triton kernel (see `tailorfx inspect ... --kernels triton`)")
    rows, jobs = [], []   # attention: each of its kernels at the tiles a GPU launch starts from
    for kname, (spec, grid) in launches.items():
        if spec.family != "flash_attention":
            rows.append((kname, grid))
            jobs.append((spec, args.arch, {}))
            continue
        batch_heads = int(grid.split("+")[0].strip(" ()").split(",")[1])
        for role, s, opts, role_grid in first_launches(spec, args.arch, args.seq, batch_heads):
            rows.append((f"{s.name}:{role}/{opts['num_warps']}w", role_grid or grid))
            jobs.append((s, args.arch, opts))
    note(f"compiling {len(jobs)} kernels for sm{args.arch} (ptxas, no GPU needed) ...")
    compiled = compile_many(jobs)
    print(f"{_describe(cfg, name)} at {args.batch} x {args.seq} tokens ({args.dtype}), Triton kernels for sm{args.arch}:")
    width = max(len(r) for r, _ in rows)
    print(f"{'kernel':<{width}} {'regs':>5} {'spills':>6} {'shared':>10}  grid")
    for (kname, grid), res in zip(rows, compiled):
        print(f"{kname:<{width}} {res['n_regs']:>5} {res['n_spills']:>6} {format_bytes(res['shared_bytes']):>10}  {grid}")


# ---- demo, bench -------------------------------------------------------------------------------

def cmd_bench(args):
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    script = os.path.join(here, f"{args.name}.py")
    if not os.path.exists(script):
        names = sorted(f[:-3] for f in os.listdir(here) if f.endswith(".py") and f != "common.py")
        raise ValueError(f"no benchmark {args.name!r}; available: {', '.join(names)}")
    sys.exit(subprocess.call([sys.executable, script, *args.rest]))


def parser() -> argparse.ArgumentParser:
    from tailorfx.codegen.schedule import SCHEDULES
    ap = ArgParser(prog="tailorfx", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=ArgParser)

    def model_args(p, seq: int, batch: int = 1):
        p.add_argument("config", nargs="*", metavar="CONFIG",
                       help="a transformers model type and KEY=VALUE overrides (llama hidden_size=4096 ...), a path "
                            "to a config.json, or module:factory; default: a small Llama")
        p.add_argument("--seq", type=positive, default=seq, help=f"tokens per sequence (default {seq})")
        p.add_argument("--batch", type=positive, default=batch, help=f"sequences per micro-batch (default {batch})")

    p = sub.add_parser("inspect", help="regions, passes, predicted memory and graphs of a model")
    model_args(p, 512)
    p.add_argument("--passes", nargs="*", default=None, help=f"default: {' '.join(INSPECT_PASSES)}")
    p.add_argument("--kernels", choices=["triton"], default=None, help="also swap regions for Triton kernels")
    p.add_argument("--graph", action="store_true", help="print every graph's code")
    p.set_defaults(fn=cmd_inspect)

    p = sub.add_parser("plan", help="the passes that fit a budget and the longest sequence; with --world: the "
                                    "parallel layout of N devices")
    model_args(p, 8192)
    p.add_argument("--budget", default=None, help="memory per device: 80GB, 24GiB, H100-80GB")
    p.add_argument("--setup", default="amp-bf16", help="training setup preset: amp-bf16, pure-bf16, "
                                                        "pure-bf16-fused-optimizer, fp32")
    p.add_argument("--world", type=positive, default=None, help="ranks (devices) to lay the model out on")
    p.add_argument("--schedule", default="1f1b", choices=list(SCHEDULES), help="pipeline schedule (with --world)")
    p.add_argument("--microbatches", type=positive, default=None, help="micro-batches per pipeline step "
                                                                        "(with --world; default pp)")
    p.add_argument("--device", default=None, choices=["H100", "H200", "A100"],
                   help="whose figures predict the step time (with --world; default: the budget's GPU, else H100)")
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser("train", help="train a model built from CONFIG (random init) on local text, packed")
    model_args(p, 256, 4)
    p.add_argument("--steps", type=positive, default=100, help="optimizer steps in all (default 100)")
    p.add_argument("--data", nargs="+", default=None, help="text files or folders (.txt .md .rst .py), one document "
                                                          "per file; default: the Python standard library's source")
    p.add_argument("--corpus-mb", type=positive_float, default=4.0, help="megabytes of the default corpus")
    p.add_argument("--budget", default=None, help="memory budget the planner must meet (default: no budget)")
    p.add_argument("--passes", nargs="*", default=None, help="default: the planner's choice")
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10, help="warmup steps of the cosine schedule")
    p.add_argument("--grad-accum", type=positive, default=1, help="micro-batches per optimizer step")
    p.add_argument("--save-every", type=positive, default=None, help="checkpoint every N steps (in --out)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    p.add_argument("--out", default="train_out", help="folder for the log, tokenizer and checkpoints")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("kernels", help="the Triton kernels a model runs: registers, spills, shared memory, grid")
    model_args(p, 4096)
    p.add_argument("--arch", type=int, choices=[80, 90], default=90, help="compile for sm80 or sm90")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="the weights' and activations' dtype")
    p.set_defaults(fn=cmd_kernels)

    p = sub.add_parser("demo", help="train a small HF Llama on the standard library's text under a budget "
                                    "(`make demo`; `tailorfx demo --help` for its options)", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)

    p = sub.add_parser("bench", help="run benchmarks/NAME.py with the remaining arguments")
    p.add_argument("name")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_bench)
    return ap


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:   # the demo parses its own options
        from tailorfx import demo
        return demo.main(argv[1:])
    ap = parser()
    args = ap.parse_args(argv)
    if args.cmd == "kernels" and not torch.cuda.is_available():
        # nothing is launched: the interpreter only lets the kernels pass run without a GPU
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        args.fn(args)
    except ValueError as e:   # bad options the library refused (a config, a budget, a pass name): one line
        ap.error(str(e).splitlines()[0])


if __name__ == "__main__":
    main()
