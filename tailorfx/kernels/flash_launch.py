"""Flash attention's host side: the spec a call needs (`spec_for`), its tiles (chosen by
measurement on a GPU: `flash_tiles`), BigBird's tables, and the launches of the forward, the
backward preprocess, dq and dk/dv kernels that `flash_attention` renders (shapes and semantics:
its docstring), with the autograd wrapper `attention`.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

from tailorfx.kernels import DTYPE_NAMES, KernelSpec, cached_kernel, cdiv, interpreted, tuning
from tailorfx.kernels.flash_attention import MODES, Config, num_warps
from tailorfx.kernels.tuning import Tiles


def normalize_params(mask: str, params) -> tuple:
    """A mask's params as a hashable tuple: window (w, g); bigbird (block, window, num_global,
    num_random, seed); dilated ((segments...), (rates...)) (a single (w, r) pair is accepted)."""
    params = tuple(params or ())
    if mask == "full":
        if params:
            raise ValueError(f"mask 'full' takes no params, got {params}")
        return ()
    if mask == "window":
        if len(params) != 2 or min(params) < 0:
            raise ValueError(f"mask 'window' takes (window, num_global) >= 0, got {params}")
        return tuple(int(p) for p in params)
    if mask == "bigbird":
        if len(params) != 5 or params[0] < 1:
            raise ValueError(f"mask 'bigbird' takes (block, window, num_global, num_random, seed), got {params}")
        return tuple(int(p) for p in params)
    if mask == "dilated":
        if len(params) != 2:
            raise ValueError(f"mask 'dilated' takes (segments, rates), got {params}")
        seg, rate = params
        seg = (int(seg),) if isinstance(seg, int) else tuple(int(s) for s in seg)
        rate = (int(rate),) if isinstance(rate, int) else tuple(int(r) for r in rate)
        if len(seg) != len(rate) or not seg or min(seg) < 1 or min(rate) < 1:
            raise ValueError(f"mask 'dilated': segments {seg} and rates {rate} (equal lengths, >= 1)")
        return seg, rate
    raise ValueError(f"flash_attention mask {mask!r}: one of {list(MODES)}")


def spec_for(q, k, *, mask: str = "full", params=(), causal: bool = False, documents: bool = False,
             softcap: Optional[float] = None, blocks: Optional[Sequence[int]] = None, key_bias: bool = False):
    """The spec that serves q (B, H, S, D), k (B, H_kv, S, D) with this mask, at `blocks`
    (as `_explicit` reads them: one (m, n) for every kernel, or per kernel); by
    default the tiles a launch on q's device starts from (`flash_tiles`' default; the
    interpreter's `default_blocks`), before any measurement. `key_bias`: a per-key additive bias
    (ALiBi) is read."""
    from tailorfx import compat
    static = _static_of(q, k, mask, normalize_params(mask, params), causal, documents, softcap, key_bias)
    tiles = _explicit(blocks) if blocks is not None else _defaults(static, q.device, compat.size_hint(q.shape[2]))
    return _spec(*static, _flat_tiles(tiles), interpreted())


KERNELS = {"fwd": "attn_fwd", "dq": "attn_bwd_dq", "dkdv": "attn_bwd_dkdv"}


def first_launches(spec, arch: int, seq: int, batch_heads: int) -> list[tuple[str, KernelSpec, dict, str]]:
    """What a GPU launch of `spec`'s attention starts from on sm`arch`, before it times any tiles:
    per kernel, (role, the spec at that role's first candidate, compile options: its warps,
    stages and function, its grid at `seq` tokens), for `tailorfx kernels` to compile what the GPU
    would run. Dilated attention's grids (per branch) are not given."""
    from tailorfx.kernels import flash_tiles
    c = Config(spec)
    static = (c.dtype, c.head_dim, c.group, c.mode, (c.bb_block,), c.causal, c.documents, c.softcap, c.key_bias)
    tiles = {"fwd": (c.block_m, c.block_n), "dq": (c.dq_block_m, c.dq_block_n), "dkdv": (c.bwd_block_m, c.bwd_block_n)}
    out = []
    for role, fn in KERNELS.items():
        t = flash_tiles.candidates(role, c.dtype, c.head_dim, c.mode, arch, flash_tiles.plain(static))[0]
        blocks = {**tiles, role: (t.block_m, t.block_n)}
        gpu = _spec(*static, blocks["fwd"] + blocks["dq"] + blocks["dkdv"], False)   # bf16 dots, as compiled
        rows, programs = {"fwd": (t.block_m, batch_heads), "dq": (t.block_m, batch_heads),
                          "dkdv": (t.block_n, batch_heads // c.group)}[role]
        grid = "" if c.dilated else f"({cdiv(seq, rows)}, {programs})"
        out.append((role, gpu, t.launch() | {"functions": [fn]}, grid))
    return out


def _static_of(q, k, mask, params, causal, documents, softcap, key_bias) -> tuple:
    """What a spec is built from besides its tiles (flash_tiles.key's `static`)."""
    return (DTYPE_NAMES[q.dtype], int(q.shape[-1]), int(q.shape[1] // k.shape[1]), mask, params, bool(causal),
            bool(documents), None if softcap is None else float(softcap), bool(key_bias))


def _explicit(blocks: Sequence[int]) -> dict:
    """blocks: (m, n) for every kernel, (m, n, bwd_m, bwd_n), or (m, n, dq_m, dq_n, bwd_m, bwd_n)."""
    b = tuple(int(x) for x in blocks)
    if len(b) == 2:
        b = b + b
    if len(b) == 4:
        b = b[:2] + b
    if len(b) != 6:
        raise ValueError(f"flash_attention blocks {tuple(blocks)}: (block_m, block_n), (block_m, block_n, "
                         "bwd_block_m, bwd_block_n) or (block_m, block_n, dq_block_m, dq_block_n, bwd_block_m, "
                         "bwd_block_n)")
    return {"fwd": Tiles(b[0], b[1]), "dq": Tiles(b[2], b[3]), "dkdv": Tiles(b[4], b[5])}


def _defaults(static: tuple, device, seq_len: int, split: int = 1) -> dict:
    """Each kernel's starting tiles (flash_tiles.choose, untimed): under the interpreter
    `default_blocks`' (4 warps); on a GPU the remembered choice for the key, else the first
    candidate (timed later by the launch)."""
    from tailorfx.kernels import flash_tiles
    where = "interpreter" if interpreted() else device   # which runs `small`'s tiles whatever the device
    return {r: flash_tiles.choose(r, static, seq_len, where, None, split=split) for r in flash_tiles.ROLES}


def _flat_tiles(tiles: dict) -> tuple:
    return tuple(x for r in ("fwd", "dq", "dkdv") for x in (tiles[r].block_m, tiles[r].block_n))


def _spec(dtype: str, head_dim: int, group: int, mask: str, params: tuple, causal: bool, documents: bool,
          softcap: Optional[float], key_bias: bool, blocks: tuple, interpret: bool):
    """blocks: (block_m, block_n, dq_block_m, dq_block_n, bwd_block_m, bwd_block_n); dq's are
    named only where they differ from the forward's."""
    bm, bn, qm, qn, bm2, bn2 = (int(b) for b in blocks)
    extra = {"bigbird_block": params[0]} if mask == "bigbird" else {}
    if (qm, qn) != (bm, bn):
        extra.update(dq_block_m=qm, dq_block_n=qn)
    if softcap is not None:
        extra["softcap"] = float(softcap)
    if key_bias:
        extra["key_bias"] = True
    if dtype == "bf16" and not interpret:   # compiled: bf16 tensor-core dots
        extra["precision"] = None
    return KernelSpec("flash_attention", dtype=dtype, head_dim=head_dim, mask=mask, causal=bool(causal),
                      documents=bool(documents), group=group, block_m=bm, block_n=bn,
                      bwd_block_m=bm2, bwd_block_n=bn2, **extra)


def _check(q, k, v, document_ids):
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"flash_attention: q (B, H, S, D), k and v (B, H_kv, S, D); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"flash_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"flash_attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if document_ids is not None and tuple(document_ids.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(f"flash_attention: document_ids must be (B, S) = {(q.shape[0], q.shape[2])}")


def _mode_args(spec, params, causal, seq_len, device, role="fwd"):
    """A kernel's mode arguments (BigBird's tables at that kernel's tiles; role "dkdv" lists
    query tiles per key tile); none for dilated, whose (segment, rate) change per launch."""
    mask = spec["mask"]
    if mask == "window":
        return list(params)
    if mask == "bigbird":
        c = Config(spec)
        tiles = {"fwd": (c.block_m, c.block_n), "dq": (c.dq_block_m, c.dq_block_n),
                 "dkdv": (c.bwd_block_m, c.bwd_block_n)}[role]
        from tailorfx.kernels.bigbird import launch_tables
        table, count, block_mask = launch_tables(params, causal, seq_len, *tiles, role == "dkdv", device)
        out = [table, count, table.shape[1]]
        if not c.aligned:
            out += [block_mask, block_mask.shape[0]]
        return out
    return []


def _spec_here(*static):
    return _spec(*static, interpreted())


_kernel = cached_kernel(_spec_here)   # a warm launch builds no KernelSpec


class _Call:
    """One attention call's arguments, checked, and its kernels' tiles: given (`blocks`), else
    chosen per kernel by `flash_tiles` (timed on the GPU the first time a key is seen)."""

    def __init__(self, q, k, mask, params, causal, document_ids, softcap, blocks, scale, key_bias, kv_split=None):
        import torch
        from tailorfx import compat
        from tailorfx.kernels.flash_tiles import kv_split as split_rule
        self.params = normalize_params(mask, params)
        self.mask, self.causal = mask, bool(causal)
        self.static = _static_of(q, k, mask, self.params, causal, document_ids is not None, softcap,
                                 key_bias is not None)
        self.batch, self.heads, self.seq = q.shape[:3]
        self.num_kv = k.shape[1]
        self.device = q.device
        self.scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
        if not self.scale > 0:   # the kernels scale each row's max, not each score (flash_attention._scores)
            raise ValueError(f"flash_attention scale={self.scale}: must be positive")
        self.given = blocks is not None
        self.seq_hint = compat.size_hint(self.seq)   # a traced length keys the choice without a guard
        group = self.heads // self.num_kv
        if kv_split is not None and (mask == "dilated" or group % kv_split):
            raise ValueError(f"flash_attention kv_split={kv_split}: a divisor of the GQA group {group} "
                             f"(dilated attention: none)")
        # dk/dv's programs per KV head, decided before its tiles (whose candidates depend on it)
        self.split = kv_split or (1 if mask == "dilated" else split_rule(
            group, cdiv(self.seq_hint, 64) * compat.size_hint(self.batch) * self.num_kv, q.device))
        self.tiles = _explicit(blocks) if self.given else _defaults(self.static, q.device, self.seq_hint, self.split)
        extra = []
        if document_ids is not None:
            if document_ids.dtype != torch.int32 or document_ids.device != q.device:
                document_ids = document_ids.to(device=q.device, dtype=torch.int32)
            extra = [document_ids.contiguous()]
        if key_bias is not None:   # (B, H, S) or broadcast to it: fp32 rows of (batch, head)
            if key_bias.dim() != 3 or key_bias.shape[-1] != self.seq:
                raise ValueError(f"flash_attention key_bias {tuple(key_bias.shape)}: (B, H, S) or broadcast to it, "
                                 f"S={self.seq}")
            extra.append(key_bias.to(device=q.device, dtype=torch.float32).expand(
                self.batch, self.heads, self.seq).contiguous())
        self.extra = extra

    def kernel(self, tiles: Optional[dict] = None):
        return _kernel(*self.static, _flat_tiles(tiles or self.tiles))

    def tune(self, role: str, launch, *tensors) -> None:
        """Choose `role`'s tiles on a GPU, timing `launch(kernel, call, options, *tensors)` per
        candidate the first time the key is seen (under a trace on random tensors of the same
        shapes, made only then; none when they would not fit, and the default stays)."""
        import torch
        if (self.given or interpreted() or self.device.type != "cuda" or self.mask == "dilated"
                or not torch.cuda.is_available()):
            return
        from tailorfx.kernels import flash_tiles
        def timed(t, *real):
            return launch(self.kernel(self.tiles | {role: t}), self, t.launch(), *real)
        got = tuning.choose_on(tensors, timed, lambda run: flash_tiles.choose(role, self.static, self.seq_hint,
                                                                              self.device, run, split=self.split))
        if got is not None:
            self.tiles[role] = got

    def options(self, role: str) -> dict:
        return {"num_warps": num_warps(None)} if self.given or interpreted() else self.tiles[role].launch()


def _launch_fwd(kern, call, options, q, k, v, out, lse, *extra):
    mode = _mode_args(kern.spec, call.params, call.causal, call.seq, q.device, "fwd")
    return tuning.spills(kern.fn("attn_fwd")[(cdiv(call.seq, kern.spec["block_m"]), call.batch * call.heads)](
        q, k, v, out, lse, *extra, *mode, call.scale, call.seq, call.heads, **options))


def _launch_dq(kern, call, options, q, k, v, dout, lse, delta, dq, *extra):
    rows = kern.spec.get("dq_block_m") or kern.spec["block_m"]   # named only where it differs
    mode = _mode_args(kern.spec, call.params, call.causal, call.seq, q.device, "dq")
    return tuning.spills(kern.fn("attn_bwd_dq")[(cdiv(call.seq, rows), call.batch * call.heads)](
        q, k, v, dout, lse, delta, dq, *extra, *mode, call.scale, call.seq, call.heads, **options))


def _launch_dkdv(kern, call, options, q, k, v, dout, lse, delta, dk, dv, *extra):
    import torch
    mode = _mode_args(kern.spec, call.params, call.causal, call.seq, q.device, "dkdv")
    grid, split = (cdiv(call.seq, kern.spec["bwd_block_n"]), call.batch * call.num_kv), call.split
    parts = [torch.empty((split, *t.shape), dtype=torch.float32, device=t.device)
             for t in (dk, dv)] if split > 1 else []
    spills = tuning.spills(kern.fn("attn_bwd_dkdv")[(grid[0], grid[1] * split)](
        q, k, v, dout, lse, delta, *(parts or (dk, dv)), *extra, *mode, call.scale, call.seq, call.heads,
        KV_SPLIT=split, **options))
    for part, out in zip(parts, (dk, dv)):   # the parts summed in one fixed order, rounded once
        out.copy_(part.sum(0))
    return spills


def forward(q, k, v, *, mask: str = "full", params=(), causal: bool = False, scale: Optional[float] = None,
            document_ids=None, softcap: Optional[float] = None, blocks: Optional[Sequence[int]] = None,
            key_bias=None, kv_split: Optional[int] = None):
    """(out (B, H, S, D) in q's dtype, lse (B, H, S) fp32; 0 and -inf on rows that see no key).
    mask/params as `normalize_params`; scale defaults to D ** -0.5; blocks as `spec_for` (on a
    GPU, by default each kernel's tiles are chosen by measurement); key_bias (B, H, S) (or
    broadcast to it) is added to every query's scores after the soft-cap; kv_split is the backward's."""
    import torch
    _check(q, k, v, document_ids)
    call = _Call(q, k, mask, params, causal, document_ids, softcap, blocks, scale, key_bias)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    batch, heads, seq, _ = q.shape
    if mask == "dilated":   # one launch per branch, merged into fp32 out/lse through the lse
        kern = call.kernel()
        bm, fn = kern.spec["block_m"], kern.fn("attn_fwd")
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((batch, heads, seq), float("-inf"), dtype=torch.float32, device=q.device)
        for w, r in zip(*call.params):
            grid = (cdiv(seq, w) * cdiv(cdiv(w, r), bm), batch * heads)   # segments x tiles of a segment
            fn[grid](q, k, v, out, lse, *call.extra, w, r, call.scale, seq, heads, **call.options("fwd"))
        return out.to(q.dtype), lse
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seq, dtype=torch.float32, device=q.device)
    call.tune("fwd", _launch_fwd, q, k, v, out, lse, *call.extra)
    _launch_fwd(call.kernel(), call, call.options("fwd"), q, k, v, out, lse, *call.extra)
    return out, lse


def backward(dout, q, k, v, out, lse, *, mask: str = "full", params=(), causal: bool = False,
             scale: Optional[float] = None, document_ids=None, softcap: Optional[float] = None,
             blocks: Optional[Sequence[int]] = None, key_bias=None, kv_split: Optional[int] = None):
    """(dq, dk, dv) of `forward`'s out (same arguments), recomputing the scores from out and lse;
    dk, dv of a kv head sum the query heads that share it (in fp32, inside the kernel, or over
    `kv_split` programs, default `flash_tiles.kv_split`'s). The key bias gets no gradient."""
    import torch
    _check(q, k, v, document_ids)
    call = _Call(q, k, mask, params, causal, document_ids, softcap, blocks, scale, key_bias, kv_split)
    q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))
    if lse.dtype != torch.float32:
        lse = lse.to(torch.float32)
    lse = lse.contiguous()
    batch, heads, seq, _ = q.shape
    num_kv = k.shape[1]
    kern = call.kernel()
    delta = torch.empty(batch, heads, seq, dtype=torch.float32, device=q.device)
    rows = batch * heads * seq
    kern.fn("attn_bwd_preprocess")[(cdiv(rows, kern.spec["block_m"]),)](out, dout, delta, rows,
                                                                         num_warps=num_warps(None))
    if mask == "dilated":   # branches add into fp32 gradients
        c = Config(kern.spec)
        fdq, fdkdv = kern.fn("attn_bwd_dq"), kern.fn("attn_bwd_dkdv")
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        group = heads // num_kv
        for w, r in zip(*call.params):
            nseg, per = cdiv(seq, w), cdiv(w, r)
            fdq[(nseg * cdiv(per, c.dq_block_m), batch * heads)](
                q, k, v, dout, lse, delta, dq, *call.extra, w, r, call.scale, seq, heads, **call.options("dq"))
            # a kv head's query heads fall into min(group, r) offsets: one program each
            fdkdv[(nseg * cdiv(per, c.bwd_block_n), batch * num_kv * min(group, r))](
                q, k, v, dout, lse, delta, dk, dv, *call.extra, w, r, call.scale, seq, heads, **call.options("dkdv"))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    call.tune("dq", _launch_dq, q, k, v, dout, lse, delta, dq, *call.extra)
    call.tune("dkdv", _launch_dkdv, q, k, v, dout, lse, delta, dk, dv, *call.extra)
    kern = call.kernel()
    _launch_dq(kern, call, call.options("dq"), q, k, v, dout, lse, delta, dq, *call.extra)
    _launch_dkdv(kern, call, call.options("dkdv"), q, k, v, dout, lse, delta, dk, dv, *call.extra)
    return dq, dk, dv


def attention(q, k, v, *, mask: str = "full", params=(), causal: bool = False, scale: Optional[float] = None,
              document_ids=None, softcap: Optional[float] = None, blocks: Optional[Sequence[int]] = None,
              key_bias=None, kv_split: Optional[int] = None):
    """`forward` with autograd through `backward`: (out, lse), lse not differentiable."""
    kw = dict(mask=mask, params=normalize_params(mask, params), causal=causal, scale=scale,
              document_ids=document_ids, softcap=softcap, blocks=None if blocks is None else tuple(blocks),
              key_bias=key_bias, kv_split=kv_split)
    return _autograd().apply(q, k, v, kw)


@functools.lru_cache(maxsize=None)
def _autograd():
    import torch

    class FlashAttentionFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, kw):
            out, lse = forward(q, k, v, **kw)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.kw = kw
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            q, k, v, out, lse = ctx.saved_tensors
            return (*backward(dout, q, k, v, out, lse, **ctx.kw), None)
    return FlashAttentionFn
