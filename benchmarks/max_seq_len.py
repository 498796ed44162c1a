"""Longest sequence whose training step (forward, backward, the AdamW step, its state already held) fits a
memory budget, found on real runs, on unmodified Hugging Face causal LMs, against the peers a user
would reach for.

Set-up: HF models built from configs with random weights (tests/models.py `hf_family`; vocab 32000,
hidden 256, intermediate 688, 2 layers, 4 attention heads / 1 KV head, max_position_embeddings
2**18), fp32, batch 1, inputs `common.lm_batch(S, vocab)` (input_ids and labels), every call with
`use_cache=False` (transformers builds a DynamicCache in train mode otherwise, as config.use_cache
is True). Optimizer: torch.optim.AdamW (lr 1e-3; on CPU torch picks its single-tensor loop).

Budget: 4 x parameter bytes (weights, gradients, both AdamW moments) + --headroom (400 MiB).
"Fits" means model bytes (parameters + buffers) + the optimizer's state + the measured peak of one
step <= budget, in the steady state: the AdamW state already exists (an unmeasured first step at
STATE_LEN tokens made it), every gradient is None, and the step `loss = model(**batch).loss;
loss.backward(); optimizer.step()` is measured. (Measuring the first step alone would let
activations use the 2 x parameter bytes the moments take from the second step on: a length that
fits only there runs out of memory at step 2.) The output object is dropped once its
loss is taken (as transformers.Trainer does). The peak is tailorfx.measure_peak's: the profiler's
allocator events, the high-water mark of bytes allocated during the step above what was live at its
start. A variant that compiles at each length (Inductor, tailorfx) runs one forward+backward at
that length first (gradients then freed), so compilation is not measured.

Each variant's length is searched on real steps (`longest`): from a start length (--start per
variant, tailorfx's from its memory model's prediction), steps of growing size up until a step
does not fit, then bisection to --granularity tokens. Every variant of a family runs in this one
process on copies of the same weights, under the same budget.

Variants:
- `eager`: the model as HF builds it;
- `hf-ckpt`: HF activation checkpointing of every decoder layer
  (`activation_checkpointing_enable()`, the new name of `gradient_checkpointing_enable()`);
- `inductor`: torch.compile with Inductor, static shapes,
  torch._functorch.config.activation_memory_budget = --amb (default 0.0: the min-cut partitioner
  told to save as little as it can);
- `alst`, `alst-tuned`: the ALST recipe (benchmarks/alst.py: HF checkpointing + DeepSpeed's
  TiledMLP with ceil(S / hidden) shards + TiledFusedLogitsLoss); `alst` slices the logits as
  ArcticTraining does (1 GiB of fp32 logits per shard), `alst-tuned` in --alst-slice (32 MiB)
  slices, a setting for this budget's headroom. They need DeepSpeed (`make bench-deps`); without it
  these rows say so and the others run;
- `tailorfx`: tailorfx.optimize(model, budget=..., optimizer="adamw") re-planned at each length
  (torch._dynamo.reset() first), trained with tailorfx.SetupOptimizer when the plan puts the
  optimizer step into backward; a BudgetError counts as not fitting. Its row also gives
  tailorfx.max_seq_len(model, budget, optimizer="adamw"), the memory model's prediction, and
  tailorfx.sequence_bound(model, budget, optimizer="adamw"): the longest any plan of tailorfx's
  rewrites could fit (rewrite/bound.py), with the share of it the measured plan reached.

Each variant is first checked against eager at --check-len tokens (fp32; the loss and every
parameter's gradient within rtol 1e-4, atol 1e-6) and for whether its feature fired in that step
and in the longest step that fit (checkpoint recompute: each layer's attention runs twice; TiledMLP
and TiledFusedLogitsLoss applications and shard counts; Inductor: compiled graphs that ran;
tailorfx: the chosen plan). --time-at S then times a full step of `alst-tuned` and `tailorfx` at S
in this process: both warmed up, then --time-reps rounds of one step each, alternated (A B, B A,
...); each one's median and the median of the rounds' ratios.

--device cuda runs the same on a GPU (the model and batches on it; a step's peak is the caching
allocator's max_memory_allocated above what was allocated before it; timed steps synchronize).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import tailorfx  # noqa: E402
from tailorfx.budget import Budget, format_bytes  # noqa: E402
from common import cuda_peak, lm_batch, print_table, write_json  # noqa: E402

RTOL, ATOL = 1e-4, 1e-6
STATE_LEN = 512   # tokens of the unmeasured step that creates the optimizer's state
DEVICE = torch.device("cpu")   # --device
DEFAULT_STARTS = {"eager": 1536, "hf-ckpt": 1536, "inductor": 2048, "alst": 1024, "alst-tuned": 28672}
LABELS = {"eager": "eager", "hf-ckpt": "HF activation checkpointing",
          "inductor": "torch.compile Inductor, activation_memory_budget={amb}",
          "alst": "ALST recipe (logits in 1 GiB slices, as ArcticTraining)",
          "alst-tuned": "ALST recipe (logits in {slice} slices)", "tailorfx": "tailorfx planner (budget)"}


def build(family: str, vocab: int, hidden: int, layers: int) -> nn.Module:
    from models import hf_family
    size = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.6875),
                num_attention_heads=max(1, hidden // 64), num_key_value_heads=1,
                max_position_embeddings=1 << 18, head_dim=64)   # (tests' tiny Gemma configs set 16)
    m = hf_family(family, num_layers=layers, **size)
    m.config.use_cache = False   # as every call passes it (and max_seq_len predicts the step as configured)
    return m.to(DEVICE)


def batch(S: int, vocab: int) -> dict:
    return {k: v.to(DEVICE) for k, v in lm_batch(S, vocab).items()}


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def step_peak(step: Callable[[], Any]) -> int:
    """Peak bytes allocated during step() above what was live before it: tailorfx.measure_peak on the
    CPU, the caching allocator's high-water mark on CUDA."""
    return cuda_peak(step) if DEVICE.type == "cuda" else tailorfx.measure_peak(step)


