"""Launch configurations chosen by measurement on the GPU, once per key, kept on disk.

triton.autotune times its configs inside the launch and keys them by argument values; the
kernels here bake tiles into their rendered source and run inside torch.library ops that
Inductor traces on fake tensors. So the choice is made on the host, before the launch: on real
tensors when the call has them, on random ones of the same shape when it is traced, and the
winner is remembered per key (the caller buckets sizes into it) in memory and in
`<triton cache dir>/tuned.json`, so a later process (or a later trace) reuses it untimed.
`pick` does the same between implementations of one op (the attention pass: the Triton flash
kernel or FlexAttention, per form and shape).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence


@dataclass(frozen=True)
class Tiles:
    """One kernel's tiles (rows held by a program x the tile its loop walks) and launch options."""
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: Optional[int] = None   # Triton's default

    def launch(self) -> dict:
        return {"num_warps": self.num_warps} | ({} if self.num_stages is None else {"num_stages": self.num_stages})


_MEMO: dict[str, Tiles] = {}
_TIMES: dict[str, dict[str, float]] = {}
_MISSED: set[str] = set()
_PICKS: dict[str, str] = {}   # key -> the implementation `pick` chose
_SPILLED: dict[str, dict[str, int]] = {}   # key -> candidates whose kernels spilled registers, and how much


def enabled() -> bool:
    """Tuning runs on CUDA only, and not when TAILORFX_AUTOTUNE=0 (then the first candidate)."""
    return os.environ.get("TAILORFX_AUTOTUNE", "1") != "0"


def room_to_time(need: int, device) -> bool:
    """Whether `need` bytes of stand-in tensors to time kernels on take under a quarter of the
    GPU's free memory (the rule every timing on real tensors inside a capture keeps)."""
    import torch
    return need < torch.cuda.mem_get_info(device)[0] / 4


def bucket(size: int) -> int:
    """Sizes that share a choice: powers of two, all above 16K together (the grid fills the GPU)."""
    from tailorfx.kernels import next_pow2
    return min(next_pow2(size), 16384)


def arch_of(device) -> int:
    """The device's sm version; 90 where no GPU is present (a trace on fake CUDA tensors)."""
    import torch
    if not torch.cuda.is_available():
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


class _TooLarge(Exception):
    """A traced call's stand-in tensors would not fit beside what the GPU holds."""


@contextlib.contextmanager
def _stand_ins(*tensors):
    """The call's own tensors, or under a trace (fake tensors) random real ones of their shapes
    to time kernels on; None when a traced call's would take over a quarter of the free memory."""
    import torch
    from tailorfx import compat
    if compat.detect_fake_mode() is None:
        yield tensors
        return
    with compat.untraced_real_tensors():
        shapes = [tuple(compat.size_hint(d) for d in t.shape) for t in tensors]
        need = sum(math.prod(sh) * t.element_size() for sh, t in zip(shapes, tensors))
        if not room_to_time(need, tensors[0].device):
            yield None
            return
        made = [torch.zeros(sh, dtype=t.dtype, device=t.device) if not t.is_floating_point()
                else torch.randn(sh, device=t.device).to(t.dtype) for sh, t in zip(shapes, tensors)]
        yield made
        del made


def choose_on(tensors: Sequence, launch: Callable, choose_with: Callable[[Callable], Tiles]) -> Optional[Tiles]:
    """`choose_with(run)` (a `choose` of the caller's key and candidates) where `run(t)` is
    `launch(t, *real)`: `real` the call's own `tensors`, or under a trace random ones of their
    shapes, made only when a key is first timed; None where those would not fit (the caller keeps
    its default)."""
    with contextlib.ExitStack() as stack:
        made = []

        def run(t):
            if not made:
                made.append(stack.enter_context(_stand_ins(*tensors)))
            if made[0] is None:
                raise _TooLarge
            return launch(t, *made[0])
        try:
            return choose_with(run)
        except _TooLarge:
            return None


def spills(compiled) -> int:
    """The bytes of registers a launched kernel spilled (Triton's CompiledKernel after its first
    launch; 0 where the launcher returns none, as the interpreter's)."""
    return int(getattr(compiled, "n_spills", 0) or 0)


def _path() -> str:
    from tailorfx.kernels import cache_dir
    return os.path.join(cache_dir(), "tuned.json")


def _versions() -> str:
    from importlib.metadata import version
    return f"torch {version('torch')}, triton {version('triton')}"


def _read() -> dict:
    try:
        with open(_path()) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if data.get("versions") == _versions() else {}


def _write(key: str, best, times: dict[str, float], spilled: Optional[dict[str, int]] = None) -> None:
    data = _read() or {"versions": _versions()}
    chosen = {"tiles": asdict(best)} if isinstance(best, Tiles) else {"pick": best}
    data.setdefault("choices", {})[key] = chosen | {"ms": times} | ({"spilled_bytes": spilled} if spilled else {})
    _SPILLED[key] = spilled or {}
    tmp = f"{_path()}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, _path())


