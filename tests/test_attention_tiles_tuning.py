"""Flash attention's tiles chosen by measurement (tailorfx/kernels/flash_tiles.py, tuning.py):
the candidates, the choice of the fastest per key, remembered in the process and on disk, a
candidate the device cannot run skipped, and every candidate exact under Triton's interpreter.
The GPU's own timings are in benchmarks/kernel_speed.py; here a timer stands in for the device."""
import json
import os
import subprocess
import sys
import uuid

os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported: kernels run on CPU

import pytest  # noqa: E402
import torch  # noqa: E402

from tailorfx.kernels import flash_launch as fl  # noqa: E402
from tailorfx.kernels import flash_tiles, tuning  # noqa: E402
from tailorfx.kernels.tuning import Tiles  # noqa: E402

from test_triton_attention import check  # noqa: E402


def test_sixteen_bit_candidates_hold_at_least_64_rows():
    """sm90 runs a dot as wgmma only from 64 rows: the rows a program keeps (queries in the
    forward and dq, keys in dk/dv) are at least 64 in every 16-bit sm90 forward and dq candidate,
    and in each kernel's sm90 default for the plain form. At head dim 128 dk/dv of a richer form
    holds 32 keys (64 spill under Triton 3.6), as sm80's does in every form (mma.sync has no such
    minimum)."""
    def kept(role, cands):
        return [t.block_n if role == "dkdv" else t.block_m for t in cands]
    for d in (64, 128):
        for role in flash_tiles.ROLES:
            full = flash_tiles.candidates(role, "bf16", d, "full", 90)
            assert full and len(set(full)) == len(full)
            assert kept(role, full[:1]) >= [64], (d, role, full)
            rich = flash_tiles.candidates(role, "bf16", d, "window", 90, is_plain=False)
            assert rich and set(rich) <= set(full)
            if role != "dkdv":
                assert min(kept(role, full)) >= 64 and min(kept(role, rich)) >= 64, (d, role)
            for plain in (True, False):
                sm80 = flash_tiles.candidates(role, "bf16", d, "window", 80, is_plain=plain)
                assert sm80 and len(set(sm80)) == len(sm80)
    assert min(kept("dkdv", flash_tiles.candidates("dkdv", "bf16", 64, "window", 90, is_plain=False))) >= 64
    assert set(kept("dkdv", flash_tiles.candidates("dkdv", "bf16", 128, "window", 90, is_plain=False))) == {32}
    assert set(kept("dkdv", flash_tiles.candidates("dkdv", "bf16", 128, "full", 80))) == {32}
    assert flash_tiles.candidates("fwd", "fp32", 128, "full") == [Tiles(16, 16)]   # FMAs: one, small
    gemma = [flash_tiles.candidates(r, "bf16", 256, "window", a, p) for r in flash_tiles.ROLES for a in (80, 90)
             for p in (True, False)]
    assert all(c and {t.num_warps for t in c} == {8} for c in gemma)   # head dim 256: tuned, on 8 warps
    assert flash_tiles.candidates("dkdv", "bf16", 512, "full") == [Tiles(16, 16, 8)]   # past 256: one


def test_the_key_names_the_form_and_buckets_the_length():
    static = ("bf16", 128, 4, "window", (4096, 0), True, True, None, False)
    k = flash_tiles.key("fwd", 90, static, 5000)
    assert k == "flash_attention.fwd sm90 bf16 d128 g4 window+causal+documents S<=8192"
    assert flash_tiles.key("fwd", 90, static, 8192) == k
    assert flash_tiles.key("fwd", 90, static, 100_000).endswith("S<=16384")
    assert flash_tiles.key("dkdv", 80, static, 5000) != k
    assert flash_tiles.key("dkdv", 90, static, 5000, split=4).endswith("S<=8192 split4")   # its own kernel
    assert flash_tiles.key("fwd", 90, static, 5000, split=4) == k                         # dk/dv's only


