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

This file runs the steps in order and reports each; `demo_args.py` holds the options,
`demo_data.py` the corpus and tokenizer, `demo_measure.py` the step's measurement, the budget, the
held-out loss and the loss plot.
"""
from __future__ import annotations

import copy
import functools
import json
import math
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import torch

from tailorfx.demo_args import Size, fill_defaults, parser
from tailorfx.demo_data import HOLDOUT_EVERY, build_corpus, train_tokenizer
from tailorfx.demo_measure import StepMemory, held_out_loss, measure_step, plot_losses, resolve_budget


def say(*parts) -> None:
    print(*parts, flush=True)


def _fmt(n: float) -> str:
    from tailorfx.budget import format_bytes
    return format_bytes(n)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parser().parse_args(None if argv is None else [str(a) for a in argv])
    fill_defaults(args)
    run(args)


def run(args) -> dict:
    """The demo's steps in order, each reported as it runs; returns what summary.json holds."""
    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    say(f"tailorfx demo{' (--quick)' if args.quick else ''}: a small Llama trained on the CPU "
        f"({torch.get_num_threads()} threads), output in {out}/")
    corpus = _corpus(args, out)
    batches = _pack(corpus, args)
    model, num_params = _model(corpus.vocab, args)
    memory = _memory(model, batches, args, out)
    training = _train(memory.opt, model, batches, memory.rewritten.seconds, args, out, t_start)
    title = (f"Llama {num_params / 1e6:.1f}M params on the Python stdlib, {args.batch}x{args.seq} tokens/step, "
             f"budget {_fmt(memory.budget)} (eager {_fmt(memory.eager.total)}, measured "
             f"{_fmt(memory.rewritten.total)})")
    loss_png = plot_losses(out / "loss.png", training.trained, training.held_points, title, corpus.vocab,
                           args.batch * args.seq)
    summary = _summary(args, corpus, batches, num_params, memory, training, loss_png, t_start)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _print_results(args, corpus.vocab, memory, training, loss_png, out, t_start)
    return summary


@dataclass
class Corpus:
    """Steps 1 and 2: the standard library's files, tokenized."""
    num_files: int
    num_held_files: int
    num_bytes: int
    vocab: int
    tokenizer_path: Path
    train_docs: List[List[int]]
    held_docs: List[List[int]]
    num_train_tokens: int


def _corpus(args, out: Path) -> Corpus:
    """[1] the corpus, [2] its tokenizer (trained, or loaded from `out`) and the tokenized files."""
    train_texts, held_texts = build_corpus(int(args.corpus_mb * 1e6), 20_000 if args.quick else None)
    nbytes = sum(len(t.encode("utf-8")) for t in train_texts + held_texts)
    say(f"\n[1] corpus: {len(train_texts) + len(held_texts)} source files of the Python {sys.version.split()[0]} "
        f"standard library ({nbytes / 1e6:.2f} MB), one document per file; "
        f"{len(held_texts)} held out (every {HOLDOUT_EVERY}th file)")
    t = time.perf_counter()
    tok, tok_path, cached = train_tokenizer(train_texts, args.vocab, out)
    vocab = tok.get_vocab_size()
    train_docs = [e.ids for e in tok.encode_batch(train_texts)]
    held_docs = [e.ids for e in tok.encode_batch(held_texts)]
    ntok = sum(map(len, train_docs))
    say(f"[2] tokenizer: byte-level BPE, {vocab} tokens, {'loaded from' if cached else 'trained and saved to'} "
        f"{tok_path.name}; {ntok:,} training tokens ({sum(len(t) for t in train_texts) / max(ntok, 1):.2f} "
        f"characters per token), {sum(map(len, held_docs)):,} held out ({time.perf_counter() - t:.1f}s)")
    return Corpus(len(train_texts) + len(held_texts), len(held_texts), nbytes, vocab, tok_path, train_docs,
                  held_docs, ntok)


@dataclass
class Batches:
    """Step 3: the packed training batches, the held-out ones, and the batch the memory is measured at."""
    train: Any                  # PackedBatches
    held: List[dict]
    batch: dict                 # the first training batch, model inputs only
    example: dict               # `batch` as train() calls the model: with num_items_in_batch


