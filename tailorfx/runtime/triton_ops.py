"""The runtime's ops with Triton implementations (`optimize(..., kernels="triton")`).

    tailorfx::triton_norm(x, weight, bias, eps, kind, offset) -> (y, stats)          + _backward
    tailorfx::triton_attention(q, k, v, document_ids, mask, params, causal, scale, softcap, key_bias)
        -> (out, lse)                                                          + _backward
    tailorfx::triton_glu(gate, up, act) -> act(gate) * up                     + _backward
    tailorfx::triton_linear_cross_entropy(hidden, weight, bias, labels, ...)
        -> (loss, grad_hidden, grad_weight, grad_bias)     gradient taken in the forward
    tailorfx::triton_rope(x, cos, sin, backward, out_dtype) -> x * cos + rotate_half(x) * sin (or its transpose)
    tailorfx::triton_rope_qk(q, k, cos, sin, backward, out_dtype) -> (q's rotation, k's)   one launch for both
    torch_norm(x, weight, bias, eps, kind, offset)   the norm on torch's own fused kernels (no Triton)

Each op launches kernels rendered by `tailorfx.kernels` and has an autograd registration, so a
rewritten graph keeps one node per op through AOTAutograd. On a GPU the ops are
`torch.library.triton_op`s (Inductor sees the Triton kernels inside them); under Triton's CPU
interpreter (TRITON_INTERPRET=1) they are opaque `custom_op`s with fake kernels, because the
interpreter cannot run on the fake or functional tensors tracing passes. Which of the two is
fixed when this module is imported.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from tailorfx.kernels import flash_launch as _flash
from tailorfx.kernels import glu as _glu
from tailorfx.kernels import interpreted
from tailorfx.kernels import linear_cross_entropy as _lce
from tailorfx.kernels import norm as _norm
from tailorfx.kernels import rope as _rope
from tailorfx.runtime.linear_ops import grads_in_forward_backward, grads_in_forward_setup, loss_dtype

INTERPRETED = interpreted()


def _op(name: str):
    """Define `tailorfx::name` as a triton_op on a GPU build, a custom_op under the interpreter."""
    def deco(fn):
        define = torch.library.custom_op if INTERPRETED else torch.library.triton_op
        return define(f"tailorfx::{name}", mutates_args=())(fn)
    return deco


def _fake(op):
    """Register a fake kernel where one is needed (custom_op); a triton_op traces its own."""
    def deco(fn):
        if INTERPRETED:
            op.register_fake(fn)
        return fn
    return deco


# ---- norms ---------------------------------------------------------------------------------
# The statistics output (rstd, and LayerNorm's mean) is not differentiable: marked so, with grads
# not materialized, autograd hands the backward None for it instead of a zero-filled tensor.

@_op("triton_norm")
def _norm_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float, kind: str,
              offset: float) -> tuple[Tensor, Tensor]:
    return _norm.forward_stats(x, weight, bias, eps, kind, offset)


@_fake(_norm_fwd)
def _norm_fwd_fake(x, weight, bias, eps, kind, offset):
    rows = x.numel() // x.shape[-1]
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((rows,) if kind == "rms" else (2, rows), dtype=torch.float32))


@_op("triton_norm_backward")
def _norm_bwd(dy: Tensor, x: Tensor, weight: Tensor, stats: Tensor, kind: str, offset: float,
              has_bias: bool) -> list[Tensor]:
    dx, dw, db = _norm.backward_stats(dy, x, weight, stats, kind, offset, has_bias)
    return [dx, dw] if db is None else [dx, dw, db]


@_fake(_norm_bwd)
def _norm_bwd_fake(dy, x, weight, stats, kind, offset, has_bias):
    return [torch.empty_like(x, memory_format=torch.contiguous_format)] + \
        [torch.empty_like(weight) for _ in range(2 if has_bias else 1)]


def _norm_setup(ctx, inputs, output):
    x, weight, bias, eps, kind, offset = inputs
    stats = output[1]
    ctx.mark_non_differentiable(stats)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, weight, stats)
    ctx.kind, ctx.offset, ctx.has_bias = kind, offset, bias is not None


def _norm_grad(ctx, dy, _dstats):
    if dy is None:   # y took no part in what was differentiated
        return None, None, None, None, None, None
    x, weight, stats = ctx.saved_tensors
    grads = _norm_bwd(dy.contiguous(), x, weight, stats, ctx.kind, ctx.offset, ctx.has_bias)
    return grads[0], grads[1], (grads[2] if ctx.has_bias else None), None, None, None


_norm_fwd.register_autograd(_norm_grad, setup_context=_norm_setup)


def triton_norm(x: Tensor, weight: Tensor, bias: Optional[Tensor], *, eps: float, kind: str, offset: float = 0.0) -> Tensor:
    """RMSNorm (`kind="rms"`, `x * rsqrt(mean(x^2) + eps) * (offset + w)`) or LayerNorm over the
    last dim, computed in fp32 and returned in x's dtype."""
    return _norm_fwd(x, weight, bias, eps, kind, offset)[0]


