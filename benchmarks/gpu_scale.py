"""Llama-3-8B on one GPU at the scale users train, beside the recipes users run (issue 64).

    python3 benchmarks/gpu_scale.py                      # one H100/H200, about 9 min (--budget-s)
    python3 benchmarks/gpu_scale.py --section longest    # some sections only, in the order given
    python3 benchmarks/gpu_scale.py --section speed --length 32768 --provider tailorfx   # some rows only
    python  benchmarks/gpu_scale.py --dry-run            # CPU, a 2-layer Llama, every code path (CI)
    python  benchmarks/gpu_scale.py --predict            # the same tables predicted on fake tensors

The model is transformers' LlamaForCausalLM from benchmarks/paper_table.py's Llama-3-8B config
(use_cache=False), initialised randomly on the GPU in bf16 (no download, no CPU copy). Every
provider trains under the paper table's setup, pure-bf16-fused-optimizer: bf16 weights and AdamW
state, the step fused into backward (tailorfx.SetupOptimizer's hooks, which the peers use too;
ALST's alst.LastShardOptimizer updates a parameter after its last shard only).
The budget is the H100-80GB preset, emulated on a larger GPU by capping the caching allocator
(torch.cuda.set_per_process_memory_fraction) at 79 GiB: an H100's 79.6 GiB less its CUDA context.

Every tailorfx.optimize() here but the speed row's "tailorfx, lowering auto" passes lowering="eager"
(meta.lowering in the JSON), not the default "auto", which means Inductor on CUDA. Eager is the lowering of every prediction the run checks
(max_seq_len, plan_for_budget, benchmarks/results/gpu_scale_predicted.json) and of the dry run.
Under Inductor a budgeted optimize() traces each candidate plan through Inductor (about 78 s a
trace at 32 layers, 10-15 min of planning). Until 2026-12-05 its optimizer steps also ran after
the compiled backward returned, every gradient alive at its end (the 56 GiB budget could not be
met); they now run inside it (docs/memory.md), not yet on a GPU. Under "auto" a CUDA model is
planned on a shallow capture made on fake CPU tensors (eager) and the plan checked on its own
Inductor trace, one trace: the row that measures what Inductor's fused kernels do to the MFU.

The call has a hard wall (10 min). A check starts only when its estimate (the model's build,
optimize() with its planning, the first step, the steady steps: `estimate_s` in its entry) fits
what is left of --budget-s; otherwise it is recorded as skipped with both figures. A section starts
only while time is left. Each check is saved as "running" before it starts. A watchdog thread at
--budget-s + 25 s writes the JSON (a check still running marked "timeout") and ends the process
with exit status 3. A check fails at once if more than 1 GiB is still allocated on the GPU from
an earlier one (a leak): it would otherwise fail for that reason and not its own.

Sections, in this order (or --section's); each writes the JSON (benchmarks/out/gpu_scale.json) as it ends:
  longest  tailorfx.max_seq_len for the budget (the planner's time), optimize() at that length
           (capture and planning), the first step, then a steady step: no OOM and the
           measured peak within -2%..+3% of opt.predict_memory(); the next granule up is refused
           by the planner on the device alone (plan_for_budget on fake tensors: on a GPU budget
           its last candidate, checkpoints offloaded to host, may still meet it).
  speed    32K, 16K and 8K tokens, a row of providers each: tailorfx's plan for the budget (at
           32K also with kernels="triton": the norms, SwiGLU, RoPE and the head on tailorfx's
           kernels, against the eager lowering's unfused ATen ops; with lowering="auto",
           optimize()'s default: on CUDA Inductor's fused kernels, the optimizer steps inside its
           backward, the plan chosen on the shallow capture checked on its trace, also with
           offload="activations"; and with offload="activations": the first k blocks' saved
           tensors wait in host memory instead of those blocks being recomputed, the planner
           picking k; and with both
           offload="activations" and kernels="triton", the plan the step-time model predicts
           fastest at 32K, --predict), eager, HF
           activation checkpointing, Liger-Kernel (its defaults, fused linear cross-entropy among
           them) + HF checkpointing, the ALST recipe (DeepSpeed's TiledMLP + TiledFusedLogitsLoss
           + HF checkpointing, benchmarks/alst.py; no ZeRO): step time, tokens/s, MFU; tailorfx's
           rows also the chosen plan and the peak against the prediction; every row one step
           profiled (kernel time by kind against the wall, and by the op that launched it: where
           an MFU goes). --provider and --length narrow the section to some rows. Each provider is
           checked against eager at a short length (the loss, every weight's gradient norm, one
           step updating each parameter once; ALST with two shards or more of each kind) and for
           its feature firing. The 32K row runs first (optimize()'s default plan, Inductor on CUDA,
           the goal's; Liger-Kernel's, the fastest peer measured; the default with offloaded
           activations; tailorfx's eager lowering, whose optimize() time becomes the later rows'
           planning estimate; its offloaded Triton row and
           its Triton row; then the others: TOP_ROW), then those checks, then 16K and 8K: at 32K the
           rewrites decide what fits and how fast, so its MFU comparison is what the run is for, and
           a budgeted optimize() takes minutes, so what runs last may find no time.
  offload  under a lower budget (OFFLOAD_BUDGET): offload="checkpoints" at the longest length
           it reaches (peak vs prediction, host bytes), and its time per token against the
           device-only plan at the longest length that one reaches.
  probe    last, in a subprocess: the longest length's plan run one granule longer. An OOM, or a
           peak over the budget less the planner's headroom (what max_seq_len holds a plan to),
           is what the prediction implies (ok); a step that fits is not. Without the longest
           section in the same call, it predicts that length itself (max_seq_len).

MFU = (6 x N x tokens + 6 x layers x tokens^2 x heads x head_dim) / step time / 989 TFLOP/s, the
H100 and H200 dense bf16 peak. N counts every weight but the input embedding (a lookup); the second
term is causal attention's two matmuls, forward and backward (the recompute excluded).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, NamedTuple

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
sys.path[:0] = [REPO, BENCH_DIR]

from gpucheck.guard import (INDUCTOR_S, KERNEL_CHOICE_S, OFFLOAD_SLOWDOWN, PREDICT_S, PYTHON_S, TRACE_S,  # noqa: E402
                            WATCHDOG_MARGIN_S, estimate_s, guarded, run_child, run_sections, start_watchdog)
from gpucheck.record import Run, Skip, bench_module, describe  # noqa: E402
from gpucheck.steps import (PEAK_TFLOPS, against_prediction, capped, first_step, grad_norms,  # noqa: E402
                            median_step_s, mfu, peak_of, step_profile, stepper, weight_grad_sum, worst_grad_rel)

SECTIONS = ("longest", "speed", "offload", "probe")
SETUP = "pure-bf16-fused-optimizer"
LOWERING = "eager"
LOWERING_WHY = ("the lowering of every prediction checked here and of the dry run; Inductor's planning "
                "takes minutes a candidate and keeps every gradient alive with the optimizer in backward")
BUDGET = "H100-80GB"
ALLOCATOR_CAP = 79 * 2**30     # an H100's 79.6 GiB less its CUDA context: what its allocator can reach
OFFLOAD_BUDGET = 56 * 2**30    # static 48 GiB of weights and AdamW state; 8 GiB left for the step
OFFLOAD_CAP = OFFLOAD_BUDGET + 3 * 2**29   # the preset's reserve (1.5 GiB) given back to the allocator
LENGTHS = (8192, 16384, 32768)
GRANULE = 128
PROVIDERS = ("tailorfx", "eager", "hf-checkpointing", "liger+hf-checkpointing", "alst")
OFFLOADED = "tailorfx, activations offloaded"   # in the longest row only
TRITON_KERNELS = "tailorfx, Triton kernels"     # likewise: norms, SwiGLU, RoPE, the head on tailorfx/kernels
INDUCTOR = "tailorfx, lowering auto"            # likewise: optimize()'s default, Inductor on CUDA (eager on CPU)
BOTH = "tailorfx, offloaded, Triton kernels"    # likewise: both, the plan predicted fastest at 32K (--predict)
INDUCTOR_OFFLOADED = "tailorfx, lowering auto, activations offloaded"   # likewise: the default with offload
TAILORFX = {"tailorfx": {}, TRITON_KERNELS: {"kernels": "triton"}, INDUCTOR: {"lowering": "auto"},
            OFFLOADED: {"offload": "activations"}, INDUCTOR_OFFLOADED: {"lowering": "auto", "offload": "activations"},
            BOTH: {"offload": "activations", "kernels": "triton"}}   # provider -> optimize() options (+ LOWERING)
# the longest length's row: what the MFU goal compares first (optimize()'s default, Inductor on CUDA:
# the goal's plan, first while the whole budget is left for its compile; the fastest peer measured,
# Liger-Kernel; the default with offload="activations", predicted over 50% where the default is not;
# tailorfx's eager lowering, whose optimize() times the later rows' planning; the plan predicted
# fastest, then the Triton row: kernel timing takes minutes), then the rows that end at once in an
# OOM, then the slower ones
TOP_ROW = (INDUCTOR, "liger+hf-checkpointing", INDUCTOR_OFFLOADED, "tailorfx", BOTH, TRITON_KERNELS, "eager",
           "hf-checkpointing", OFFLOADED, "alst")
# dry run: a 2-layer Llama on CPU, budgets in MiB, lengths short enough for CPU steps
DRY = dict(budget=3 << 20, offload_budget=3 << 20, lengths=(256, 512), granule=64, limit=2048)


# ---- the model and its budgets -------------------------------------------------------------

def config(dry: bool):
    if dry:
        from transformers import AutoConfig
        return AutoConfig.for_model("llama", vocab_size=512, hidden_size=64, intermediate_size=172,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    use_cache=False, max_position_embeddings=8192)
    return bench_module("paper_table").MODELS["Llama-3-8B"]()


def build(run: Run):
    """The model, random bf16 weights made where it trains (an 8B model never exists on the CPU)."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device(run.device):
        model = AutoModelForCausalLM.from_config(config(run.dry), dtype=torch.bfloat16)
    return model.train()


