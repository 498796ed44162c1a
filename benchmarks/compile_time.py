"""Where optimize()'s time goes on Hugging Face models: Dynamo's capture, the passes and the
compile at the captured sizes (the static-first lowering, codegen/lower.py), then the first call at
a new length (its symbolic sizes compiled once) and a later one (no compile), against the same
model's eager step. One thread, tiny configs (vocab 512, hidden 64, 2 layers), one process, each
family after a warm-up optimize() of Llama (first-use imports and caches out of the figures).

    python benchmarks/compile_time.py                     # llama gemma2 mixtral phi3
    python benchmarks/compile_time.py --families qwen3 gpt2
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def run(family: str, passes, S: int) -> dict:
    import tailorfx
    from models import batch, hf_family
    model = hf_family(family)
    opt, t_opt = timed(lambda: tailorfx.optimize(model, passes=passes, example_inputs=batch(S=S)))
    lowering = [g.lowering for g in opt.session.graphs]
    static = [g.step_static for g in opt.session.graphs]

    def step(n):
        out = opt(**batch(S=n))
        out.loss.backward()
    _, t_new = timed(lambda: step(2 * S))       # a new length: the symbolic compile, once
    _, t_again = timed(lambda: step(3 * S))     # another: no compile
    _, t_eager = timed(lambda: model(**batch(S=3 * S)).loss.backward())
    return {"family": family, "passes": passes, "optimize_s": t_opt, "lowering": lowering, "compiled_static": static,
            "first_new_length_s": t_new, "later_length_s": t_again, "eager_step_s": t_eager,
            "graphs": len(opt.session.graphs)}


def main():
    from common import print_table, write_json
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=["llama", "gemma2", "mixtral", "phi3"])
    ap.add_argument("--seq", type=int, default=40)
    a = ap.parse_args()
    torch.set_num_threads(1)
    run("llama", None, a.seq)       # warm-up
    rows = [run(f, p, a.seq) for f in a.families for p in (None, ["minisequence", "recompute"])]
    print_table(f"optimize() on tiny HF models (captured at S={a.seq}; then S={2 * a.seq}, S={3 * a.seq}), one thread",
                ["family", "passes", "lowering", "optimize() s", "first new length s", "later length s",
                 "eager step s"],
                [[r["family"], "+".join(r["passes"]) if r["passes"] else "default", ",".join(r["lowering"]),
                  f"{r['optimize_s']:.2f}", f"{r['first_new_length_s']:.2f}", f"{r['later_length_s']:.3f}",
                  f"{r['eager_step_s']:.3f}"] for r in rows])
    print("wrote", write_json("compile_time.json", {"seq": a.seq, "rows": rows}))


if __name__ == "__main__":
    main()
