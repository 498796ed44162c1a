"""Matching helpers over Dynamo (torch-level) and ATen fx graphs. Matching never mutates."""
from __future__ import annotations

import operator
from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.nn.functional as F

from tailorfx import compat
from tailorfx.rewrite.capture import dropout_is_identity, node_value


def op_name(node: fx.Node) -> str:
    """A short name for what a node computes: 'linear', 'softmax', 'scaled_dot_product_attention'."""
    t = node.target
    if node.op == "call_method":
        return str(t)
    if node.op != "call_function":
        return node.op
    short = compat.op_short_name(t)
    return short if short is not None else getattr(t, "__name__", str(t))


LINEAR_OPS = frozenset({"linear", "linear_fp32_out"})   # F.linear(x, W, b); tailorfx's own (passes/precision)
MATMUL_OPS = frozenset({"addmm", "mm", "matmul", "bmm", "baddbmm", "einsum", "conv1d",
                        "_grouped_mm", "grouped_mm", "grouped_mm_fallback"}) | LINEAR_OPS   # MoE experts
ATTENTION_OPS = frozenset({
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "flex_attention", "_scaled_dot_product_cudnn_attention",
    "attention_call", "sparse_attention", "dilated_attention",   # tailorfx's own (passes/attention)
    "score_mod_attention", "triton_attention",
})
FLOAT_CASTS = frozenset({"to", "type", "float", "half", "bfloat16", "double"})   # tensor methods casting dtype
NORM_OPS = frozenset({"layer_norm", "rms_norm", "group_norm", "native_layer_norm", "_fused_rms_norm"})
STAT_OPS = frozenset({"rsqrt", "var", "var_mean", "std"})
# Ops that draw random numbers: recomputing them (a chunk in backward, an output on demand) would
# draw other values.
RANDOM_OPS = frozenset({"dropout", "native_dropout", "rand", "randn", "rand_like", "randn_like",
                        "bernoulli", "randint", "multinomial", "randperm", "normal", "uniform",
                        "token_chunked_random",    # a chunked region with dropout (it replays only its own backward)
                        "draw_seed"})              # an attention's dropout seed (tailorfx.attention)


def draws_random(n: fx.Node) -> bool:
    """n draws random numbers (recomputing it would draw other values); dropout with p=0 or
    training=False does not."""
    name = op_name(n)
    if name not in RANDOM_OPS:
        return False
    return not (name in ("dropout", "native_dropout") and dropout_is_identity(n))


LOSS_OPS = frozenset({"cross_entropy", "nll_loss", "nll_loss_forward", "nll_loss2d_forward"})
# Ops whose `dim` argument decides whether they mix sequence positions.
DIM_OPS = frozenset({
    "softmax", "log_softmax", "_softmax", "_log_softmax", "cumsum", "cumprod", "logcumsumexp",
    "sort", "argsort", "flip", "roll", "cat", "concat", "narrow", "split", "chunk", "tensor_split",
    "mean", "sum", "amax", "amin", "max", "min", "var", "std", "logsumexp", "norm", "topk",
    "cummax", "cummin", "diff", "unbind",
})


def tensors_in(x: Any) -> list[torch.Tensor]:
    """Tensor values found in a (nested) fx argument structure or value."""
    out: list[torch.Tensor] = []

    def visit(a):
        if isinstance(a, fx.Node):
            visit(node_value(a))
        elif isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            for b in a:
                visit(b)
        elif isinstance(a, dict):
            for b in a.values():
                visit(b)
    visit(x)
    return out


def dim_arg(node: fx.Node) -> Any:
    """The `dim` argument of a node, positional or keyword (None if absent).

    With `self` counted as the first argument (as call_method nodes and ATen ops both do), `dim`
    is the second argument, except for split-like ops where a size or count comes first.
    """
    if "dim" in node.kwargs:
        return node.kwargs["dim"]
    pos = 2 if op_name(node) in ("split", "chunk", "tensor_split", "split_with_sizes") else 1
    return node.args[pos] if len(node.args) > pos else None


def getitem_dims(index: Any, ndim: int) -> dict[int, Any]:
    """Map each input dim to the index element applied to it, for `x[index]`."""
    if not isinstance(index, tuple):
        index = (index,)
    consumed = sum(1 for i in index if i is not None and i is not Ellipsis)
    out: dict[int, Any] = {}
    d = 0
    for i in index:
        if i is None:
            continue
        if i is Ellipsis:
            d += ndim - consumed
            continue
        out[d] = i
        d += 1
    return out


def is_full_slice(s: Any) -> bool:
    return isinstance(s, slice) and s.start in (None, 0) and s.stop is None and s.step in (None, 1)


def users_closure(starts: Iterable[fx.Node]) -> list[fx.Node]:
    """Every node reachable from `starts` through users, in graph order."""
    seen: set[fx.Node] = set()
    stack = list(starts)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.users)
    order = {n: i for i, n in enumerate(next(iter(seen)).graph.nodes)} if seen else {}
    return sorted(seen, key=order.__getitem__)


def inputs_closure(starts: Iterable[fx.Node]) -> set[fx.Node]:
    """`starts` and every node they are computed from, back to the graph's inputs."""
    seen: set[fx.Node] = set()
    stack = list(starts)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def is_functional_call(node: fx.Node, fn: Any) -> bool:
    return node.op == "call_function" and node.target in (fn, getattr(F, getattr(fn, "__name__", ""), None))


def named_args(node: fx.Node, names: tuple[str, ...]) -> dict:
    """The node's positional arguments under `names`, its keyword arguments as they are."""
    a = dict(zip(names, node.args))
    a.update(node.kwargs)
    return a


def same_size(a, b) -> bool:
    """Two sizes (ints or SymInts) that are the same expression, or equal under the graph's
    shape guards."""
    return compat.sym_equal(a, b)


def unwrap_repeat_kv(x: fx.Node) -> fx.Node:
    """k for repeat_kv(k) (k[:, :, None].expand(B, H_kv, n, S, D).reshape(B, H_kv * n, S, D)) or
    repeat_interleave(k, n, dim=1): query head h reads kv head h // n either way, which is how
    the kernels and SDPA's enable_gqa map heads. Anything else is returned as it is."""
    if not isinstance(x, fx.Node) or not x.args or not isinstance(x.args[0], fx.Node):
        return x
    name = op_name(x)
    if name == "repeat_interleave":
        a = named_args(x, ("input", "repeats", "dim"))
        return x.args[0] if a.get("dim") == 1 and isinstance(a.get("repeats"), int) else x
    e = x.args[0]
    if name not in ("reshape", "view") or op_name(e) != "expand" or not isinstance(e.args[0], fx.Node):
        return x
    h = e.args[0]
    if not (is_getitem(h) and isinstance(h.args[0], fx.Node)):
        return x
    k = h.args[0]
    kv, hv, ev, xv = (node_value(n) for n in (k, h, e, x))
    if not all(isinstance(t, torch.Tensor) for t in (kv, hv, ev, xv)) or \
            (kv.dim(), hv.dim(), ev.dim(), xv.dim()) != (4, 5, 5, 4):
        return x
    b, hk, s, d = kv.shape
    ok = (all_same(hv.shape, (b, hk, 1, s, d))
          and all_same(ev.shape[:2] + ev.shape[3:], (b, hk, s, d))
          and all_same(xv.shape, (b, hk * ev.shape[2], s, d)))
    return k if ok else x


def all_same(xs, ys) -> bool:
    """Two shapes of the same sizes (see same_size)."""
    return len(xs) == len(ys) and all(same_size(a, b) for a, b in zip(xs, ys))
