"""Attention specs: which keys each query sees, as callables with a dense reference and costs.

    spec = SlidingWindow(512, global_tokens=4)
    out = spec(q, k, v, document_ids=doc)   # q (B, H, S, D); k, v (B, H_kv, S, D); doc (B, S)
    spec.dense_mask(S, H)                   # (1, 1, S, S) bool: the same pattern, explicitly
    spec.flops(B, H, S, D), spec.extra_bytes(B, H, S, D, 2)   # what a planner compares

Every spec is causal unless ``causal=False``, scales scores by ``scale`` (default 1/sqrt(D)),
and with ``document_ids`` never attends across documents. The kernels behind the calls
(``tailorfx.runtime.attention_kernels``) do O(S x keys per query) work in O(S) memory, forward
and backward, and are opaque custom ops, so a compiled graph keeps them as one node each.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from tailorfx.runtime.attention_kernels import (
    dilated_attention, dilated_workspace_bytes, score_mod_attention, sparse_attention,
)
from tailorfx.runtime.attention_tiles import KV_CHUNK, TILE, bigbird_random_blocks
from tailorfx.runtime.flash_cpu import grouped_sdpa

__all__ = [
    "AttentionSpec", "Exact", "SlidingWindow", "BigBird", "Dilated",
    "masked_attention", "dense_extra_bytes",
]

# Matmul FLOPs per attended (query, key) pair and head dim: QK^T and PV forward; recompute of
# QK^T plus dV, dP, dQ, dK backward.
FORWARD_FLOPS, BACKWARD_FLOPS = 4, 10


def masked_attention(
    q: Tensor, k: Tensor, v: Tensor, weights: Tensor, scale: Optional[float] = None
) -> Tensor:
    """Dense eager reference: softmax over keys with multiplicities ``weights`` (bool or counts).

    ``weights`` broadcasts to (B, H, S, S); a key of weight c counts c times in the softmax. Rows
    with no key give a zero output (and zero gradients), not nan.
    """
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if weights.dtype == torch.bool:
        s = s.masked_fill(~weights, float("-inf"))
    else:
        s = s + torch.log(weights.to(s.dtype))
    live = weights.bool().any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~live, 0.0), -1) * live
    return torch.matmul(p, v)


def dense_extra_bytes(B: int, H: int, S: int, D: int, dtype_bytes: int) -> int:
    """Training bytes beyond q/k/v/out of ``masked_attention``: the bool mask plus four S x S
    tensors alive at the backward peak (masked scores, probs, their grads)."""
    return B * H * S * S * (4 * dtype_bytes + 1)


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """Base of the specs; subclasses define the pattern, its kernel and its pair count."""

    causal: bool = True
    scale: Optional[float] = None
    tile: int = TILE  # query rows per block of the kernels: speed only, results do not change
    kv_chunk: int = KV_CHUNK  # keys per matmul: bounds the transient (tile x keys) scores
    # dropout on the probabilities (training): each call draws a seed from torch's CPU generator,
    # the tiles draw their masks from it (runtime.attention_tiles.Dropout), the backward the same
    dropout: float = 0.0

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, document_ids: Optional[Tensor] = None,
        score_tensor: Optional[Tensor] = None, dropout_seed: Optional[Tensor] = None,
    ) -> Tensor:
        batch, heads, seq, dim = q.shape
        if k.shape != v.shape or k.shape[0] != batch or k.shape[2] != seq or k.shape[3] != dim:
            raise ValueError(f"{type(self).__name__}: q {tuple(q.shape)} vs k/v {tuple(k.shape)}")
        if heads % k.shape[1]:
            raise ValueError(f"{type(self).__name__}: {heads} query heads, {k.shape[1]} kv heads")
        if document_ids is not None and document_ids.shape != (batch, seq):
            raise ValueError(f"document_ids {tuple(document_ids.shape)}, expected {(batch, seq)}")
        scale = self.scale if self.scale is not None else dim**-0.5
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{type(self).__name__}: dropout={self.dropout} is not in [0, 1)")
        drop = self._drop(dropout_seed)
        score_mod = getattr(self, "score_mod", None)
        if score_mod is not None:
            args = (scale, self.causal, self.tile, self.kv_chunk, getattr(self, "softcap", None), *drop)
            return score_mod_attention(q, k, v, document_ids, score_tensor, score_mod, *args)[0]
        if score_tensor is not None:
            raise ValueError(f"{type(self).__name__}: score_tensor= without a score_mod")
        return self._run(q, k, v, document_ids, scale, drop)

    def dense_weights(
        self, S: int, num_heads: int, document_ids: Optional[Tensor] = None, device=None
    ) -> Tensor:
        """(B or 1, H or 1, S, S) int: how often each key counts for each query (0 = masked)."""
        w = self._pattern_weights(S, num_heads, device)
        if self.causal:
            i = torch.arange(S, device=device)
            w = w * (i[None, :] <= i[:, None])
        if document_ids is not None:
            doc = document_ids.to(device)
            w = w * (doc[:, None, :, None] == doc[:, None, None, :])
        return w if w.dim() == 4 else w[None]

    def dense_mask(
        self, S: int, num_heads: int, document_ids: Optional[Tensor] = None, device=None
    ) -> Tensor:
        """(B or 1, H or 1, S, S) bool: True where query i attends key j. The kernels' reference."""
        return self.dense_weights(S, num_heads, document_ids, device) > 0

    def reference(
        self, q: Tensor, k: Tensor, v: Tensor, document_ids: Optional[Tensor] = None
    ) -> Tensor:
        """Dense eager attention with the explicit mask (O(S^2) memory): for tests and baselines."""
        w = self.dense_weights(q.shape[2], q.shape[1], document_ids, q.device)
        return masked_attention(q, k, v, w if w.max() > 1 else w > 0, self.scale)

    def num_pairs(self, S: int, num_heads: int) -> int:
        """Attended (head, query, key) triples of one sequence, with multiplicity, no documents."""
        raise NotImplementedError

    def flops(self, B: int, H: int, S: int, D: int, *, backward: bool = True) -> int:
        """Matmul FLOPs of the attended pairs (documents only lower this): forward (+ backward)."""
        return B * self.num_pairs(S, H) * D * (FORWARD_FLOPS + (BACKWARD_FLOPS if backward else 0))

    def extra_bytes(self, B: int, H: int, S: int, D: int, dtype_bytes: int) -> int:
        """Training bytes beyond q/k/v/out (and their grads): O(S), never O(S^2).

        Saved lse (fp32), one tile's scores/probs/grads, and fp32 grad accumulators when the
        inputs are narrower than fp32.
        """
        widen = 3 * B * H * S * D * 4 if dtype_bytes < 4 else 0
        return 4 * B * H * S + 3 * 4 * B * H * self.tile * self.kv_chunk + widen

    def _pattern_weights(self, S: int, num_heads: int, device) -> Tensor:
        raise NotImplementedError

    def _drop(self, seed: Optional[Tensor]) -> tuple[float, Optional[Tensor]]:
        """(p, the seed of this call's masks): `seed` as given (the attention pass draws it in the
        graph, where recompute keeps it), else one drawn now."""
        if not self.dropout:
            return 0.0, None
        return float(self.dropout), draw_seed() if seed is None else seed

    def _sparse(self, q, k, v, document_ids, scale, kind: str, params: list[int], softcap=None,
                drop=(0.0, None)) -> Tensor:
        args = (scale, self.causal, self.tile, self.kv_chunk, None if softcap is None else float(softcap), *drop)
        return sparse_attention(q, k, v, document_ids, kind, params, *args)[0]

    def _run(self, q, k, v, document_ids, scale, drop=(0.0, None)) -> Tensor:
        raise NotImplementedError