def torch_norm(x: Tensor, weight: Tensor, bias: Optional[Tensor], *, eps: float, kind: str, offset: float = 0.0) -> Tensor:
    """triton_norm's norm on torch's own kernels, F.rms_norm or F.layer_norm: on CUDA one fused
    kernel each way, computed in fp32 and rounded once to x's dtype, as the Triton kernel does.
    What kernels="triton" lowers a norm to where these were measured the faster
    (passes/kernel_choice.py): weights in x's dtype, no weight offset."""
    if offset:
        raise ValueError("torch_norm takes no weight offset (a 16-bit 1 + w would be rounded first)")
    shape = (x.shape[-1],)
    with torch.autocast(x.device.type, enabled=False):   # autocast would return layer_norm's in fp32
        if kind == "rms":
            return torch.nn.functional.rms_norm(x, shape, weight, eps)
        return torch.nn.functional.layer_norm(x, shape, weight, bias, eps)


# ---- attention -----------------------------------------------------------------------------

_MASKS = {"Exact": "full", "SlidingWindow": "window", "BigBird": "bigbird", "Dilated": "dilated"}


def attention_params(kind: str, params: dict) -> tuple[str, tuple]:
    """An attention spec (tailorfx.attention: class name and fields) as the kernel's mask and params."""
    if kind == "Exact":
        return "full", ()
    if kind == "SlidingWindow":
        return "window", (params["window"], params.get("global_tokens", 0))
    if kind == "BigBird":
        return "bigbird", (params["block"], params["window"], params["num_global"], params["num_random"],
                           params.get("seed", 0))
    return "dilated", (tuple(params["segments"]), tuple(params["rates"]))


def _flat(mask: str, params: tuple) -> list[int]:
    """Mask params as the flat int list the op schema takes (dilated: count, segments, rates)."""
    if mask == "dilated":
        seg, rate = params
        return [len(seg), *seg, *rate]
    return [int(p) for p in params]


def _unflat(mask: str, flat: list[int]) -> tuple:
    if mask == "dilated":
        n = flat[0]
        return tuple(flat[1:1 + n]), tuple(flat[1 + n:1 + 2 * n])
    return tuple(flat)


def attention_kind(mask: str, flat: list[int]) -> tuple[str, dict]:
    """The attention spec (class name, fields) a kernel's mask and flat params stand for:
    attention_params' inverse (the step-time model counts the pairs it attends)."""
    params = _unflat(mask, flat)
    if mask == "full":
        return "Exact", {}
    if mask == "window":
        return "SlidingWindow", dict(zip(("window", "global_tokens"), params))
    if mask == "bigbird":
        return "BigBird", dict(zip(("block", "window", "num_global", "num_random", "seed"), params))
    return "Dilated", {"segments": params[0], "rates": params[1]}