def counting_inductor(counts: Counter) -> Callable:
    """Inductor as a Dynamo backend that counts the graphs it compiles and the calls of their code."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        counts["graphs_compiled"] += 1
        compiled = compile_fx(gm, example_inputs)

        def run(*args):
            counts["compiled_calls"] += 1
            return compiled(*args)
        return run
    return backend


class Compiled(nn.Module):
    """torch.compile(model) with static shapes, compiled under a config patch; one compile per length."""
    def __init__(self, model, patch: dict, backend: Any = "inductor"):
        super().__init__()
        self.model, self.patch = model, patch
        self.__dict__["compiled"] = torch.compile(model, backend=backend, dynamic=False)

    def forward(self, **kw):
        with torch._inductor.config.patch({k: v for k, v in self.patch.items() if "." in k}), \
                torch._functorch.config.patch({k: v for k, v in self.patch.items() if "." not in k}):
            return self.compiled(**kw)


@dataclass
class Runner:
    """One variant at one length: what trains, how its loss is computed and what checks it fired."""
    module: nn.Module                            # its parameters are the ones trained
    loss: Callable[[dict], torch.Tensor]         # batch -> loss (the output object dropped)
    optimizer: Callable[[], Any]                 # a fresh optimizer (state created by its first step)
    warm_up: bool = False                        # compiles at each new length: one step before measuring
    counts: Counter = field(default_factory=Counter)
    fired: Callable[[int], dict] = lambda S: {"ok": None}   # after a step at length S


def adamw(module: nn.Module):
    return lambda: torch.optim.AdamW(module.parameters())


def attention_hooks(model: nn.Module, counts: Counter) -> None:
    from alst import count_attention_calls
    count_attention_calls(model, counts)


def recompute_fired(counts: Counter, num_layers: int) -> dict:
    calls = counts["attention_calls"]
    return {"ok": calls == 2 * num_layers, "attention_calls": calls, "expected": 2 * num_layers}


def eager_runner(base: nn.Module) -> Runner:
    m = copy.deepcopy(base)
    return Runner(m, lambda b: m(**b, use_cache=False).loss, adamw(m))


def ckpt_runner(base: nn.Module) -> Runner:
    m = copy.deepcopy(base)
    m.activation_checkpointing_enable()
    r = Runner(m, lambda b: m(**b, use_cache=False).loss, adamw(m))
    attention_hooks(m, r.counts)
    L = len(m.model.layers)
    r.fired = lambda S: recompute_fired(r.counts, L)
    return r


def inductor_runner(base: nn.Module, amb: float) -> Runner:
    counts = Counter()
    c = Compiled(copy.deepcopy(base), {"activation_memory_budget": amb}, backend=counting_inductor(counts))
    r = Runner(c, lambda b: c(**b, use_cache=False).loss, adamw(c), warm_up=True, counts=counts)
    r.fired = lambda S: {"ok": counts["compiled_calls"] > 0, "graphs_compiled": counts["graphs_compiled"],
                         "compiled_calls": counts["compiled_calls"]}
    return r


def alst_runner(base: nn.Module, slice_bytes: int) -> Runner:
    from alst import ALSTCausalLM, logits_shards, mlp_shards
    m = ALSTCausalLM(copy.deepcopy(base), logits_slice_bytes=slice_bytes)
    cfg, L = m.model.config, len(m.model.model.layers)
    r = Runner(m, lambda b: m(**b).loss, adamw(m), counts=m.counts)

    def fired(S):
        c, mlp, lg = m.counts, mlp_shards(S, cfg.hidden_size), logits_shards(1, S, cfg.vocab_size, slice_bytes)
        out = {**recompute_fired(c, L), "tiled_mlp_applies": c["tiled_mlp_applies"],
               "tiled_mlp_shards": mlp, "tiled_mlp_shard_calls": c["tiled_mlp_shard_calls"],
               "tiled_loss_applies": c["tiled_loss_applies"], "tiled_loss_shards": lg,
               "tiled_loss_shard_calls": c["tiled_loss_shard_calls"]}
        # per step: each layer's MLP applied in forward and in the recompute; each shard run in the
        # no-grad forward, the recompute's forward and the backward (3 per shard and layer)
        out["ok"] = (out["ok"] and c["tiled_mlp_applies"] == 2 * L and c["tiled_mlp_shard_calls"] == 3 * L * mlp
                     and c["tiled_loss_applies"] == 1 and c["tiled_loss_shard_calls"] == lg)
        return out
    r.fired = fired
    return r


def tailorfx_runner(base: nn.Module, budget: int, S: int, vocab: int) -> Optional[Runner]:
    torch._dynamo.reset()   # the benchmark re-plans many lengths in one process
    try:
        opt = tailorfx.optimize(copy.deepcopy(base), budget=budget, optimizer="adamw",
                                example_inputs={**batch(S, vocab), "use_cache": False})
    except tailorfx.BudgetError as e:
        print(f"    S={S}: no plan fits ({str(e).splitlines()[0][:100]})", flush=True)
        return None
    if opt.setup.optimizer_in_backward:
        make_opt = lambda: tailorfx.SetupOptimizer(opt.parameters(), opt.setup)   # noqa: E731
    else:
        make_opt = adamw(opt)
    r = Runner(opt, lambda b: opt(**b, use_cache=False).loss, make_opt, warm_up=True)

    def fired(S):
        plans = opt.plan
        chosen = [p.chosen.label if p.chosen is not None else str(p.passes) for p in plans]
        eager_fallback = opt.__dict__.get("_eager_reason")
        return {"ok": bool(plans) and not eager_fallback, "plan": chosen,
                "passes": sorted({x for p in plans for x in p.passes}),
                "optimizer_in_backward": opt.setup.optimizer_in_backward, "eager_fallback": eager_fallback}
    r.fired = fired
    return r


def variants(base: nn.Module, a, budget: int) -> dict:
    """key -> factory(S) returning the Runner at length S (None: no plan fits); one model per
    variant, built on first use, except tailorfx's (re-planned per length)."""
    def once(make):
        made = []
        return lambda S: made[0] if made else (made.append(make()) or made[0])
    return {
        "eager": once(lambda: eager_runner(base)),
        "hf-ckpt": once(lambda: ckpt_runner(base)),
        "inductor": once(lambda: inductor_runner(base, a.amb)),
        "alst": once(lambda: alst_runner(base, 1 << 30)),
        "alst-tuned": once(lambda: alst_runner(base, a.alst_slice)),
        "tailorfx": lambda S: tailorfx_runner(base, budget, S, a.vocab),
    }


