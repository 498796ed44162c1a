"""Llama-3-8B on one GPU at the scale users train, beside the recipes users run (issue 64).

    python3 benchmarks/gpu_scale.py                      # one H100/H200, about 9 min (--budget-s)
    python3 benchmarks/gpu_scale.py --section longest    # some sections only
    python  benchmarks/gpu_scale.py --dry-run            # CPU, a 2-layer Llama, every code path (CI)
    python  benchmarks/gpu_scale.py --predict            # the same tables predicted on fake tensors

The model is transformers' LlamaForCausalLM from benchmarks/paper_table.py's Llama-3-8B config
(use_cache=False), initialised randomly on the GPU in bf16 (no download, no CPU copy). Every
provider trains under the paper table's setup, pure-bf16-fused-optimizer: bf16 weights and AdamW
state, the step fused into backward (tailorfx.SetupOptimizer's hooks, which the peers use too).
The budget is the H100-80GB preset, emulated on a larger GPU by capping the caching allocator
(torch.cuda.set_per_process_memory_fraction) at 79 GiB: an H100's 79.6 GiB less its CUDA context.

Sections, in this order; each writes the JSON (benchmarks/out/gpu_scale.json) as it ends and starts
only while --budget-s has the time it needs:
  longest  tailorfx.max_seq_len for the budget (the planner's time), optimize() at that length
           (capture and planning), the first step (compile), then a steady step: no OOM and the
           measured peak within -2%..+3% of opt.predict_memory(); the next granule up is refused
           by the planner on the device alone (plan_for_budget on fake tensors: on a GPU budget
           its last candidate, checkpoints offloaded to host, may still meet it).
  speed    8K, 16K, 32K tokens: tailorfx's plan for the budget, eager, HF activation
           checkpointing, Liger-Kernel (its defaults, fused linear cross-entropy among them) + HF
           checkpointing, the ALST recipe (DeepSpeed's TiledMLP + TiledFusedLogitsLoss + HF
           checkpointing, benchmarks/alst.py; no ZeRO): step time, tokens/s, MFU. Each peer is
           checked against eager at a short length, and that its feature fired.
  offload  under a lower budget (OFFLOAD_BUDGET): offload="checkpoints" at the longest length
           it reaches (peak vs prediction, host bytes), and its time per token against the
           device-only plan at the longest length that one reaches.
  probe    last, in a subprocess: the longest length's plan run one granule longer (an OOM, or
           a peak over the budget, is what the prediction implies).

MFU = (6 x N x tokens + 6 x layers x tokens^2 x heads x head_dim) / step time / 989 TFLOP/s, the
H100 and H200 dense bf16 peak. N counts every weight but the input embedding (a lookup); the second
term is causal attention's two matmuls, forward and backward (the recompute excluded).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
sys.path[:0] = [REPO, BENCH_DIR]

from gpucheck.record import Run, Skip, bench_module, describe, finish, new_section  # noqa: E402

SECTIONS = ("longest", "speed", "offload", "probe")
SETUP = "pure-bf16-fused-optimizer"
PEAK_TFLOPS = 989.0            # H100 SXM and H200 dense bf16 (NVIDIA's data sheets)
BUDGET = "H100-80GB"
ALLOCATOR_CAP = 79 * 2**30     # an H100's 79.6 GiB less its CUDA context: what its allocator can reach
OFFLOAD_BUDGET = 56 * 2**30    # static 48 GiB of weights and AdamW state; 8 GiB left for the step
OFFLOAD_CAP = OFFLOAD_BUDGET + 3 * 2**29   # the preset's reserve (1.5 GiB) given back to the allocator
LENGTHS = (8192, 16384, 32768)
GRANULE = 128
PROVIDERS = ("tailorfx", "eager", "hf-checkpointing", "liger+hf-checkpointing", "alst")
# dry run: a 2-layer Llama on CPU, budgets in MiB, lengths short enough for CPU steps
DRY = dict(budget=3 << 20, offload_budget=3 << 20, lengths=(256, 512), granule=64, limit=2048)


# ---- the model and its steps ---------------------------------------------------------------

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


def counted_params(model) -> int:
    emb = model.get_input_embeddings().weight
    return sum(p.numel() for p in model.parameters() if p is not emb)


def mfu(model, S: int, seconds: float) -> float:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    flops = 6 * counted_params(model) * S + 6 * cfg.num_hidden_layers * S * S * cfg.num_attention_heads * head_dim
    return flops / seconds / (PEAK_TFLOPS * 1e12)


def sync(run: Run) -> None:
    if run.cuda:
        import torch
        torch.cuda.synchronize()


def stepper(run: Run, module, model, inputs: dict):
    """One training step of `module` (the model as a provider wraps it), the optimizer fused into
    backward through tailorfx.SetupOptimizer's hooks on `model`'s parameters; returns (step, close)."""
    import tailorfx
    optim = tailorfx.SetupOptimizer(model.parameters(), SETUP)

    def step():
        out = module(**inputs)
        loss = out.loss
        loss.backward()
        optim.step()          # a no-op for hooked parameters; steps the rest
        optim.zero_grad()
        sync(run)
        return out
    return step, optim.close


def peak_of(run: Run, step) -> dict:
    """The peak of one steady step: allocated bytes on the GPU (static included), on the CPU
    tailorfx.measure_peak's bytes above what was live before it (dynamic)."""
    import torch
    import tailorfx
    if run.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        return {"before": before, "peak": torch.cuda.max_memory_allocated(),
                "reserved": torch.cuda.max_memory_reserved()}
    return {"dynamic_peak": tailorfx.measure_peak(step)}