def batch(run: Run, S: int) -> dict:
    import torch
    g = torch.Generator().manual_seed(S)
    ids = torch.randint(0, config(run.dry).vocab_size, (1, S), generator=g).to(run.device)
    return {"input_ids": ids, "labels": ids.clone()}


def plan_labels(opt) -> list:
    return [p.chosen.label if p.chosen else p.reason for p in opt.plan]


def kernel_choices(opt) -> dict:
    """The Triton kernels a tailorfx row runs, the norms lowered to torch's fused kernel, the regions
    on Inductor's code alone and those left to their own code, each as measured fastest
    (kernels="triton": passes/kernel_choice.py)."""
    from tailorfx.passes.kernel_choice import LEFT_TO
    records = [r for g in opt.graph_records for r in g.records]
    left = [s for r in records for s in r.skipped if any(m in s for m in LEFT_TO.values())]
    fused, alone = (sum(r.stats.get(kind, 0) for r in records if r.name == "kernels")
                    for kind in ("torch_norm", "inductor_region"))
    from tailorfx.kernels import tuning   # each choice's key: what won and every candidate's ms
    timed = {k: v for k, v in tuning.choices().items() if k.startswith("kernels.") and "pick" in v}
    return {"triton_kernels": sorted(opt.kernel_launches()), "torch_fused_norms": fused,
            "inductor_regions": alone, "left_to_own_code": left,
            "kernel_choices": timed}


