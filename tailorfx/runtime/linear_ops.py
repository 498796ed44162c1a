"""The fused LM head + cross-entropy (chunked, gradient taken in forward) and the linear with an
fp32 result: custom ops the mini-sequence and precision passes put in graphs.

    chunked_linear_cross_entropy(hidden, weight, bias, labels, ...)   # no S x V logits in memory
    linear_fp32_out(x, weight, bias)                                  # bf16 matmul, fp32 result
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from tailorfx.kernels.linear_cross_entropy import loss_dtype
from tailorfx.kernels.weight_grad import add_weight_grad
from tailorfx.kernels.linear_cross_entropy import gemms_in_weight_dtype  # noqa: F401 (this module's rule too)


def transient_bytes(op_name: str, args: list, as_int: Callable, cuda: bool = False) -> int:
    """Bytes one of these ops allocates and frees inside itself (see ops.transient_bytes); `cuda`:
    as the op runs on CUDA (a GPU budget predicted on CPU fake tensors)."""
    if op_name.startswith("chunked_linear_cross_entropy"):
        hidden, weight = args[0], args[1]
        n_rows, vocab = as_int(hidden.shape[0]), as_int(weight.shape[0])
        n = max(1, min(as_int(args[6]), n_rows))
        if gemms_in_weight_dtype(hidden, weight, cuda):
            # the chunk's fp32 logits (x2 under a soft-cap: tanh's output in place, and the capped
            # logits) and, beside them, the chunk's logits or their gradient in the weight's dtype;
            # an fp32 accumulator of the weight's gradient if asked
            return int(-(-n_rows // n) * vocab * (4 * (2 if args[7] is not None else 1) + weight.element_size())
                       + _fp32_accumulator(op_name, args, as_int))
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        item = torch.empty((), dtype=dtype).element_size()
        # the chunk's logits (under a soft-cap turned into tanh's output in place) and the capped logits
        extra = -(-n_rows // n) * vocab * item * (2 if args[7] is not None else 1)
        if op_name.endswith("_with_grads") and args[9] and hidden.dtype != dtype:
            extra += -(-n_rows // n) * as_int(hidden.shape[-1]) * item   # g @ w before its cast
        if op_name.endswith("_with_grads"):
            # each row's factor on the chunk of hidden (the weight's gradient), and the bias's
            # gradient as a product with those factors (see _lce_chunk)
            extra += -(-n_rows // n) * as_int(hidden.shape[-1]) * item * bool(args[10]) + vocab * item * bool(args[11])
        if weight.dtype != dtype:
            w_up = as_int(weight.numel()) * item          # the weight, upcast once
            if op_name.endswith("_with_grads") and args[10]:
                # + its gradient accumulated in fp32; cast to the weight's dtype at the end (that
                # output is counted by the graph) once the chunk buffers are gone
                out = as_int(weight.numel()) * weight.element_size()
                return int(2 * w_up + max(0, extra - out))
            extra += w_up
        return int(extra)
    if op_name == "triton_linear_cross_entropy":   # runtime/triton_ops.py, same arguments
        hidden, weight = args[0], args[1]
        n_rows, vocab, width = as_int(hidden.shape[0]), as_int(weight.shape[0]), as_int(hidden.shape[-1])
        chunk = -(-n_rows // max(1, as_int(args[6])))
        if gemms_in_weight_dtype(hidden, weight, cuda):
            # the chunk's logits in the weight's dtype (the kernel turns them into their gradient
            # in place), the per-row fp32 losses, and an fp32 accumulator of the weight's gradient
            # if asked
            return int(chunk * vocab * weight.element_size() + n_rows * 4 + _fp32_accumulator(op_name, args, as_int))
        # the chunk's fp32 logits (turned into their gradient in place), the per-row losses, the
        # chunk of hidden in fp32 and, for a low-precision weight, its fp32 copy and fp32
        # gradient accumulator
        extra = chunk * vocab * 4 + n_rows * 4
        if hidden.dtype != torch.float32:
            extra += 2 * chunk * width * 4
        if weight.dtype != torch.float32:
            extra += as_int(weight.numel()) * 4 * (2 if args[10] else 1)
        return int(extra)
    if op_name == "linear_fp32_out" and args[0].device.type != "cuda":
        # CPU upcasts the operands (see the op)
        return sum(as_int(t.numel()) * 4 for t in args[:3] if t is not None)
    return 0


def _fp32_accumulator(op_name: str, args: list, as_int: Callable) -> int:
    """An fp32 sum of a 16-bit weight's gradient (`grad_weight_fp32`, argument 12 of the ops that
    take grads in the forward), held until it is cast to the weight's dtype at the op's end."""
    computes = op_name.endswith("_with_grads") or op_name == "triton_linear_cross_entropy"
    if not (computes and args[10] and len(args) > 12 and args[12]):
        return 0
    return as_int(args[1].numel()) * 4


# ---------------------------------------------------------------------------------------------
# chunked_linear_cross_entropy: LM head + loss without the N x V logits
# ---------------------------------------------------------------------------------------------


def _lce_chunk(h, y, w, b, ignore_index, softcap, logit_scale, scale, grad_h, grad_w, grad_b,
               vocab_start=0, group=None, out=None):
    """Summed loss of one row chunk; writes grad_h and accumulates grad_w/grad_b if not None.

    With a process `group`, `w` is rows `vocab_start:` of a vocabulary split over its ranks: the
    rows' max, sum of exponentials and target logit are all-reduced (runtime/vocab_parallel.py),
    and grad_h is this rank's share. `out`: a buffer of at least h's rows x V in w's dtype the
    logits are written to (see lce_chunks)."""
    # the only chunk x V buffer (plus the capped logits under softcap)
    if out is None:
        z = F.linear(h, w, b)
    else:
        z = out[:h.shape[0]]
        torch.mm(h, w.t(), out=z) if b is None else torch.addmm(b, h, w.t(), out=z)
    if z.dtype != torch.float64:
        z = z.float()      # low-precision logits upcast one chunk at a time, as eager's logits.float()
    if logit_scale is not None:
        z.mul_(logit_scale)
    if softcap is not None:
        t = z.div_(softcap).tanh_()   # tanh(z / c) in z's own buffer: kept for the gradient
        z = t * softcap
    valid = y != ignore_index
    # the labels in this rank's rows (all of them on one device)
    mine = valid if group is None else valid & (y >= vocab_start) & (y < vocab_start + w.shape[0])
    target = torch.where(mine, y - vocab_start, 0).unsqueeze(1)
    grads = grad_h is not None or grad_w is not None or grad_b is not None
    if group is not None:
        loss, sum_exp = _vocab_parallel_loss(z, target, mine, valid, group)
        if not grads:
            return loss
        g = z.div_(sum_exp)      # the softmax, in z's buffer
    elif grads and z.device.type == "cpu":
        # the softmax in one pass over z (log_softmax and exp made two); the loss from the target's
        # probability, exact where that underflowed (see _underflowed_losses)
        g = torch.softmax(z, dim=1, out=z)
        p_t = g.gather(1, target).squeeze(1)
        losses = -p_t.log()
        lost = valid & (p_t < torch.finfo(g.dtype).tiny)
        if lost.any():          # a host check, free on the CPU (a stall per chunk on CUDA)
            rows = lost.nonzero().squeeze(1)
            losses[rows] = _underflowed_losses(g, rows, h, w, b, target, logit_scale, softcap)
        loss = torch.where(valid, losses, 0).sum()
    else:
        # log_softmax in place over z, as eager's cross_entropy computes it
        torch.log_softmax(z, dim=1, out=z)
        loss = torch.where(valid, -z.gather(1, target).squeeze(1), 0).sum()
        if not grads:
            return loss
        g = z.exp_()
    g.scatter_add_(1, target, -mine.to(g.dtype).unsqueeze(1))
    if softcap is not None:
        g.mul_(t.mul_(t).neg_().add_(1))  # d(c*tanh(z/c))/dz = 1 - tanh^2
    # each row's factor (1/count, 0 for ignored rows, the logit scale) goes on the chunk x H
    # operands and results of the GEMMs below, not on the chunk x V gradient: a pass fewer over it
    rs = valid.to(g.dtype) if scale is None else valid.to(g.dtype) * scale
    if logit_scale is not None:
        rs = rs * logit_scale
    rs = rs.unsqueeze(1)
    if w.dtype != g.dtype:    # the backward GEMMs in the weight's dtype too, as eager's autograd runs them
        g_w, rs = g.mul_(rs).to(w.dtype), None    # scaled before the cast, as eager's gradient
        del g
    else:
        g_w = g
    if grad_h is not None:
        if grad_h.dtype == g_w.dtype:
            torch.mm(g_w, w, out=grad_h)   # straight into the chunk of grad_hidden: no chunk x H temporary
            if rs is not None:
                grad_h.mul_(rs)
        else:
            grad_h.copy_(g_w @ w if rs is None else (g_w @ w).mul_(rs))
    if grad_w is not None:
        add_weight_grad(grad_w, g_w, h if rs is None else h * rs.to(h.dtype), slab=4096)
    if grad_b is not None:
        grad_b.add_(g_w.sum(0, dtype=grad_b.dtype) if rs is None else (g_w.t() @ rs).squeeze(1).to(grad_b.dtype))
    return loss


def _underflowed_losses(p, rows, h, w, b, target, logit_scale, softcap):
    """Losses of `rows` whose target's probability underflowed in the softmax `p`: with m the
    row's largest logit (at the largest probability p_max = exp(m - lse), at least 1/V),
    loss = lse - z_t = (m - z_t) - log(p_max), the two logits recomputed as dot products."""
    out = []
    for i in rows.tolist():      # rare rows; no copy of a row of p
        top = p[i].argmax()
        cols = torch.stack([top, target[i, 0]])
        z = (w[cols] @ h[i].to(w.dtype)).to(p.dtype)
        if b is not None:
            z = z + b[cols].to(p.dtype)
        if logit_scale is not None:
            z = z * logit_scale
        if softcap is not None:
            z = torch.tanh(z / softcap) * softcap
        out.append(z[0] - z[1] - p[i, top].log())
    return torch.stack(out)


def _vocab_parallel_loss(z, target, mine, valid, group):
    """(summed loss, each row's sum of exponentials) of logits whose vocabulary is split over
    `group`'s ranks: the rows' max, sum of exponentials and target logit all-reduced; z is left
    holding exp(z - the row's max)."""
    picked = z.gather(1, target)
    z_max = z.amax(dim=1, keepdim=True)
    dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
    z.sub_(z_max).exp_()
    stats = torch.cat([z.sum(dim=1, keepdim=True), torch.where(mine.unsqueeze(1), picked, 0)], dim=1)
    dist.all_reduce(stats, group=group)
    sum_exp, picked = stats[:, :1], stats[:, 1:]
    return torch.where(valid, (z_max + sum_exp.log() - picked).squeeze(1), 0).sum(), sum_exp


def lce_chunks(hidden, weight, bias, labels, ignore_index, reduction, num_chunks, softcap, logit_scale,
               need_hidden, need_weight, need_bias, vocab_start=0, group=None, in_weight_dtype=None,
               grad_weight_fp32=False):
    """Loss and (if asked) grads for d(loss)/d(inputs) with grad_output 1, one row chunk at a time.

    The loss math runs in fp32 (fp64 stays fp64). On CUDA, with `hidden` and weight both
    bf16/fp16, the GEMMs run in that dtype (tensor cores; fp32 accumulation inside each), as
    eager's bf16 head does: each chunk's logits are upcast to fp32 as `cross_entropy(logits.float())`
    upcasts them, their gradient cast back for the backward GEMMs, and the weight's gradient summed
    over the chunks in its own dtype (as Liger-Kernel's fused head does), or in fp32 with
    `grad_weight_fp32` (Liger's `accum_dtype=torch.float32`); no fp32 copy of the weight.
    Elsewhere the weight is upcast once (V*H*4 bytes) and the GEMMs run in fp32
    (`in_weight_dtype` forces either). A bf16 `hidden` with an fp32 (master) weight is upcast one
    chunk at a time.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"chunked_linear_cross_entropy: reduction {reduction!r} not in mean/sum")
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    n = max(1, min(num_chunks, hidden.size(0)))
    if in_weight_dtype if in_weight_dtype is not None else gemms_in_weight_dtype(hidden, weight):
        w, b, h_dtype = weight, bias, hidden.dtype
    else:
        w, b, h_dtype = weight.to(dtype), bias.to(dtype) if bias is not None else None, dtype
    count = (labels != ignore_index).sum()
    # torch: mean over zero valid labels is nan, but its grads are zero (not nan).
    scale = 1.0 / count.clamp(min=1).to(dtype) if reduction == "mean" else None
    total = torch.zeros((), dtype=dtype, device=hidden.device)
    grad_h = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    grad_w = (torch.zeros(w.shape, dtype=torch.promote_types(w.dtype, torch.float32) if grad_weight_fp32
                          else w.dtype, device=w.device) if need_weight else None)
    grad_b = torch.zeros(b.shape, dtype=dtype, device=b.device) if need_bias else None
    grad_h_chunks = grad_h.tensor_split(n) if need_hidden else [None] * n
    # One logits buffer for every chunk, the same bytes as one chunk's logits: a new one per chunk
    # is a fresh mmap on the CPU (glibc maps blocks over 32 MiB anew), whose page faults made the
    # logits GEMM 25% slower at 1,024 x 32,000. fp32 and fp64 logits only: lower precision ones
    # are upcast into a buffer of their own.
    rows = -(-hidden.size(0) // n)
    out = (torch.empty(rows, w.shape[0], dtype=w.dtype, device=w.device)
           if w.dtype in (torch.float32, torch.float64) and hidden.size(0) else None)
    for h, y, gh in zip(hidden.tensor_split(n), labels.tensor_split(n), grad_h_chunks):
        total += _lce_chunk(h.to(h_dtype), y, w, b, ignore_index, softcap, logit_scale, scale, gh, grad_w, grad_b,
                            vocab_start, group, out)
    del out     # before the gradients' casts below allocate
    loss = total / count if reduction == "mean" else total
    grad_w = grad_w.to(weight.dtype) if need_weight else weight.new_empty(0)
    grad_b = grad_b.to(bias.dtype) if need_bias else weight.new_empty(0)
    return loss.to(loss_dtype(hidden, weight)), grad_h, grad_w, grad_b


@torch.library.custom_op("tailorfx::chunked_linear_cross_entropy", mutates_args=())
def _lce_loss(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
              ignore_index: int, reduction: str, num_chunks: int,
              logit_softcap: Optional[float], logit_scale: Optional[float],
              grad_weight_fp32: bool = False) -> Tensor:
    """Loss only; its autograd recomputes the chunks in backward (the 'recompute' mode)."""
    return lce_chunks(hidden, weight, bias, labels, ignore_index, reduction, num_chunks,
                      logit_softcap, logit_scale, False, False, False)[0]


@_lce_loss.register_fake
def _lce_loss_fake(hidden, weight, bias, labels, ignore_index, reduction, num_chunks, logit_softcap,
                   logit_scale, grad_weight_fp32=False):
    return hidden.new_empty((), dtype=loss_dtype(hidden, weight))


@torch.library.custom_op("tailorfx::chunked_linear_cross_entropy_with_grads", mutates_args=())
def _lce_with_grads(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                    ignore_index: int, reduction: str, num_chunks: int,
                    logit_softcap: Optional[float], logit_scale: Optional[float], grad_hidden: bool,
                    grad_weight: bool, grad_bias: bool,
                    grad_weight_fp32: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, grad_hidden, grad_weight, grad_bias) in one pass; unrequested grads are empty."""
    return lce_chunks(hidden, weight, bias, labels, ignore_index, reduction, num_chunks,
                      logit_softcap, logit_scale, grad_hidden, grad_weight, grad_bias,
                      grad_weight_fp32=grad_weight_fp32)


@_lce_with_grads.register_fake
def _lce_with_grads_fake(hidden, weight, bias, labels, ignore_index, reduction, num_chunks,
                         logit_softcap, logit_scale, grad_hidden, grad_weight, grad_bias, grad_weight_fp32=False):
    return (hidden.new_empty((), dtype=loss_dtype(hidden, weight)),
            torch.empty_like(hidden) if grad_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if grad_weight else weight.new_empty(0),
            torch.empty_like(bias) if grad_bias else weight.new_empty(0))


def grads_in_forward_setup(ctx, inputs, output):
    """Autograd of an LM-head op `(hidden, weight, bias, labels, 5 options, grad_hidden,
    grad_weight, grad_bias, grad_weight_fp32) -> (loss, grad_hidden, grad_weight, grad_bias)` whose
    gradients were taken in the forward: keep them; the backward only scales them."""
    _, grad_h, grad_w, grad_b = output
    ctx.mark_non_differentiable(grad_h, grad_w, grad_b)
    # eager autograd (a pipeline stage) would hand the backward zero-filled hidden- and
    # weight-sized gradients for those three outputs unless told not to
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(grad_h, grad_w, grad_b)
    ctx.computed = inputs[9:12]


def grads_in_forward_backward(ctx, grad_loss, *_):
    needs = ctx.needs_input_grad[:3]
    if grad_loss is None:      # the loss itself took no part in what was differentiated
        return (None,) * 13
    if any(need and not computed for need, computed in zip(needs, ctx.computed)):
        raise RuntimeError("fused LM head: an input needs a grad that was not computed in the forward "
                           f"(needed {needs}, computed {ctx.computed})")
    grads = [g * grad_loss if need else None for g, need in zip(ctx.saved_tensors, needs)]
    return (*grads, *[None] * 10)


_lce_with_grads.register_autograd(grads_in_forward_backward, setup_context=grads_in_forward_setup)


def _lce_loss_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], inputs[2], inputs[3])
    ctx.args, ctx.fp32 = inputs[4:9], inputs[9] if len(inputs) > 9 else False


