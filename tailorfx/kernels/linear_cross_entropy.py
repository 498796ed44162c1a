"""Fused LM head + cross-entropy, chunked over tokens, gradient taken in the forward (Liger-Kernel
style): per chunk of rows the host computes the logits `h @ W^T (+ b)` with a torch matmul,
one Triton program per row turns them in place into d(loss)/d(logits), and the host finishes
with `grad_h = g @ W` and `grad_W += g^T @ h`. No N x V buffer ever exists: the chunk's logits
(fp32, or on CUDA in the weight's 16-bit dtype) are the only chunk x V one.

Semantics are those of `tailorfx.runtime.linear_ops.chunked_linear_cross_entropy`: logits in fp32,
then `logit_scale *` (Cohere), then the soft-cap `c * tanh(z / c)` (Gemma-2), then cross-entropy
against `labels` with `ignore_index` rows contributing nothing; plus an optional z-loss
`z_loss * lse^2` per non-ignored row (PaLM). Reduction "mean" divides by the number of
non-ignored rows (or by `normalizer`, HF's `num_items_in_batch`), "sum" does not.

Spec (compile-time constants of the rendered source):
    block         vocabulary columns per step of the row loop (power of two)
    softcap       optional float: the soft-cap's c (its code is left out without it)
    logit_scale   optional float: the logits' multiplier (left out without it)
    z_loss        optional float > 0: the z-loss coefficient (left out without it)
    grad          bool (default True): whether the kernel writes d(loss)/d(logits) in place
                  (False: one pass over the vocabulary, loss only)
The kernel computes in fp32 whatever the logits' dtype: fp32 logits, or on CUDA the chunk's logits
in the weight's bf16/fp16, read as fp32 (the reference upcasts the logits) and overwritten by their
gradient rounded to that dtype. The source does not depend on it, so the spec carries no dtype
(`logits="bf16"` names the pointer type for a compile check only).

The kernel, per row: pass 1 loops over the vocabulary in `block` columns keeping an online max
and sum of exponentials (fp32) and reads the target's logit; lse = max + log(sum); the row's loss
`lse - z[target] (+ z_loss * lse^2)` is stored. Pass 2 (grad) loops again and writes
`scale * (softmax * (1 + 2 z_loss lse) - onehot)` times the soft-cap's `1 - tanh^2` and the
logit scale over the logits. An ignored row skips both passes and writes zeros. `scale`
(1 / count, 1 / normalizer, or 1) is read from a one-element device tensor: no host sync.
tanh is built from exp (no libdevice): sign(x) (1 - e^{-2|x|}) / (1 + e^{-2|x|}), its Taylor
series to x^7 below |x| = 1/8.
"""
from __future__ import annotations

from string import Template
from typing import Optional

from tailorfx.kernels import KernelSpec, cached_kernel

_HEADER = '''"""tailorfx generated: ${name}"""
import triton
import triton.language as tl

BLOCK = tl.constexpr(${block})
${constants}'''

_TANH = '''

@triton.jit
def _tanh(x):
    # sign(x) (1 - e^-2|x|) / (1 + e^-2|x|), and its odd Taylor series below 1/8 (no cancellation)
    ax = tl.abs(x)
    e = tl.math.exp(-2.0 * ax)
    t = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    return tl.where(ax < 0.125, small, tl.where(x < 0.0, -t, t))
'''

_KERNEL = '''

@triton.jit
def lce_fwd(logits_ptr, labels_ptr, loss_ptr, scale_ptr, n_cols, stride, ignore_index):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride
    label = tl.load(labels_ptr + row)
    cols = tl.arange(0, BLOCK)
    if label != ignore_index:
        # pass 1: online max and sum of exp over the vocabulary
        m = float("-inf")
        d = 0.0
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
${transform_z}
            z = tl.where(mask, z, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=0))
            d = d * tl.math.exp(m - m_new) + tl.sum(tl.math.exp(z - m_new), axis=0)
            m = m_new
        lse = m + tl.math.log(d)
        zt = tl.load(row_ptr + label).to(tl.float32)
${transform_zt}
        tl.store(loss_ptr + row, lse - zt${z_loss_term})
${grad_pass}    else:
        tl.store(loss_ptr + row, 0.0)
${zero_pass}'''

_GRAD_PASS = '''        # pass 2: d(loss)/d(logits) in place
        scale = tl.load(scale_ptr)
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
${transform_z}
            p = tl.math.exp(z - lse)${z_loss_grad}
            g = tl.where(offs == label, p - 1.0, p) * scale${chain}
            tl.store(row_ptr + offs, g.to(logits_ptr.dtype.element_ty), mask=mask)
'''

