"""Triton kernels rendered from op specs: one template per kernel family, a cache keyed by spec.

    spec = KernelSpec("rms_norm", dtype="fp32", block=1024)
    kernel = load(spec)            # renders, writes, imports (cached by spec)
    kernel.source                  # the Triton source text (goldens live in tests/golden/triton/)
    kernel.fn("norm_fwd")[grid](...)   # a launch (through torch.library.wrap_triton on a GPU)
    kernel.compile(90)             # PTX -> cubin for sm90 on this GPU-less machine: regs, spills, shared

A family is a module in this package with `render(spec) -> str` (the source, spec values baked in
as module-level `tl.constexpr`s) and `signatures(spec) -> {fn name: {arg: type}}` (what
`triton.compile` needs for each jit function it compiles ahead of time). Its launch code gets
kernels through `cached_kernel`, keyed by the static arguments a spec is built from, so a warm
launch builds no KernelSpec.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

import torch

FAMILIES: tuple[str, ...] = ("norm", "partials", "glu", "rope", "linear_cross_entropy", "flash_attention")


# a spec's dtype: its name for a torch dtype, and the Triton pointer type of a tensor of it
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
POINTER_TYPES = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16"}


def next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1): a block that covers n elements."""
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) in integers: the programs or tiles that cover a elements b at a time."""
    return -(-a // b)


@dataclass(frozen=True)
class KernelSpec:
    """A kernel family and the compile-time values its source is rendered with."""
    family: str
    params: tuple[tuple[str, Any], ...]

    def __init__(self, family: str, **params: Any):
        if family not in FAMILIES:
            raise ValueError(f"unknown Triton kernel family {family!r}; one of {list(FAMILIES)}")
        object.__setattr__(self, "family", family)
        object.__setattr__(self, "params", tuple(sorted(params.items())))

    def __getitem__(self, key: str) -> Any:
        return dict(self.params)[key]

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)

    @property
    def name(self) -> str:
        """A readable, unique name: family and values (`norm_kind=rms_dtype=fp32_block=1024`)."""
        return "_".join([self.family] + [f"{k}={v}" for k, v in self.params])

    @property
    def key(self) -> str:
        return hashlib.sha256(self.name.encode()).hexdigest()[:16]


def family(name: str):
    """The module holding a family's template."""
    if name not in FAMILIES:
        raise ValueError(f"unknown Triton kernel family {name!r}; one of {list(FAMILIES)}")
    return importlib.import_module(f"{__name__}.{name}")


def render(spec: KernelSpec) -> str:
    """The Triton source text of `spec` (deterministic: the goldens compare it byte for byte)."""
    return family(spec.family).render(spec)


def cache_dir() -> str:
    """Where rendered kernels and tuning choices live: $TAILORFX_TRITON_CACHE, else a folder in the temp dir."""
    path = os.environ.get("TAILORFX_TRITON_CACHE") or os.path.join(tempfile.gettempdir(), f"tailorfx-triton-{os.getuid()}")
    os.makedirs(path, exist_ok=True)
    return path


class Kernel:
    """A rendered family instance: its source, its jit functions, and ahead-of-time compilation."""

    def __init__(self, spec: KernelSpec, source: str, module):
        self.spec, self.source, self.module = spec, source, module
        self.interpreted = module.__name__.endswith("_interpreted")

    def fn(self, name: str):
        """The launchable kernel: `fn[grid](*args)`. On a GPU it goes through
        torch.library.wrap_triton, so a torch.library.triton_op calling it stays traceable
        (Inductor sees into it). wrap_triton returns the jit function itself outside a trace and
        a traceable wrapper inside one, so it is called per launch (a cached eager result would
        launch untraced under Inductor). The interpreter's functions are launched as they are."""
        jit = self.jit(name)
        if self.interpreted:
            return jit
        from torch.library import wrap_triton
        return wrap_triton(jit)

    def jit(self, name: str):
        """The @triton.jit function itself."""
        return getattr(self.module, name)

    def signatures(self) -> dict[str, dict[str, str]]:
        return family(self.spec.family).signatures(self.spec)

    def compile(self, arch: int, num_warps: Optional[int] = None) -> dict:
        """Compile every jit function of this kernel for sm`arch` (80 or 90): `n_regs` and `n_spills`
        (the largest over its functions, from ptxas -v), `shared_bytes`, and `cubin` per function;
        `num_warps` defaults to the family's choice for the spec (`num_warps(spec)`, else 4)."""
        return compile_many([(self.spec, arch)], num_warps)[0]

    def __repr__(self) -> str:
        return f"Kernel({self.spec.name})"


