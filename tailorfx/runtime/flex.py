"""Attention on FlexAttention: a form the attention pass proved (causal or not, a sliding window
with global tokens, packed documents, a soft-cap, ALiBi's per-key bias) as FlexAttention's block
mask and mods, so Inductor fuses it into torch's own flash-style kernel, forward and backward.

    out = flex_attention(q, k, v, kind="SlidingWindow", params=(("window", 4096),), causal=True,
                         scale=0.088, document_ids=doc)

The block mask is computed in the graph from the form alone, per call, in O((S / 128)^2): a tile
pair is "full" (the mask is not evaluated) only where every pair in it is kept, and is skipped only
where none is, so the tiles never change the result, only the work. Documents are bounded per
tile by their smallest and largest id, which holds for any layout of ids.

On a GPU, `pick` times this against the Triton flash kernel per form and shape, once, and the
attention pass runs the faster (kept beside the tile choices, kernels/tuning.py). On the CPU torch
has no fused FlexAttention backward: the operator runs torch's reference, which builds the
(S x S) scores, so there it only checks that the mods compute the form.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from tailorfx.compat import size_hint
from tailorfx.compat.runtime import flex_attention_op

BLOCK = 128    # FlexAttention's default tile, both ways
FORMS = ("Exact", "SlidingWindow")
_IGNORED = ("backward_blocks", "repeat_kv")   # the CPU backward's options: nothing to do with the mask


def flex_supports(kwargs: dict) -> Optional[str]:
    """None when `flex_attention` runs an attention_call with these keyword arguments, else why not."""
    kind, params = kwargs["kind"], dict(kwargs["params"])
    if kind not in FORMS:
        return f"no FlexAttention mask is written for attention spec {kind!r}"
    if params.get("dropout"):
        return "attention dropout: FlexAttention has none"
    other = sorted(set(params) - {"softcap", "window", "global_tokens", *_IGNORED})
    if other:
        return f"{kind} with {', '.join(other)}: no FlexAttention mod is written for it"
    bias = kwargs.get("key_bias")
    bias = bias.meta.get("val") if hasattr(bias, "meta") else bias   # a graph node: its fake value
    if isinstance(bias, Tensor) and bias.requires_grad:
        return "a per-key bias that needs a gradient: FlexAttention's kernel would add a scatter for it"
    return None


_MODS: dict[tuple, Callable] = {}   # one function object per form: every layer's graph traces the same one


def mask_mod(causal: bool, window: int, global_tokens: int, documents: bool) -> Callable:
    """`(b, h, q, kv[, doc]) -> keep`: the form's mask in FlexAttention's signature."""
    key = ("mask", causal, window, global_tokens, documents)
    if key not in _MODS:
        _MODS[key] = _mask_mod(causal, window, global_tokens, documents)
    return _MODS[key]


def _mask_mod(causal: bool, window: int, global_tokens: int, documents: bool) -> Callable:
    def positional(b, h, q, kv):
        keep = q == q
        if window:
            keep = (kv > q - window) & (kv < q + window)
            if global_tokens:
                keep = keep | (q < global_tokens) | (kv < global_tokens)
        return keep & (q >= kv) if causal else keep

    if not documents:
        return positional

    def in_document(b, h, q, kv, doc):
        return positional(b, h, q, kv) & (doc[b, q] == doc[b, kv])
    return in_document


def score_mod(softcap: Optional[float], key_bias: bool) -> Callable:
    """`(s, b, h, q, kv[, bias]) -> s'`: the scaled scores soft-capped, then the per-key bias added
    (the order of tailorfx.attention.Exact)."""
    key = ("score", softcap, key_bias)
    if key not in _MODS:
        _MODS[key] = _score_mod(softcap, key_bias)
    return _MODS[key]


def _score_mod(softcap: Optional[float], key_bias: bool) -> Callable:
    def capped(s, b, h, q, kv):
        return softcap * torch.tanh(s / softcap) if softcap is not None else s

    if not key_bias:
        return capped

    def biased(s, b, h, q, kv, bias):
        return capped(s, b, h, q, kv) + bias[b, h, kv]
    return biased


def tile_classes(seq_len: int, causal: bool, window: int = 0, global_tokens: int = 0,
                 document_ids: Optional[Tensor] = None, block: int = BLOCK,
                 device=None) -> tuple[Tensor, Tensor]:
    """(any, full): (B or 1, n, n) bool over (query tile, key tile), n = ceil(S / block). `any` holds
    every tile pair where some pair is kept, `full` only pairs where all are (a tile cut by S's end is
    never full)."""
    device = document_ids.device if document_ids is not None else device
    n = -(-seq_len // block)
    start = torch.arange(n, device=device) * block
    end = torch.clamp(start + block, max=seq_len) - 1
    q0, q1, k0, k1 = start[:, None], end[:, None], start[None, :], end[None, :]
    dmin, dmax = q0 - k1, q1 - k0   # every q - kv in between occurs in the tile pair
    some = torch.ones(n, n, dtype=torch.bool, device=device)
    every = (q1 - q0 == block - 1) & (k1 - k0 == block - 1)
    if window:
        some = (dmin < window) & (dmax > -window)
        every = every & (dmax < window) & (dmin > -window)
        if global_tokens:
            some = some | (q0 < global_tokens) | (k0 < global_tokens)
    if causal:
        some, every = some & (dmax >= 0), every & (dmin >= 0)
    if document_ids is None:
        return some[None], every[None]
    doc = document_ids
    pad = n * block - seq_len
    if pad:   # the last id repeated: a tile's id range is that of its real tokens
        doc = torch.cat([doc, doc[:, -1:].expand(doc.shape[0], pad)], 1)
    doc = doc.view(doc.shape[0], n, block)
    lo, hi = doc.amin(-1), doc.amax(-1)
    overlap = (lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None])
    one = (lo == hi)[:, :, None] & (lo == hi)[:, None, :] & (lo[:, :, None] == lo[:, None, :])
    return some[None] & overlap, every[None] & one


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """(count, indices) of each query tile's key tiles, as BlockMask keeps them: (B, 1, n) and
    (B, 1, n, n) int32, the tiles it holds first, in order."""
    count = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count[:, None], order[:, None]


def block_mask(seq_len: int, causal: bool, window: int = 0, global_tokens: int = 0,
               document_ids: Optional[Tensor] = None, device=None) -> BlockMask:
    """The form's BlockMask: partial tiles (the mask is evaluated) and full ones (it is not)."""
    some, every = tile_classes(seq_len, causal, window, global_tokens, document_ids, device=device)
    partial, full = _ordered(some & ~every), _ordered(every)
    mod = mask_mod(causal, window, global_tokens, document_ids is not None)
    return BlockMask.from_kv_blocks(*partial, *full, BLOCK_SIZE=BLOCK, mask_mod=mod, seq_lengths=(seq_len, seq_len))