def budgets(run: Run) -> dict:
    from tailorfx.budget import PRESETS
    if run.dry:
        return {"budget": DRY["budget"], "cap": None, "offload_budget": DRY["offload_budget"],
                "offload_cap": None, "granule": DRY["granule"], "limit": DRY["limit"], "lengths": DRY["lengths"]}
    from tailorfx.budget import Budget
    return {"budget": Budget(PRESETS[BUDGET], BUDGET, "sm90"), "cap": ALLOCATOR_CAP,
            "offload_budget": Budget(OFFLOAD_BUDGET, "56 GiB GPU", "sm90"), "offload_cap": OFFLOAD_CAP,
            "granule": GRANULE, "limit": 1 << 21, "lengths": LENGTHS}


# ---- sections --------------------------------------------------------------------------------

def section_longest(run: Run, sec: dict) -> None:
    b = budgets(run)
    cfg = config(run.dry)
    guarded(run, sec, "max_seq_len", PREDICT_S, lambda: predict_longest(run))
    if "longest" not in run.shared:
        raise Skip("max_seq_len gave no length to train at")
    S = run.shared["longest"]
    guarded(run, sec, "next granule refused", PREDICT_S, lambda: next_granule(cfg, b["budget"], S + b["granule"]))
    guarded(run, sec, "train at the longest length", estimate_s(run, cfg, S, steps=3, plan=True),
            lambda: train_longest(run, S))


def predict_longest(run: Run) -> dict:
    """tailorfx.max_seq_len for the budget, kept in run.shared["longest"] for the sections after."""
    import tailorfx
    b = budgets(run)
    t0 = time.time()
    S = tailorfx.max_seq_len(config(run.dry), b["budget"], setup=SETUP, granularity=b["granule"], limit=b["limit"])
    run.shared["longest"] = S
    return {"predicted_longest": S, "planner_s": round(time.time() - t0, 1), "budget": str(b["budget"])}


def train_longest(run: Run, S: int) -> dict:
    """optimize() at S under the budget (its time becomes the estimates' planning time), the first
    step, a steady step's peak against the prediction, one more step timed."""
    import tailorfx
    b = budgets(run)
    res = {"tokens": S}
    with capped(run, b["cap"]):
        t0 = time.time()
        model = build(run)
        res["build_s"] = round(time.time() - t0, 1)
        inputs = batch(run, S)
        t0 = time.time()
        opt = tailorfx.optimize(model, budget=b["budget"], setup=SETUP, example_inputs=inputs, lowering=LOWERING)
        res["optimize_s"] = run.shared["plan_s"] = round(time.time() - t0, 1)   # capture and planning
        res["plan"] = plan_labels(opt)
        with stepper(run, opt, model, inputs, SETUP) as (step, _):
            res["first_step_s"] = first_step(run, step)[0]
            est = opt.predict_memory()
            res["measured"] = peak_of(run, step)
            res["prediction"] = against_prediction(res["measured"], est)
            res["host_bytes"] = est.host_bytes
            res["step_s"] = round(median_step_s(step, 1), 2)
            res["mfu"] = mfu(model, S, res["step_s"])
    res["ok"] = res["prediction"]["within_-2%..+3%"] or run.dry
    return res