def test_query_heads_split_only_where_the_grid_leaves_sms_idle():
    """dk/dv's grid is one program per key tile and KV head; a KV head's query heads go one to a
    program only while that grid is under one wave of SMs (132: an H100), up to 8 a KV head.
    Off CUDA: never (the interpreter's tests pass kv_split)."""
    assert flash_tiles.split_for(4, 64, 132) == 4       # 2,048 tokens at 64 keys x 2 KV heads
    assert flash_tiles.split_for(8, 131, 132) == 8
    assert flash_tiles.split_for(8, 132, 132) == 1      # one full wave already
    assert flash_tiles.split_for(4, 1024, 132) == 1     # Llama-3-8B at 8K tokens: 7.8 waves
    assert flash_tiles.split_for(6, 16, 132) == 6
    assert flash_tiles.split_for(16, 16, 132) == 1      # past MAX_SPLIT the parts would cost too much
    assert flash_tiles.split_for(1, 4, 132) == 1        # MHA: nothing to split
    assert flash_tiles.kv_split(8, 16, torch.device("cpu")) == 1
    # a split launch's fp32 parts spilled at sm80's 16 x 64 dk/dv tile under Triton 3.6: not a candidate there
    serial = flash_tiles.candidates("dkdv", "bf16", 64, "full", 80)
    assert serial[0] == Tiles(16, 64, 8, 2) and flash_tiles.candidates("dkdv", "bf16", 64, "full", 80,
                                                                      split=True) == serial[1:]


def _launcher(seq=80, dim=64, heads=2):
    """A forward launch of the interpreted kernel at given tiles, and what it ran with."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, heads, seq, dim, generator=g).to(torch.float16) for _ in range(3))
    ran = []

    def run(t):
        fl.forward(q, k, v, causal=True, blocks=(t.block_m, t.block_n, 16, 16))
        ran.append(t)
    return run, ran


def test_the_fastest_candidate_is_chosen_once_per_key(tmp_path, monkeypatch):
    monkeypatch.setenv("TAILORFX_TRITON_CACHE", str(tmp_path))
    cands = flash_tiles.candidates("fwd", "fp16", 64, "full", 90)
    ms = {c: 1.0 + i for i, c in enumerate(cands)}
    ms[cands[2]] = 0.5   # the timer says the third is fastest
    timed = []

    def timer(fn):
        fn()
        timed.append(ran[-1])
        return ms[ran[-1]]
    run, ran = _launcher()
    key = f"test {uuid.uuid4()}"
    assert tuning.choose(key, cands, run, timer) == cands[2]
    assert timed == cands   # each candidate's kernel ran and was timed
    assert tuning.choose(key, cands, run, timer) == cands[2] and len(timed) == len(cands)   # remembered
    saved = json.loads((tmp_path / "tuned.json").read_text())["choices"][key]
    assert saved["tiles"] == {"block_m": cands[2].block_m, "block_n": cands[2].block_n,
                              "num_warps": cands[2].num_warps, "num_stages": cands[2].num_stages}
    # a new process reads the choice from disk, untimed
    code = ("from tailorfx.kernels import flash_tiles, tuning; "
            f"print(tuning.known({key!r}, flash_tiles.candidates('fwd', 'fp16', 64, 'full', 90)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "TAILORFX_TRITON_CACHE": str(tmp_path)}).stdout
    assert out.strip() == repr(cands[2])


def test_flash_tiles_choose_times_the_roles_candidates(tmp_path, monkeypatch):
    """flash_tiles.choose on a (stand-in) CUDA device: the key's candidates for its arch, timed
    by the launch it is given; on the CPU the interpreter's tiles, untimed."""
    monkeypatch.setenv("TAILORFX_TRITON_CACHE", str(tmp_path))
    group = 1000 + uuid.uuid4().int % 10_000_000   # a key no other call used
    static = ("fp16", 64, group, "full", (), True, False, None, False)
    run, ran = _launcher()
    cands = flash_tiles.candidates("fwd", "fp16", 64, "full", 90)
    got = flash_tiles.choose("fwd", static, 2048, "cuda", run, timer=lambda fn: (fn(), ran[-1].block_n)[1])
    assert got == min(cands, key=lambda c: c.block_n) and ran == cands
    assert flash_tiles.choose("fwd", static, 2048, "cuda", None) == got   # remembered, untimed
    assert flash_tiles.choose("fwd", static, 4096, "cuda", None) == cands[0]   # another bucket: the default
    # off CUDA the interpreter's 4-warp tiles, untimed
    assert flash_tiles.choose("fwd", static, 2048, torch.device("cpu"), run) == Tiles(64, 32) and ran == cands