_ZERO_PASS = '''        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            tl.store(row_ptr + offs, tl.zeros([BLOCK], dtype=tl.float32).to(logits_ptr.dtype.element_ty),
                     mask=offs < n_cols)
'''


def _params(spec):
    block = spec["block"]
    if block & (block - 1) or block < 16:
        raise ValueError(f"linear_cross_entropy block {block} is not a power of two >= 16")
    softcap, logit_scale, z_loss = spec.get("softcap"), spec.get("logit_scale"), spec.get("z_loss")
    if softcap is not None and not float(softcap) > 0:
        raise ValueError(f"linear_cross_entropy softcap={softcap}: a positive float (or leave it out)")
    if z_loss is not None and not float(z_loss) > 0:
        raise ValueError(f"linear_cross_entropy z_loss={z_loss}: a positive float (or leave it out)")
    return block, softcap, logit_scale, z_loss, bool(spec.get("grad", True))


def render(spec) -> str:
    block, softcap, logit_scale, z_loss, grad = _params(spec)
    consts = []
    if logit_scale is not None:
        consts.append(f"LOGIT_SCALE = tl.constexpr({float(logit_scale)!r})")
    if softcap is not None:
        consts.append(f"SOFTCAP = tl.constexpr({float(softcap)!r})")
    if z_loss is not None:
        consts.append(f"Z_LOSS = tl.constexpr({float(z_loss)!r})")

    def transform(var, indent, keep_t):
        """logit_scale then soft-cap on `var` (keep_t: keep tanh's value for the chain rule)."""
        lines = []
        if logit_scale is not None:
            lines.append(f"{var} = {var} * LOGIT_SCALE")
        if softcap is not None:
            lines += ([f"t = _tanh({var} / SOFTCAP)", f"{var} = t * SOFTCAP"] if keep_t
                      else [f"{var} = _tanh({var} / SOFTCAP) * SOFTCAP"])
        return "\n".join(" " * indent + ln for ln in lines) or _EMPTY

    chain = (" * (1.0 - t * t)" if softcap is not None else "") + (" * LOGIT_SCALE" if logit_scale is not None else "")
    grad_pass = Template(_GRAD_PASS).substitute(
        transform_z=transform("z", 12, True),
        z_loss_grad=" * (1.0 + 2.0 * Z_LOSS * lse)" if z_loss is not None else "",
        chain=chain) if grad else ""
    src = Template(_HEADER).substitute(name=spec.name, block=block, constants="".join(c + "\n" for c in consts))
    if softcap is not None:
        src += _TANH
    src += Template(_KERNEL).substitute(
        transform_z=transform("z", 12, False), transform_zt=transform("zt", 8, False),
        z_loss_term=" + Z_LOSS * lse * lse" if z_loss is not None else "",
        grad_pass=grad_pass, zero_pass=_ZERO_PASS if grad else "")
    return src.replace(_EMPTY + "\n", "")


_EMPTY = "\x00"   # a hole this spec leaves empty: its line goes


def signatures(spec) -> dict[str, dict[str, str]]:
    # the logits are fp32, or on CUDA the weight's bf16/fp16 (one source serves both: Triton
    # specializes the launch on the pointer's type; `logits` names it for a compile check)
    return {"lce_fwd": {"logits_ptr": "*" + spec.get("logits", "fp32"), "labels_ptr": "*i64", "loss_ptr": "*fp32", "scale_ptr": "*fp32",
                        "n_cols": "i32", "stride": "i32", "ignore_index": "i32"}}


def num_warps(spec) -> int:
    return 4 if spec["block"] <= 2048 else 8 if spec["block"] <= 8192 else 16


def spec_for(vocab: int, *, softcap: Optional[float] = None, logit_scale: Optional[float] = None,
             z_loss: float = 0.0, grad: bool = True, block: Optional[int] = None):
    """The spec serving a vocabulary of `vocab` (block: 4096, or the next power of two >= vocab
    when smaller, at least 16)."""
    if block is None:
        block = max(16, min(4096, 1 << max(0, int(vocab) - 1).bit_length()))
    return _spec(int(block), softcap, logit_scale, z_loss, bool(grad))


def _spec(block: int, softcap: Optional[float], logit_scale: Optional[float], z_loss: float, grad: bool):
    extra = {}
    if softcap is not None:
        extra["softcap"] = float(softcap)
    if logit_scale is not None:
        extra["logit_scale"] = float(logit_scale)
    if z_loss:
        extra["z_loss"] = float(z_loss)
    return KernelSpec("linear_cross_entropy", block=block, grad=grad, **extra)


_kernel = cached_kernel(_spec)