@_op("triton_attention")
def _attn_fwd(q: Tensor, k: Tensor, v: Tensor, document_ids: Optional[Tensor], mask: str, params: list[int],
              causal: bool, scale: float, softcap: Optional[float],
              key_bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return _flash.forward(q, k, v, mask=mask, params=_unflat(mask, params), causal=causal, scale=scale,
                          document_ids=document_ids, softcap=softcap, key_bias=key_bias)


@_fake(_attn_fwd)
def _attn_fwd_fake(q, k, v, document_ids, mask, params, causal, scale, softcap, key_bias=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:3], dtype=torch.float32)


@_op("triton_attention_backward")
def _attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
              document_ids: Optional[Tensor], mask: str, params: list[int], causal: bool, scale: float,
              softcap: Optional[float], key_bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    return _flash.backward(dout, q, k, v, out, lse, mask=mask, params=_unflat(mask, params), causal=causal,
                           scale=scale, document_ids=document_ids, softcap=softcap, key_bias=key_bias)


@_fake(_attn_bwd)
def _attn_bwd_fake(dout, q, k, v, out, lse, document_ids, mask, params, causal, scale, softcap, key_bias=None):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _attn_setup(ctx, inputs, output):
    q, k, v, document_ids, mask, params, causal, scale, softcap, key_bias = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)   # no zero-filled (B, H, S) gradient for lse
    ctx.save_for_backward(q, k, v, out, lse, document_ids, key_bias)
    ctx.args = (mask, params, causal, scale, softcap)


def _attn_grad(ctx, dout, _dlse):
    if dout is None:   # out took no part in what was differentiated
        return (None,) * 10
    q, k, v, out, lse, document_ids, key_bias = ctx.saved_tensors
    dq, dk, dv = _attn_bwd(dout.contiguous(), q, k, v, out, lse, document_ids, *ctx.args, key_bias)
    return dq, dk, dv, None, None, None, None, None, None, None


_attn_fwd.register_autograd(_attn_grad, setup_context=_attn_setup)


def triton_attention(q: Tensor, k: Tensor, v: Tensor, *, kind: str, params: tuple, causal: bool, scale: float,
                     document_ids: Optional[Tensor] = None, softcap: Optional[float] = None,
                     key_bias: Optional[Tensor] = None, key_bias_scale: float = 1.0) -> Tensor:
    """`tailorfx.attention.attention_call` on the flash-attention kernel: q (B, H, S, D), k/v
    (B, H_kv, S, D), GQA without repeating k/v; the attention spec `kind(**params)` as its mask;
    `key_bias` as attention_call takes it (ALiBi: one value per key, no gradient), in fp32."""
    mask, mparams = attention_params(kind, dict(params))
    if key_bias is not None:
        from tailorfx.attention import per_key_bias   # here: tailorfx.attention imports the runtime
        key_bias = per_key_bias(key_bias, key_bias_scale, q).float()
    return _attn_fwd(q, k, v, document_ids, mask, _flat(mask, mparams), causal, float(scale), softcap,
                     key_bias)[0]


def triton_attention_kwargs(kwargs: dict) -> dict:
    """An attention_call's keyword arguments as triton_attention's: a soft-cap, a field of the
    exact spec, is the kernel's own argument."""
    kwargs, params = dict(kwargs), dict(kwargs["params"])
    if "softcap" in params:
        kwargs["softcap"], kwargs["params"] = params.pop("softcap"), tuple(params.items())
    return kwargs


def triton_attention_supports(kwargs: dict) -> Optional[str]:
    """None when the kernel runs an attention_call with these keyword arguments, else why not."""
    kind, params = kwargs["kind"], dict(kwargs["params"])
    bias = kwargs.get("key_bias")
    bias = bias.meta.get("val") if hasattr(bias, "meta") else bias   # a graph node: its fake value
    if isinstance(bias, Tensor) and bias.requires_grad:
        return "a per-key bias that needs a gradient runs as a score_mod on the tiles: the Triton kernel gives it none"
    if kind not in _MASKS:
        return f"no Triton kernel for attention spec {kind!r}"
    if params.get("dropout"):
        return "attention dropout runs on the tiles: the Triton kernel has none"
    if params.get("score_mod") is not None:
        return f"score_mod {params['score_mod']!r} runs on the tiles: the Triton kernel has none"
    return None


