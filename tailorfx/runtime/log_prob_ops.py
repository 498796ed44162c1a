"""Per-token log-probabilities of the LM head's labels, chunked: what TRL's trainers read from
`model(..., fused_lm_head=True)` (log_probs, entropy, is_top1, mean_logits that DPO and KTO log,
log_sum_sq_probs that WPO weighs by), without the N x V logits.

    log_probs, entropy, is_top1, log_sum_sq_probs, mean_logits = chunked_token_log_probs(hidden, weight, ...)

Unlike the fused loss (linear_ops.py), whose gradient is taken in forward for a loss of known
weights, a caller weighs these per-token values as it likes (TRL's nll, DFT or policy-gradient
losses), so the backward recomputes each chunk's logits with the per-token gradients it is given
(as TRL's own ChunkedLogProbFunction does), in chunks the planner sizes under the budget.
Rows whose label is `ignore_index` are not scored: their outputs are 0 (False) and cost nothing.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from tailorfx.runtime.linear_ops import gemms_in_weight_dtype

__all__ = ["chunked_token_log_probs", "transient_bytes"]


def _rows_per_chunk(n_rows: int, num_chunks: int) -> int:
    return max(1, -(-n_rows // max(1, num_chunks)))


def _operands(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]):
    """(weight, bias, hidden dtype) the GEMMs run in: the weight's low precision on CUDA, else
    fp32 (fp64 stays fp64), the weight upcast once (as the fused loss does)."""
    if gemms_in_weight_dtype(hidden, weight):
        return weight, bias, hidden.dtype
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    return weight.to(dtype), (bias.to(dtype) if bias is not None else None), dtype


def _transform(z: Tensor, logit_scale: float, softcap: Optional[float], inv_t: float):
    """In place: softcap(z * logit_scale) * inv_t, TRL's order (the temperature after the cap);
    returns (z, tanh(z * logit_scale / cap)), the tanh kept for the gradient (None without a cap)."""
    if logit_scale != 1.0:
        z.mul_(logit_scale)
    t = None
    if softcap is not None:
        t = torch.tanh(z.div_(softcap))       # z holds z/cap, t the tanh (kept for the gradient)
        z.copy_(t).mul_(softcap)
    if inv_t != 1.0:
        z.mul_(inv_t)
    return z, t


def _forward(hidden, weight, bias, labels, ignore_index, num_chunks, softcap, logit_scale, inv_t,
             want_entropy, want_top1, want_sum_sq, want_mean):
    n_rows = hidden.shape[0]
    w, b, h_dtype = _operands(hidden, weight, bias)
    f32 = torch.promote_types(hidden.dtype, torch.float32)
    log_probs = hidden.new_zeros(n_rows, dtype=f32)
    log_z = hidden.new_zeros(n_rows, dtype=f32)
    entropy = hidden.new_zeros(n_rows if want_entropy else 0, dtype=f32)
    top1 = hidden.new_zeros(n_rows if want_top1 else 0, dtype=torch.bool)
    sum_sq = hidden.new_zeros(n_rows if want_sum_sq else 0, dtype=f32)
    mean = hidden.new_zeros(n_rows if want_mean else 0, dtype=f32)
    rows = (labels != ignore_index).nonzero().squeeze(1)
    step = _rows_per_chunk(n_rows, num_chunks)
    for start in range(0, rows.numel(), step):
        idx = rows[start:start + step]
        y = labels[idx].unsqueeze(1)
        z, _ = _transform(F.linear(hidden[idx].to(h_dtype), w, b).to(f32), logit_scale, softcap, inv_t)
        if want_top1:
            top1[idx] = z.argmax(1) == y.squeeze(1)      # the first maximum, as TRL's is_top1
        if want_mean:
            mean[idx] = z.mean(1)
        z_t = z.gather(1, y).squeeze(1)
        m = z.amax(1, keepdim=True)
        z.sub_(m)
        if want_entropy:
            e = torch.exp(z)
            s = e.sum(1)
            ez = torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).view(-1)   # sum_v e_v (z_v - m), no chunk x V temporary
            entropy[idx] = s.log() - ez / s
        else:
            e = z.exp_()
            s = e.sum(1)
        if want_sum_sq:         # log sum_v p_v^2 = log sum_v e_v^2 - 2 log sum_v e_v
            sum_sq[idx] = torch.bmm(e.unsqueeze(1), e.unsqueeze(2)).view(-1).log() - 2 * s.log()
        del e
        lz = m.squeeze(1) + s.log()
        log_z[idx] = lz
        log_probs[idx] = z_t - lz
    return log_probs, entropy, top1, log_z, sum_sq, mean


def _backward(hidden, weight, bias, labels, log_z, entropy, grad_lp, grad_ent, ignore_index, num_chunks,
              softcap, logit_scale, inv_t, need_h, need_w, need_b):
    """d/d(hidden, weight, bias) of sum(grad_lp * log_probs + grad_ent * entropy), chunk by chunk:
    d log p_y / dz = onehot(y) - p, d entropy / dz = -p (log p + entropy)."""
    n_rows = hidden.shape[0]
    w, b, h_dtype = _operands(hidden, weight, bias)
    f32 = torch.promote_types(hidden.dtype, torch.float32)
    grad_h = torch.zeros_like(hidden) if need_h else hidden.new_empty(0)
    grad_w = torch.zeros(w.shape, dtype=f32, device=w.device) if need_w else None
    grad_b = torch.zeros(w.shape[0], dtype=f32, device=w.device) if need_b else None
    rows = (labels != ignore_index).nonzero().squeeze(1)
    step = _rows_per_chunk(n_rows, num_chunks)
    for start in range(0, rows.numel(), step):
        idx = rows[start:start + step]
        y = labels[idx].unsqueeze(1)
        h = hidden[idx].to(h_dtype)
        z, t = _transform(F.linear(h, w, b).to(f32), logit_scale, softcap, inv_t)
        z.sub_(log_z[idx].unsqueeze(1))           # log p
        g_lp = grad_lp[idx].to(f32).unsqueeze(1) if grad_lp is not None else None
        if grad_ent is not None:
            p = torch.exp(z)
            # -p (g_lp + g_ent (log p + entropy)); the target's g_lp added below
            a = z.add_(entropy[idx].unsqueeze(1)).mul_(grad_ent[idx].to(f32).unsqueeze(1))
            if g_lp is not None:
                a.add_(g_lp)
            g = p.mul_(a).neg_()
            del a
        else:
            g = z.exp_().mul_(-g_lp)
        if g_lp is not None:
            g.scatter_add_(1, y, g_lp)
        if inv_t != 1.0:
            g.mul_(inv_t)
        if t is not None:
            g.mul_(t.mul_(t).neg_().add_(1))       # d(cap * tanh(x / cap))/dx = 1 - tanh^2
        if logit_scale != 1.0:
            g.mul_(logit_scale)
        g_w = g.to(w.dtype) if w.dtype != g.dtype else g
        if need_h:
            grad_h[idx] = (g_w @ w).to(hidden.dtype)
        if grad_w is not None:
            grad_w.addmm_(g_w.t().to(f32), h.to(f32))
        if grad_b is not None:
            grad_b.add_(g.sum(0))
    return (grad_h, grad_w.to(weight.dtype) if need_w else weight.new_empty(0),
            grad_b.to(bias.dtype) if need_b else weight.new_empty(0))


@torch.library.custom_op("tailorfx::chunked_token_log_probs", mutates_args=())
def _token_log_probs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, ignore_index: int,
                     num_chunks: int, softcap: Optional[float], logit_scale: float, inv_temperature: float,
                     want_entropy: bool, want_top1: bool, want_sum_sq: bool = False, want_mean: bool = False
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(log_probs, entropy, is_top1, log-partition, log_sum_sq_probs, mean_logits) per row; those
    not asked for empty."""
    return _forward(hidden, weight, bias, labels, ignore_index, num_chunks, softcap, logit_scale, inv_temperature,
                    want_entropy, want_top1, want_sum_sq, want_mean)