def against_prediction(measured: dict, est) -> dict:
    """(predicted - measured) / measured: the whole peak on a GPU, the dynamic peak on the CPU."""
    if "peak" in measured:
        pred, meas = est.peak_bytes, measured["peak"]
    else:
        pred, meas = est.forward_backward_peak_bytes, measured["dynamic_peak"]
    return {"predicted": pred, "measured": meas, "error": (pred - meas) / meas,
            "within_-2%..+3%": -0.02 <= (pred - meas) / meas <= 0.03}


@contextlib.contextmanager
def capped(run: Run, cap: int):
    """The caching allocator capped at `cap` bytes (an 80 GB GPU emulated on a larger one)."""
    if not run.cuda:
        yield None
        return
    import torch
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    try:
        yield cap
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


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
    import tailorfx
    b = budgets(run)
    cfg = config(run.dry)

    def predict():
        t0 = time.time()
        S = tailorfx.max_seq_len(cfg, b["budget"], setup=SETUP, granularity=b["granule"], limit=b["limit"])
        run.shared["longest"] = S
        return {"predicted_longest": S, "planner_s": round(time.time() - t0, 1), "budget": str(b["budget"])}
    run.check(sec, "max_seq_len", predict)

    run.check(sec, "next granule refused", lambda: next_granule(cfg, b["budget"], run.shared["longest"] + b["granule"]))

    def train():
        S = run.shared["longest"]
        with capped(run, b["cap"]):
            t0 = time.time()
            model = build(run)
            res = {"tokens": S, "build_s": round(time.time() - t0, 1)}
            inputs = batch(run, S)
            t0 = time.time()
            opt = tailorfx.optimize(model, budget=b["budget"], setup=SETUP, example_inputs=inputs)
            res["optimize_s"] = round(time.time() - t0, 1)   # capture and planning
            step, close = stepper(run, opt, model, inputs)
            t0 = time.time()
            step()
            res["first_step_s"] = round(time.time() - t0, 1)   # the compile
            est = opt.predict_memory()
            res["plan"] = [p.chosen.label if p.chosen else p.reason for p in opt.plan]
            res["measured"] = peak_of(run, step)
            res["prediction"] = against_prediction(res["measured"], est)
            res["host_bytes"] = est.host_bytes
            t0 = time.time()
            step()
            res["step_s"] = round(time.time() - t0, 2)
            res["mfu"] = mfu(model, S, res["step_s"])
            res["report"] = str(opt.report())[:3000]
            close()
            res["ok"] = res["prediction"]["within_-2%..+3%"] or run.dry
        return res
    run.check(sec, "train at the longest length", train)


