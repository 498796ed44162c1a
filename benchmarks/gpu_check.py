"""tailorfx on one CUDA GPU, section by section, written to JSON as each section ends.

    PYTHONPATH=. python3 benchmarks/gpu_check.py                    # every section, ~4 min on an H100
    PYTHONPATH=. python3 benchmarks/gpu_check.py --section kernels --section nccl
    PYTHONPATH=. python3 benchmarks/gpu_check.py --section hf --variant fp32/default   # hf: these variants only
    python benchmarks/gpu_check.py --dry-run                        # CPU, tiny shapes, < 1 min (CI)

Sections (default: all, in this order):
  kernels  each Triton kernel family of tailorfx/runtime/triton_ops.py (RMSNorm/LayerNorm,
           SwiGLU/GeGLU, RoPE, attention: causal, sliding window, documents; the fused LM head
           + cross-entropy) against torch, forward and backward, fp32 and bf16: relative error
           ||out - ref|| / ||ref|| against an fp64 reference on the same rounded inputs (torch's
           own error in the same dtype beside it), pass/fail per tolerance; then the kernel
           benchmark, benchmarks/kernel_speed.py's cases at Llama-3-8B shapes case by case while time is
           left (every provider interleaved: device and wall time, GB/s or TFLOP/s, memory,
           agreement; the attention tiles tuned on the first call).
  memory   the CUDA allocator's history of one training step (HF Llama, bf16, optimize()
           default): its peak and largest allocations with their Python frames, not the snapshot;
           exact attention's SDPA call on grouped k, v in fp32 (k, v repeated on CUDA) against
           SDPA's enable_gqa: peaks, kernels, agreement.
  nccl     a world-size-1 NCCL process group (file:// store): all_reduce, a DeviceMesh; then one
           training step under torch.cuda.set_sync_debug_mode ("warn": every sync and where;
           "error": the first one raises, recorded, not fatal).
  hf       HF LlamaForCausalLM from a config (hidden 1024, 4 layers, vocab 32000; random
           weights) at 2048 tokens under optimize() default (lowering "auto": Inductor on CUDA),
           lowering="eager", kernels="triton", fp32, setup="pure-bf16-fused-optimizer", fp32 with
           checkpoints offloaded to pinned host memory (offload="checkpoints", under the eager
           lowering and under Inductor), and 8192
           tokens while time is left: loss and gradients vs eager, the measured peak of one
           steady-state step vs opt.predict_memory(), step time.

The run keeps to --budget-s (optional variants are skipped, and say so, past it). Every check
catches its own exception (type, message, traceback tail in the JSON) so one failure hides no
other. --dry-run runs every set-up and a tiny version of the work on CPU, Triton kernels through
its interpreter; CUDA-only measurements are listed under "skipped". Needs no install: the repo
root is put on sys.path.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
sys.path[:0] = [REPO, BENCH_DIR]   # tailorfx from this checkout; gpucheck/

from gpucheck.record import SECTIONS, Run, describe, finish, new_section  # noqa: E402


def versions(run: Run) -> dict:
    import numpy
    import torch
    import transformers
    import triton
    import tailorfx
    v = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
         "triton": triton.__version__, "transformers": transformers.__version__, "numpy": numpy.__version__,
         "cuda": torch.version.cuda, "tailorfx": os.path.dirname(tailorfx.__file__), "dry_run": run.dry,
         "device": run.device, "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
         "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32, "budget_s": run.args.budget_s}
    if run.cuda:
        p = torch.cuda.get_device_properties(0)
        v.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_bytes=p.total_memory,
                 num_sms=p.multi_processor_count)
        try:
            nccl = torch.cuda.nccl.version()
            v["nccl"] = ".".join(str(x) for x in nccl) if isinstance(nccl, tuple) else str(nccl)
        except Exception as e:   # noqa: BLE001
            v["nccl"] = f"unknown ({type(e).__name__})"
    return v


def runners() -> dict:
    """Section name -> its function (imported after TRITON_INTERPRET is settled)."""
    from gpucheck.hf_checks import section_hf
    from gpucheck.kernel_checks import section_kernels
    from gpucheck.memory_checks import section_memory
    from gpucheck.nccl_checks import section_nccl
    return {"kernels": section_kernels, "memory": section_memory, "nccl": section_nccl, "hf": section_hf}


def table(data: dict) -> str:
    lines = [f"{data['meta'].get('gpu', data['meta'].get('device'))}  torch {data['meta'].get('torch')}  "
             f"triton {data['meta'].get('triton')}  transformers {data['meta'].get('transformers')}"]
    for name, sec in data["sections"].items():
        counts: dict = {}
        for c in sec["checks"]:
            counts[c["status"]] = counts.get(c["status"], 0) + 1
        lines.append(f"[{name}] {sec['status']}  {sec.get('seconds', '?')} s  " +
                     ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
        if "error" in sec:
            lines.append(f"    section error: {sec['error']['type']}: {sec['error']['message'][:150]}")
        for c in sec["checks"]:
            parts = [f"  {c['status']:<7} {c['name']:<42}"]
            if "worst_rel" in c:
                parts.append(f"rel {c['worst_rel']:.1e}")
            if "ms" in c:
                parts.append(f"{c['ms']:.3f} ms vs torch {c['torch_ms']:.3f} ms")
            if "loss_rel" in c:
                parts.append(f"loss rel {c['loss_rel']:.1e}")
            if "grad_rel" in c:
                parts.append(f"grad rel {c['grad_rel']:.1e}")
            if isinstance(c.get("measured"), dict):
                pred = f"{c['predicted']['peak'] / 2**20:.0f}" if "predicted" in c else "failed"
                cuda = (f", CUDA-modelled {c['predicted_cuda_modelled']['peak'] / 2**20:.0f}"
                        if "predicted_cuda_modelled" in c else "")
                parts.append(f"peak {c['measured']['max_allocated'] / 2**20:.0f} MiB (predicted {pred}{cuda}), "
                             f"reserved/allocated {c['measured']['reserved_over_allocated']:.2f}")
            if "step_ms" in c:
                parts.append(f"step {c['step_ms']:.1f} ms")
            if "vs_eager" in c:
                parts.append(f"vs eager: peak x{c['vs_eager']['dynamic_peak']:.2f}, time x{c['vs_eager']['step_time']:.2f}")
            if "error" in c:
                parts.append(f"{c['error']['type']}: {c['error']['message'][:100]}")
            if "reason" in c:
                parts.append(c["reason"][:100])
            lines.append("  ".join(parts))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--section", action="append", choices=SECTIONS, help="repeatable; default: all")
    ap.add_argument("--variant", action="append", help="hf section: only these variants (repeatable; names as printed)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton's interpreter")
    ap.add_argument("--out", default=os.path.join(BENCH_DIR, "out", "gpu_check.json"))
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="seconds: hf variants start only while enough of it is left (a variant takes up to ~1 min)")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"   # before triton or tailorfx is imported
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check.py needs a CUDA GPU; on CPU run it with --dry-run", file=sys.stderr)
        return 2
    run = Run(args, "cpu" if args.dry_run else "cuda")
    run.data["meta"].update(versions(run))
    run.save()
    for name in run.sections:
        sec = run.data["sections"][name] = new_section()
        t0 = time.time()
        try:
            runners()[name](run, sec)
        except Exception as e:   # noqa: BLE001  (recorded; the next section still runs)
            sec["error"] = describe(e)
        finish(sec, t0)
        run.save()
    run.data["meta"]["total_s"] = round(time.time() - run.start, 1)
    run.save()
    print(table(run.data))
    print(f"wrote {args.out}")
    return 0
if __name__ == "__main__":
    sys.exit(main())