def _causal_pairs(S: int, causal: bool) -> int:
    return S * (S + 1) // 2 if causal else S * S


@dataclass(frozen=True)
class Exact(AttentionSpec):
    """Exact attention. No documents: SDPA (its CPU flash kernel is O(S) memory). Documents: on
    CPU one flash call per document when ids are sorted per row, else block-sparse tiles.
    `softcap`: scores become softcap * tanh(scores / softcap) before the mask (Gemma-2's
    attn_logit_softcapping); SDPA has no such transform, so on CPU the tiles run it.
    `score_mod`: the name of a FlexAttention-style transform of the scaled (and soft-capped)
    scores, `fn(score, b, h, q_idx, kv_idx, score_tensor)` (attention_kernels.SCORE_MODS; built in:
    "key_bias", ALiBi's per-key bias), run by the tiles forward and backward; the call passes the
    tensor it reads as `score_tensor=` (its gradient flows). `backward_blocks=N`: on the CPU, the
    flash backward per (query block, key block) pair of S / N tokens, so its fp32 q-sized
    accumulator is one block's. `repeat_kv=True`: on the CPU, grouped-query attention's flash
    backward runs with k and v repeated to every query head and their gradients summed per group
    (ATen's grouped backward leaves threads idle: 1.5x faster on 2 cores with one kv head of four),
    for four q-sized transients (one block pair's when blocked). Given to optimize(attention=...)
    with nothing else, these backward options keep the model's own causality, soft-cap, window and
    dropout."""

    softcap: Optional[float] = None
    score_mod: Optional[str] = None
    backward_blocks: int = 0   # 0: one call (~3% faster at 16K tokens than blocks)
    repeat_kv: bool = False

    def __post_init__(self):
        if not isinstance(self.backward_blocks, int) or self.backward_blocks < 0:
            raise ValueError(f"Exact: backward_blocks={self.backward_blocks!r} must be an int >= 0 (0: one call)")
        if not isinstance(self.repeat_kv, bool):
            raise ValueError(f"Exact: repeat_kv={self.repeat_kv!r} must be True or False")

    def _pattern_weights(self, S, num_heads, device):
        return torch.ones(1, S, S, dtype=torch.int64, device=device)

    def num_pairs(self, S, num_heads):
        return num_heads * _causal_pairs(S, self.causal)

    def extra_bytes(self, B, H, S, D, dtype_bytes):
        # The CPU flash backward holds one fp32 (B, H, S, D) accumulator (measured: +8 MiB at
        # S=4K, H=8, D=64 for any H_kv); per-document calls add their results before the copy.
        rows = -(-S // self.backward_blocks) if self.backward_blocks > 1 else S
        repeated = 4 * B * H * rows * D * dtype_bytes if self.repeat_kv else 0
        return super().extra_bytes(B, H, S, D, dtype_bytes) + 2 * B * H * rows * D * 4 + repeated

    def _run(self, q, k, v, document_ids, scale, drop=(0.0, None)):
        if self.softcap is not None or self.dropout:
            return self._sparse(q, k, v, document_ids, scale, "full", [], self.softcap, drop)
        if document_ids is None:
            repeat = self.repeat_kv and k.shape[1] != q.shape[1]
            if (self.backward_blocks > 1 or repeat) and q.device.type == "cpu":
                return self._sparse(q, k, v, None, scale, "full", [self.backward_blocks, int(repeat)])
            return grouped_sdpa(q, k, v, is_causal=self.causal, scale=scale)
        return self._sparse(q, k, v, document_ids, scale, "full", [])


@dataclass(frozen=True)
class SlidingWindow(AttentionSpec):
    """Query i sees keys i - window < j <= i (Mistral's ``sliding_window``); the first
    ``global_tokens`` tokens see and are seen by all. Without causality: |i - j| < window.
    `softcap`: scores soft-capped first, as Exact's (Gemma-2's sliding layers)."""

    window: int
    global_tokens: int = 0
    softcap: Optional[float] = None

    def __post_init__(self):
        for name, value, least in (("window", self.window, 1), ("global_tokens", self.global_tokens, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"SlidingWindow({name}={value!r}) is not valid: an int >= {least} (tokens)")

    def _pattern_weights(self, S, num_heads, device):
        i = torch.arange(S, device=device)[:, None]
        j = torch.arange(S, device=device)[None, :]
        g = self.global_tokens
        near = (j > i - self.window) & (j < i + self.window)
        return (near | (i < g) | (j < g)).long()[None]

    def num_pairs(self, S, num_heads):
        i = torch.arange(S, dtype=torch.int64)
        w, g = self.window, self.global_tokens
        global_left = torch.clamp(torch.clamp(i - w + 1, min=0), max=g)
        if self.causal:
            per_query = torch.clamp(i + 1, max=w) + global_left
            per_query = torch.where(i < g, i + 1, per_query)
        else:
            band = torch.clamp(i + w, max=S) - torch.clamp(i - w + 1, min=0)
            per_query = torch.where(i < g, torch.full_like(i, S), band + global_left)
        return num_heads * int(per_query.sum())

    def _run(self, q, k, v, document_ids, scale, drop=(0.0, None)):
        params = [self.window, self.global_tokens]
        return self._sparse(q, k, v, document_ids, scale, "window", params, self.softcap, drop)


@dataclass(frozen=True)
class BigBird(AttentionSpec):
    """Blocks of ``block`` tokens: query block qi sees key blocks qi - window .. qi + window, the
    first ``num_global`` blocks (which also see all), and ``num_random`` random blocks per query
    block drawn with ``seed`` from the blocks it does not see yet (for causal specs, from its
    past); then the causal mask applies. The random blocks are shared by all heads and rows."""

    block: int
    window: int
    num_global: int
    num_random: int
    seed: int = 0

    def __post_init__(self):
        for name in ("block", "window", "num_global", "num_random", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"BigBird({name}={value!r}) is not valid: an int")
        if self.block < 1 or min(self.window, self.num_global, self.num_random) < 0:
            raise ValueError(f"BigBird: invalid parameters {self} (block >= 1, the others >= 0)")

    def _block_rows(self, qb0: int, qb1: int, num_blocks: int) -> Tensor:
        qb = torch.arange(qb0, qb1)[:, None]
        kb = torch.arange(num_blocks)[None, :]
        rand = bigbird_random_blocks(
            num_blocks, self.window, self.num_global, self.num_random, self.seed, self.causal
        )
        picked = (rand[qb0:qb1, None, :] == kb[..., None]).any(-1)
        near = (kb - qb).abs() <= self.window
        return near | (kb < self.num_global) | (qb < self.num_global) | picked

    def _pattern_weights(self, S, num_heads, device):
        nb = -(-S // self.block)
        blk = torch.arange(S) // self.block
        return self._block_rows(0, nb, nb)[blk[:, None], blk[None, :]].long()[None].to(device)

    def num_pairs(self, S, num_heads):
        nb = -(-S // self.block)
        size = torch.clamp(S - torch.arange(nb) * self.block, max=self.block)
        total = 0
        for qb0 in range(0, nb, 1024):  # rows of blocks in slabs: O(nb) memory per slab
            qb1 = min(qb0 + 1024, nb)
            pairs = size[qb0:qb1, None] * size[None, :]
            if self.causal:
                qb, kb = torch.arange(qb0, qb1)[:, None], torch.arange(nb)[None, :]
                diag = size[qb0:qb1, None] * (size[qb0:qb1, None] + 1) // 2
                pairs = torch.where(kb < qb, pairs, torch.where(kb == qb, diag, 0))
            total += int((pairs * self._block_rows(qb0, qb1, nb)).sum())
        return num_heads * total

    def _run(self, q, k, v, document_ids, scale, drop=(0.0, None)):
        params = [self.block, self.window, self.num_global, self.num_random, self.seed]
        return self._sparse(q, k, v, document_ids, scale, "bigbird", params, None, drop)


@dataclass(frozen=True)
class Dilated(AttentionSpec):
    """LongNet dilated attention. For head h and group (w, r): segments of w tokens; positions
    p (from the segment start) with p % r == h % r attend each other. Groups combine through
    their softmax denominators: a key counts once per group joining it to the query. A query no
    group selects gets a zero output."""

    segments: tuple[int, ...] = field(default=())
    rates: tuple[int, ...] = field(default=())

    def __post_init__(self):
        object.__setattr__(self, "segments", tuple(int(w) for w in self.segments))
        object.__setattr__(self, "rates", tuple(int(r) for r in self.rates))
        if not self.segments or len(self.segments) != len(self.rates):
            raise ValueError(f"Dilated: segments {self.segments} and rates {self.rates}")
        if min(self.segments) < 1 or min(self.rates) < 1:
            raise ValueError(f"Dilated: segments and rates must be positive: {self}")

    def _pattern_weights(self, S, num_heads, device):
        i = torch.arange(S, device=device)
        h = torch.arange(num_heads, device=device)[:, None]
        counts = torch.zeros(num_heads, S, S, dtype=torch.int64, device=device)
        for w, r in zip(self.segments, self.rates):
            seg, pos = i // w, i % w
            chosen = (pos[None, :] % r) == (h % r)  # (H, S)
            same = seg[:, None] == seg[None, :]
            counts += (chosen[:, :, None] & chosen[:, None, :] & same).long()
        return counts

    def num_pairs(self, S, num_heads):
        total = 0
        for w, r in zip(self.segments, self.rates):
            for h in range(num_heads):
                o = h % r
                for length, count in ((w, S // w), (S % w, 1)):
                    m = max(0, -(-(length - o) // r))
                    total += count * _causal_pairs(m, self.causal)
        return total

    def extra_bytes(self, B, H, S, D, dtype_bytes):
        # One run of segments packed at a time, plus an fp32 output accumulator for narrow dtypes.
        packed = dilated_workspace_bytes(
            B, H, S, D, dtype_bytes, self.segments, self.rates, self.tile, self.kv_chunk
        )
        widen = 4 * B * H * S * D if dtype_bytes < 4 else 0
        return super().extra_bytes(B, H, S, D, dtype_bytes) + packed + widen

    def _run(self, q, k, v, document_ids, scale, drop=(0.0, None)):
        if self.dropout:
            raise ValueError("Dilated: dropout is not supported (its branches merge through their lse)")
        return dilated_attention(
            q, k, v, document_ids, list(self.segments), list(self.rates), scale, self.causal,
            self.tile, self.kv_chunk,
        )[0]


def draw_seed() -> Tensor:
    """One attention call's dropout seed: an int64 scalar from torch's CPU generator (on the CPU
    whatever the device, so the kernels read it without a device sync)."""
    return torch.randint(0, 1 << 62, (), dtype=torch.int64)


# ---- the call the attention pass puts in graphs (fx prints it; it rebuilds the spec from primitives) ----
SPECS = {cls.__name__: cls for cls in (Exact, SlidingWindow, BigBird, Dilated)}


@functools.lru_cache(maxsize=None)
def build_spec(kind: str, params: tuple, causal: bool, scale: float) -> AttentionSpec:
    return SPECS[kind](**dict(params), causal=causal, scale=scale)


def attention_call(q, k, v, *, kind: str, params: tuple, causal: bool, scale: float,
                   document_ids: Optional[Tensor] = None, key_bias: Optional[Tensor] = None,
                   key_bias_scale: float = 1.0, dropout_seed: Optional[Tensor] = None):
    """`SPECS[kind](**dict(params), causal=causal, scale=scale)(q, k, v, document_ids=...)`; k, v
    have H_kv heads; `document_ids` (B, S) keeps each query to keys of its own document (packed
    sequences; the attention pass passes it only for a mask it proved to be a document mask).
    `key_bias`: key_bias_scale * key_bias is added to every query's scores, one value per key, as
    the model added it: broadcast to (B, H, 1, S), or with heads folded into the batch to
    (B * H, 1, S) (Bloom's ALiBi); the exact spec runs it as score_mod "key_bias".
    `dropout_seed`: the seed of a spec with dropout (draw_seed(), a node of its own in the graph)."""
    if key_bias is not None:
        if kind != "Exact":
            raise ValueError(f"a per-key bias runs with the exact spec only, not {kind}")
        params = (*params, ("score_mod", "key_bias"))
        key_bias = per_key_bias(key_bias, key_bias_scale, q)
    if kind != "Exact" or document_ids is not None or params:
        # The custom ops' fake kernels return empty_like(q/k/v) while the real ones return
        # contiguous tensors: with RoPE'd (transposed-layout) inputs AOTAutograd would plan a
        # backward `view` on strides the real gradients do not have. (Exact with documents runs
        # the custom ops too.)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    spec = build_spec(kind, params, causal, scale)
    if document_ids is None and key_bias is None and dropout_seed is None:
        return spec(q, k, v)
    return spec(q, k, v, document_ids=document_ids, score_tensor=key_bias, dropout_seed=dropout_seed)


def per_key_bias(bias: Tensor, coeff: float, q: Tensor) -> Tensor:
    """A bias added to (B, H, S, S) scores as (Bb, Hb, 1, S), or to heads-folded (B * H, S, S)
    scores as (B * H or 1, 1, S), as a (B, H, S) view: the tensor score_mod "key_bias" reads."""
    batch, heads, seq = q.shape[:3]
    if coeff != 1.0:
        bias = bias * coeff
    if bias.dim() <= 3 and bias.shape[-2:-1] == (1,) and (bias.dim() < 3 or bias.shape[0] in (1, batch * heads)):
        flat = bias.reshape(-1, bias.shape[-1])   # (B * H or 1, S): heads folded into the batch
        per_key = flat.view(batch, heads, -1) if flat.shape[0] == batch * heads else flat.view(1, 1, -1)
    else:
        per_key = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))[:, :, 0]
    return per_key.expand(batch, heads, seq)


def spec_params(spec: AttentionSpec) -> tuple[str, tuple]:
    """(kind, params): the spec's class name and its non-default fields other than causal/scale."""
    params = tuple((f.name, getattr(spec, f.name)) for f in dataclasses.fields(spec)
                   if f.name not in ("causal", "scale") and getattr(spec, f.name) != f.default)
    return type(spec).__name__, params