def next_granule(cfg, budget, S: int) -> dict:
    """The planner one granule past max_seq_len's (device-only) longest: refused, or, on a GPU
    budget, met only by offloading checkpoints to host memory (the planner's last candidate)."""
    import tailorfx
    from tailorfx.sizing import plan_for_budget
    try:
        opt = plan_for_budget(cfg, budget, S, setup=SETUP)
    except tailorfx.BudgetError as e:
        return {"tokens": S, "refused": str(e)[:600], "smallest_budget": e.suggested_bytes}
    label = opt.plan[0].chosen.label if opt.plan[0].chosen else opt.plan[0].reason
    if "offloaded" in label:
        return {"tokens": S, "refused": "every device-only plan; the planner offloads checkpoints to host", "plan": label}
    return {"tokens": S, "refused": None, "plan": label, "ok": False}


def provider(run: Run, name: str, model):
    """(module to call, what shows the feature fired, cleanup) for one provider on a fresh model."""
    import torch
    if name == "eager":
        return model, (lambda out: {}), (lambda: None)
    if name == "hf-checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model, (lambda out: {"checkpointing": model.is_gradient_checkpointing}), (lambda: None)
    if name == "liger+hf-checkpointing":
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except ImportError as e:
            raise Skip(f"Liger-Kernel is not installed ({e}); carry its wheel (make gpu-wheels)") from e
        restore = restorable_llama_module()
        apply_liger_kernel_to_llama(model=model)   # its defaults: RoPE, RMSNorm, SwiGLU, fused linear CE
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # the fused head returns no logits in training
        return model, (lambda out: {"logits_skipped": out.logits is None}), restore
    if name == "alst":
        alst = bench_module("alst")
        try:
            alst.require_deepspeed()
        except ImportError as e:
            raise Skip(str(e)) from e
        wrapped = alst.ALSTCausalLM(model)
        return wrapped, (lambda out: {k: int(v) for k, v in wrapped.counts.items()}), (lambda: None)
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


def tailorfx_module(run: Run, model, inputs: dict):
    import tailorfx
    opt = tailorfx.optimize(model, budget=budgets(run)["budget"], setup=SETUP, example_inputs=inputs)
    plan = [p.chosen.label if p.chosen else p.reason for p in opt.plan]
    return opt, (lambda out: {"plan": plan, "logits_skipped": out.logits is None}), (lambda: None)


def agreement(run: Run, name: str, S: int) -> dict:
    """A provider's loss and gradient norms beside eager's at S tokens, on the same weights (build()
    seeds its initialisation); bf16 both, so the tolerance is bf16's: 2e-2 on the loss, 5e-2 on
    each weight's gradient norm."""
    inputs = batch(run, S)
    if "eager_reference" not in run.shared:
        ref_model = build(run)
        out = ref_model(**inputs)
        out.loss.backward()
        run.shared["eager_reference"] = (out.loss.item(), {n: p.grad.float().norm().item()
                                                           for n, p in ref_model.named_parameters() if p.grad is not None})
        del ref_model, out
        run.free()
    ref_loss, ref_grads = run.shared["eager_reference"]
    model = build(run)
    module, fired, cleanup = (tailorfx_module(run, model, inputs) if name == "tailorfx" else provider(run, name, model))
    try:
        out = module(**inputs)
        out.loss.backward()
        grads = {n: p.grad.float().norm().item() for n, p in model.named_parameters() if p.grad is not None}
        worst = max(abs(grads.get(n, 0.0) - g) / max(g, 1e-30) for n, g in ref_grads.items())
        res = {"tokens": S, "loss": out.loss.item(), "eager_loss": ref_loss,
               "loss_rel": abs(out.loss.item() - ref_loss) / abs(ref_loss), "worst_grad_norm_rel": worst,
               "fired": fired(out)}
    finally:
        cleanup()
    res["ok"] = res["loss_rel"] <= 2e-2 and worst <= 5e-2
    return res


