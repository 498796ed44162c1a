"""Kernels: the regions the runtime has Triton kernels for become calls of those kernels
(`optimize(..., kernels="triton")`).

Invariant: each replaced region computes what it computed (fp32 math inside the kernels); a
region is replaced only after its own nodes, run on random inputs, agree with the kernel's
reference formula, so a norm spelled in an unexpected way is left as it was and reported.

    before:  f = x.to(float32); v = f.pow(2).mean(-1, keepdim=True); h = f * rsqrt(v + 1e-06)
             y = w * h.to(float32)
    after:   y = triton_norm(x, w, None, eps=1e-06, kind='rms', offset=0.0)

    before:  y = mul(silu(gate), up)                 after:  y = triton_glu(gate, up, act='silu')
    before:  q2 = q * cos + cat((-q[..., 8:], q[..., :8]), -1) * sin;  k2 = (the same of k)
    after:   q2, k2 = triton_rope_qk(q, k, cos, sin)      (one rotation alone: triton_rope(q, cos, sin))
    before:  o = attention_call(q, k, v, kind='Exact', params=(), causal=True, scale=0.125)
    after:   o = triton_attention(q, k, v, causal=True, scale=0.125, ...)
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from tailorfx import compat
from tailorfx.passes import register
from tailorfx.passes.kernel_choice import choose, subgraph
from tailorfx.rewrite import match
from tailorfx.rewrite.capture import node_value
from tailorfx.rewrite.passes import PassContext, PassResult, annotate
from tailorfx.rewrite.regions import Region

NAME = "kernels"
KERNELS = (None, "triton")


@dataclass(frozen=True)
class Swap:
    """A region to replace by one kernel call: `fn(*args, **kwargs)` in place of `out` (with
    `more`: a call returning a tuple, its items in place of `out` and then each of `more`)."""
    out: fx.Node
    fn: Callable
    args: tuple
    kwargs: dict
    kernel: str          # the kernel family, for the report and opt.kernels()
    more: tuple = ()


@dataclass(frozen=True)
class Rule:
    """`match(region, nodes, ctx)` -> Swaps, a reason the region is left as it was (str), or None."""
    name: str
    kind: str            # the region kind it reads
    match: Callable[[Region, dict, PassContext], Union[list[Swap], str, None]]


# ---- norms ----------------------------------------------------------------------------------

def _eps(members: list[fx.Node]) -> Optional[float]:
    """The epsilon of a norm: layer_norm's argument, or the float added before rsqrt."""
    for n in members:
        name = match.op_name(n)
        if name == "layer_norm":
            return float(n.args[4] if len(n.args) > 4 else n.kwargs.get("eps", 1e-5))
        if name in ("add", "__add__", "iadd") and n.users and any(match.op_name(u) == "rsqrt" for u in n.users):
            consts = [a for a in n.args if isinstance(a, (int, float))]
            if consts:
                return float(consts[0])
    return None


def _norm_reference(x, w, b, eps: float, kind: str, offset: float):
    if kind == "layer":
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w + offset)


def _norm_kind(fn: fx.GraphModule, width: int, dtypes: list[torch.dtype], eps: float) -> Union[tuple[str, float], str, None]:
    """(kind, offset) of the norm formula `fn` computes on random inputs of `dtypes` (x, weight,
    bias); a reason string when it cannot run on its own; None when it is none of them. The
    candidates differ by O(1), so a low-precision region is compared at its dtype's rounding."""
    gen = torch.Generator().manual_seed(0)
    probe = [torch.randn(3, width, generator=gen).to(dtypes[0])]
    probe += [torch.randn(width, generator=gen).to(d) for d in dtypes[1:]]
    try:
        got = fn(*probe)[0].float()
    except Exception as e:  # a region that cannot run on its own: leave it
        return f"its nodes do not run on their own ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
    x, w = probe[0].float(), probe[1].float()
    bias = probe[2].float() if len(probe) == 3 else None
    tol = 1e-4 if all(d in (torch.float32, torch.float64) for d in dtypes) else 2e-2
    for kind, offset in [("layer", 0.0)] + ([("rms", 0.0), ("rms", 1.0)] if bias is None else []):
        if torch.allclose(got, _norm_reference(x, w, bias, eps, kind, offset), rtol=tol, atol=tol / 10):
            return kind, offset
    return None