def load(spec: KernelSpec) -> Kernel:
    """Render `spec`, write it to the cache directory and import it (Triton reads a jit function's
    source from its file, so the rendered text has to live in one). Under TRITON_INTERPRET=1 its
    functions run on CPU through Triton's interpreter."""
    return _load(spec, interpreted())


def cached_kernel(spec_of):
    """`spec_of(*static) -> KernelSpec` turned into `kernel(*static) -> Kernel`, loaded once per
    static arguments (hashable values: dtypes' names, sizes, flags) and interpreter setting: a
    launch after the first builds, hashes and looks up no KernelSpec."""
    @functools.lru_cache(maxsize=None)
    def by_static(interpret: bool, *static) -> Kernel:
        return _load(spec_of(*static), interpret)

    def kernel(*static) -> Kernel:
        return by_static(interpreted(), *static)
    kernel.cache_info = by_static.cache_info
    return kernel


@functools.lru_cache(maxsize=None)
def _load(spec: KernelSpec, interpret: bool) -> Kernel:
    import triton
    source = render(spec)
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    mod_name = f"tailorfx_triton_{spec.family}_{digest}" + ("_interpreted" if interpret else "")
    path = os.path.join(cache_dir(), mod_name + ".py")
    if not os.path.exists(path) or open(path).read() != source:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    if mod_name in sys.modules:
        return Kernel(spec, source, sys.modules[mod_name])
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    old = triton.knobs.runtime.interpret
    triton.knobs.runtime.interpret = interpret   # read by @triton.jit when the module runs
    try:
        module_spec.loader.exec_module(module)
    finally:
        triton.knobs.runtime.interpret = old
    return Kernel(spec, source, module)


ARCHS = (80, 90)


def compile_many(jobs: list[tuple], num_warps: Optional[int] = None, float_type: str = "fp32") -> list[dict]:
    """compile_kernel for each (spec, arch) or (spec, arch, options): options are compile_kernel's
    num_warps, num_stages and functions for that job. A process whose Triton runs the
    interpreter cannot also compile (the interpreter patches triton.language when it is
    imported), so there the jobs run in one fresh Python process without TRITON_INTERPRET."""
    jobs = [(j[0], j[1], {"num_warps": num_warps, **(j[2] if len(j) > 2 else {})}) for j in jobs]
    for _, arch, _ in jobs:
        if arch not in ARCHS:
            raise ValueError(f"arch={arch!r} is not supported: one of {list(ARCHS)} (sm80 = A100, sm90 = H100)")
    if not interpreted():
        return [compile_kernel(_load(spec, False), arch, float_type=float_type, **opts) for spec, arch, opts in jobs]
    import base64
    import json
    import subprocess
    import tempfile
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    request = json.dumps({"jobs": [[spec.family, list(spec.params), arch, opts] for spec, arch, opts in jobs],
                          "float_type": float_type})
    # files, not pipes: the wait is for the process alone, not for every process that inherits a pipe
    with tempfile.TemporaryFile("w+") as stdin, tempfile.TemporaryFile("w+") as stdout, \
            tempfile.TemporaryFile("w+") as stderr:
        stdin.write(request)
        stdin.seek(0)
        r = subprocess.run([sys.executable, "-c", f"from {__name__} import _compile_main; _compile_main()"],
                           stdin=stdin, stdout=stdout, stderr=stderr, env=env)
        stdout.seek(0)
        stderr.seek(0)
        printed, errors = stdout.read(), stderr.read()
    if r.returncode:
        raise RuntimeError(f"compiling Triton kernels for {sorted({a for _, a in jobs})} failed:\n{errors[-4000:]}")
    out = json.loads(printed.strip().splitlines()[-1])
    for res in out:
        res["cubin"] = {k: base64.b64decode(v) for k, v in res["cubin"].items()}
    return out