def close(optimizer) -> None:
    if isinstance(optimizer, tailorfx.SetupOptimizer):
        optimizer.close()


def state_bytes(optimizer) -> int:
    """Bytes of an optimizer's state (AdamW's moments and step counts; SetupOptimizer's per-parameter
    optimizers and master weights)."""
    opts = list(optimizer.optimizers.values()) if isinstance(optimizer, tailorfx.SetupOptimizer) else [optimizer]
    tensors = [t for o in opts for st in o.state.values() for t in st.values() if torch.is_tensor(t)]
    if isinstance(optimizer, tailorfx.SetupOptimizer):
        tensors += list(optimizer.master.values())
    return sum(t.numel() * t.element_size() for t in tensors)


def steady_step(runner: Runner, inputs: dict, vocab: int) -> tuple[int, int, float]:
    """(optimizer state bytes, peak bytes above what was live before, seconds) of a training step in
    the steady state: the optimizer's state already exists (a first step at STATE_LEN tokens made
    it, unmeasured), gradients are None, then forward, backward and optimizer.step() are measured.
    The first step alone would let activations use the memory the AdamW moments take from the
    second step on, so a length that fits only there fails at step 2."""
    params = list(runner.module.parameters())
    if runner.warm_up:
        runner.loss(inputs).backward()
    for p in params:
        p.grad = None
    optimizer = runner.optimizer()
    try:
        runner.loss(batch(STATE_LEN, vocab)).backward()
        optimizer.step()
        for p in params:
            p.grad = None
        state = state_bytes(optimizer)
        runner.counts.clear()

        def step():
            loss = runner.loss(inputs)
            loss.backward()
            optimizer.step()
        t0 = time.perf_counter()
        peak = step_peak(step)
        return state, peak, time.perf_counter() - t0
    finally:
        close(optimizer)
        for p in params:
            p.grad = None