@_token_log_probs.register_fake
def _token_log_probs_fake(hidden, weight, bias, labels, ignore_index, num_chunks, softcap, logit_scale,
                          inv_temperature, want_entropy, want_top1, want_sum_sq=False, want_mean=False):
    n, f32 = hidden.shape[0], torch.promote_types(hidden.dtype, torch.float32)
    return (hidden.new_empty(n, dtype=f32), hidden.new_empty(n if want_entropy else 0, dtype=f32),
            hidden.new_empty(n if want_top1 else 0, dtype=torch.bool), hidden.new_empty(n, dtype=f32),
            hidden.new_empty(n if want_sum_sq else 0, dtype=f32), hidden.new_empty(n if want_mean else 0, dtype=f32))


@torch.library.custom_op("tailorfx::chunked_token_log_probs_backward", mutates_args=())
def _token_log_probs_backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                              log_z: Tensor, entropy: Tensor, grad_log_probs: Optional[Tensor],
                              grad_entropy: Optional[Tensor], ignore_index: int, num_chunks: int,
                              softcap: Optional[float], logit_scale: float, inv_temperature: float,
                              need_hidden: bool, need_weight: bool, need_bias: bool
                              ) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden, grad_weight, grad_bias); unrequested ones empty."""
    return _backward(hidden, weight, bias, labels, log_z, entropy, grad_log_probs, grad_entropy, ignore_index,
                     num_chunks, softcap, logit_scale, inv_temperature, need_hidden, need_weight, need_bias)


@_token_log_probs_backward.register_fake
def _token_log_probs_backward_fake(hidden, weight, bias, labels, log_z, entropy, grad_log_probs, grad_entropy,
                                   ignore_index, num_chunks, softcap, logit_scale, inv_temperature,
                                   need_hidden, need_weight, need_bias):
    return (torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0),
            torch.empty_like(bias) if need_bias else weight.new_empty(0))


def _setup(ctx, inputs, output):
    hidden, weight, bias, labels, *options = inputs
    log_probs, entropy, top1, log_z, sum_sq, mean = output
    ctx.mark_non_differentiable(top1, log_z, sum_sq, mean)     # TRL's metrics: no gradient, as TRL's
    ctx.set_materialize_grads(False)    # entropy is most often a metric: no zero-filled gradient for it
    ctx.save_for_backward(hidden, weight, bias, labels, log_z, entropy)
    ctx.options = options


def _grad(ctx, grad_lp, grad_ent, *_):
    hidden, weight, bias, labels, log_z, entropy = ctx.saved_tensors
    ignore_index, num_chunks, softcap, logit_scale, inv_t, *_ = ctx.options
    need = ctx.needs_input_grad[:3]
    if (grad_lp is None and grad_ent is None) or not any(need):
        return (None,) * 13
    gh, gw, gb = torch.ops.tailorfx.chunked_token_log_probs_backward(
        hidden, weight, bias, labels, log_z, entropy, grad_lp, grad_ent, ignore_index, num_chunks, softcap,
        logit_scale, inv_t, *need)
    return (gh if need[0] else None, gw if need[1] else None, gb if need[2] else None, *[None] * 10)


_token_log_probs.register_autograd(_grad, setup_context=_setup)


def chunked_token_log_probs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, *,
                            ignore_index: int = -100, num_chunks: int = 8, softcap: Optional[float] = None,
                            logit_scale: float = 1.0, temperature: float = 1.0, entropy: bool = True,
                            top1: bool = True, log_sum_sq_probs: bool = False, mean_logits: bool = False
                            ) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(log p(label), entropy, label is the argmax, log sum_v p_v^2, mean_v z_v) per row of
    `hidden` [N, H] under the head `z = softcap(logit_scale * (hidden @ weight.T + bias)) /
    temperature`, N x V logits never whole; 0 (False) on ignored rows; all but log p None unless
    asked for. The last two are metrics (TRL's DPO logs them; WPO weighs by the first), without
    gradient, as TRL's."""
    lp, ent, top, _, sq, mean = torch.ops.tailorfx.chunked_token_log_probs(
        hidden, weight, bias, labels, ignore_index, num_chunks, softcap, float(logit_scale), 1.0 / temperature,
        entropy, top1, log_sum_sq_probs, mean_logits)
    return (lp, (ent if entropy else None), (top if top1 else None), (sq if log_sum_sq_probs else None),
            (mean if mean_logits else None))