def flex_attention(q: Tensor, k: Tensor, v: Tensor, *, kind: str, params: tuple, causal: bool, scale: float,
                   document_ids: Optional[Tensor] = None, key_bias: Optional[Tensor] = None,
                   key_bias_scale: float = 1.0) -> Tensor:
    """`tailorfx.attention.attention_call` on FlexAttention (q (B, H, S, D); k, v (B, H_kv, S, D),
    grouped heads unrepeated); the forms `flex_supports` accepts."""
    p = dict(params)
    seq = q.shape[2]
    window = int(p.get("window", 0)) if kind == "SlidingWindow" else 0
    mask = block_mask(seq, causal, window, int(p.get("global_tokens", 0)), document_ids, device=q.device)
    mask_buffers = () if document_ids is None else (document_ids,)
    score_buffers = ()
    if key_bias is not None:
        from tailorfx.attention import per_key_bias   # here: tailorfx.attention imports the runtime
        bias = per_key_bias(key_bias, key_bias_scale, q)   # fp32 at least: the scores' dtype in the kernel
        score_buffers = (bias.to(torch.promote_types(bias.dtype, torch.float32)).contiguous(),)
    softcap = p.get("softcap")
    mod = score_mod(None if softcap is None else float(softcap), key_bias is not None)
    return flex_attention_op(q, k, v, mod, mask, float(scale), score_buffers, mask_buffers)