def next_granule(cfg, budget, S: int) -> dict:
    """The planner one granule past max_seq_len's (device-only) longest: refused, or, on a GPU
    budget, met only by offloading checkpoints to host memory (the planner's last candidate)."""
    import tailorfx
    from tailorfx.sizing import plan_for_budget
    try:
        opt = plan_for_budget(cfg, budget, S, setup=SETUP, lowering=LOWERING)
    except tailorfx.BudgetError as e:
        return {"tokens": S, "refused": str(e)[:600], "smallest_budget": e.suggested_bytes}
    label = plan_labels(opt)[0]
    if "offloaded" in label:
        return {"tokens": S, "refused": "every device-only plan; the planner offloads checkpoints to host", "plan": label}
    return {"tokens": S, "refused": None, "plan": label, "ok": False}


class Provider(NamedTuple):
    """A provider's model as a step calls it, what shows its feature fired, what undoes it, and
    the optimizer class it trains with (None: tailorfx.SetupOptimizer)."""
    module: Any
    fired: Callable[[Any], dict]
    cleanup: Callable[[], None] = lambda: None
    optimizer: Any = None


def make_provider(run: Run, name: str, model, inputs: dict, min_shards: int = 1) -> Provider:
    """One provider on a fresh model: tailorfx's (optimize() under the budget, TAILORFX's options)
    or a peer's. `min_shards`: ALST's least shard count of each kind (the agreement's 2)."""
    import tailorfx
    if "kernels" in TAILORFX.get(name, {}) and run.dry:
        raise Skip("Triton's interpreter takes minutes a step at the dry run's lengths; the kernels' exactness "
                   "under it is make test's (tests/test_kernels_pass.py, tests/test_autocast.py)")
    if name in TAILORFX:
        opt = tailorfx.optimize(model, budget=budgets(run)["budget"], setup=SETUP, example_inputs=inputs,
                                **{"lowering": LOWERING, **TAILORFX[name]})
        return Provider(opt, lambda out: {"plan": plan_labels(opt), "logits_skipped": out.logits is None,
                                          "lowerings": sorted({g.lowering for g in opt.graph_records}),
                                          **kernel_choices(opt)})
    if name == "eager":
        return Provider(model, lambda out: {})
    if name == "hf-checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return Provider(model, lambda out: {"checkpointing": model.is_gradient_checkpointing})
    if name == "liger+hf-checkpointing":
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except ImportError as e:
            raise Skip(f"Liger-Kernel is not installed ({e}); carry its wheel (make gpu-wheels)") from e
        restore = restorable_llama_module()
        apply_liger_kernel_to_llama(model=model)   # its defaults: RoPE, RMSNorm, SwiGLU, fused linear CE
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # the fused head returns no logits in training
        return Provider(model, lambda out: {"logits_skipped": out.logits is None}, restore)
    if name == "alst":
        alst = bench_module("alst")
        try:
            alst.require_deepspeed()
        except ImportError as e:
            raise Skip(str(e)) from e
        wrapped = alst.ALSTCausalLM(model, min_shards=min_shards)
        return Provider(wrapped, lambda out: {k: int(v) for k, v in wrapped.counts.items()},
                        optimizer=alst.LastShardOptimizer)
    raise ValueError(name)


def restorable_llama_module():
    """Liger patches transformers' llama module (its rotary function among others) as well as the
    instance: a function putting every name of that module back, so later providers run HF's code."""
    from transformers.models.llama import modeling_llama
    saved = dict(vars(modeling_llama))
    classes = {k: dict(vars(v)) for k, v in saved.items() if isinstance(v, type) and v.__module__ == modeling_llama.__name__}

    def restore():
        for k, v in saved.items():
            setattr(modeling_llama, k, v)
        for k, attrs in classes.items():
            cls = saved[k]
            for a, v in attrs.items():
                if a not in ("__dict__", "__weakref__") and getattr(cls, a, None) is not v:
                    setattr(cls, a, v)
    return restore


def eager_reference(run: Run, inputs: dict) -> tuple[float, dict]:
    """Eager PyTorch's loss and gradient norms by name at `inputs`, computed once (build() seeds
    the weights, so every provider's model starts from the same ones)."""
    if "eager_reference" not in run.shared:
        model = build(run)
        out = model(**inputs)
        out.loss.backward()
        run.shared["eager_reference"] = (out.loss.item(), {n: p.grad.float().norm().item()
                                                           for n, p in model.named_parameters() if p.grad is not None})
        del model, out
        run.free()
    return run.shared["eager_reference"]