def _match_norm(region: Region, nodes: dict, ctx: PassContext) -> Union[list[Swap], str, None]:
    from tailorfx.runtime.triton_ops import triton_norm
    members = [nodes[n] for n in region.nodes if n in nodes]
    if len(region.inputs) != 1 or len(region.outputs) != 1 or len(region.params) not in (1, 2):
        return (f"a norm of {len(region.inputs)} inputs, {len(region.params)} parameters and "
                f"{len(region.outputs)} outputs (the kernel takes x, weight and an optional bias)")
    x, out = nodes[region.inputs[0]], nodes[region.outputs[0]]
    params = [nodes[p] for p in region.params]
    xv, ov = node_value(x), node_value(out)
    if not isinstance(xv, torch.Tensor) or not isinstance(ov, torch.Tensor) or ov.shape != xv.shape:
        return "its output is not shaped like its input"
    if ov.dtype != xv.dtype:
        return f"it returns {ov.dtype} from {xv.dtype} input (the kernel returns the input's dtype)"
    if any(node_value(p).shape != (xv.shape[-1],) for p in params):
        return "its parameters are not vectors over the last dim"
    eps = _eps(members)
    if eps is None:
        return "no epsilon found (neither layer_norm's nor a constant added before rsqrt)"
    fn = subgraph([x, *params], [out], set(members))
    if fn is None:
        return "it reads values from outside the region"
    width = xv.shape[-1] if isinstance(xv.shape[-1], int) else 8
    with compat.real_tensors():   # real probes also while a fake-tensor model is captured
        found = _norm_kind(fn, width, [xv.dtype] + [node_value(p).dtype for p in params], eps)
    if isinstance(found, tuple):
        kind, offset = found
        args = (x, params[0], params[1] if len(params) == 2 else None)
        return [Swap(out, triton_norm, args, {"eps": eps, "kind": kind, "offset": offset}, "norm")]
    if found is not None:
        return found
    return "its values differ from LayerNorm and from RMSNorm (weight offset 0 or 1) at its epsilon"


# ---- gated MLP activations -------------------------------------------------------------------

def _act(n: fx.Node) -> Optional[str]:
    name = match.op_name(n)
    if name == "silu":
        return "silu"
    if name == "gelu":
        approximate = n.kwargs.get("approximate") or (n.args[1] if len(n.args) > 1 else "none")
        return {"tanh": "gelu_tanh", "none": "gelu"}.get(approximate)
    return None


def _match_glu(region: Region, nodes: dict, ctx: PassContext) -> Union[list[Swap], str, None]:
    from tailorfx.runtime.triton_ops import triton_glu
    swaps = []
    for name in region.nodes:
        n = nodes.get(name)
        if n is None or n.target not in (operator.mul, torch.mul) or len(n.args) != 2:
            continue
        a, b = n.args
        for act_node, up in ((a, b), (b, a)):
            if isinstance(act_node, fx.Node) and isinstance(up, fx.Node) and (act := _act(act_node)):
                gate = act_node.args[0]
                gv, uv, ov = node_value(gate), node_value(up), node_value(n)
                if len(act_node.users) == 1 and gv.shape == uv.shape == ov.shape and gv.dtype == uv.dtype == ov.dtype:
                    swaps.append(Swap(n, triton_glu, (gate, up), {"act": act}, "glu"))
                    break
    return swaps or None


# ---- rotary embedding -------------------------------------------------------------------------

def _is_mul(n) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in (operator.mul, torch.mul) and len(n.args) == 2


def _rotate_half_of(n: fx.Node) -> Optional[fx.Node]:
    """x when n is `cat((-x[..., h:], x[..., :h]), -1)` (transformers' rotate_half), else None."""
    if match.op_name(n) != "cat" or not n.args or len(n.args[0]) != 2:
        return None
    neg, first = n.args[0]
    if not (isinstance(neg, fx.Node) and match.op_name(neg) == "neg" and isinstance(first, fx.Node)):
        return None
    second = neg.args[0]
    srcs = {a.args[0] for a in (first, second) if isinstance(a, fx.Node) and a.op == "call_function"
            and a.target is operator.getitem and isinstance(a.args[0], fx.Node)}
    return srcs.pop() if len(srcs) == 1 else None


