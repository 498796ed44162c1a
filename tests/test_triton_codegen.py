"""Triton codegen: the generated source of every example spec against its golden, every example
compiled for sm80 and sm90 on this GPU-less machine (no register spills, shared memory within
the arch's limit), the norm kernels against torch under the interpreter, and the kernels pass on
HF models (each norm replaced, loss and gradients equal eager's)."""
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tailorfx import kernels as tt
from tailorfx.kernels import norm

GOLDENS = os.path.join(os.path.dirname(__file__), "goldens", "triton")


def _examples():
    out = []
    for fam in tt.FAMILIES:
        try:
            mod = tt.family(fam)
        except ModuleNotFoundError:
            continue
        out += mod.examples()
    return out


EXAMPLES = _examples()


@pytest.mark.parametrize("spec", EXAMPLES, ids=[s.name for s in EXAMPLES])
def test_golden_source(spec):
    got = tt.render(spec)
    path = os.path.join(GOLDENS, f"{spec.name}.py")
    if os.environ.get("TAILORFX_UPDATE_GOLDENS"):
        with open(path, "w") as f:
            f.write(got)
    with open(path) as f:
        assert got == f.read(), f"{spec.name}: generated source changed (TAILORFX_UPDATE_GOLDENS=1 to accept)"


def test_goldens_have_examples():
    """A golden file whose spec is no longer an example is stale."""
    names = {f"{s.name}.py" for s in EXAMPLES}
    assert sorted(set(os.listdir(GOLDENS)) - names) == []


@pytest.mark.slow
@pytest.mark.ptxas   # make test-torch211 (CI) runs it under the GPU machines' Triton
def test_every_example_compiles_for_sm80_and_sm90():
    """sm80 with float scalars typed as Triton's launcher types them (fp32), sm90 as Inductor's
    (fp64): a kernel must keep its dots and stores fp32 under both."""
    jobs, results = [], []
    for arch, floats in zip(tt.ARCHS, ("fp32", "fp64")):
        some = [(spec, arch) for spec in EXAMPLES]
        jobs += some
        results += tt.compile_many(some, float_type=floats)
    bad = []
    for (spec, arch), res in zip(jobs, results):
        assert res["cubin"] and all(len(c) > 0 for c in res["cubin"].values())
        assert 0 < res["n_regs"] <= 255
        if res["n_spills"] or res["shared_bytes"] > tt.SHARED_LIMIT[arch]:
            bad.append(f"{spec.name} sm{arch}: {res['n_spills']} B spilled, {res['shared_bytes']} B shared")
    assert bad == []


# the forms each attention tile candidate is compiled in: the plain one (causal, GQA 4) for every
# candidate, the others for those not marked plain-only (flash_tiles._HALF)
_PLAIN = dict(mask="full", causal=True)
_RICH = [dict(mask="window", causal=True, documents=True, softcap=30.0, key_bias=True),
         dict(mask="full", causal=False, documents=True)]


@pytest.mark.slow
@pytest.mark.ptxas   # about 30 ptxas runs per (head dim, arch): make test-torch211 (CI)
@pytest.mark.parametrize("head_dim,arch", [(64, 90), (128, 90), (256, 90), (64, 80), (128, 80), (256, 80)])
def test_every_attention_tile_candidate_compiles_without_spills(head_dim, arch):
    """Each flash-attention kernel at each candidate's tiles, warps and stages (the choices a
    GPU launch times, flash_tiles.candidates), compiled for its arch with ptxas: no register
    spills, shared memory within the arch's limit, in every form it may serve (bf16, the sm90
    Inductor typing of float scalars, fp64), dk/dv also as its split launch. CI runs it under
    Triton 3.9 and 3.6 (the GPU machines'), whose register allocations differ."""
    from tailorfx.kernels import flash_tiles
    from tailorfx.kernels.flash_launch import KERNELS as fn, _spec, normalize_params
    jobs = []
    for role, split in [(r, False) for r in flash_tiles.ROLES] + [("dkdv", True)]:
        rich = flash_tiles.candidates(role, "bf16", head_dim, "full", arch, False, split)
        for t in flash_tiles.candidates(role, "bf16", head_dim, "full", arch, True, split):
            for form in [_PLAIN] + (_RICH if t in rich else []):
                form = dict(form)
                mask = form.pop("mask")
                params = normalize_params(mask, {"full": (), "window": (256, 4)}[mask])
                tiles = {"fwd": (t.block_m, t.block_n, 64, 64, 16, 64), "dq": (64, 64, t.block_m, t.block_n, 16, 64),
                         "dkdv": (64, 64, 64, 64, t.block_m, t.block_n)}[role]
                spec = _spec("bf16", head_dim, 4, mask, params, form.get("causal", False), form.get("documents", False),
                             form.get("softcap"), form.get("key_bias", False), tiles, False)
                # split: the KV head's 4 query heads one a program, storing fp32 parts (flash_tiles.kv_split)
                over = {"overrides": {"KV_SPLIT": 4, "dk_ptr": "*fp32", "dv_ptr": "*fp32"}} if split else {}
                jobs.append((spec, arch, {"num_warps": t.num_warps, "num_stages": t.num_stages, "functions": [fn[role]],
                                          **over}))
    results = tt.compile_many(jobs, float_type="fp64" if arch == 90 else "fp32")
    bad = [f"{spec.name} sm{arch} {opts}: {res['n_spills']} B spilled, {res['shared_bytes']} B shared"
           for (spec, arch, opts), res in zip(jobs, results)
           if res["n_spills"] or res["shared_bytes"] > tt.SHARED_LIMIT[arch]]
    assert len(results) == len(jobs) >= 10
    assert bad == [], "\n".join(bad)