def timed_steps(run: Run, name: str, S: int, reps: int) -> dict:
    """One provider at S tokens on a fresh model under the capped allocator: the first step (its
    compile), the peak of a steady step, the median step time of `reps` more."""
    import torch
    b = budgets(run)
    with capped(run, b["cap"]):
        model = build(run)
        inputs = batch(run, S)
        t0 = time.time()
        module, fired, cleanup = (tailorfx_module(run, model, inputs) if name == "tailorfx" else provider(run, name, model))
        res = {"provider": name, "tokens": S, "setup_s": round(time.time() - t0, 1)}
        try:
            step, close = stepper(run, module, model, inputs)
            t0 = time.time()
            out = step()
            res["first_step_s"] = round(time.time() - t0, 1)
            res["fired"] = fired(out)
            del out
            res["measured"] = peak_of(run, step)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            res["step_s"] = statistics.median(times)
            res["tokens_per_s"] = S / res["step_s"]
            res["mfu"] = mfu(model, S, res["step_s"])
            close()
        except torch.OutOfMemoryError as e:
            res["oom"] = str(e)[:300]
        finally:
            cleanup()
    return res


def section_speed(run: Run, sec: dict) -> None:
    b = budgets(run)
    reps = 1 if run.dry else 3
    sec["notes"].append("providers run one after another on fresh models (each holds 48 GB of weights and AdamW "
                        "state, so two cannot share the 80 GB budget); the GPU's clocks are steady enough for that")
    short = b["lengths"][0] // 16 if not run.dry else 64
    for name in PROVIDERS:
        if name == "eager":
            continue
        run.check(sec, f"agreement {name}", lambda name=name: agreement(run, name, short))
    for S in b["lengths"]:
        for name in PROVIDERS:
            need = 0 if run.dry else 20 + S / 1024 * 3
            if run.left() < need:
                sec["checks"].append({"name": f"{name} S={S}", "status": "skipped",
                                      "reason": f"time budget ({run.left():.0f} s left, {need:.0f} s needed)"})
                continue
            run.check(sec, f"{name} S={S}", lambda name=name, S=S: timed_steps(run, name, S, reps))


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
    run.check(sec, "max_seq_len with and without offload", predict)

    def train(S: int, offload: bool) -> dict:
        with capped(run, b["offload_cap"]):
            model = build(run)
            inputs = batch(run, S)
            kw = {"offload": "checkpoints", "recompute": "full"} if offload else {}
            opt = tailorfx.optimize(model, budget=b["offload_budget"], setup=SETUP, example_inputs=inputs, **kw)
            step, close = stepper(run, opt, model, inputs)
            step()
            est = opt.predict_memory()
            res = {"tokens": S, "offload": offload, "plan": [p.chosen.label if p.chosen else p.reason for p in opt.plan],
                   "host_bytes_predicted": est.host_bytes}
            res["measured"] = peak_of(run, step)
            res["prediction"] = against_prediction(res["measured"], est)
            times = []
            for _ in range(1 if run.dry else 2):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            res["step_s"] = statistics.median(times)
            res["s_per_1k_tokens"] = res["step_s"] / S * 1024
            close()
            res["ok"] = res["prediction"]["within_-2%..+3%"] or run.dry
        return res
    if "offloaded" not in run.shared:
        return
    run.check(sec, "offloaded at its longest", lambda: train(run.shared["offloaded"], True))
    both = run.shared["device_only"]
    run.check(sec, "device-only at its longest", lambda: train(both, False))
    run.check(sec, "offloaded at the device-only longest", lambda: train(both, True))
    per = {c["name"]: c.get("s_per_1k_tokens") for c in sec["checks"]}
    if per.get("device-only at its longest") and per.get("offloaded at the device-only longest"):
        sec["offload_time_ratio"] = per["offloaded at the device-only longest"] / per["device-only at its longest"]


def section_probe(run: Run, sec: dict) -> None:
    if "longest" not in run.shared:
        raise Skip("the longest section did not predict a length")
    S = run.shared["longest"] + budgets(run)["granule"]

    def probe():
        cmd = [sys.executable, os.path.abspath(__file__), "--probe-tokens", str(S)] + (["--dry-run"] if run.dry else [])
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(60, run.left()))
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        res = json.loads(lines[-1]) if lines else {"stderr": p.stderr[-2000:]}
        res.update(tokens=S, returncode=p.returncode)
        return res
    run.check(sec, f"the longest plan at {S} tokens", probe)


