"""What gpu_check's sections share: the run (its results, written after every check; its time
budget; models the sections reuse) and how a check's outcome is recorded."""
from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from typing import Callable, Optional

SECTIONS = ("kernels", "memory", "nccl", "hf")
BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench_module(name: str):
    """benchmarks/NAME.py, loaded by its path (under a name no installed package has)."""
    import importlib.util
    mod_name = f"tailorfx_benchmarks_{name}"
    if mod_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(mod_name, os.path.join(BENCH_DIR, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[mod_name] = module
    return sys.modules[mod_name]


class Skip(Exception):
    """A check that cannot run here (the reason is recorded, the section stays ok)."""


# ---- recording -------------------------------------------------------------------------------

def describe(e: BaseException) -> dict:
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    return {"type": type(e).__name__, "message": str(e)[:2000], "traceback": "".join(tb)[-3000:]}


def error_chain_text(e: BaseException) -> str:
    seen, parts = set(), []
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return "\n".join(parts)


class Run:
    """The results so far (written after every check) and what the sections share."""

    def __init__(self, args, device: str, sections: tuple = SECTIONS):
        self.args, self.dry, self.device = args, args.dry_run, device
        self.sections = [s for s in dict.fromkeys(args.section or sections) if s in sections]   # in the order asked
        self.cuda = device == "cuda"
        self.start = time.time()
        self.shared: dict = {}   # trained models the sections reuse (compiling costs most of the time)
        self.data = {"meta": {"argv": sys.argv[1:], "started": time.strftime("%Y-%m-%d %H:%M:%S")},
                     "sections": {}}
        self._interp: Optional[str] = None

    def left(self) -> float:
        return self.args.budget_s - (time.time() - self.start)

    def save(self) -> None:
        path = self.args.out
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, path)

    def check(self, section: dict, name: str, fn: Callable[[], Optional[dict]]) -> dict:
        """Run one check; its dict (optionally with "ok") goes in the section, an exception too.
        The entry is saved as "running" before `fn` starts, so a run killed mid-check says which
        check it was in and since when (`at_s`: seconds into the run)."""
        t0 = time.time()
        entry = {"name": name, "status": "running", "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "at_s": round(t0 - self.start, 1)}
        section["checks"].append(entry)
        self.save()
        try:
            res = dict(fn() or {})
            status = "pass" if res.pop("ok", True) else "fail"
        except Skip as s:
            res, status = {"reason": str(s)}, "skipped"
        except Exception as e:   # noqa: BLE001  (recorded: one failure must not hide the others)
            reason = self.interpreter_limit(e)
            res, status = ({"reason": reason}, "skipped") if reason else ({"error": describe(e)}, "error")
        entry.update(status=status, seconds=round(time.time() - t0, 2), **res)
        self.free()
        self.save()
        return entry

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            import torch
            torch.cuda.empty_cache()

    def interpreter_limit(self, e: BaseException) -> Optional[str]:
        """The reason, when `e` is Triton's interpreter failing on a runtime loop bound (see probe)."""
        if "only 0-dimensional arrays can be converted" not in error_chain_text(e):
            return None
        if self._interp is None:
            self._interp = interpreter_probe() or ""
        return self._interp or None


def interpreter_probe() -> Optional[str]:
    """Why Triton's CPU interpreter cannot run a loop whose bound is a runtime value here, or None.
    Triton 3.6's interpreter takes int() of a 1-element array, which NumPy >= 2.4 refuses (Triton
    3.9 squeezes it first); compiled for a GPU the same kernels are fine."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    import numpy
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def count(n_ptr, out_ptr):
        n = tl.load(n_ptr)
        acc = 0.0
        for _ in range(0, n):
            acc += 1.0
        tl.store(out_ptr, acc)
    out = torch.zeros(1)
    try:
        count[(1,)](torch.tensor([3], dtype=torch.int32), out)
    except Exception as e:   # noqa: BLE001
        return (f"Triton {triton.__version__}'s interpreter cannot run a loop with a runtime bound under NumPy "
                f"{numpy.__version__} ({type(e).__name__}: {str(e)[:120]}): the kernels with such loops (attention, "
                f"the LM head, norm backward) are skipped under the interpreter here; on a GPU they compile")
    return None


def new_section() -> dict:
    return {"status": "running", "checks": [], "skipped": [], "notes": []}


def finish(section: dict, t0: float) -> None:
    statuses = {c["status"] for c in section["checks"]}
    section["status"] = ("error" if "error" in statuses or "error" in section else
                         "fail" if "fail" in statuses else "ok")
    section["seconds"] = round(time.time() - t0, 1)