def _compile_main() -> None:
    """compile_many's worker: jobs as JSON on stdin, results (cubins base64) as one JSON line."""
    import base64
    import json
    request = json.loads(sys.stdin.read())
    out = []
    for fam, params, arch, opts in request["jobs"]:
        res = compile_kernel(_load(KernelSpec(fam, **dict(params)), False), arch, float_type=request["float_type"],
                             **opts)
        res["cubin"] = {k: base64.b64encode(v).decode() for k, v in res["cubin"].items()}
        out.append(res)
    print(json.dumps(out))


def warps(spec: KernelSpec) -> int:
    """The warps a family launches `spec` with (its `num_warps(spec)`, else 4)."""
    fn = getattr(family(spec.family), "num_warps", None)
    return fn(spec) if fn is not None else 4


def compile_kernel(kernel: Kernel, arch: int, num_warps: Optional[int] = None, float_type: str = "fp32",
                   num_stages: Optional[int] = None, functions: Optional[list[str]] = None,
                   overrides: Optional[dict] = None) -> dict:
    """triton.compile for CUDA sm`arch` without a GPU; registers and spills from the bundled ptxas.
    float_type: how a launch types the kernels' float scalars (Triton's launcher "fp32", Inductor's
    "fp64" on CUDA); num_stages: Triton's default unless given; functions: all unless given;
    overrides: {argument: type or constexpr value} replacing the signatures' where a function has it."""
    num_warps = num_warps or warps(kernel.spec)
    options = {"num_warps": num_warps} | ({} if num_stages is None else {"num_stages": num_stages})
    import re
    import subprocess

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    out = {"n_regs": 0, "n_spills": 0, "shared_bytes": 0, "cubin": {}, "functions": {}}
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    gpu = "sm_90a" if arch == 90 else f"sm_{arch}"
    for name, signature in kernel.signatures().items():
        if functions is not None and name not in functions:
            continue
        fn = kernel.jit(name)
        signature = {k: (overrides or {}).get(k, v) for k, v in signature.items()}
        constexprs = {k: v for k, v in signature.items() if not isinstance(v, str)}
        sig = {k: ("constexpr" if not isinstance(v, str) else float_type if v == "fp32" else v)
               for k, v in signature.items()}
        compiled = triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", arch, 32),
                                  options=options)
        with tempfile.TemporaryDirectory() as d:
            ptx = os.path.join(d, "k.ptx")
            with open(ptx, "w") as f:
                f.write(compiled.asm["ptx"])
            r = subprocess.run([ptxas, "-v", "--gpu-name", gpu, ptx, "-o", os.path.join(d, "k.o")],
                               capture_output=True, text=True, check=True)
        log = r.stdout + r.stderr
        regs = max(int(x) for x in re.findall(r"Used (\d+) registers", log))
        spills = sum(int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log))
        info = {"n_regs": regs, "n_spills": spills, "shared_bytes": int(compiled.metadata.shared),
                "num_warps": num_warps, "num_stages": num_stages}
        out["functions"][name] = info
        out["cubin"][name] = compiled.asm["cubin"]
        out["n_regs"] = max(out["n_regs"], regs)
        out["n_spills"] = max(out["n_spills"], spills)
        out["shared_bytes"] = max(out["shared_bytes"], info["shared_bytes"])
    return out


SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}   # opt-in shared memory per block (A100, H100)


def interpreted() -> bool:
    """Triton runs kernels on CPU only through its interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_triton(model: torch.nn.Module) -> None:
    """kernels="triton" needs a CUDA model, or Triton's CPU interpreter for a CPU one; a model of
    fake tensors (predicted for, never run: shallow.py's capture of a config) a GPU's Triton driver
    to trace the kernels' launches with, or the interpreter."""
    from tailorfx import compat
    params = list(model.parameters())
    if params and all(isinstance(p, compat.FakeTensor) for p in params) and torch.cuda.is_available():
        return
    devices = {p.device.type for p in params}
    if devices - {"cuda"} and not interpreted():
        raise ValueError(f"kernels='triton' on a {'/'.join(sorted(devices))} model needs Triton's CPU interpreter: "
                         f"set TRITON_INTERPRET=1 before importing tailorfx (slow; for tests), or move the "
                         f"model to a CUDA GPU, or drop kernels= to run torch's own ops")