def _rope_parts(n: fx.Node) -> Optional[tuple[fx.Node, fx.Node, fx.Node, list[fx.Node]]]:
    """(x, cos, sin, the nodes computing n) when n is `x * cos + rotate_half(x) * sin`."""
    if match.op_name(n) != "add" or len(n.args) != 2 or not all(_is_mul(a) for a in n.args):
        return None
    for lin, rot in (n.args, n.args[::-1]):
        for cat, sin in (rot.args, rot.args[::-1]):
            x = _rotate_half_of(cat) if isinstance(cat, fx.Node) else None
            if x is None or x not in lin.args or not isinstance(sin, fx.Node):
                continue
            cos = lin.args[1] if lin.args[0] is x else lin.args[0]
            neg = cat.args[0][0]
            members = [a for a in (cat.args[0][1], neg.args[0])] + [neg, cat, lin, rot, n]
            if isinstance(cos, fx.Node):
                return x, cos, sin, members
    return None


def _rope_probe_shape(shape) -> tuple:
    """Small sizes for a probe of `shape`, keeping its broadcast (size-1) dims and its last dim."""
    return tuple(1 if isinstance(d, int) and d == 1 else (2, 3, 5)[i % 3]
                 for i, d in enumerate(shape[:-1])) + (int(shape[-1]),)


def _match_rope(region: Region, nodes: dict, ctx: PassContext) -> Union[list[Swap], str, None]:
    from tailorfx.runtime.triton_ops import triton_rope
    swaps, why, order = [], None, None
    for name in region.nodes:
        n = nodes.get(name)
        parts = _rope_parts(n) if n is not None else None
        if parts is None:
            continue
        x, cos, sin, members = parts
        xv, cv, sv, ov = (node_value(a) for a in (x, cos, sin, n))
        # autocast's bf16 q and k meet fp32 cos and sin: the result is fp32, as torch promotes it
        if not (xv.dim() == 4 and ov.shape == xv.shape and cv.dtype == sv.dtype
                and ov.dtype == torch.promote_types(xv.dtype, cv.dtype)
                and {xv.dtype, cv.dtype} <= {torch.float32, torch.bfloat16, torch.float16}):
            why = f"{n.name}: not (B, H, S, D) with cos and sin of one dtype and the result in x's and theirs promoted"
            continue
        if cv.requires_grad or sv.requires_grad or cv.shape != sv.shape or cv.shape[-1] != xv.shape[-1]:
            why = f"{n.name}: cos/sin need a gradient or do not match x's last dim"
            continue
        order = order or {m: i for i, m in enumerate(n.graph.nodes)}
        fn = subgraph([x, cos, sin], [n], set(members))
        if fn is None:
            why = f"{n.name}: the rotation reads values from outside it"
            continue
        with compat.real_tensors():
            gen = torch.Generator().manual_seed(0)
            probe = [torch.randn(_rope_probe_shape(v.shape), generator=gen) for v in (xv, cv, sv)]
            half = probe[0].shape[-1] // 2
            rotated = torch.cat((-probe[0][..., half:], probe[0][..., :half]), -1)
            try:
                ok = torch.allclose(fn(*probe)[0], probe[0] * probe[1] + rotated * probe[2], rtol=1e-5, atol=1e-6)
            except Exception:   # a rotation that cannot run on its own: leave it
                ok = False
        if not ok:
            why = f"{n.name}: its values differ from x * cos + rotate_half(x) * sin"
            continue
        swaps.append(Swap(n, triton_rope, (x, cos, sin), {}, "rope"))
    return _paired(swaps, order) or why


def _narrowed(sw: Swap) -> Swap:
    """A rotation computed in fp32 whose one use casts it to 16 bits (autocast's q and k before
    attention: the attention pass's cast) written in that dtype by the kernel, the cast dropped:
    the same one rounding of the fp32 result, and of its gradient, with no fp32 copy moved."""
    users = list(sw.out.users)
    cast = users[0] if len(users) == 1 else None
    if (cast is None or cast.op != "call_method" or cast.target != "to" or len(cast.args) != 2 or cast.kwargs
            or node_value(sw.out).dtype != torch.float32 or cast.args[1] not in (torch.bfloat16, torch.float16)):
        return sw
    return dataclasses.replace(sw, out=cast, kwargs={"out_dtype": cast.args[1]})