def _pack(corpus: Corpus, args) -> Batches:
    """[3] the documents packed into rows of --seq tokens, --batch rows a batch."""
    from tailorfx.runtime.packing import PackedBatches
    from tailorfx.runtime.train import NOT_MODEL_INPUTS, count_targets
    S, B = args.seq, args.batch
    t = time.perf_counter()
    data = PackedBatches(corpus.train_docs, seq_len=S, batch_size=B, shuffle=True, seed=args.seed, drop_last=True)
    held_data = PackedBatches(corpus.held_docs, seq_len=S, batch_size=B)
    held_batches = [held_data[i] for i in range(min(len(held_data), args.eval_batches))]
    say(f"[3] packing: {data.stats}")
    say(f"    {len(data)} batches of {B} x {S} (one epoch: {len(data) * B * S:,} token slots); held-out "
        f"evaluation: {len(held_batches)} batches ({sum(count_targets(b) for b in held_batches):,} targets) "
        f"({time.perf_counter() - t:.1f}s)")
    if len(data) == 0 or not held_batches:
        raise SystemExit("tailorfx demo: error: the corpus is too small for one batch: raise --corpus-mb "
                         "or lower --seq / --batch")
    batch = {k: v for k, v in data[0].items() if k not in NOT_MODEL_INPUTS}
    example = dict(batch, num_items_in_batch=torch.tensor(count_targets(batch)))   # as train() calls it
    return Batches(data, held_batches, batch, example)