def test_compile_refuses_unknown_arch():
    with pytest.raises(ValueError, match="arch=75 is not supported"):
        tt.load(EXAMPLES[0]).compile(75)


def test_unknown_family():
    with pytest.raises(ValueError, match="unknown Triton kernel family 'conv'"):
        tt.KernelSpec("conv", block=4)


def test_layer_norm_without_bias_renders_no_bias():
    src = tt.render(tt.KernelSpec("norm", kind="layer", block=64, dtype="fp32", bias=False))
    assert "b_ptr + cols" not in src and "db +=" not in src
    assert "b_ptr + cols" in tt.render(tt.KernelSpec("norm", kind="layer", block=64, dtype="fp32", bias=True))


def _norm_ref(x, w, b, eps, kind, offset, dtype=torch.float32):
    xf = x.to(dtype)
    if kind == "layer":
        return torch.nn.functional.layer_norm(xf, (x.shape[-1],), w.to(dtype), None if b is None else b.to(dtype), eps)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (w.to(dtype) + offset)


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 9), width=st.integers(1, 70), kind=st.sampled_from(["rms", "rms1", "layer", "layer_nobias"]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), per=st.sampled_from([1, 3, 32]))
def test_norm_matches_torch(rows, width, kind, dtype, per):
    """Forward and backward against torch in fp64 (an fp32 reference has rounding errors of its
    own, which 1/sqrt(eps) amplifies where a row's variance is ~0, e.g. a layer norm of width 1):
    fp32 to 1e-5, fp16/bf16 inputs to their rounding (the kernels compute in fp32 and round once
    on store)."""
    g = torch.Generator().manual_seed(rows * 100 + width)
    x = torch.randn(rows, width, generator=g).to(dtype)
    w = torch.randn(width, generator=g).to(dtype)
    b = torch.randn(width, generator=g).to(dtype) if kind == "layer" else None
    offset = 1.0 if kind == "rms1" else 0.0
    k = "rms" if kind.startswith("rms") else "layer"
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    br = b.double().requires_grad_() if b is not None else None
    ref = _norm_ref(xr, wr, br, 1e-5, k, offset, torch.float64)
    dy = torch.randn(rows, width, generator=g)
    ref.backward(dy.double())
    y, rstd, mean = norm.forward(x, w, b, 1e-5, k, offset)
    dx, dw, db = norm.backward(dy.to(dtype), x, w, rstd, mean, k, offset, b is not None, rows_per_program=per)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    if dtype != torch.float32:   # the reference sees dy rounded as the kernel does
        dy = dy.to(dtype).double()
        xr.grad = wr.grad = None
        if br is not None:
            br.grad = None
        _norm_ref(xr, wr, br, 1e-5, k, offset, torch.float64).backward(dy)

    def close(a, r, name, scale=1.0):
        scale = max(float(r.abs().max()), scale, 1.0)
        assert (a.double() - r).abs().max() <= tol * scale * max(1, width) ** 0.5, name
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    close(y, ref.detach(), "y")
    # dx = rstd * (dy*w - its mean - xhat * mean(dy*w*xhat)): the kernel's fp32 rounding of the
    # terms in brackets reaches dx multiplied by rstd (up to 1/sqrt(eps) for a row of ~0 variance)
    close(dx, xr.grad, "dx", float(rstd.max()) * float((dy.float() * w.float()).abs().max()))
    close(dw, wr.grad, "dw")
    if b is not None:
        close(db, br.grad, "db")
    else:
        assert db is None