def model_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def fits(make, S: int, budget: int, vocab: int, static: int, log: Callable, record: list) -> bool:
    runner = make(S)
    if runner is None:
        record.append({"S": S, "fits": False, "why": "no plan fits"})
        return False
    try:
        state, peak, secs = steady_step(runner, batch(S, vocab), vocab)
    except RuntimeError as e:   # an allocation failure counts as not fitting
        log(f"    S={S}: failed ({str(e).splitlines()[0][:80]})")
        record.append({"S": S, "fits": False, "why": str(e).splitlines()[0][:200]})
        return False
    total, fired = static + state + peak, runner.fired(S)
    ok = total <= budget
    log(f"    S={S}: {format_bytes(total)} ({format_bytes(peak)} above the weights and optimizer state; {secs:.1f}s) "
        f"{'fits' if ok else 'over'}; fired: {fired}")
    record.append({"S": S, "fits": ok, "total_bytes": total, "optimizer_state_bytes": state,
                   "step_peak_bytes": peak, "seconds": secs,
                   "fired": fired})
    return ok


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


def check_exact(base: nn.Module, make, S: int, vocab: int) -> dict:
    """The variant's loss and every parameter gradient against eager's at length S, fp32, and what
    fired in that step. Runs before the variant's first measured step, so both hold base's weights."""
    inputs = batch(S, vocab)
    ref = copy.deepcopy(base)
    ref_loss = ref(**inputs, use_cache=False).loss
    ref_loss.backward()
    runner = make(S)
    if runner is None:
        return {"S": S, "ok": None, "why": "no plan fits"}
    params = list(runner.module.parameters())
    for p in params:
        p.grad = None
    runner.counts.clear()
    loss = runner.loss(inputs)
    loss.backward()
    fired = runner.fired(S)
    names = [n for n, _ in ref.named_parameters()]
    ref_params = list(ref.parameters())
    if [p.shape for p in ref_params] != [p.shape for p in params]:
        return {"S": S, "ok": False, "why": "parameters differ from eager's", "fired": fired}
    worst, worst_name, max_abs = 0.0, None, 0.0
    for n, p, q in zip(names, ref_params, params):
        if q.grad is None:
            return {"S": S, "ok": False, "why": f"no gradient for {n}", "fired": fired}
        err = (q.grad - p.grad).abs()
        ratio = (err / (ATOL + RTOL * p.grad.abs())).max().item()
        max_abs = max(max_abs, err.max().item())
        if ratio > worst:
            worst, worst_name = ratio, n
    for p in params:
        p.grad = None
    loss_rel = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    return {"S": S, "ok": loss_rel <= RTOL and worst <= 1.0, "loss": loss.item(), "eager_loss": ref_loss.item(),
            "loss_rel_err": loss_rel, "grad_max_abs_err": max_abs, "grad_worst_tolerance_ratio": worst,
            "grad_worst_param": worst_name, "fired": fired}


