"""Where optimize()'s time goes on Hugging Face models: Dynamo's capture, the passes and the
compile at the captured sizes, then the first call at a new length (its symbolic sizes compiled
once) and a later one (no compile), against the same model's eager step. One thread, tiny configs
(vocab 512, hidden 64, 2 layers), each family after a warm-up optimize() of Llama (first-use
imports and caches out of the figures).

With `--lowering inductor` the rewritten graphs go through Inductor; each set of families then runs
in `--processes` fresh processes one after another, sharing one new Inductor cache directory, so
the first process compiles cold and the next ones read Inductor's FX graph cache (its hits, misses
and bypasses are counted from `torch._dynamo.utils.counters["inductor"]`).

    python benchmarks/compile_time.py                                 # eager lowering: llama gemma2 mixtral phi3
    python benchmarks/compile_time.py --families qwen3 gpt2
    python benchmarks/compile_time.py --lowering inductor --families llama qwen2 --processes 2
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
CACHE_KEYS = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def _cache_counts() -> dict:
    from torch._dynamo.utils import counters
    return {k: counters["inductor"][k] for k in CACHE_KEYS}


def run(family: str, passes, S: int, lowering: str = "auto") -> dict:
    import tailorfx
    from models import batch, hf_family
    model = hf_family(family)
    before = _cache_counts()
    opt, t_opt = timed(lambda: tailorfx.optimize(model, passes=passes, example_inputs=batch(S=S), lowering=lowering))
    lowerings = [g.lowering for g in opt.session.graphs]
    static = [g.step_static for g in opt.session.graphs]

    def step(n):
        out = opt(**batch(S=n))
        out.loss.backward()
    _, t_first = timed(lambda: step(S))         # the first training step at the captured length
    _, t_new = timed(lambda: step(2 * S))       # a new length: the symbolic compile, once
    _, t_again = timed(lambda: step(3 * S))     # another: no compile
    _, t_eager = timed(lambda: model(**batch(S=3 * S)).loss.backward())
    after = _cache_counts()
    return {"family": family, "passes": passes, "optimize_s": t_opt, "lowering": lowerings, "compiled_static": static,
            "first_step_s": t_first, "first_new_length_s": t_new, "later_length_s": t_again, "eager_step_s": t_eager,
            "graphs": len(opt.session.graphs), "fx_graph_cache": {k: after[k] - before[k] for k in CACHE_KEYS}}


def one_process(families: list[str], S: int, lowering: str) -> list[dict]:
    torch.set_num_threads(1)
    run("llama", None, S, lowering)       # warm-up
    return [run(f, p, S, lowering) for f in families for p in (None, ["minisequence", "recompute"])]


def main():
    from common import print_table, write_json
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=["llama", "gemma2", "mixtral", "phi3"])
    ap.add_argument("--seq", type=int, default=40)
    ap.add_argument("--lowering", default="auto", choices=["auto", "eager", "inductor"])
    ap.add_argument("--processes", type=int, default=None,
                    help="fresh processes sharing one new Inductor cache (default: 2 with inductor, else 1 in this one)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:   # one fresh process: rows as JSON on the last line of stdout
        print(json.dumps(one_process(a.families, a.seq, a.lowering)))
        return
    processes = a.processes or (2 if a.lowering == "inductor" else 1)
    rows = []
    if processes == 1 and a.lowering != "inductor":
        rows = [dict(r, process=1) for r in one_process(a.families, a.seq, a.lowering)]
    else:
        cache = tempfile.mkdtemp(prefix="tailorfx-compile-time-")
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        for p in range(1, processes + 1):
            out = subprocess.run([sys.executable, __file__, "--child", "--seq", str(a.seq), "--lowering", a.lowering,
                                  "--families", *a.families], env=env, capture_output=True, text=True, check=True)
            rows += [dict(r, process=p) for r in json.loads(out.stdout.strip().splitlines()[-1])]
    print_table(f"optimize() on tiny HF models, lowering={a.lowering} (captured at S={a.seq}; then S={2 * a.seq}, "
                f"S={3 * a.seq}), one thread",
                ["process", "family", "passes", "lowering", "optimize() s", "first step s", "first new length s",
                 "later length s", "eager step s", "FX cache hit/miss/bypass"],
                [[str(r["process"]), r["family"], "+".join(r["passes"]) if r["passes"] else "default",
                  ",".join(r["lowering"]), f"{r['optimize_s']:.2f}", f"{r['first_step_s']:.2f}",
                  f"{r['first_new_length_s']:.2f}", f"{r['later_length_s']:.3f}", f"{r['eager_step_s']:.3f}",
                  "/".join(str(r["fx_graph_cache"][k]) for k in CACHE_KEYS)] for r in rows])
    name = "compile_time.json" if a.lowering != "inductor" else "compile_time_inductor.json"
    print("wrote", write_json(name, {"seq": a.seq, "lowering": a.lowering, "processes": processes, "rows": rows}))


if __name__ == "__main__":
    main()