def test_a_candidate_the_device_cannot_run_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("TAILORFX_TRITON_CACHE", str(tmp_path))

    class OutOfResources(Exception):
        pass
    cands = [Tiles(128, 64, 8, 2), Tiles(64, 32, 4, 2)]
    seen = []

    def run(t):
        seen.append(t)
        if t.block_m == 128:
            raise OutOfResources("out of resource: shared memory, Required: 300000, Hardware limit: 232448")

    def timer(fn):
        fn()
        return 2.0
    assert tuning.choose(f"test {uuid.uuid4()}", cands, run, timer) == cands[1] and seen == cands
    with pytest.raises(ValueError, match="boom"):   # any other error is the kernel's, and propagates
        tuning.choose(f"test {uuid.uuid4()}", cands, lambda t: (_ for _ in ()).throw(ValueError("boom")), timer)


def test_a_candidate_that_spills_on_this_compiler_is_not_chosen(tmp_path, monkeypatch):
    """A launch reports the bytes its kernel spilled under the GPU's Triton (which may differ from
    the one the candidates were checked with): a spilling candidate is not chosen, even when timed
    faster, unless every candidate spills; the spills are kept beside the times."""
    monkeypatch.setenv("TAILORFX_TRITON_CACHE", str(tmp_path))
    cands = [Tiles(64, 64, 4, 2), Tiles(64, 32, 4, 2), Tiles(32, 32, 4, 2)]
    ms = {cands[0]: 0.5, cands[1]: 1.0, cands[2]: 2.0}
    last = []

    def timer(fn):
        fn()
        return ms[last[-1]]

    def runner(spills):
        def run(t):
            last.append(t)
            return spills[t]
        return run
    key = f"test {uuid.uuid4()}"
    assert tuning.choose(key, cands, runner({cands[0]: 1220, cands[1]: 0, cands[2]: None}), timer) == cands[1]
    saved = json.loads((tmp_path / "tuned.json").read_text())["choices"][key]
    assert saved["spilled_bytes"] == {repr(cands[0]): 1220} and saved["ms"][repr(cands[0])] == 0.5
    assert tuning.choices()[key]["spilled_bytes"] == {repr(cands[0]): 1220}
    every = f"test {uuid.uuid4()}"   # every candidate spills here: the fastest of them
    assert tuning.choose(every, cands, runner({cands[0]: 8, cands[1]: 8, cands[2]: 8}), timer) == cands[0]


@pytest.mark.slow   # interpreted checks at tiles up to 128 x 64 (about a minute)
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("mask,params,causal,docs", [
    ("full", (), True, False), ("full", (), False, True), ("window", (40, 2), True, True)])
def test_every_candidate_is_exact(dim, mask, params, causal, docs):
    """Each kernel's candidates on both archs, paired in turn, forward and backward against the
    fp64 reference (fp16, GQA 2, 150 tokens: no multiple of any tile)."""
    def cands(role):
        return list(dict.fromkeys(flash_tiles.candidates(role, "fp16", dim, mask, 90)
                                  + flash_tiles.candidates(role, "fp16", dim, mask, 80)))
    fwd, dq, dkdv = cands("fwd"), cands("dq"), cands("dkdv")
    doc = torch.tensor([[0] * 70 + [1] * 80]) if docs else None
    for i in range(max(len(fwd), len(dq), len(dkdv))):
        f, q, kv = fwd[i % len(fwd)], dq[i % len(dq)], dkdv[i % len(dkdv)]
        check(1, 4, 2, 150, dim, mask, params, causal, doc, dtype=torch.float16,
              blocks=(f.block_m, f.block_n, q.block_m, q.block_n, kv.block_m, kv.block_n), seed=i)