def _paired(swaps: list[Swap], order: Optional[dict]) -> list[Swap]:
    """Two rotations by the same cos and sin (an attention's q and k) as one `triton_rope_qk`
    call, one launch each way, where both inputs exist before the first rotation's result."""
    from tailorfx.runtime.triton_ops import triton_rope_qk
    by_table: dict = {}
    for sw in swaps:
        by_table.setdefault(sw.args[1:], []).append(sw)
    out = []
    for group in by_table.values():
        first, second = (sorted(group, key=lambda sw: order[sw.out]) + [None])[:2] if len(group) == 2 else (None, None)
        qv = node_value(first.args[0]) if first is not None else None
        kv = node_value(second.args[0]) if second is not None else None
        if (first is None or kv.shape[0] != qv.shape[0] or kv.shape[2:] != qv.shape[2:]
                or order[second.args[0]] > order[first.out]):
            out += [_narrowed(sw) for sw in group]
            continue
        nq, nk = _narrowed(first), _narrowed(second)
        if nq.kwargs and nq.kwargs == nk.kwargs and all(order[u] > order[nq.out] for u in nk.out.users):
            # both cast alike, k's cast read only after q's (where the call goes): both written narrow
            first, second = nq, nk
        out.append(Swap(first.out, triton_rope_qk, (first.args[0], second.args[0], *first.args[1:]), first.kwargs,
                        "rope", more=(second.out,)))
    return out


# ---- attention ------------------------------------------------------------------------------

def _match_attention(region: Region, nodes: dict, ctx: PassContext) -> Union[list[Swap], str, None]:
    from tailorfx.attention import attention_call
    from tailorfx.runtime.flex import flex_attention
    from tailorfx.runtime.triton_ops import triton_attention, triton_attention_kwargs, triton_attention_supports
    swaps, on_kernel = [], False
    for name in region.nodes:
        n = nodes.get(name)
        on_kernel |= n is not None and n.target in (triton_attention, flex_attention)   # the attention pass chose it
        if n is None or n.target is not attention_call:
            continue
        why = triton_attention_supports(n.kwargs)
        if why:
            return why
        swaps.append(Swap(n, triton_attention, n.args, triton_attention_kwargs(n.kwargs), "flash_attention"))
    if on_kernel and not swaps:
        return None
    return swaps or ("no attention_call in the region: the attention pass did not rewrite it"
                     if region.nodes else None)


rules_kernels = (
    Rule("norm", "norm", _match_norm),
    Rule("glu", "mlp", _match_glu),
    Rule("rope", "attention", _match_rope),
    Rule("attention", "attention", _match_attention),
)


def _erase_dead(gm: fx.GraphModule, start: fx.Node) -> None:
    """Erase `start` and whatever feeds only it (the replaced region's nodes)."""
    stack, erased = [start], set()
    while stack:
        n = stack.pop()
        if n in erased or n.users or n.op in ("placeholder", "output") or n.is_impure():
            continue
        inputs = n.all_input_nodes
        gm.graph.erase_node(n)
        erased.add(n)
        stack.extend(inputs)


class KernelsPass:
    """Replace norms, gated activations and attention by calls of the runtime's Triton kernels."""
    name = NAME
    after = ("attention", "precision")

    def __init__(self, options: dict):
        kernels = options.get("kernels")
        if kernels not in KERNELS:
            raise ValueError(f"kernels={kernels!r} is not valid: 'triton' or None")

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        stats: dict = {}
        touched, skipped = [], []
        for rule in rules_kernels:
            for region in ctx.regions.of_kind(rule.kind):
                nodes = {n.name: n for n in gm.graph.nodes}
                got = rule.match(region, nodes, ctx)
                if got is None:
                    continue
                if isinstance(got, str):
                    skipped.append(f"{region.path}: {got}")
                    continue
                kept = [choose(s, ctx.options.get("lowering")) for s in got]
                skipped.extend(f"{region.path}: {why}" for _, why in kept if why)
                got = [s for s, _ in kept if s is not None]
                if not got:
                    continue
                for swap in got:
                    with gm.graph.inserting_before(swap.out):
                        new = gm.graph.call_function(swap.fn, swap.args, swap.kwargs)
                    annotate(new, swap.out, pass_name=NAME)
                    if not swap.more:
                        swap.out.replace_all_uses_with(new)
                        _erase_dead(gm, swap.out)
                    for i, old in enumerate((swap.out, *swap.more) if swap.more else ()):
                        with gm.graph.inserting_before(swap.out):
                            item = gm.graph.call_function(operator.getitem, (new, i))
                        annotate(item, old, pass_name=NAME)
                        old.replace_all_uses_with(item)
                    for old in (swap.out, *swap.more) if swap.more else ():
                        _erase_dead(gm, old)
                    stats.setdefault(swap.kernel, []).append(region.path)
                touched.append(region.path)
        return PassResult(gm, bool(touched), {k: len(v) for k, v in stats.items()},
                          tuple(dict.fromkeys(touched)), tuple(skipped))


