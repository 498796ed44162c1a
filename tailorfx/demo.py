"""`tailorfx demo`: train a small Llama for real, on the CPU, inside a memory budget.

    python -c "from tailorfx.demo import main; main([])"          # about 6 minutes on 2 cores
    python -c "from tailorfx.demo import main; main(['--quick'])"  # seconds, tiny everything

What it does, with nothing downloaded:

1. Corpus: the Python standard library's own source files (``sysconfig.get_paths()["stdlib"]``,
   ``*.py``; openly licensed under the PSF license, present wherever Python is), one document per
   file, in a deterministic order, capped in size; every 20th file is held out. Test suites,
   site-packages and generated tables (``encodings``, ``pydoc_data``) are left out.
2. Tokenizer: a byte-level BPE trained here with `tokenizers` on the training files (cached in
   the output folder, keyed by the corpus and the vocabulary size).
3. Packing: documents packed into rows of ``--seq`` tokens with `tailorfx.runtime.packing`
   (positions restart per document, no attention mask, so no token attends across a join).
4. Model: a transformers ``LlamaForCausalLM`` built from a config, random init, fp32.
5. Memory: eager's peak of one training step (weights + AdamW state + the measured peak of
   forward, backward, clipping and the optimizer step, as `train()` runs it) at the demo's batch;
   then ``tailorfx.optimize(model, budget=...)`` (default: 60% of eager's peak) lets the planner
   choose the passes, and the rewritten step is measured the same way (it must be within the
   budget) and compared with the memory model's prediction.
6. Training: `tailorfx.runtime.train.train` with AdamW, warmup + cosine, clipping, for about
   ``--minutes`` (the step count is chosen from timed steps), in chunks resumed from checkpoints
   so the held-out loss is measured along the way.

It writes to ``--out`` (default ``demo_out/``): ``train.jsonl`` (one JSON line per optimizer
step), ``summary.json``, ``loss.png`` (train loss per step and held-out loss),
``memory_timeline.png`` (predicted live memory over one step, eager and rewritten, with the
measured peak) and the tokenizer.
"""
from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import json
import math
import sys
import sysconfig
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from tailorfx.cli_args import ArgParser, positive, positive_float

# generated tables and test suites: not the prose-and-code a language model should learn from
SKIP_PARTS = frozenset({"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__phello__"})
HOLDOUT_EVERY = 20
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


def say(*parts) -> None:
    print(*parts, flush=True)


# ---- 1. corpus ----------------------------------------------------------------------------------
def stdlib_files(root: Optional[Path] = None) -> List[Path]:
    """The standard library's *.py files, top-level modules first, then by path (deterministic)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [f for f in root.rglob("*.py")
             if f.is_file() and not (SKIP_PARTS & set(f.relative_to(root).parts))
             and not f.relative_to(root).parts[0].startswith("config-")]
    return sorted(files, key=lambda f: (len(f.relative_to(root).parts), f.relative_to(root).as_posix()))


def build_corpus(max_bytes: int, max_file_bytes: Optional[int] = None,
                 root: Optional[Path] = None) -> Tuple[List[str], List[str]]:
    """(train texts, held-out texts): one document per file, files taken in order while they fit
    in `max_bytes` (files over `max_file_bytes` skipped); of the files taken, every
    HOLDOUT_EVERY-th (the 11th, 31st, ...) is held out."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    taken, total = [], 0
    for f in stdlib_files(root):
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        n = len(text.encode("utf-8"))
        if not text.strip() or total + n > max_bytes or (max_file_bytes is not None and n > max_file_bytes):
            continue
        taken.append(text)
        total += n
    held_out = lambda i: i % HOLDOUT_EVERY == HOLDOUT_EVERY // 2  # noqa: E731
    return [t for i, t in enumerate(taken) if not held_out(i)], [t for i, t in enumerate(taken) if held_out(i)]