def agreement(run: Run, name: str, S: int) -> dict:
    """A provider's loss and gradient norms beside eager's at S tokens, on the same weights; bf16
    both, so the tolerance is bf16's: 2e-2 on the loss, 5e-2 on each weight's gradient norm. Then
    one step with the optimizer in backward must update each parameter once (ALST, run with two
    shards or more of each kind, would update a parameter once per shard without LastShardOptimizer)."""
    inputs = batch(run, S)
    ref_loss, ref_grads = eager_reference(run, inputs)
    model = build(run)
    names = {id(p): n for n, p in model.named_parameters()}
    p = make_provider(run, name, model, inputs, min_shards=2)
    try:
        out = p.module(**inputs)
        out.loss.backward()
        worst = worst_grad_rel(ref_grads, grad_norms(model, names))
        res = {"tokens": S, "loss": out.loss.item(), "eager_loss": ref_loss,
               "loss_rel": abs(out.loss.item() - ref_loss) / abs(ref_loss), "worst_grad_norm_rel": worst,
               "fired": p.fired(out)}
        del out
        model.zero_grad(set_to_none=True)
        with stepper(run, p.module, model, inputs, SETUP, p.optimizer) as (step, optim):
            step()
            res.update(updates_in_one_step=optim.num_updates, parameters=len(optim.params))
    finally:
        p.cleanup()
    sharded = all(v >= 2 for k, v in res["fired"].items() if k.endswith("max_shards"))
    res["ok"] = (res["loss_rel"] <= 2e-2 and worst <= 5e-2 and sharded
                 and res["updates_in_one_step"] == res["parameters"])
    return res


def timed_steps(run: Run, name: str, S: int, reps: int) -> dict:
    """One provider at S tokens on a fresh model under the capped allocator: its setup (tailorfx's
    optimize()), the first step, a steady step's peak (tailorfx's against its prediction), the
    median time of `reps` more. A peer's OOM is a result; tailorfx's, under its own budget, fails."""
    import torch
    b = budgets(run)
    res = {"provider": name, "tokens": S}
    with capped(run, b["cap"]):
        model = build(run)
        inputs = batch(run, S)
        try:
            t0 = time.time()
            p = make_provider(run, name, model, inputs)
            res["setup_s"] = round(time.time() - t0, 1)
            if name in TAILORFX and not setup_extra_s(TAILORFX[name]):
                run.shared["plan_s"] = res["setup_s"]   # a budgeted optimize(): the later rows' planning estimate
            try:
                with stepper(run, p.module, model, inputs, SETUP, p.optimizer) as (step, _):
                    res["first_step_s"], out = first_step(run, step)
                    res["fired"] = p.fired(out)
                    del out
                    res["measured"] = peak_of(run, step)
                    if name in TAILORFX:
                        res["prediction"] = against_prediction(res["measured"], p.module.predict_memory())
                    res["step_s"] = median_step_s(step, reps)
                    res["profile"] = step_profile(run, step)   # where the time goes (the MFU goal's gap)
            finally:
                p.cleanup()
            res.update(tokens_per_s=S / res["step_s"], mfu=mfu(model, S, res["step_s"]))
        except torch.OutOfMemoryError as e:
            res["oom"] = str(e)[:300]
    if name in TAILORFX:
        res["ok"] = "prediction" in res and "oom" not in res and (res["prediction"]["within_-2%..+3%"] or run.dry)
    return res