def deepspeed_missing() -> Optional[str]:
    try:
        from alst import require_deepspeed
        require_deepspeed()
    except ImportError as e:
        return str(e)
    return None


def run_family(family: str, a, headroom: int) -> dict:
    base = build(family, a.vocab, a.hidden, a.layers)
    params = sum(p.numel() * p.element_size() for p in base.parameters())
    budget = 4 * params + headroom   # weights, gradients, both AdamW moments
    static = model_bytes(base)
    makers = variants(base, a, budget)
    out = {}
    for key in a.variants:
        label = LABELS[key].format(amb=a.amb, slice=format_bytes(a.alst_slice))
        print(f"{family}: {label}", flush=True)
        if key.startswith("alst") and (why := deepspeed_missing()):
            print(f"    skipped: {why}", flush=True)
            out[key] = {"label": label, "skipped": why}
            continue
        torch._dynamo.reset()   # Dynamo's cache ignores config patches: no variant reuses another's graphs
        row = {"label": label}
        t0 = time.perf_counter()
        row["exact"] = check_exact(base, makers[key], a.check_len, a.vocab)
        print(f"    exact at S={a.check_len}: {row['exact']}", flush=True)
        start = a.start.get(key, DEFAULT_STARTS.get(key, 1024))
        if key == "tailorfx":   # start where the memory model says (the search then measures)
            row["predicted"] = tailorfx.max_seq_len(base, budget, optimizer="adamw", granularity=a.granularity)
            start = a.start.get(key, row["predicted"])
            # the longest any plan of tailorfx's rewrites could fit (a lower bound on every plan's peak)
            row["bound"] = tailorfx.sequence_bound(base, budget, optimizer="adamw", granularity=a.granularity).seq_len
            print(f"    memory model: {row['predicted']}; bound: {row['bound']}", flush=True)
        record: list = []
        if a.search:
            S, capped = longest(lambda s: fits(makers[key], s, budget, a.vocab, static,
                                               lambda m: print(m, flush=True), record),
                                start, a.granularity, a.limit)
            row.update(max_seq_len=S, capped_at_limit=capped, start=start, steps=record,
                       fired_at_longest=next((r["fired"] for r in record if r["S"] == S and r["fits"]), None))
        row["seconds"] = time.perf_counter() - t0
        out[key] = row
    result = {"params_bytes": params, "model_bytes": static, "budget_bytes": budget, "results": out}
    if a.time_at:
        result["timing"] = time_pair(base, makers, a, budget, static)
    return result


