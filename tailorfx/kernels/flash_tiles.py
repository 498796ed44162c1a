"""Flash attention's tiles: the candidates of each kernel (forward, dq, dk/dv) per dtype, head dim
and arch, the default, and the choice among them by measurement on a GPU (`tuning.choose`),
keyed by (arch, dtype, head dim, mask form, query heads per kv head, length bucket).

Every candidate compiles for its arch without register spills under Triton 3.6 (torch 2.11's, the
GPU machines') and 3.9 (torch 2.13's): `tests/test_triton_codegen.py` compiles them all with ptxas
in both virtualenvs. Another Triton may spill where these did not: a launch reports its kernel's
spills, and the tuner keeps a spilling candidate only where every candidate spills
(`tuning.choose`). 16-bit forward and dq candidates on sm90 hold at least 64 query rows per
program, so their dots can run as wgmma; so does dk/dv's default for the plain form (64 keys).
dk/dv holds four (keys x head dim) tiles, so its query sub-tile stays small, and at head dim 128
a form with documents, a soft-cap or a key bias spills at 64 keys under Triton 3.6: there it holds
32 keys on 8 warps, as sm80 does in every form (mma.sync has no 64-row minimum). fp32 runs IEEE
dots on FMAs (exact), where small tiles are faster and a single candidate is kept. Dilated
attention (strided gathers, one launch per branch), BigBird (a block-mask lookup per element,
which spills at 64 rows) and head dims over 256 keep the tiles of `flash_attention.default_blocks`:
one candidate, untuned, on 4 warps (8 past head dim 128). Head dim 256 (Gemma) runs 8 warps, with
fewer than 64 rows in dq and dk/dv, where more spill; in fp32 its dk/dv spills under Triton 3.6
even on 16 x 16 tiles.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

from tailorfx.kernels import tuning
from tailorfx.kernels.tuning import Tiles, arch_of, bucket

ROLES = ("fwd", "dq", "dkdv")

# head dim (<= 64, <= 128) -> role -> arch -> candidates for 16-bit inputs, the default first;
# P: only for the plain form (a full mask with no documents, soft-cap or key bias), where the
# others' extra loads would spill (ptxas-checked over both forms: tests/test_triton_codegen.py);
# S: only for dk/dv's serial launch (one program per KV head), where the split one's fp32 parts spill
P = "plain"
S = "serial"
_HALF = {
    64: {
        "fwd": {90: [Tiles(128, 64, 8, 2), Tiles(64, 64, 4, 2), Tiles(64, 32, 4, 2), Tiles(128, 32, 8, 2),
                     Tiles(64, 64, 8, 2)],
                80: [(Tiles(64, 64, 8, 2), P), Tiles(128, 32, 8, 2), (Tiles(64, 32, 4, 2), P)]},
        "dq": {90: [Tiles(64, 64, 4, 2), Tiles(128, 32, 8, 2), Tiles(64, 32, 4, 2), Tiles(128, 64, 8, 2),
                    Tiles(64, 64, 8, 2)],
               80: [(Tiles(64, 64, 4, 2), P), (Tiles(64, 32, 4, 2), P), (Tiles(128, 32, 8, 2), P), Tiles(128, 16, 8, 2),
                    Tiles(64, 16, 4, 2)]},
        "dkdv": {90: [Tiles(16, 64, 4, 2), (Tiles(32, 64, 4, 2), P), Tiles(16, 64, 8, 2), Tiles(32, 64, 8, 2),
                      Tiles(16, 128, 8, 2), Tiles(32, 128, 8, 2)],
                 80: [(Tiles(16, 64, 8, 2), (P, S)), Tiles(32, 32, 4, 2), Tiles(16, 32, 4, 2), Tiles(64, 32, 8, 2)]},
    },
    128: {
        "fwd": {90: [(Tiles(128, 64, 8, 2), P), Tiles(64, 64, 8, 2), Tiles(128, 32, 8, 2), Tiles(64, 32, 4, 2),
                     Tiles(64, 64, 4, 2)],
                80: [Tiles(64, 64, 8, 2), Tiles(64, 32, 4, 2)]},
        "dq": {90: [Tiles(64, 32, 4, 2), Tiles(128, 32, 8, 2), Tiles(64, 32, 8, 2), Tiles(128, 16, 8, 2),
                    Tiles(64, 32, 4, 3), (Tiles(128, 64, 8, 2), P)],
               80: [(Tiles(64, 64, 8, 2), P), Tiles(64, 32, 8, 2), Tiles(32, 32, 4)]},
        # dk/dv holds k, v, dk and dv (four 64 x 128 tiles at 64 keys): 8 warps, and 32 keys where
        # a richer form spills at 64 (Triton 3.6); sm80 spills at 64 keys in every form
        "dkdv": {90: [(Tiles(16, 64, 8, 2), P), (Tiles(16, 64, 8, 3), P), Tiles(32, 32, 8, 2), Tiles(16, 32, 8, 2),
                      Tiles(64, 32, 8, 2)],
                 80: [Tiles(16, 32, 8, 2), Tiles(32, 32, 8, 2)]},
    },
    # Gemma's 256: 8 warps; 64 query rows spill in dq, more than 16 keys in dk/dv
    256: {
        "fwd": {90: [Tiles(64, 32, 8, 2), Tiles(32, 32, 8, 2), Tiles(64, 16, 8, 2)],
                80: [Tiles(64, 32, 8, 2), Tiles(32, 32, 8, 2)]},
        "dq": {90: [Tiles(32, 32, 8, 2), Tiles(32, 16, 8, 2)],
               80: [Tiles(32, 32, 8, 2), Tiles(32, 16, 8, 2)]},
        "dkdv": {90: [Tiles(16, 16, 8, 2), Tiles(32, 16, 8, 2)],
                 80: [Tiles(16, 16, 8, 2), (Tiles(32, 16, 8, 2), P)]},
    },
}


def plain(static: tuple) -> bool:
    """A full mask with no documents, soft-cap or key bias (flash_tiles.key's `static`)."""
    _dtype, _d, _group, mask, _params, _causal, documents, softcap, key_bias = static
    return mask == "full" and not documents and softcap is None and not key_bias


def candidates(role: str, dtype: str, head_dim: int, mask: str, arch: int = 90, is_plain: bool = True,
               split: bool = False) -> list[Tiles]:
    """The tiles `role`'s kernel may run with on sm`arch`, the default first (`split`: dk/dv's
    launch with a KV head's query heads over several programs, `kv_split`)."""
    if role not in ROLES:
        raise ValueError(f"flash attention kernel {role!r}: one of {list(ROLES)}")
    if dtype == "fp32" or mask in ("dilated", "bigbird") or head_dim > 256:   # one, every form
        return [small(role, dtype, head_dim, mask)]
    entries = _HALF[next(w for w in _HALF if head_dim <= w)][role][80 if arch < 90 else 90]
    out = []
    for e in entries:
        tiles, only = (e if isinstance(e, tuple) else (e, ()))
        only = (only,) if isinstance(only, str) else only
        if (P not in only or is_plain) and (S not in only or not split):
            out.append(tiles)
    return out


def small(role: str, dtype: str, head_dim: int, mask: str) -> Tiles:
    """`role`'s tiles of `flash_attention.default_blocks`: the interpreter's, and on a GPU the one
    candidate of the forms that are not tuned; on 8 warps past head dim 128, where 4 spill."""
    from tailorfx.kernels.flash_attention import default_blocks
    bm, bn, bm2, bn2 = default_blocks(dtype, head_dim, mask)
    warps = 8 if head_dim > 128 else 4
    return Tiles(bm2, bn2, warps) if role == "dkdv" else Tiles(bm, bn, warps)


def key(role: str, arch: int, static: tuple, seq_len: int, split: int = 1) -> str:
    """static: (dtype, head_dim, group, mask, params, causal, documents, softcap, key_bias); split:
    dk/dv's `kv_split`, named where it is not 1."""
    dtype, head_dim, group, mask, _params, causal, documents, softcap, key_bias = static
    form = [mask, "causal" if causal else "bidirectional"] + ["documents"] * bool(documents) + \
        ["softcap"] * (softcap is not None) + ["key_bias"] * bool(key_bias)
    split = f" split{split}" if split > 1 and role == "dkdv" else ""
    return f"flash_attention.{role} sm{arch} {dtype} d{head_dim} g{group} {'+'.join(form)} S<={bucket(seq_len)}{split}"


def choose(role: str, static: tuple, seq_len: int, device, run: Optional[Callable[[Tiles], None]],
           timer: Optional[Callable] = None, split: int = 1) -> Tiles:
    """`role`'s tiles for this call: on CUDA the fastest candidate for its key, timed by `run`
    the first time the key is seen (None: not timed now, the remembered choice or the first
    candidate); off CUDA (Triton's interpreter), `small`'s."""
    dtype, head_dim, mask = static[0], static[1], static[3]
    if getattr(device, "type", device) != "cuda":
        return small(role, dtype, head_dim, mask)
    arch = arch_of(device)
    split = split if role == "dkdv" else 1
    cands = candidates(role, dtype, head_dim, mask, arch, plain(static), split > 1)
    return tuning.choose(key(role, arch, static, seq_len, split), cands, run, timer)


def kv_split(group: int, programs: int, device) -> int:
    """How many dk/dv programs share a KV head's query heads (see `split_for`); 1 off CUDA.
    `programs`: the serial grid at 64 keys a program (the launch decides before its tiles)."""
    import torch
    if getattr(device, "type", device) != "cuda" or not torch.cuda.is_available():
        return 1
    return split_for(group, programs, _sm_count(torch.cuda.current_device() if device.index is None else device.index))


def split_for(group: int, programs: int, sms: int) -> int:
    """One program per query head (the group, up to MAX_SPLIT) where the serial grid at 64 keys a
    program is under one wave of `sms` SMs; else 1. A whole split leaves no head loop in the
    kernel (a partial one kept it and spilled at 255-register tiles). The parts' fp32 buffers,
    split x (B, H_kv, S, D) x 2, stay under MAX_SPLIT x 64 x SMs x D x 8 bytes (69 MB on an
    H100 at head dim 128), and only at lengths where the grid is that small."""
    return group if programs < sms and 1 < group <= MAX_SPLIT else 1


MAX_SPLIT = 8   # Llama-3-70B's group; MQA (32-71 query heads a KV head) keeps its loop


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    import torch
    return torch.cuda.get_device_properties(index).multi_processor_count