# ---- gated activations -----------------------------------------------------------------------

@_op("triton_glu")
def _glu_fwd(gate: Tensor, up: Tensor, act: str) -> Tensor:
    return _glu.forward(gate, up, act)


@_fake(_glu_fwd)
def _glu_fwd_fake(gate, up, act):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@_op("triton_glu_backward")
def _glu_bwd(dout: Tensor, gate: Tensor, up: Tensor, act: str) -> tuple[Tensor, Tensor]:
    return _glu.backward(dout, gate, up, act)


@_fake(_glu_bwd)
def _glu_bwd_fake(dout, gate, up, act):
    return (torch.empty_like(gate, memory_format=torch.contiguous_format),
            torch.empty_like(up, memory_format=torch.contiguous_format))


def _glu_setup(ctx, inputs, output):
    gate, up, act = inputs
    ctx.save_for_backward(gate, up)
    ctx.act = act


def _glu_grad(ctx, dout):
    gate, up = ctx.saved_tensors
    dgate, dup = _glu_bwd(dout.contiguous(), gate, up, ctx.act)
    return dgate, dup, None


_glu_fwd.register_autograd(_glu_grad, setup_context=_glu_setup)


def triton_glu(gate: Tensor, up: Tensor, *, act: str) -> Tensor:
    """`act(gate) * up` (act "silu": SwiGLU; "gelu_tanh": GeGLU), computed in fp32; the backward
    recomputes the activation from gate."""
    return _glu_fwd(gate, up, act)


# ---- LM head + cross-entropy -----------------------------------------------------------------