def _lce_loss_grad(ctx, grad_loss):
    hidden, weight, bias, labels = ctx.saved_tensors
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    _, gh, gw, gb = torch.ops.tailorfx.chunked_linear_cross_entropy_with_grads(
        hidden, weight, bias, labels, *ctx.args, need_h, need_w, need_b, ctx.fp32)
    return (gh * grad_loss if need_h else None, gw * grad_loss if need_w else None,
            gb * grad_loss if need_b else None, *[None] * 7)


_lce_loss.register_autograd(_lce_loss_grad, setup_context=_lce_loss_setup)


def chunked_linear_cross_entropy(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, *,
    ignore_index: int = -100, reduction: str = "mean", num_chunks: int = 8,
    logit_softcap: Optional[float] = None, logit_scale: Optional[float] = None, recompute: bool = False,
    grad_weight_fp32: bool = False,
) -> Tensor:
    """``F.cross_entropy(softcap(logit_scale * F.linear(hidden, weight, bias)), labels)`` without
    N x V logits (Cohere scales its logits, Gemma-2 soft-caps them).

    With grads needed, they are computed during the forward and only scaled in backward (one pass
    over the vocabulary); ``recompute=True`` saves only the inputs and redoes the pass in backward.
    Without grads (eval, no_grad), nothing but the loss is computed. ``grad_weight_fp32``: a
    16-bit weight's gradient is summed over the chunks in fp32 (see lce_chunks).
    """
    needs = [t is not None and t.requires_grad for t in (hidden, weight, bias)]
    if recompute or not (torch.is_grad_enabled() and any(needs)):
        return torch.ops.tailorfx.chunked_linear_cross_entropy(
            hidden, weight, bias, labels, ignore_index, reduction, num_chunks, logit_softcap, logit_scale,
            grad_weight_fp32)
    return torch.ops.tailorfx.chunked_linear_cross_entropy_with_grads(
        hidden, weight, bias, labels, ignore_index, reduction, num_chunks, logit_softcap, logit_scale,
        *needs, grad_weight_fp32)[0]