def build_model(vocab: int, seq: int, size: Size, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
                      num_hidden_layers=size.layers, num_attention_heads=size.heads,
                      num_key_value_heads=size.kv_heads, max_position_embeddings=max(seq, 128),
                      tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM(cfg).float().train()


def _model(vocab: int, args) -> Tuple[torch.nn.Module, int]:
    """[4] the Llama at its random init; returns (it, its number of parameters)."""
    model = build_model(vocab, args.seq, args.size, args.seed)
    nparams = sum(p.numel() for p in model.parameters())
    sz = args.size
    say(f"[4] model: transformers LlamaForCausalLM, {nparams / 1e6:.2f}M parameters (hidden {sz.hidden}, "
        f"{sz.layers} layers, {sz.heads} heads / {sz.kv_heads} KV heads, MLP {sz.intermediate}, vocab {vocab}), "
        f"random init, fp32, AdamW")
    return model, nparams


@dataclass
class Memory:
    """Step 5: one training step's memory, eager and rewritten, measured and predicted, and the
    plan that meets the budget."""
    opt: Any                    # the tailorfx OptimizedModule that trains
    eager: StepMemory
    rewritten: StepMemory
    budget: int
    budget_label: str
    predicted: Any              # the memory model's prediction of the rewritten step (.peak_bytes) ...
    predicted_eager: Any        # ... and of eager's
    plan_seconds: float
    timeline: str               # the PNG of the predicted live memory over one step

    @property
    def fits(self) -> bool:
        return self.rewritten.total <= self.budget


def _memory(model: torch.nn.Module, batches: Batches, args, out: Path) -> Memory:
    """[5] eager's step measured, a plan under the budget, the rewritten step measured and compared
    with the budget and the prediction; the model is back at its init afterwards."""
    from tailorfx.report import plot_timeline
    S, B = args.seq, args.batch
    init_state = copy.deepcopy(model.state_dict())
    say(f"\n[5] memory of one training step at batch {B} x {S} (weights + AdamW state + the measured peak of "
        f"forward, backward, clip and step)")
    eager = _measure_eager(model, batches.batch, args.lr)
    try:
        budget, budget_label = resolve_budget(args.budget, eager.total)
    except ValueError as e:
        raise SystemExit(f"tailorfx demo: error: {e}")
    say(f"    budget: {_fmt(budget)} ({budget_label}); planning (capture, candidate plans, compile) ...")
    t = time.perf_counter()
    opt, budget, budget_label = plan(model, batches.example, budget, budget_label, eager.total)
    plan_seconds = time.perf_counter() - t
    say(f"    planned in {plan_seconds:.1f}s\n")
    # train() keeps the loss only (the logits die with the forward); eager runs the model untraced
    report = opt.report(outputs_held=False, as_eager=True)
    # each prediction traces the step: the report asks for each twice, and the lines below once more
    report.predict = functools.lru_cache(maxsize=None)(report.predict)
    say(str(report).rstrip())
    rewritten = measure_step(opt, model, batches.batch, args.lr)
    predicted, predicted_eager = report.predict(S, True), report.predict(S, False)
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
    return Memory(opt, eager, rewritten, budget, budget_label, predicted, predicted_eager, plan_seconds, timeline)


def _measure_eager(model: torch.nn.Module, batch: dict, lr: float) -> StepMemory:
    """Eager's training step measured on a copy of `model`, and reported."""
    eager_model = copy.deepcopy(model)
    eager = measure_step(eager_model, eager_model, batch, lr)
    del eager_model
    say(f"    eager: {_fmt(eager.total)} measured ({_fmt(eager.static)} weights + AdamW state, "
        f"{_fmt(eager.dynamic)} at the step's peak); {eager.seconds:.2f}s per step")
    return eager


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


@dataclass
class Training:
    """Step 6: what the chunks of `train()` did."""
    steps: int                                  # planned
    log_path: Path
    held_points: List[Tuple[int, float]]        # (step, held-out loss), the first before training
    records: List[dict] = field(default_factory=list)
    seconds: float = 0.0
    stopped_early: bool = False

    @property
    def trained(self) -> List[dict]:
        return [x for x in self.records if x.get("loss") is not None]

    @property
    def tokens(self) -> int:
        return sum(x["tokens"] for x in self.records)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def last10(self) -> List[float]:
        return [x["loss"] for x in self.trained[-10:]]


def _train(opt, model: torch.nn.Module, batches: Batches, seconds_per_step: float, args, out: Path,
           t_start: float) -> Training:
    """[6] `train()` in chunks resumed from checkpoints, the held-out loss measured after each; stops
    early when past the time budget (the machine slower than timed)."""
    from tailorfx.runtime.train import train
    before = held_out_loss(model, batches.held)
    steps, how = _num_steps(args, model, batches.held, seconds_per_step)
    n_chunks = max(1, min(args.evals, steps))
    ends = sorted({round(steps * (i + 1) / n_chunks) for i in range(n_chunks)})
    warmup = max(1, min(100, steps // 10))
    say(f"\n[6] training: {steps} steps ({how}) of {args.batch * args.seq:,} token slots, lr {args.lr:g} "
        f"(warmup {warmup}, cosine to 10%), weight decay 0.1, clip 1.0; held-out loss every ~{steps // n_chunks} "
        f"steps")
    say(f"    step {0:>5}  held-out {before:.3f}")
    done = Training(steps, out / "train.jsonl", [(0, before)])
    deadline = None if args.steps is not None else time.perf_counter() + args.minutes * 60 * 1.15
    progress = sys.stderr.isatty() and not args.quick
    with tempfile.TemporaryDirectory(prefix="tailorfx-demo-") as ckpt:
        for end in ends:
            r = train(opt, batches.train, steps=end, total_steps=steps, lr=args.lr, warmup=warmup, min_lr_ratio=0.1,
                      weight_decay=0.1, clip_norm=1.0, checkpoint_dir=ckpt, keep_last=1, resume=True,
                      log_path=done.log_path, progress=progress, seed=args.seed)
            done.seconds += r.elapsed
            done.records += r.records
            held = held_out_loss(model, batches.held)
            done.held_points.append((end, held))
            recent = [x for x in r.losses[-10:]]
            tps = sum(x["tokens"] for x in r.records) / r.elapsed if r.elapsed else 0.0
            say(f"    step {end:>5}  held-out {held:.3f}   train {sum(recent) / len(recent):.3f} (mean of last "
                f"{len(recent)})   {tps:,.0f} tokens/s   {time.perf_counter() - t_start:.0f}s elapsed")
            if deadline is not None and end != ends[-1] and time.perf_counter() > deadline:
                done.stopped_early = True
                say(f"    stopping at step {end}: past the time budget (the machine is slower than timed)")
                break
    return done


def _num_steps(args, model: torch.nn.Module, held: List[dict], seconds_per_step: float) -> Tuple[int, str]:
    """(optimizer steps, how they were chosen): --steps, else as many as fit --minutes with the
    held-out evaluations (one batch timed here)."""
    t_eval = time.perf_counter()
    held_out_loss(model, held[:1])
    eval_seconds = (time.perf_counter() - t_eval) * len(held)
    if args.steps is not None:
        return args.steps, "as asked"
    usable_s = args.minutes * 60 - args.evals * eval_seconds
    steps = max(args.evals, int(usable_s / (seconds_per_step * 1.08)))   # 8%: logging, checkpoints
    return steps, f"to fit {args.minutes:g} min at the timed {seconds_per_step:.2f}s per step"


def _summary(args, corpus: Corpus, batches: Batches, num_params: int, memory: Memory, training: Training,
             loss_png: Path, t_start: float) -> dict:
    """What summary.json holds."""
    st, sz, trained, last10 = batches.train.stats, args.size, training.trained, training.last10
    return {
        "corpus": {"files": corpus.num_files, "held_out_files": corpus.num_held_files, "bytes": corpus.num_bytes,
                   "train_tokens": corpus.num_train_tokens, "python": sys.version.split()[0]},
        "tokenizer": {"vocab": corpus.vocab, "path": str(corpus.tokenizer_path)},
        "packing": {"rows": st.rows, "seq_len": args.seq, "packed_fraction": st.packed_fraction,
                    "padded_fraction": st.padded_fraction},
        "model": {"params": num_params, "hidden": sz.hidden, "layers": sz.layers, "heads": sz.heads,
                  "kv_heads": sz.kv_heads, "intermediate": sz.intermediate},
        "batch": args.batch, "seq": args.seq,
        "memory": {"budget": memory.budget, "budget_label": memory.budget_label,
                   "eager_measured": memory.eager.total, "eager_predicted": memory.predicted_eager.peak_bytes,
                   "measured": memory.rewritten.total, "predicted": memory.predicted.peak_bytes,
                   "fits": memory.fits, "plan": [str(p) for p in memory.opt.plan]},
        "timing": {"eager_step_s": memory.eager.seconds, "rewritten_step_s": memory.rewritten.seconds,
                   "plan_s": memory.plan_seconds, "train_s": training.seconds, "tokens_per_s": training.tokens_per_s,
                   "total_s": time.perf_counter() - t_start},
        "train": {"steps": len(training.records), "planned_steps": training.steps,
                  "stopped_early": training.stopped_early,
                  "first_loss": trained[0]["loss"] if trained else None,
                  "last_loss": trained[-1]["loss"] if trained else None,
                  "last10_loss": sum(last10) / len(last10) if last10 else None, "tokens": training.tokens},
        "held_out": [{"step": s, "loss": v} for s, v in training.held_points],
        "files": {"log": str(training.log_path), "loss_png": str(loss_png), "timeline_png": str(memory.timeline)},
    }


def _print_results(args, vocab: int, memory: Memory, training: Training, loss_png: Path, out: Path,
                   t_start: float) -> None:
    """The closing table, eager against tailorfx, and what training did."""
    eager, rewritten, tokens_per_step = memory.eager, memory.rewritten, args.batch * args.seq
    records, trained, last10, tokens = training.records, training.trained, training.last10, training.tokens
    before, after = training.held_points[0][1], training.held_points[-1][1]
    real = sum(x["targets"] or 0 for x in records)
    w = 30
    say("\n" + "=" * 78)
    say(f"{'':<{w}}{'eager':>16}{'tailorfx':>16}")
    say(f"{'peak of one step, measured':<{w}}{_fmt(eager.total):>16}{_fmt(rewritten.total):>16}   "
        f"({rewritten.total / eager.total:.0%} of eager)")
    say(f"{'peak of one step, predicted':<{w}}{_fmt(memory.predicted_eager.peak_bytes):>16}"
        f"{_fmt(memory.predicted.peak_bytes):>16}")
    say(f"{'budget':<{w}}{'':>16}{_fmt(memory.budget):>16}   ({'met' if memory.fits else 'EXCEEDED'})")
    say(f"{'seconds per step (timed)':<{w}}{eager.seconds:>16.2f}{rewritten.seconds:>16.2f}")
    say(f"{'tokens/s (timed)':<{w}}{tokens_per_step / eager.seconds:>16,.0f}"
        f"{tokens_per_step / rewritten.seconds:>16,.0f}\n")
    say(f"training: {len(records)} steps, {tokens:,} token slots ({real / max(tokens, 1):.0%} real targets) in "
        f"{training.seconds:.0f}s = {training.tokens_per_s:,.0f} tokens/s")
    if trained:
        say(f"train loss: first step {trained[0]['loss']:.3f}, last step {trained[-1]['loss']:.3f} "
            f"(mean of last {len(last10)}: {sum(last10) / len(last10):.3f})")
    say(f"held-out loss: {before:.3f} before -> {after:.3f} after training (perplexity {math.exp(before):,.0f} -> "
        f"{math.exp(after):,.1f}); uniform guess: {math.log(vocab):.3f}")
    say(f"files: {loss_png}, {memory.timeline}, {training.log_path}, {out / 'summary.json'}")
    say(f"total {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    main()