def known(key: str, candidates: Sequence[Tiles]) -> Optional[Tiles]:
    """The choice remembered for `key` (this process, then the disk cache), if still a candidate."""
    if key in _MEMO:
        return _MEMO[key]
    if key in _MISSED:   # the disk is read once per key, not per launch
        return None
    found = _read().get("choices", {}).get(key)
    if found is not None and Tiles(**found["tiles"]) in candidates:
        _MEMO[key] = Tiles(**found["tiles"])
        return _MEMO[key]
    _MISSED.add(key)
    return None


def choose(key: str, candidates: Sequence[Tiles], run: Optional[Callable[[Tiles], Optional[int]]],
           timer: Optional[Callable[[Callable[[], None]], float]] = None) -> Tiles:
    """The candidate whose `run` is fastest (`timer(fn) -> ms`, default triton's do_bench),
    timed once per key; a candidate the device cannot run (out of shared memory or registers)
    is skipped. `run` may return the bytes of registers its kernel spilled (Triton reports them
    when it loads the kernel): a candidate that spills under this GPU's compiler is kept only
    where every candidate does. With one candidate nothing is timed; with `run` None (not timed
    now) or tuning off (`enabled`), the remembered choice, else the first."""
    got = known(key, candidates)
    if got is not None:
        return got
    if run is None or not enabled():
        return candidates[0]
    if len(candidates) == 1:
        _MEMO[key] = candidates[0]
        return candidates[0]
    timer = timer or _default_timer
    times, spilled = {}, {}
    for c in candidates:
        def once(c=c):
            spilled[repr(c)] = int(run(c) or 0)
        try:
            times[repr(c)] = float(timer(once))
        except Exception as e:   # noqa: BLE001 - Triton's OutOfResources and compile errors vary by version
            if "out of resource" not in str(e).lower() and type(e).__name__ != "OutOfResources":
                raise
            times[repr(c)] = math.inf
    ran = [c for c in candidates if math.isfinite(times[repr(c)])]
    clean = [c for c in ran if not spilled.get(repr(c))]
    best = min(clean or ran or candidates, key=lambda c: times[repr(c)])
    if math.isinf(times[repr(best)]):
        raise RuntimeError(f"no launch configuration of {key} runs on this device: {list(candidates)}")
    _MEMO[key] = best
    _TIMES[key] = times
    _write(key, best, times, {k: n for k, n in spilled.items() if n})
    return best


def _default_timer(fn: Callable[[], None]) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=5, rep=20)


def known_pick(key: str, names: Sequence[str]) -> Optional[str]:
    """The implementation remembered for `key` (this process, then the disk cache), if still offered."""
    if key not in _PICKS and key not in _MISSED:
        found = _read().get("choices", {}).get(key, {}).get("pick")
        if found is None:
            _MISSED.add(key)
        else:
            _PICKS[key] = found
    got = _PICKS.get(key)
    return got if got in names else None


def pick(key: str, runs: dict[str, Callable[[], None]],
         timer: Optional[Callable[[Callable[[], None]], float]] = None) -> str:
    """The name of the fastest of `runs` (each runs one implementation of the same op), timed once
    per key (`timer(fn) -> ms`, default triton's do_bench) and remembered as `choose`'s tiles are.
    An implementation that fails to compile or run is not picked; its error is kept as its time."""
    got = known_pick(key, list(runs))
    if got is not None:
        return got
    timer = timer or _default_timer
    times: dict = {}
    for name, run in runs.items():
        try:
            times[name] = float(timer(run))
        except Exception as e:   # noqa: BLE001 - an implementation that cannot run here loses
            times[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    ran = [n for n in runs if isinstance(times[n], float)]
    if not ran:
        raise RuntimeError(f"no implementation of {key} runs on this device: {times}")
    best = min(ran, key=lambda n: times[n])
    _PICKS[key] = best
    _MISSED.discard(key)
    _TIMES[key] = times
    _write(key, best, times)
    return best


def pick_apart(key: str, names: Sequence[str], make_runs: Callable[[], dict[str, Callable[[], None]]],
               timer: Optional[Callable[[Callable[[], None]], float]] = None) -> str:
    """`pick(key, make_runs(), timer)` (the remembered choice among `names` without one), apart from
    a capture that may be running: on real tensors, with gradients, and with each torch.compile'd
    implementation's backward compiled with its forward (compiled at its first backward, it would
    record its compile metrics into the capture's)."""
    import torch

    from tailorfx import compat
    got = known_pick(key, names)
    if got is not None:
        return got
    with compat.untraced_real_tensors(), compat.backward_compiled_with_forward(), torch.enable_grad():
        return pick(key, make_runs(), timer)


def choices() -> dict[str, dict]:
    """What this process chose: key -> {"tiles" or "pick", "ms" per candidate (timed here, else {}),
    and "spilled_bytes" per candidate whose kernel spilled registers, if any}."""
    tiles = {k: {"tiles": asdict(v), "ms": _TIMES.get(k, {})} | ({"spilled_bytes": _SPILLED[k]} if _SPILLED.get(k) else {})
             for k, v in _MEMO.items()}
    return tiles | {k: {"pick": v, "ms": _TIMES.get(k, {})} for k, v in _PICKS.items()}