def _kernel_for(vocab: int, softcap, logit_scale, z_loss, grad: bool, block: Optional[int]):
    """`spec_for`'s kernel, loaded once per static arguments: a warm call builds no KernelSpec."""
    if block is None:
        block = max(16, min(4096, 1 << max(0, int(vocab) - 1).bit_length()))
    return _kernel(int(block), softcap, logit_scale, z_loss, bool(grad))


def examples() -> list:
    """Representative specs: plain (Llama), Gemma-2's soft-cap 30, Cohere's logit scale 0.0625,
    z-loss 1e-4, every feature at once, a loss-only (eval) kernel; blocks 2048 to 8192."""

    def spec(block, grad=True, **extra):
        return KernelSpec("linear_cross_entropy", block=block, grad=grad, **extra)
    return [spec(4096),
            spec(4096, logits="bf16"),
            spec(4096, softcap=30.0),
            spec(2048, logit_scale=0.0625),
            spec(4096, z_loss=1e-4),
            spec(8192, softcap=30.0, logit_scale=0.0625, z_loss=1e-4),
            spec(4096, grad=False, softcap=30.0)]


def default_chunk(n_rows: int, hidden: int, vocab: int) -> int:
    """Liger's choice: rows per chunk so a chunk's logits are about as large as the hidden
    states, a power of two."""
    per = -(-n_rows // max(1, -(-vocab // hidden)))
    return 1 << max(0, per - 1).bit_length()


def forward(hidden, weight, bias, labels, ignore_index: int = -100, reduction: str = "mean",
            softcap: Optional[float] = None, logit_scale: Optional[float] = None, z_loss: float = 0.0,
            chunk: Optional[int] = None, *, normalizer=None, block: Optional[int] = None, grads: bool = True,
            in_weight_dtype: Optional[bool] = None, grad_weight_fp32: bool = False):
    """(loss, grad_hidden, grad_weight, grad_bias) of
    `cross_entropy(softcap(logit_scale * (hidden @ weight^T + bias)), labels) (+ z_loss * lse^2)`,
    the grads for d(loss) = 1 (the caller scales them by the incoming grad).

    hidden (N, H), weight (V, H), bias (V,) or None, labels (N,) integer. `chunk`: rows per chunk
    (default `default_chunk`). `normalizer` (number or 0-d tensor, reduction "mean" only) replaces
    the count of non-ignored rows as the divisor. Logits, softmax and the gradient accumulators
    are fp32 (off CUDA the weight is upcast once, as the torch reference does; on CUDA bf16/fp16
    GEMMs accumulate in fp32, each chunk's logits stay in that dtype and become their gradient in
    place, and the weight's gradient is summed in its dtype, as Liger-Kernel's, or with
    `grad_weight_fp32` in fp32 as Liger's `accum_dtype=torch.float32`; `in_weight_dtype`
    forces either path); grad_hidden is in hidden's
    dtype, grad_weight/grad_bias in weight's/bias's, the loss in promote(hidden, weight).
    Mean over zero non-ignored rows is nan (as torch), its grads zero. `grads=False`: the
    loss-only kernel, grads returned as None. Labels out of [0, V) other than ignore_index are not
    checked (the kernel would read out of its row)."""
    import torch
    with torch.no_grad():
        return _forward(hidden, weight, bias, labels, ignore_index, reduction, softcap, logit_scale, z_loss, chunk,
                        normalizer, block, grads, in_weight_dtype, grad_weight_fp32)


def _denominator(labels, ignore_index: int, reduction: str, normalizer):
    """(the loss's divisor, None for "sum"; the gradient's scale as a 0-d fp32 device tensor, which
    the kernel reads: no host sync)."""
    import torch
    f32, dev = torch.float32, labels.device
    if reduction == "sum":
        return None, torch.ones((), dtype=f32, device=dev)
    if normalizer is not None:
        denom = torch.as_tensor(normalizer, dtype=f32, device=dev)
        return denom, torch.reciprocal(denom)
    denom = (labels != ignore_index).sum().to(f32)
    return denom, torch.reciprocal(denom.clamp(min=1))   # torch: mean over zero valid rows is nan, its grads zero


def _forward(hidden, weight, bias, labels, ignore_index, reduction, softcap, logit_scale, z_loss, chunk, normalizer,
             block, grads, in_weight_dtype=None, grad_weight_fp32=False):
    import torch
    from tailorfx.kernels.weight_grad import add_weight_grad
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction {reduction!r} not in mean/sum")
    if normalizer is not None and reduction != "mean":
        raise ValueError("linear_cross_entropy: normalizer replaces the count of reduction 'mean'")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} "
                         f"must be (N, H) and (V, H)")
    if hidden.dtype == torch.float64 or weight.dtype == torch.float64:
        raise ValueError("linear_cross_entropy: the kernel computes in fp32; fp64 inputs are not supported")
    n_rows, n_hidden = hidden.shape
    vocab = weight.shape[0]
    if labels.numel() != n_rows:
        raise ValueError(f"linear_cross_entropy: {labels.numel()} labels for {n_rows} rows")
    dev, f32 = hidden.device, torch.float32
    k = _kernel_for(vocab, softcap, logit_scale, z_loss, grads, block)
    chunk = max(1, int(chunk) if chunk else default_chunk(n_rows, n_hidden, vocab))
    if labels.dim() != 1:
        labels = labels.reshape(-1)
    if labels.dtype != torch.int64:
        labels = labels.to(torch.int64)
    labels = labels.contiguous()
    # on CUDA, bf16/fp16 hidden and weight: the GEMMs in that dtype (tensor cores, fp32 accumulation);
    # each chunk's logits stay in it, the kernel reads them as fp32 (eager's logits.float()) and
    # writes their gradient over them, rounded once as eager's backward of .float() rounds it (about
    # 10 bytes moved per logit, not 26 through an fp32 copy); no fp32 copy of the weight
    low = gemms_in_weight_dtype(hidden, weight) if in_weight_dtype is None else bool(in_weight_dtype)
    w = weight if low or weight.dtype == f32 else weight.to(f32)
    b = bias if bias is None or low or bias.dtype == f32 else bias.to(f32)
    denom, scale = _denominator(labels, ignore_index, reduction, normalizer)
    loss_rows = torch.empty(n_rows, dtype=f32, device=dev)
    grad_h = torch.empty_like(hidden) if grads else None
    # low: summed over the chunks in the weight's dtype, or in fp32 if asked
    grad_w = torch.zeros(w.shape, dtype=f32 if grad_weight_fp32 else w.dtype, device=dev) if grads else None
    grad_b = torch.zeros(b.shape, dtype=f32, device=dev) if grads and b is not None else None
    fn, warps = k.fn("lce_fwd"), num_warps(k.spec)
    # each chunk's rows as views made once (split), the weight's transpose once
    w_t = None if low else w.t()
    chunk_labels, chunk_loss = labels.split(chunk), loss_rows.split(chunk)
    chunk_grad_h = grad_h.split(chunk) if grads else None
    for i, h in enumerate(hidden.split(chunk)):
        if low:
            z = torch.nn.functional.linear(h, w, b)   # the chunk's logits, in the weight's dtype
        else:
            if h.dtype != f32:
                h = h.to(f32)
            z = torch.addmm(b, h, w_t) if b is not None else torch.mm(h, w_t)
        fn[(h.shape[0],)](z, chunk_labels[i], chunk_loss[i], scale, vocab, z.stride(0), ignore_index,
                          num_warps=warps)
        if not grads:
            continue
        g = z   # now d(loss)/d(logits), in place
        del z
        if grad_h.dtype == g.dtype and grad_h.is_contiguous():
            torch.mm(g, w, out=chunk_grad_h[i])
        else:
            chunk_grad_h[i].copy_(g @ w)
        add_weight_grad(grad_w, g, h, slab=4096)
        if grad_b is not None:
            grad_b.add_(g.sum(0, dtype=f32))
        del g, h
    loss = loss_rows.sum()
    if denom is not None:
        loss = loss / denom
    out_dtype = loss_dtype(hidden, weight)
    if loss.dtype != out_dtype:
        loss = loss.to(out_dtype)
    if not grads:
        return loss, None, None, None
    if grad_w.dtype != weight.dtype:
        grad_w = grad_w.to(weight.dtype)
    if grad_b is not None and grad_b.dtype != bias.dtype:
        grad_b = grad_b.to(bias.dtype)
    return loss, grad_h, grad_w, grad_b


def loss_dtype(hidden, weight):
    """The fused head's loss as its math ran: fp32 (fp64 stays fp64) whatever the inputs' dtype, as
    eager's `cross_entropy(logits.float())`; a model whose loss was 16-bit gets a cast in the graph."""
    import torch
    return torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32   # no ATen call


def gemms_in_weight_dtype(hidden, weight, cuda: bool = False) -> bool:
    """The head's GEMMs run in the weight's own low precision: on CUDA (tensor cores). CPU
    upcasts: its bf16 GEMMs allocate fp32 scratch of their own, and run no faster. The torch
    head (runtime/linear_ops.py) decides by the same rule."""
    import torch
    return (hidden.dtype == weight.dtype and weight.dtype in (torch.bfloat16, torch.float16)
            and (cuda or weight.device.type == "cuda"))