def _int(x) -> int:
    """A size as an int: a graph node's value, a SymInt's hint (no guard), or the number itself."""
    return compat.size_hint(node_value(x) if isinstance(x, fx.Node) else x)


def kernel_launches(node: fx.Node) -> list[tuple]:
    """(spec, forward launch grid as text) for each Triton kernel a graph node launches, at the
    shapes of its inputs' fake values (a symbolic length at its hint); [] for nodes that launch
    none."""
    from tailorfx.kernels import cdiv, flash_launch, glu, linear_cross_entropy, norm, rope
    from tailorfx.runtime.triton_ops import (attention_params, triton_attention, triton_glu,
                                             triton_linear_cross_entropy, triton_norm, triton_rope, triton_rope_qk)
    if node.op != "call_function":
        return []
    kw = node.kwargs
    chunked = {torch.ops.tailorfx.token_chunked.default: 4, torch.ops.tailorfx.token_segment.default: 5}
    if node.target in chunked:   # a chunked MLP or segment: its own graph's kernels
        from tailorfx.runtime.ops import chunked_region
        fn = chunked_region(node.args[0]).fn
        inner = [got for n in fn.graph.nodes for got in kernel_launches(n)] if isinstance(fn, fx.GraphModule) else []
        return [(spec, f"{grid} per chunk, {_int(node.args[chunked[node.target]])} chunks") for spec, grid in inner]
    if node.target is triton_norm:
        x = node_value(node.args[0])
        spec = norm.spec_for(x, kw["kind"], kw.get("offset", 0.0), node.args[2] is not None)
        return [(spec, f"({_int(x.numel()) // _int(x.shape[-1])},)")]
    if node.target is triton_glu:
        gate = node_value(node.args[0])
        spec = glu.spec_for(gate, kw["act"])
        return [(spec, f"({cdiv(_int(gate.numel()), spec['block'])},)")]
    if node.target in (triton_rope, triton_rope_qk):
        x, cos = node_value(node.args[0]), node_value(node.args[-2])
        heads_k = _int(node_value(node.args[1]).shape[1]) if node.target is triton_rope_qk else 0
        out = node_value(node) if node.target is triton_rope else node_value(node)[0]
        spec = rope.spec_for(x, cos=cos, out_dtype=out.dtype, heads_k=heads_k)
        batch, heads, seq = (_int(d) for d in x.shape[:3])   # q's head blocks, then k's, in one launch
        return [(spec, f"({batch * seq}, {cdiv(heads, spec['block_h']) + cdiv(heads_k, spec['block_h'])})")]
    if node.target is triton_linear_cross_entropy:
        rows, vocab = _int(node_value(node.args[0]).shape[0]), _int(node_value(node.args[1]).shape[0])
        grad = any(isinstance(a, fx.Node) and node_value(a).requires_grad for a in node.args[:3])
        spec = linear_cross_entropy.spec_for(vocab, softcap=kw.get("logit_softcap"),
                                             logit_scale=kw.get("logit_scale"), grad=grad)
        chunks = max(1, min(rows, _int(kw.get("num_chunks", 8))))
        return [(spec, f"({cdiv(rows, chunks)},) x {chunks} chunks")]
    if node.target is triton_attention:
        mask, params = attention_params(kw["kind"], dict(kw["params"]))
        q, k = node_value(node.args[0]), node_value(node.args[1])
        spec = flash_launch.spec_for(q, k, mask=mask, params=params, causal=kw["causal"],
                                        documents=kw.get("document_ids") is not None, softcap=kw.get("softcap"),
                                        key_bias=kw.get("key_bias") is not None)
        batch, heads, seq = (_int(d) for d in q.shape[:3])
        if mask == "dilated":
            segments, rates = params
            grids = [f"({cdiv(seq, w) * cdiv(cdiv(w, r), spec['block_m'])}, {batch * heads})"
                     for w, r in zip(segments, rates)]
            return [(spec, " + ".join(grids))]
        return [(spec, f"({cdiv(seq, spec['block_m'])}, {batch * heads})")]
    return []


@register(NAME)
def _factory(options: dict) -> KernelsPass:
    return KernelsPass(options)