def time_pair(base: nn.Module, makers: dict, a, budget: int, static: int) -> dict:
    """Seconds per full step (forward, backward, optimizer step) at --time-at of each timed variant:
    both built, measured once in the steady state and warmed up, then --time-reps rounds of one
    step each, alternated (A B, B A, ...) so that the machine's drift falls on both alike; each
    variant's median, and the median of the rounds' ratios."""
    S, out, steps = a.time_at, {}, {}
    inputs = batch(S, a.vocab)
    for key in a.time_variants:
        if key.startswith("alst") and (why := deepspeed_missing()):
            out[key] = {"skipped": why}
            continue
        torch._dynamo.reset()
        runner = makers[key](S)
        if runner is None:
            out[key] = {"fits": False, "why": "no plan fits"}
            print(f"time at S={S}: {key}: no plan fits", flush=True)
            continue
        state, peak, first = steady_step(runner, inputs, a.vocab)
        peak += state
        optimizer = runner.optimizer()

        def step(runner=runner, optimizer=optimizer):
            for p in runner.module.parameters():
                p.grad = None
            runner.loss(inputs).backward()
            optimizer.step()
        steps[key] = (step, optimizer, runner)
        out[key] = {"fits": static + peak <= budget, "total_bytes": static + peak, "measured_step_seconds": first}
    for step, _, _ in steps.values():
        step()   # warm-up once all are built (a later build's dynamo reset recompiles an earlier one here)
    times: dict = {key: [] for key in steps}
    for i in range(a.time_reps):
        for key in (list(steps) if i % 2 == 0 else list(steps)[::-1]):
            sync()
            t0 = time.perf_counter()
            steps[key][0]()
            sync()
            times[key].append(time.perf_counter() - t0)
    for key, (_, optimizer, runner) in steps.items():
        close(optimizer)
        for p in runner.module.parameters():
            p.grad = None
        total = out[key]["total_bytes"]
        out[key].update(seconds_per_step=statistics.median(times[key]), seconds=times[key])
        print(f"time at S={S}: {key}: {out[key]['seconds_per_step']:.2f}s per step (median of {a.time_reps}: "
              f"{', '.join(f'{t:.2f}' for t in times[key])}); steady-state step {format_bytes(total)} "
              f"({'fits' if total <= budget else 'over'})", flush=True)
    if len(steps) == 2:
        first_key, second_key = a.time_variants
        ratios = [t1 / t0 for t0, t1 in zip(times[first_key], times[second_key])]
        out["ratio"] = statistics.median(ratios)
        out["ratios"] = ratios
        print(f"time at S={S}: {second_key} / {first_key} = {out['ratio']:.2f}x (median of the rounds' ratios: "
              f"{', '.join(f'{r:.2f}' for r in ratios)})", flush=True)
    return out


def yes_no(v) -> str:
    return "-" if v is None else ("yes" if v else "NO")