# ---------------------------------------------------------------------------------------------
# linear_fp32_out: a low-precision matmul that hands on its fp32 accumulator
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("tailorfx::linear_fp32_out", mutates_args=())
def _linear_fp32_out(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``F.linear`` of bf16/fp16 operands whose fp32 result is returned, not rounded to their dtype.

    CUDA runs one mixed-dtype GEMM (``mm(..., out_dtype=float32)``). CPU has none, so the operands
    are upcast: the same result, since a product of two 8- or 11-bit mantissas is exact in fp32.
    """
    if x.is_cuda:
        y = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
        y = y.view(*x.shape[:-1], weight.shape[0])
        return y.add_(bias.float()) if bias is not None else y
    return F.linear(x.float(), weight.float(), bias.float() if bias is not None else None)


@_linear_fp32_out.register_fake
def _linear_fp32_out_fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


def _linear_fp32_out_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _linear_fp32_out_grad(ctx, grad):
    # The backward matmuls run in the operands' dtype, as torch.autocast's do.
    x, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad
    g = grad.to(x.dtype)
    gx = g @ weight if need_x else None
    gw = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) if need_w else None
    gb = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype) if need_b else None
    return gx, gw, gb


_linear_fp32_out.register_autograd(_linear_fp32_out_grad, setup_context=_linear_fp32_out_setup)


linear_fp32_out_op = torch.ops.tailorfx.linear_fp32_out.default


def linear_fp32_out(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(x, weight, bias)`` in x's low precision with an fp32 result (see the op)."""
    return torch.ops.tailorfx.linear_fp32_out(x, weight, bias)