def transient_bytes(op_name: str, args: list, as_int: Callable, cuda: bool = False) -> int:
    """Bytes these ops allocate and free inside themselves (the memory model adds them per call):
    a chunk's fp32 logits, a second chunk x V buffer for the entropy (forward: exp; backward, when
    the entropy has a gradient: p) and for a soft-cap's tanh, a low-precision weight's fp32 copy
    off CUDA, and in backward the weight's gradient accumulated in fp32 beside its cast."""
    if op_name not in ("chunked_token_log_probs", "chunked_token_log_probs_backward"):
        return 0
    hidden, weight = args[0], args[1]
    n_rows, vocab, width = as_int(hidden.shape[0]), as_int(weight.shape[0]), as_int(hidden.shape[-1])
    backward = op_name.endswith("_backward")
    chunks, softcap = (args[9], args[10]) if backward else (args[5], args[6])
    rows = _rows_per_chunk(n_rows, as_int(chunks))
    second = (args[7] is not None) if backward else bool(args[9])
    extra = rows * vocab * 4 * (1 + int(second) + int(softcap is not None))
    extra += rows * width * 4 * (2 if backward else 1)      # the chunk of hidden gathered (and its gradient)
    low = weight.dtype not in (torch.float32, torch.float64)
    if low and not (cuda and hidden.dtype == weight.dtype):
        extra += as_int(weight.numel()) * 4                   # the weight upcast once
    if backward and args[14] and low:
        extra += as_int(weight.numel()) * 4                   # its gradient accumulated in fp32
    return int(extra)