# ---- 2. tokenizer -------------------------------------------------------------------------------
def train_tokenizer(texts: Sequence[str], vocab: int, cache_dir: Path):
    """A byte-level BPE tokenizer trained on `texts` (cached in `cache_dir`); returns
    (tokenizers.Tokenizer, its path, whether it came from the cache)."""
    from tokenizers import ByteLevelBPETokenizer, Tokenizer
    key = hashlib.sha256()
    for t in texts:
        key.update(hashlib.sha256(t.encode("utf-8")).digest())
    path = Path(cache_dir) / f"tokenizer-bpe{vocab}-{key.hexdigest()[:12]}.json"
    if path.exists():
        return Tokenizer.from_file(str(path)), path, True
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(list(texts), vocab_size=vocab, min_frequency=2, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return Tokenizer.from_file(str(path)), path, False


# ---- 4. model -----------------------------------------------------------------------------------
def build_model(vocab: int, seq: int, size: Size, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
                      num_hidden_layers=size.layers, num_attention_heads=size.heads,
                      num_key_value_heads=size.kv_heads, max_position_embeddings=max(seq, 128),
                      tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM(cfg).float().train()


# ---- 5. memory ----------------------------------------------------------------------------------
@dataclass
class StepMemory:
    total: int          # weights + optimizer state + the measured peak of the step
    dynamic: int        # the measured peak of the step above weights and optimizer state
    static: int         # weights + optimizer state
    seconds: float      # wall time of one step (the mean of timed steps after the measured one)


def _make_step(module, params: List[torch.nn.Parameter], optimizer, batch: dict, clip: float) -> Callable[[], None]:
    """One training step as `tailorfx.runtime.train.train` runs it (zero grads, forward and
    backward with num_items_in_batch, clip, AdamW step)."""
    from tailorfx.runtime.train import accumulate

    def step():
        optimizer.zero_grad(set_to_none=True)
        accumulate(module, [batch])
        torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
    return step


def measure_step(module, model: torch.nn.Module, batch: dict, lr: float, clip: float = 1.0,
                 timed_steps: int = 3) -> StepMemory:
    """Weights + AdamW state + tailorfx.measure_peak of a steady-state training step (the second
    step: the optimizer state exists, gradients freed at its start), then the time of a step.
    Steps the model's weights: the caller restores them."""
    import tailorfx
    from tailorfx.runtime.train import make_optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(model, lr)
    step = _make_step(module, params, opt, batch, clip)
    step()                              # compiles (tailorfx) and creates the optimizer state
    opt.zero_grad(set_to_none=True)
    peak = tailorfx.measure_peak(step)   # its profiler's start/stop lines are dropped
    t = time.perf_counter()
    for _ in range(timed_steps):
        step()
    seconds = (time.perf_counter() - t) / max(1, timed_steps)
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0)
    static = sum(p.numel() * p.element_size() for p in model.parameters()) + state
    opt.zero_grad(set_to_none=True)
    return StepMemory(static + peak, peak, static, seconds)


def plan(model, example: dict, budget: int, label: str, eager_total: int, tries: int = 3):
    """tailorfx.optimize(model, budget) -> (opt, budget, label). A budget no plan meets (BudgetError)
    is replaced by the one the error suggests; a budget met only by moving the optimizer step into
    backward (which this demo's AdamW loop does not run) is raised half-way towards eager's peak."""
    import tailorfx
    from tailorfx.errors import BudgetError
    for attempt in range(tries):
        try:
            with warnings.catch_warnings():   # handled below, in the demo's words
                warnings.filterwarnings("ignore", message=r".*only with the optimizer step in backward.*")
                opt = tailorfx.optimize(model, budget=budget, example_inputs=example)
        except BudgetError as e:
            say(f"    the planner cannot meet {_fmt(budget)}: {str(e).split('. Use')[0].split(': ', 1)[-1]}.")
            budget, label = e.suggested_bytes, "the smallest budget the planner can meet, plus its headroom"
            say(f"    so the demo uses the budget it suggests: {_fmt(budget)}")
        else:
            if not opt.setup.optimizer_in_backward:
                return opt, budget, label
            raised = (budget + eager_total) // 2
            say(f"    {_fmt(budget)} is met only with the AdamW step moved into backward, which this demo's "
                f"training loop (tailorfx.runtime.train.train) does not run: trying {_fmt(raised)}")
            budget, label = raised, "raised until a normal AdamW step fits"
    raise SystemExit(f"tailorfx demo: error: no budget tried fits a normal AdamW step; pass a larger --budget "
                     f"(eager measured {_fmt(eager_total)})")


def resolve_budget(text: str, eager_total: int) -> Tuple[int, str]:
    """'60%' -> that share of eager's measured step; else a size tailorfx.Budget parses."""
    from tailorfx.budget import Budget
    text = str(text).strip()
    if text.endswith("%"):
        share = float(text[:-1]) / 100
        if not 0 < share:
            raise ValueError(f"budget {text!r}: a positive percentage of eager's peak")
        return int(eager_total * share), f"{text} of eager's measured peak"
    return Budget.parse(text).bytes, text


# ---- 6. evaluation and plots --------------------------------------------------------------------
def held_out_loss(model: torch.nn.Module, batches: Sequence[dict]) -> float:
    """Mean token loss over `batches` (eval mode, no grad), weighted by target count."""
    from tailorfx.runtime.train import NOT_MODEL_INPUTS, count_targets
    was_training = model.training
    model.eval()
    total = count = 0.0
    try:
        with torch.no_grad():
            for b in batches:
                n = count_targets(b)
                if not n:
                    continue
                out = model(**{k: v for k, v in b.items() if k not in NOT_MODEL_INPUTS})
                total += float(out.loss) * n
                count += n
    finally:
        model.train(was_training)
    return total / count if count else float("nan")


def plot_losses(path: Path, records: List[dict], held: List[Tuple[int, float]], title: str,
                vocab: int, tokens_per_step: int) -> Path:
    """Train loss per optimizer step (and its moving average) with the held-out points, as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(10, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    steps = [r["step"] for r in records if r.get("loss") is not None]
    losses = [r["loss"] for r in records if r.get("loss") is not None]
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, lw=0.8, label="train loss (per step)")
    if len(losses) >= 5:
        k = max(2, len(losses) // 40)
        smooth, acc = [], 0.0
        for i, x in enumerate(losses):   # trailing mean of k steps
            acc += x - (losses[i - k] if i >= k else 0.0)
            smooth.append(acc / min(i + 1, k))
        ax.plot(steps, smooth, color="tab:blue", lw=1.8, label=f"train loss (mean of {k} steps)")
    if held:
        ax.plot([s for s, _ in held], [v for _, v in held], "o-", color="tab:orange", lw=1.8,
                label="held-out loss (files never trained on)")
    ax.axhline(math.log(vocab), color="gray", ls=":", lw=1, label=f"uniform over {vocab} tokens (ln V)")
    ax.set_xlabel(f"optimizer step ({tokens_per_step} token slots each)")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return Path(path)


# ---- the demo -----------------------------------------------------------------------------------
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


def _defaults(args) -> None:
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


def _fmt(n: float) -> str:
    from tailorfx.budget import format_bytes
    return format_bytes(n)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parser().parse_args(None if argv is None else [str(a) for a in argv])
    _defaults(args)
    run(args)


def run(args) -> dict:
    from tailorfx.report import plot_timeline
    from tailorfx.runtime.packing import PackedBatches
    from tailorfx.runtime.train import NOT_MODEL_INPUTS, count_targets, train

    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    S, B = args.seq, args.batch
    say(f"tailorfx demo{' (--quick)' if args.quick else ''}: a small Llama trained on the CPU "
        f"({torch.get_num_threads()} threads), output in {out}/")

    # 1. corpus
    train_texts, held_texts = build_corpus(int(args.corpus_mb * 1e6), 20_000 if args.quick else None)
    nbytes = sum(len(t.encode("utf-8")) for t in train_texts + held_texts)
    say(f"\n[1] corpus: {len(train_texts) + len(held_texts)} source files of the Python {sys.version.split()[0]} "
        f"standard library ({nbytes / 1e6:.2f} MB), one document per file; "
        f"{len(held_texts)} held out (every {HOLDOUT_EVERY}th file)")

    # 2. tokenizer
    t = time.perf_counter()
    tok, tok_path, cached = train_tokenizer(train_texts, args.vocab, out)
    vocab = tok.get_vocab_size()
    train_docs = [e.ids for e in tok.encode_batch(train_texts)]
    held_docs = [e.ids for e in tok.encode_batch(held_texts)]
    ntok = sum(map(len, train_docs))
    say(f"[2] tokenizer: byte-level BPE, {vocab} tokens, {'loaded from' if cached else 'trained and saved to'} "
        f"{tok_path.name}; {ntok:,} training tokens ({sum(len(t) for t in train_texts) / max(ntok, 1):.2f} "
        f"characters per token), {sum(map(len, held_docs)):,} held out ({time.perf_counter() - t:.1f}s)")

    # 3. packing
    t = time.perf_counter()
    data = PackedBatches(train_docs, seq_len=S, batch_size=B, shuffle=True, seed=args.seed, drop_last=True)
    held_data = PackedBatches(held_docs, seq_len=S, batch_size=B)
    held_batches = [held_data[i] for i in range(min(len(held_data), args.eval_batches))]
    st = data.stats
    say(f"[3] packing: {st}")
    say(f"    {len(data)} batches of {B} x {S} (one epoch: {len(data) * B * S:,} token slots); held-out "
        f"evaluation: {len(held_batches)} batches ({sum(count_targets(b) for b in held_batches):,} targets) "
        f"({time.perf_counter() - t:.1f}s)")
    if len(data) == 0 or not held_batches:
        raise SystemExit("tailorfx demo: error: the corpus is too small for one batch: raise --corpus-mb "
                         "or lower --seq / --batch")
    batch = {k: v for k, v in data[0].items() if k not in NOT_MODEL_INPUTS}
    example = dict(batch, num_items_in_batch=torch.tensor(count_targets(batch)))   # as train() calls it

    # 4. model
    model = build_model(vocab, S, args.size, args.seed)
    nparams = sum(p.numel() for p in model.parameters())
    sz = args.size
    say(f"[4] model: transformers LlamaForCausalLM, {nparams / 1e6:.2f}M parameters (hidden {sz.hidden}, "
        f"{sz.layers} layers, {sz.heads} heads / {sz.kv_heads} KV heads, MLP {sz.intermediate}, vocab {vocab}), "
        f"random init, fp32, AdamW")
    init_state = copy.deepcopy(model.state_dict())

    # 5. memory: eager, plan, rewritten
    say(f"\n[5] memory of one training step at batch {B} x {S} (weights + AdamW state + the measured peak of "
        f"forward, backward, clip and step)")
    eager_model = copy.deepcopy(model)
    eager = measure_step(eager_model, eager_model, batch, args.lr)
    del eager_model
    say(f"    eager: {_fmt(eager.total)} measured ({_fmt(eager.static)} weights + AdamW state, "
        f"{_fmt(eager.dynamic)} at the step's peak); {eager.seconds:.2f}s per step")
    try:
        budget, budget_label = resolve_budget(args.budget, eager.total)
    except ValueError as e:
        raise SystemExit(f"tailorfx demo: error: {e}")
    say(f"    budget: {_fmt(budget)} ({budget_label}); planning (capture, candidate plans, compile) ...")
    t = time.perf_counter()
    opt, budget, budget_label = plan(model, example, budget, budget_label, eager.total)
    plan_seconds = time.perf_counter() - t
    say(f"    planned in {plan_seconds:.1f}s\n")
    report = opt.report()
    if report.predict is not None:   # each prediction traces the step: the report asks for each twice
        report.predict = functools.lru_cache(maxsize=None)(report.predict)
    say(str(report).rstrip())
    rewritten = measure_step(opt, model, batch, args.lr)
    predict = report.predict or (lambda seq, rewritten: opt.predict_memory(seq, rewritten=rewritten))
    predicted, predicted_eager = predict(S, True), predict(S, False)
    model.load_state_dict(init_state)      # the measured steps trained it: start from the init again
    fits = rewritten.total <= budget
    say(f"\n    rewritten: {_fmt(rewritten.total)} measured ({_fmt(rewritten.dynamic)} at the step's peak), "
        f"predicted {_fmt(predicted.peak_bytes)} ({(predicted.peak_bytes - rewritten.total) / rewritten.total:+.1%}); "
        f"budget {_fmt(budget)}: {'met' if fits else 'EXCEEDED'}; {rewritten.seconds:.2f}s per step")
    say(f"    eager:     {_fmt(eager.total)} measured, predicted {_fmt(predicted_eager.peak_bytes)} "
        f"({(predicted_eager.peak_bytes - eager.total) / eager.total:+.1%}); the rewritten step holds "
        f"{rewritten.total / eager.total:.0%} of it")
    # what opt.memory_timeline(path, S, measured=...) draws, from the estimates made above
    timeline = plot_timeline(str(out / "memory_timeline.png"), predicted_eager, predicted, rewritten.dynamic)

    # 6. training
    tokens_per_step = B * S
    before = held_out_loss(model, held_batches)
    t_eval = time.perf_counter()
    held_out_loss(model, held_batches[:1])
    eval_seconds = (time.perf_counter() - t_eval) * len(held_batches)
    if args.steps is not None:
        steps = args.steps
        how = "as asked"
    else:
        usable_s = args.minutes * 60 - args.evals * eval_seconds
        steps = max(args.evals, int(usable_s / (rewritten.seconds * 1.08)))   # 8%: logging, checkpoints
        how = f"to fit {args.minutes:g} min at the timed {rewritten.seconds:.2f}s per step"
    n_chunks = max(1, min(args.evals, steps))
    ends = sorted({round(steps * (i + 1) / n_chunks) for i in range(n_chunks)})
    warmup = max(1, min(100, steps // 10))
    say(f"\n[6] training: {steps} steps ({how}) of {tokens_per_step:,} token slots, lr {args.lr:g} "
        f"(warmup {warmup}, cosine to 10%), weight decay 0.1, clip 1.0; held-out loss every ~{steps // n_chunks} "
        f"steps")
    say(f"    step {0:>5}  held-out {before:.3f}")
    log_path = out / "train.jsonl"
    held_points = [(0, before)]
    train_seconds, records = 0.0, []
    deadline = None if args.steps is not None else time.perf_counter() + args.minutes * 60 * 1.15
    stopped_early = False
    progress = sys.stderr.isatty() and not args.quick
    with tempfile.TemporaryDirectory(prefix="tailorfx-demo-") as ckpt:
        for end in ends:
            r = train(opt, data, steps=end, total_steps=steps, lr=args.lr, warmup=warmup, min_lr_ratio=0.1,
                      weight_decay=0.1, clip_norm=1.0, checkpoint_dir=ckpt, keep_last=1, resume=True,
                      log_path=log_path, progress=progress, seed=args.seed)
            train_seconds += r.elapsed
            records += r.records
            held = held_out_loss(model, held_batches)
            held_points.append((end, held))
            recent = [x for x in r.losses[-10:]]
            tps = sum(x["tokens"] for x in r.records) / r.elapsed if r.elapsed else 0.0
            say(f"    step {end:>5}  held-out {held:.3f}   train {sum(recent) / len(recent):.3f} (mean of last "
                f"{len(recent)})   {tps:,.0f} tokens/s   {time.perf_counter() - t_start:.0f}s elapsed")
            if deadline is not None and end != ends[-1] and time.perf_counter() > deadline:
                stopped_early = True
                say(f"    stopping at step {end}: past the time budget (the machine is slower than timed)")
                break
    after = held_points[-1][1]

    # results
    trained = [x for x in records if x.get("loss") is not None]
    tokens = sum(x["tokens"] for x in records)
    real = sum(x["targets"] or 0 for x in records)
    tok_s = tokens / train_seconds if train_seconds else 0.0
    last10 = [x["loss"] for x in trained[-10:]]
    title = (f"Llama {nparams / 1e6:.1f}M params on the Python stdlib, {B}x{S} tokens/step, budget "
             f"{_fmt(budget)} (eager {_fmt(eager.total)}, measured {_fmt(rewritten.total)})")
    loss_png = plot_losses(out / "loss.png", trained, held_points, title, vocab, tokens_per_step)
    summary = {
        "corpus": {"files": len(train_texts) + len(held_texts), "held_out_files": len(held_texts), "bytes": nbytes,
                   "train_tokens": ntok, "python": sys.version.split()[0]},
        "tokenizer": {"vocab": vocab, "path": str(tok_path)},
        "packing": {"rows": st.rows, "seq_len": S, "packed_fraction": st.packed_fraction,
                    "padded_fraction": st.padded_fraction},
        "model": {"params": nparams, "hidden": sz.hidden, "layers": sz.layers, "heads": sz.heads,
                  "kv_heads": sz.kv_heads, "intermediate": sz.intermediate},
        "batch": B, "seq": S,
        "memory": {"budget": budget, "budget_label": budget_label, "eager_measured": eager.total,
                   "eager_predicted": predicted_eager.peak_bytes, "measured": rewritten.total,
                   "predicted": predicted.peak_bytes, "fits": fits, "plan": [str(p) for p in opt.plan]},
        "timing": {"eager_step_s": eager.seconds, "rewritten_step_s": rewritten.seconds, "plan_s": plan_seconds,
                   "train_s": train_seconds, "tokens_per_s": tok_s, "total_s": time.perf_counter() - t_start},
        "train": {"steps": len(records), "planned_steps": steps, "stopped_early": stopped_early,
                  "first_loss": trained[0]["loss"] if trained else None,
                  "last_loss": trained[-1]["loss"] if trained else None,
                  "last10_loss": sum(last10) / len(last10) if last10 else None, "tokens": tokens},
        "held_out": [{"step": s, "loss": v} for s, v in held_points],
        "files": {"log": str(log_path), "loss_png": str(loss_png), "timeline_png": str(timeline)},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    w = 30
    say("\n" + "=" * 78)
    say(f"{'':<{w}}{'eager':>16}{'tailorfx':>16}")
    say(f"{'peak of one step, measured':<{w}}{_fmt(eager.total):>16}{_fmt(rewritten.total):>16}   "
        f"({rewritten.total / eager.total:.0%} of eager)")
    say(f"{'peak of one step, predicted':<{w}}{_fmt(predicted_eager.peak_bytes):>16}"
        f"{_fmt(predicted.peak_bytes):>16}")
    say(f"{'budget':<{w}}{'':>16}{_fmt(budget):>16}   ({'met' if fits else 'EXCEEDED'})")
    say(f"{'seconds per step (timed)':<{w}}{eager.seconds:>16.2f}{rewritten.seconds:>16.2f}")
    say(f"{'tokens/s (timed)':<{w}}{tokens_per_step / eager.seconds:>16,.0f}"
        f"{tokens_per_step / rewritten.seconds:>16,.0f}\n")
    say(f"training: {len(records)} steps, {tokens:,} token slots ({real / max(tokens, 1):.0%} real targets) in "
        f"{train_seconds:.0f}s = {tok_s:,.0f} tokens/s")
    if trained:
        say(f"train loss: first step {trained[0]['loss']:.3f}, last step {trained[-1]['loss']:.3f} "
            f"(mean of last {len(last10)}: {sum(last10) / len(last10):.3f})")
    say(f"held-out loss: {before:.3f} before -> {after:.3f} after training (perplexity {math.exp(before):,.0f} -> "
        f"{math.exp(after):,.1f}); uniform guess: {math.log(vocab):.3f}")
    say(f"files: {loss_png}, {timeline}, {log_path}, {out / 'summary.json'}")
    say(f"total {time.perf_counter() - t_start:.0f}s")
    return summary


if __name__ == "__main__":
    main()