def asked_lengths(run: Run, b: dict) -> list[int]:
    """The speed rows' lengths: --length's, or the section's. A dry run scales --length's by its own
    longest over the GPU's (32K -> 512), so the GPU's exact command can be rehearsed on the CPU."""
    asked = getattr(run.args, "length", None)
    if not asked:
        return list(b["lengths"])
    return [max(b["granule"], L * max(b["lengths"]) // max(LENGTHS)) for L in asked] if run.dry else list(asked)


def section_speed(run: Run, sec: dict) -> None:
    """The longest row, the agreements, the other rows (see the module's docstring for why)."""
    b = budgets(run)
    reps = 1 if run.dry else 3
    sec["notes"].append("providers run one after another on fresh models (each holds 48 GB of weights and AdamW "
                        "state, so two cannot share the 80 GB budget); the GPU's clocks are steady enough for that")
    sec["notes"].append("the longest row runs first, then the agreements at a short length, then the shorter rows: "
                        "a budgeted optimize() takes minutes, so the rows at the end of the time may be skipped")
    lengths = sorted(asked_lengths(run, b), reverse=True)
    speed_row(run, sec, lengths[0], TOP_ROW, reps)
    short = min(b["lengths"]) // 16 if not run.dry else 64   # 512 tokens, whatever --length asks
    for name in asked(run, PROVIDERS[:1] + PROVIDERS[2:]):   # every provider but eager, the reference
        need = estimate_s(run, config(run.dry), short, steps=3, plan=name in TAILORFX,
                          builds=1 + ("eager_reference" not in run.shared))
        guarded(run, sec, f"agreement {name}", need, lambda name=name: agreement(run, name, short))
    for S in lengths[1:]:
        speed_row(run, sec, S, PROVIDERS, reps)


def asked(run: Run, names: tuple) -> tuple:
    """`names` less the providers --provider left out (none named: all)."""
    wanted = getattr(run.args, "provider", None)
    return tuple(n for n in names if not wanted or n in wanted)


def speed_row(run: Run, sec: dict, S: int, names: tuple, reps: int) -> None:
    for name in asked(run, names):
        opts = TAILORFX.get(name, {})     # a tailorfx row's options say what its setup and steps cost more
        need = estimate_s(run, config(run.dry), S, steps=3 + reps, plan=name in TAILORFX,
                          slowdown=OFFLOAD_SLOWDOWN if "offload" in opts else 4 / 3) + setup_extra_s(opts)
        guarded(run, sec, f"{name} S={S}", need, lambda name=name: timed_steps(run, name, S, reps))


def setup_extra_s(opts: dict) -> float:
    """What a tailorfx row's options add to optimize()'s planning: kernel timing, or the Inductor trace."""
    return KERNEL_CHOICE_S if "kernels" in opts else INDUCTOR_S if opts.get("lowering") == "auto" else 0.0


def section_offload(run: Run, sec: dict) -> None:
    import tailorfx
    b = budgets(run)
    cfg = config(run.dry)

    def predict():
        t0 = time.time()
        dev = tailorfx.max_seq_len(cfg, b["offload_budget"], setup=SETUP, granularity=b["granule"], limit=b["limit"])
        off = tailorfx.max_seq_len(cfg, b["offload_budget"], setup=SETUP, granularity=b["granule"], limit=b["limit"],
                                   offload="checkpoints")
        run.shared.update(device_only=dev, offloaded=off)
        return {"device_only_longest": dev, "offloaded_longest": off, "ratio": off / dev,
                "planner_s": round(time.time() - t0, 1), "budget": str(b["offload_budget"])}
    guarded(run, sec, "max_seq_len with and without offload", 2 * PREDICT_S, predict)
    if "offloaded" not in run.shared:
        raise Skip("max_seq_len gave no lengths to train at")
    reps = 1 if run.dry else 2
    both = run.shared["device_only"]
    for name, S, offload in (("offloaded at its longest", run.shared["offloaded"], True),
                             ("device-only at its longest", both, False),
                             ("offloaded at the device-only longest", both, True)):
        need = estimate_s(run, cfg, S, steps=2 + reps, plan=True, slowdown=OFFLOAD_SLOWDOWN if offload else 4 / 3)
        guarded(run, sec, name, need, lambda S=S, offload=offload: train_offload(run, S, offload, reps))
    per = {c["name"]: c.get("s_per_1k_tokens") for c in sec["checks"]}
    if per.get("device-only at its longest") and per.get("offloaded at the device-only longest"):
        sec["offload_time_ratio"] = per["offloaded at the device-only longest"] / per["device-only at its longest"]


def train_offload(run: Run, S: int, offload: bool, reps: int) -> dict:
    """optimize() under the offload budget, checkpoints in host memory or not: the peak against the
    prediction, the host bytes predicted, the median time of `reps` steps."""
    import tailorfx
    b = budgets(run)
    res = {"tokens": S, "offload": offload}
    with capped(run, b["offload_cap"]):
        model = build(run)
        inputs = batch(run, S)
        kw = {"offload": "checkpoints", "recompute": "full"} if offload else {}
        opt = tailorfx.optimize(model, budget=b["offload_budget"], setup=SETUP, example_inputs=inputs,
                                lowering=LOWERING, **kw)
        res["plan"] = plan_labels(opt)
        with stepper(run, opt, model, inputs, SETUP) as (step, _):
            res["first_step_s"] = first_step(run, step)[0]
            est = opt.predict_memory()
            res["host_bytes_predicted"] = est.host_bytes
            res["measured"] = peak_of(run, step)
            res["prediction"] = against_prediction(res["measured"], est)
            res["step_s"] = median_step_s(step, reps)
    res["s_per_1k_tokens"] = res["step_s"] / S * 1024
    res["ok"] = res["prediction"]["within_-2%..+3%"] or run.dry
    return res


def section_probe(run: Run, sec: dict) -> None:
    """The longest length's plan one granule longer, in a subprocess; the length predicted here when
    the longest section did not run in this call (a lease's second call: --section offload --section probe)."""
    if "longest" not in run.shared:
        guarded(run, sec, "max_seq_len", PREDICT_S, lambda: predict_longest(run))
    if "longest" not in run.shared:
        raise Skip("max_seq_len gave no length to probe past")
    S = run.shared["longest"] + budgets(run)["granule"]
    need = PYTHON_S + TRACE_S + estimate_s(run, config(run.dry), S, steps=2)
    guarded(run, sec, f"the longest plan at {S} tokens", need, lambda: probe(run, S, need))


def probe(run: Run, S: int, need_s: float) -> dict:
    """probe_main in a subprocess (its OOM leaves this process's allocator alone), given 1.5 times
    its estimate, or what is left if less (the estimate at least); the watchdog kills it too."""
    cmd = [sys.executable, os.path.abspath(__file__), "--probe-tokens", str(S)] + (["--dry-run"] if run.dry else [])
    timeout = 1200.0 if run.dry else max(need_s, min(1.5 * need_s, run.left()))
    out, err, returncode = run_child(run, cmd, timeout)
    if returncode is None:
        return {"tokens": S, "ok": False, "timed_out_s": round(timeout), "stderr": err[-2000:]}
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    res = json.loads(lines[-1]) if lines else {"ok": False, "stderr": err[-2000:]}
    res.update(tokens=S, returncode=returncode)
    return res


def probe_main(S: int, dry: bool) -> None:
    """In the subprocess: the plan that saves the most (max_seq_len's) at S tokens under the cap,
    with no budget check; prints one JSON line. ok: the step OOMs (with the cap free on the GPU at
    the start: `free_before`) or peaks over `limit`, the budget less the planner's headroom, which
    max_seq_len held the prediction to; not ok: it fits."""
    import torch
    import tailorfx
    from tailorfx import planner
    from tailorfx.budget import Budget
    from tailorfx.setup import resolve, with_device_costs

    class A:
        dry_run = dry
        budget_s = 1e9
        out = os.devnull
        section = None
    run = Run(A, "cpu" if dry else "cuda", sections=SECTIONS)
    b = budgets(run)
    budget = Budget.parse(b["budget"])
    res = {"budget": budget.bytes}
    if run.cuda:
        res["free_before"], res["total"] = torch.cuda.mem_get_info()
    with capped(run, b["cap"]):
        try:
            model = build(run)
            inputs = batch(run, S)
            setup = with_device_costs(resolve(SETUP), budget, model, 1)   # the CUDA costs the planner counts
            res["limit"] = int(planner.usable(budget.bytes, setup.headroom))
            opt = tailorfx.optimize(model, setup=setup, passes=["attention", "minisequence", "recompute"],
                                    minisequence="segments", recompute="full", example_inputs=inputs,
                                    lowering=LOWERING)
            with stepper(run, opt, model, inputs, SETUP) as (step, _):
                step()
                res["predicted"] = opt.predict_memory().peak_bytes
                res["measured"] = peak_of(run, step)
        except Exception as e:   # noqa: BLE001  (an OOM is an expected outcome; anything else is reported)
            res.update(error=describe(e), oom=isinstance(e, torch.OutOfMemoryError))
    peak = res.get("measured", {}).get("peak")
    res["over_limit"] = peak is not None and peak > res.get("limit", budget.bytes)
    room = not run.cuda or res["free_before"] >= b["cap"]
    res["ok"] = bool((res.get("oom") and room) or res["over_limit"] or (run.dry and "error" not in res))
    print(json.dumps(res, default=str), flush=True)


# ---- predicted tables (fake tensors, no GPU) -----------------------------------------------------

def predicted_time(opt, cfg, S: int) -> dict:
    """The step-time model's figures for a plan (`tailorfx.parallel.plan_step_time`, its graphs as
    lowered): seconds by kind of kernel and MFU on the Hopper classes (fitted on the H200 of
    2026-12-04, benchmarks/steptime_gpu.py)."""
    from tailorfx.parallel import plan_step_time
    from gpucheck.steps import config_params, step_flops
    out = {}
    for gpu in ("H200", "H100"):
        st = plan_step_time(opt, gpu)
        out[gpu] = {"step_s": round(st.total_s, 3), **{k: round(v, 2) for k, v in st.by_kind},
                    "optimizer_s": round(st.optimizer_s, 3), "host_copies_s": round(st.host_copies_s, 3),
                    "mfu": round(step_flops(cfg, config_params(cfg), S) / st.total_s / (PEAK_TFLOPS * 1e12), 3)}
    return out


def predict_tables(out: str) -> dict:
    """What the GPU run should measure, from the memory model alone (CUDA's costs of the sm90
    budget modelled): the longest lengths, the refusal above, the predicted peaks and step times at
    the speed section's lengths, the offload lengths. Written beside the measured JSON."""
    import tailorfx
    from tailorfx.budget import Budget, PRESETS
    from tailorfx.sizing import plan_for_budget
    cfg = config(False)
    b, ob = Budget(PRESETS[BUDGET], BUDGET, "sm90"), Budget(OFFLOAD_BUDGET, "56 GiB GPU", "sm90")
    res = {"model": "Llama-3-8B", "setup": SETUP, "budget": str(b), "offload_budget": str(ob)}
    t0 = time.time()
    res["longest"] = tailorfx.max_seq_len(cfg, b, setup=SETUP, granularity=GRANULE)
    res["longest_s"] = round(time.time() - t0, 1)
    print("longest", res["longest"], res["longest_s"], "s", flush=True)
    res["next_granule"] = next_granule(cfg, b, res["longest"] + GRANULE)
    res["speed"] = {}
    for S in LENGTHS:   # the whole model captured: its step time is read off its own graphs
        opt = plan_for_budget(cfg, b, S, setup=SETUP, lowering=LOWERING, shallow=False)
        est = opt.predict_memory()
        res["speed"][S] = {"plan": plan_labels(opt), "predicted_peak_gib": round(est.peak_bytes / 2**30, 2),
                           "predicted_time": predicted_time(opt, cfg, S)}
        if S == max(LENGTHS):   # the row that also runs offload="activations", kernels="triton", both, Inductor
            for name in (OFFLOADED, TRITON_KERNELS, BOTH, INDUCTOR, INDUCTOR_OFFLOADED):
                kw = {"lowering": LOWERING, **TAILORFX[name]}
                if kw["lowering"] == "auto":   # Inductor on CUDA (eager on this CPU): 8 min a plan here
                    kw["lowering"] = "inductor"
                other = plan_for_budget(cfg, b, S, setup=SETUP, shallow=False, **kw)
                oest = other.predict_memory()
                res["speed"][S][name] = {"plan": plan_labels(other),
                                         "predicted_peak_gib": round(oest.peak_bytes / 2**30, 2),
                                         "host_gib": round(oest.host_bytes / 2**30, 2),
                                         "predicted_time": predicted_time(other, cfg, S)}
        print(S, res["speed"][S], flush=True)
    res["offload"] = predict_offload(cfg, ob)
    print("offload", res["offload"], flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    return res


def predict_offload(cfg, ob) -> dict:
    """The offload section's lengths under the lower budget, and its time check predicted: at the
    device-only longest, the offloaded plan (checkpoints to host, every block recomputed, as
    train_offload asks) against the device-only plan, per token."""
    import tailorfx
    from tailorfx.sizing import plan_for_budget
    res = {"device_only_longest": tailorfx.max_seq_len(cfg, ob, setup=SETUP, granularity=GRANULE),
           "offloaded_longest": tailorfx.max_seq_len(cfg, ob, setup=SETUP, granularity=GRANULE, offload="checkpoints")}
    S = res["device_only_longest"]
    for name, kw in (("device-only at its longest", {}),
                     ("offloaded at the device-only longest", {"offload": "checkpoints", "recompute": "full"})):
        opt = plan_for_budget(cfg, ob, S, setup=SETUP, lowering=LOWERING, shallow=False, **kw)
        res[name] = {"tokens": S, "plan": plan_labels(opt), "predicted_time": predicted_time(opt, cfg, S)}
    res["offload_time_ratio"] = {gpu: round(res["offloaded at the device-only longest"]["predicted_time"][gpu]["step_s"]
                                            / res["device-only at its longest"]["predicted_time"][gpu]["step_s"], 3)
                                 for gpu in ("H200", "H100")}
    return res


RUNNERS = {"longest": section_longest, "speed": section_speed, "offload": section_offload, "probe": section_probe}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--section", action="append", choices=SECTIONS,
                    help="repeatable, run in the order given; default: all, in the order below")
    ap.add_argument("--provider", action="append", choices=TOP_ROW,
                    help="repeatable; the speed section's rows for these providers only (default: all)")
    ap.add_argument("--length", action="append", type=int,
                    help="repeatable; the speed section's lengths in tokens (default: 32K, 16K, 8K)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, a 2-layer Llama, Triton's interpreter")
    ap.add_argument("--predict", action="store_true", help="the tables on fake tensors (no GPU, no steps)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds (default 540; 1200 with --dry-run): a check starts only when its estimate fits the "
                         f"time left; {WATCHDOG_MARGIN_S:.0f} s after it a watchdog writes the JSON and exits (status 3)")
    ap.add_argument("--probe-tokens", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dry_run or args.predict:   # --predict: the Triton row's kernels planned on CPU, none run
        os.environ["TRITON_INTERPRET"] = "1"
    if args.probe_tokens:
        probe_main(args.probe_tokens, args.dry_run)
        return 0
    if args.predict:
        predict_tables(args.out or os.path.join(BENCH_DIR, "results", "gpu_scale_predicted.json"))
        return 0
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_scale.py needs a CUDA GPU; on CPU run it with --dry-run or --predict", file=sys.stderr)
        return 2
    args.out = args.out or os.path.join(BENCH_DIR, "out", "gpu_scale.json")
    args.budget_s = args.budget_s or (1200.0 if args.dry_run else 540.0)
    run = Run(args, "cpu" if args.dry_run else "cuda", sections=SECTIONS)
    run.data["meta"].update(torch=torch.__version__, device=run.device, dry_run=run.dry, setup=SETUP,
                            gpu=torch.cuda.get_device_name() if run.cuda else None, peak_tflops=PEAK_TFLOPS,
                            lowering=LOWERING, lowering_why=LOWERING_WHY, budget_s=args.budget_s,
                            weight_grad_sum=weight_grad_sum(run.device))
    run.save()
    start_watchdog(run, WATCHDOG_MARGIN_S)
    run_sections(run, RUNNERS)
    run.data["meta"]["total_s"] = round(time.time() - run.start, 1)
    run.save()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