def probe_main(S: int, dry: bool) -> None:
    """In the subprocess: the plan that saves the most (max_seq_len's) at S tokens under the cap,
    with no budget check; prints one JSON line: OOM, or the peak against the budget."""
    import torch
    import tailorfx

    class A:
        dry_run = dry
        budget_s = 1e9
        out = os.devnull
        section = None
    run = Run(A, "cpu" if dry else "cuda", sections=SECTIONS)
    b = budgets(run)
    res = {}
    with capped(run, b["cap"]):
        model = build(run)
        inputs = batch(run, S)
        opt = tailorfx.optimize(model, setup=SETUP, passes=["attention", "minisequence", "recompute"],
                                minisequence="segments", recompute="full", example_inputs=inputs)
        step, close = stepper(run, opt, model, inputs)
        try:
            step()
            res["measured"] = peak_of(run, step)
            res["predicted"] = opt.predict_memory().peak_bytes
            res["budget"] = int(b["budget"].bytes) if hasattr(b["budget"], "bytes") else b["budget"]
        except Exception as e:   # noqa: BLE001  (an OOM is the expected outcome)
            res["error"] = describe(e)
            res["oom"] = "out of memory" in str(e).lower()
        close()
    print(json.dumps(res, default=str), flush=True)


# ---- predicted tables (fake tensors, no GPU) -----------------------------------------------------

def predict_tables(out: str) -> dict:
    """What the GPU run should measure, from the memory model alone (CUDA's costs of the sm90
    budget modelled): the longest lengths, the refusal above, the predicted peaks at the speed
    section's lengths, the offload lengths. Written beside the measured JSON."""
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
    for S in LENGTHS:
        opt = plan_for_budget(cfg, b, S, setup=SETUP)
        est = opt.predict_memory()
        res["speed"][S] = {"plan": [p.chosen.label if p.chosen else p.reason for p in opt.plan],
                           "predicted_peak_gib": round(est.peak_bytes / 2**30, 2)}
        print(S, res["speed"][S], flush=True)
    res["offload"] = {"device_only_longest": tailorfx.max_seq_len(cfg, ob, setup=SETUP, granularity=GRANULE),
                      "offloaded_longest": tailorfx.max_seq_len(cfg, ob, setup=SETUP, granularity=GRANULE,
                                                                offload="checkpoints")}
    print("offload", res["offload"], flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    return res


RUNNERS = {"longest": section_longest, "speed": section_speed, "offload": section_offload, "probe": section_probe}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--section", action="append", choices=SECTIONS, help="repeatable; default: all, in order")
    ap.add_argument("--dry-run", action="store_true", help="CPU, a 2-layer Llama, Triton's interpreter")
    ap.add_argument("--predict", action="store_true", help="the tables on fake tensors (no GPU, no steps)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=540.0, help="seconds: later checks start only while time is left")
    ap.add_argument("--probe-tokens", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dry_run:
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
    run = Run(args, "cpu" if args.dry_run else "cuda", sections=SECTIONS)
    run.data["meta"].update(torch=torch.__version__, device=run.device, dry_run=run.dry, setup=SETUP,
                            gpu=torch.cuda.get_device_name() if run.cuda else None, peak_tflops=PEAK_TFLOPS)
    run.save()
    for name in run.sections:
        sec = run.data["sections"][name] = new_section()
        t0 = time.time()
        try:
            RUNNERS[name](run, sec)
        except Skip as s:
            sec["skipped"].append(str(s))
        except Exception as e:   # noqa: BLE001  (recorded; the next section still runs)
            sec["error"] = describe(e)
        finish(sec, t0)
        run.save()
        print(f"[{name}] {sec['status']} {sec['seconds']} s: " + ", ".join(f"{c['name']} {c['status']}" for c in sec["checks"]),
              flush=True)
    run.data["meta"]["total_s"] = round(time.time() - run.start, 1)
    run.save()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