def table(family: str, a, res: dict) -> None:
    out = res["results"]
    eager = out.get("eager", {}).get("max_seq_len") or None
    alst = out.get("alst-tuned", {}).get("max_seq_len") or out.get("alst", {}).get("max_seq_len") or None
    rows = []
    for key, r in out.items():
        if "skipped" in r:
            rows.append([r["label"], "skipped", "-", "-", "-", "-", r["skipped"][:60]])
            continue
        S = r.get("max_seq_len")
        ex = r.get("exact", {})
        fired = (r.get("fired_at_longest") or ex.get("fired") or {}).get("ok")
        exact = yes_no(ex.get("ok"))
        if ex.get("ok") is not None:
            exact += f" ({ex['grad_worst_tolerance_ratio']:.2g} of tol)"
        bound = r.get("bound")
        rows.append([r["label"], "-" if S is None else f"{S}{'+' if r.get('capped_at_limit') else ''}",
                     f"{S / eager:.1f}x" if S and eager else "-", f"{S / alst:.2f}x" if S and alst else "-",
                     exact, yes_no(fired), r.get("predicted", "-"),
                     f"{bound} ({S / bound:.0%})" if S and bound else "-"])
    print_table(f"HF {family}: longest sequence whose steady-state training step (forward, backward, AdamW step) "
                f"fits {format_bytes(res['budget_bytes'])} (4 x param bytes + {a.headroom}); vocab {a.vocab}, "
                f"hidden {a.hidden}, {a.layers} layers, fp32, batch 1",
                ["variant", "longest sequence", "vs eager", "vs ALST", f"exact? (S={a.check_len})", "fired?",
                 "predicted", "bound (reached)"], rows)
    t = res.get("timing")
    if t:
        print(f"step time at S={a.time_at}: " + ", ".join(
            f"{k} {v['seconds_per_step']:.2f}s" for k, v in t.items() if isinstance(v, dict) and "seconds_per_step" in v)
            + (f"; ratio {t['ratio']:.2f}" if "ratio" in t else ""))


def parse_starts(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, S = item.partition("=")
        if key not in LABELS or not S.isdigit():
            raise SystemExit(f"--start takes VARIANT=LENGTH with VARIANT one of {sorted(LABELS)}, got {item!r}")
        out[key] = int(S)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--headroom", default="400MiB", help="budget = 4 x parameter bytes + this")
    ap.add_argument("--families", nargs="+", default=["qwen2", "mistral", "gemma2"])
    ap.add_argument("--variants", nargs="+", default=list(LABELS), choices=list(LABELS))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--start", nargs="*", default=[], help="VARIANT=LENGTH, e.g. alst-tuned=28672")
    ap.add_argument("--granularity", type=int, default=512)
    ap.add_argument("--limit", type=int, default=1 << 16)
    ap.add_argument("--amb", type=float, default=0.0, help="Inductor's activation_memory_budget")
    ap.add_argument("--alst-slice", default="32MiB", help="alst-tuned: fp32 logits per TiledFusedLogitsLoss shard")
    ap.add_argument("--check-len", type=int, default=1024, help="length of the exactness check against eager")
    ap.add_argument("--no-search", dest="search", action="store_false",
                    help="only the exactness and fired checks (and --time-at)")
    ap.add_argument("--time-at", type=int, default=16384, help="0: no timing")
    ap.add_argument("--time-variants", nargs=2, default=["alst-tuned", "tailorfx"], choices=list(LABELS))
    ap.add_argument("--time-reps", type=int, default=6)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (peaks from the caching allocator)")
    ap.add_argument("--out", default="max_seq_len.json", help="file name under benchmarks/out/")
    a = ap.parse_args()
    global DEVICE
    DEVICE = torch.device(a.device)
    a.start = parse_starts(a.start)
    a.alst_slice = Budget.parse(a.alst_slice).bytes
    headroom = Budget.parse(a.headroom).bytes
    result = {"headroom": a.headroom, "model": {k: v for k, v in vars(a).items()}, "families": {}}
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=4096):
        for family in a.families:
            res = run_family(family, a, headroom)
            result["families"][family] = res
            table(family, a, res)
            write_json(a.out, result)
    print("wrote", write_json(a.out, result))


if __name__ == "__main__":
    main()