# Bytes per (head, query, key) score that torch's unfused FlexAttention holds inside itself at its
# peak on the CPU (the mods vmapped over the whole score matrix), by role, 16-bit inputs or not, and
# a tanh soft-cap among the mods (its backward keeps more); measured on torch 2.13 at 512 tokens,
# every form alike otherwise (causal, window, documents, key bias).
UNFUSED_BYTES = {("forward", False, False): 13.3, ("forward", True, False): 13.2,
                 ("forward", False, True): 13.3, ("forward", True, True): 13.2,
                 ("backward", False, False): 29.0, ("backward", True, False): 26.4,
                 ("backward", False, True): 32.8, ("backward", True, True): 32.4}


def unfused_transient_bytes(role: str, batch: int, heads: int, queries: int, keys: int, sixteen_bit: bool,
                            softcap: bool) -> int:
    """What FlexAttention's operator allocates inside itself where Inductor does not fuse it (the
    CPU, or eager lowering): `role` 'forward' or 'backward'. Fused on a GPU it holds no such buffer."""
    return int(UNFUSED_BYTES[role, sixteen_bit, softcap] * batch * heads * queries * keys)


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(size_hint(d) for d in t.shape)   # a traced length, read without a guard


def form_key(q: Tensor, k: Tensor, kwargs: dict) -> str:
    """What a choice between kernels is kept under: arch, dtype, head dim, query heads per kv head,
    the form (spec and its fields, causality, documents, soft-cap, bias) and the length's bucket."""
    from tailorfx.kernels.tuning import arch_of, bucket
    B, H, S, D = _shape(q)
    params = ",".join(f"{a}={b}" for a, b in kwargs["params"] if a not in _IGNORED)
    form = [f"{kwargs['kind']}({params})", "causal" if kwargs["causal"] else "bidirectional"] + \
        ["documents"] * ("document_ids" in kwargs) + ["key_bias"] * ("key_bias" in kwargs)
    arch = arch_of(q.device)
    return f"sm{arch} {str(q.dtype).removeprefix('torch.')} d{D} g{H // _shape(k)[1]} {'+'.join(form)} S<={bucket(S)}"


def _timed_inputs(q: Tensor, k: Tensor, kwargs: dict) -> tuple[tuple, dict]:
    """Random tensors of a call's shapes on its device, documents of a quarter of the sequence each
    where the form has documents: what `pick` times the candidates on."""
    B, H, S, D = _shape(q)
    make = functools.partial(torch.randn, device=q.device, dtype=q.dtype, requires_grad=True)
    args = (make(B, H, S, D), make(*_shape(k)), make(*_shape(k)))
    extra = dict(kwargs)
    if "document_ids" in extra:
        extra["document_ids"] = torch.arange(S, device=q.device).div(max(1, S // 4), rounding_mode="floor").expand(B, S)
    if "key_bias" in extra:
        extra["key_bias"] = torch.randn(B, H, 1, S, device=q.device, dtype=q.dtype)
        extra["key_bias_scale"] = 1.0
    return args, extra


def pick(q: Tensor, k: Tensor, kwargs: dict, runs: dict[str, Callable], key: str,
         timer: Optional[Callable] = None) -> str:
    """The fastest of `runs` (name -> fn(q, k, v, **kwargs), forward and backward timed) for this
    form and shape, timed on random tensors once per `key` and remembered (kernels/tuning.py's
    pick_apart: inside a capture too)."""
    from tailorfx.kernels import tuning

    def make_runs():
        args, extra = _timed_inputs(q, k, kwargs)
        grad = torch.randn_like(args[0])

        def step(fn):
            return lambda: torch.autograd.grad(fn(*args, **extra), args, grad)
        return {name: step(fn) for name, fn in runs.items()}
    return tuning.pick_apart(key, tuple(runs), make_runs, timer)


def memory_ok(q: Tensor, k: Tensor) -> bool:
    """Whether timing at this shape (inputs, their gradients, outputs) takes under a quarter of
    the device's free memory: where not, the attention pass keeps the remembered or first choice."""
    if q.device.type != "cuda":
        return False
    from tailorfx.kernels.tuning import room_to_time
    numel = math.prod(_shape(q)) + 2 * math.prod(_shape(k))
    return room_to_time(4 * numel * q.element_size() + 8 * math.prod(_shape(q)[:3]), q.device)