@_op("triton_linear_cross_entropy")
def _lce_fwd(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, ignore_index: int,
             reduction: str, num_chunks: int, logit_softcap: Optional[float], logit_scale: Optional[float],
             grad_hidden: bool, grad_weight: bool, grad_bias: bool,
             grad_weight_fp32: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    chunk = -(-hidden.shape[0] // max(1, num_chunks))
    grads = grad_hidden or grad_weight or grad_bias
    loss, gh, gw, gb = _lce.forward(hidden, weight, bias, labels, ignore_index, reduction, logit_softcap,
                                    logit_scale, 0.0, chunk, grads=grads, grad_weight_fp32=grad_weight_fp32)
    # the schema's outputs for gradients not taken are empty tensors
    return (loss, gh if grad_hidden else hidden.new_empty(0), gw if grad_weight else weight.new_empty(0),
            gb if grad_bias and gb is not None else weight.new_empty(0))


@_fake(_lce_fwd)
def _lce_fwd_fake(hidden, weight, bias, labels, ignore_index, reduction, num_chunks, logit_softcap, logit_scale,
                  grad_hidden, grad_weight, grad_bias, grad_weight_fp32=False):
    return (hidden.new_empty((), dtype=loss_dtype(hidden, weight)),
            torch.empty_like(hidden) if grad_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if grad_weight else weight.new_empty(0),
            torch.empty_like(bias) if grad_bias else weight.new_empty(0))


_lce_fwd.register_autograd(grads_in_forward_backward, setup_context=grads_in_forward_setup)


def triton_linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, *,
                                ignore_index: int = -100, reduction: str = "mean", num_chunks: int = 8,
                                logit_softcap: Optional[float] = None, logit_scale: Optional[float] = None,
                                grad_weight_fp32: bool = False) -> Tensor:
    """`runtime.linear_ops.chunked_linear_cross_entropy` on the fused Triton kernel: the loss of
    `cross_entropy(softcap(logit_scale * linear(hidden, weight, bias)), labels)` and, when grads
    are needed, every gradient in the same pass (scaled in backward); no N x V logits.
    `grad_weight_fp32`: a 16-bit weight's gradient is summed over the chunks in fp32."""
    needs = [t is not None and t.requires_grad for t in (hidden, weight, bias)]
    if not torch.is_grad_enabled():
        needs = [False, False, False]
    return _lce_fwd(hidden, weight, bias, labels, ignore_index, reduction, num_chunks, logit_softcap,
                    logit_scale, *needs, grad_weight_fp32)[0]


# ---- rotary embedding ------------------------------------------------------------------------

# The result's dtype is `out_dtype`, torch's promotion of x's, cos's and sin's where the op is made
# (`x * cos` of autocast's bf16 q and fp32 cos is fp32); the backward writes x's gradient in x's.

def _promoted(*ts: Tensor) -> torch.dtype:
    return _rope.promoted(*(t.dtype for t in ts))


@_op("triton_rope")
def _rope_fwd(x: Tensor, cos: Tensor, sin: Tensor, backward: bool, out_dtype: torch.dtype) -> Tensor:
    return _rope.apply(x, cos, sin, backward=backward, out_dtype=out_dtype)


@_fake(_rope_fwd)
def _rope_fwd_fake(x, cos, sin, backward, out_dtype):
    return _rope.output_like(x, out_dtype)


def _rope_setup(ctx, inputs, output):
    x, cos, sin, backward, _ = inputs
    ctx.save_for_backward(cos, sin)
    ctx.backward, ctx.x_dtype = backward, x.dtype


def _rope_grad(ctx, dout):
    cos, sin = ctx.saved_tensors
    return _rope_fwd(dout, cos, sin, not ctx.backward, ctx.x_dtype), None, None, None, None


_rope_fwd.register_autograd(_rope_grad, setup_context=_rope_setup)


def triton_rope(x: Tensor, cos: Tensor, sin: Tensor, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """transformers' `x * cos + rotate_half(x) * sin` for x (B, H, S, D), cos/sin (B or 1, 1, S, D)
    or (B or 1, S, D), in the dtype torch promotes theirs to; the backward is the transposed rotation
    (no gradient for cos and sin, which HF builds from position ids without one). `out_dtype`: the
    fp32 result written in 16 bits (the kernels pass's fusion of a cast that follows it)."""
    return _rope_fwd(x, cos, sin, False, out_dtype or _promoted(x, cos, sin))


@_op("triton_rope_qk")
def _rope_qk_fwd(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool,
                 out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return _rope.apply_pair(q, k, cos, sin, backward=backward, out_dtype=out_dtype)


@_fake(_rope_qk_fwd)
def _rope_qk_fwd_fake(q, k, cos, sin, backward, out_dtype):
    return _rope.output_like(q, out_dtype), _rope.output_like(k, out_dtype)


def _rope_qk_setup(ctx, inputs, output):
    q, k, cos, sin, backward, _ = inputs
    ctx.set_materialize_grads(False)   # an unused q or k output: no zero-filled gradient to rotate
    ctx.save_for_backward(cos, sin)
    ctx.backward, ctx.x_dtype = backward, q.dtype


def _rope_qk_grad(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    dq, dk = (g if need else None for g, need in zip((dq, dk), ctx.needs_input_grad[:2]))
    back, dtype = not ctx.backward, ctx.x_dtype
    if dq is not None and dk is not None:
        dq, dk = _rope_qk_fwd(dq, dk, cos, sin, back, dtype)
    elif dq is not None:
        dq = _rope_fwd(dq, cos, sin, back, dtype)
    elif dk is not None:
        dk = _rope_fwd(dk, cos, sin, back, dtype)
    return dq, dk, None, None, None, None


_rope_qk_fwd.register_autograd(_rope_qk_grad, setup_context=_rope_qk_setup)


def triton_rope_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
                   out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """`triton_rope` of q (B, H, S, D) and k (B, H_kv, S, D) in one launch per direction, as HF's
    `apply_rotary_pos_emb(q, k, cos, sin)`: what the kernels pass emits for an attention's q and k."""
    return _rope_qk_fwd(q, k, cos, sin, False, out_dtype or _promoted(q, cos, sin))
