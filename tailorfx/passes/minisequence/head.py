"""The LM head fused with its cross-entropy: the logits exist one chunk of tokens at a time, and a
model that also returns them returns None for them in training.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from tailorfx.passes.minisequence.chunks import NAME, SEGMENTS_HEAD_CHUNKS, Chunking, Rewrite, auto_chunks
from tailorfx.passes.minisequence.cost import hint_bytes
from tailorfx.rewrite import match
from tailorfx.rewrite.capture import autocast_of, cast_value, node_value
from tailorfx.rewrite.passes import PassContext, annotate, insert_cast
from tailorfx.rewrite.regions import Region, is_param, param_source
from tailorfx.runtime import ops

# Between the LM head and the loss only these may appear (dtype casts and reshapes).
_PASSTHROUGH = frozenset({"float", "to", "view", "reshape", "contiguous", "type"})
LOGITS_NOTE = ("logits=None: the LM head is fused with the loss in training with labels (as Liger-Kernel's "
               "skip_logits); optimize(..., keep_logits=True) returns them, with the head unfused")


class ByRequest(str):
    """A region left as it was because the user asked for what it computes (not a failure)."""


def rewrite_head(gm, nodes, region: Region, ctx: PassContext, chunking: Chunking, segments: bool,
                 done) -> Optional[str]:
    """The LM head and its cross_entropy as one chunked op, recorded in `done`; else why not (a
    ByRequest when the user asked for what the head computes). `segments`: chunk as finely as the
    segments plan does."""
    head = nodes[region.nodes[0]]
    if match.op_name(head) not in match.LINEAR_OPS:
        return f"the LM head is a {match.op_name(head)}, only F.linear heads are fused"
    chain, side = _head_chain(head)
    loss = chain[-1]
    returned = [n for n in chain if any(u.op == "output" for u in n.users)]
    if match.op_name(loss) != "cross_entropy":
        if not ctx.options.get("training", True):
            return ByRequest("eval mode or no_grad: no loss to fuse the LM head with; left unfused")
        if loss is head or (returned and len(chain) == len(returned)):
            return ("the logits leave the graph before any loss (a graph break, or no labels given), "
                    "so the LM head cannot be fused with a loss; left unchanged")
        return f"the logits feed {match.op_name(loss)!r}, not cross_entropy"
    returned += side
    if returned and ctx.options.get("keep_logits"):
        return ByRequest("logits returned (keep_logits=True): LM head and loss left unfused")
    if returned and not ctx.options.get("training", True):
        return ByRequest("logits returned (eval mode or no_grad): LM head and loss left unfused")
    transform = _logit_transform(chain[1:-1])
    if isinstance(transform, str):
        return transform
    softcap, logit_scale = transform
    kw = _loss_kwargs(loss)
    if isinstance(kw, str):
        return kw
    reduction = kw.get("reduction", "mean")
    h, w = head.args[0], head.args[1]
    b = head.args[2] if len(head.args) > 2 else head.kwargs.get("bias")
    if not (isinstance(w, fx.Node) and is_param(w, through_casts=True)):
        return "the LM head weight is not a parameter"
    # A low-precision head (precision pass) reads W.to(bf16): the fused op takes the fp32
    # master instead, computes in fp32 and accumulates W's gradient in fp32 (no V x H copy).
    w = param_source(w)
    b = param_source(b) if isinstance(b, fx.Node) and is_param(b, through_casts=True) else b
    hv = node_value(h)
    hidden = hv.shape[-1]
    h_dims = ctx.seq.dims(hv)
    if len(h_dims) != 1:
        return f"sequence dim of the LM head input not found ({h_dims})"
    # the plan that saves the most: chunks of min_tokens however long the sequence (a chunk's
    # logits and their gradient are the head's transient); else as many as keep a chunk's
    # logits within the size of the head's input, up to MAX_CHUNKS
    ideal = SEGMENTS_HEAD_CHUNKS if segments else auto_chunks(hint_bytes(node_value(head), ctx), hint_bytes(hv, ctx))
    m = chunking.count(gm, h, h_dims[0], ideal, loss)
    options = {"ignore_index": int(kw.get("ignore_index", -100)), "reduction": reduction, "num_chunks": m}
    options.update({k: v for k, v in (("logit_softcap", softcap), ("logit_scale", logit_scale)) if v is not None})
    amp = autocast_of(hv) if node_value(head).dtype != node_value(w).dtype else None
    if _sums_grad_in_fp32(ctx, node_value(w)) or amp is not None:   # autocast's master weight: its sum in fp32
        options["grad_weight_fp32"] = True
    if amp is not None:   # the linear ran in autocast's dtype; the fused op is a custom op autocast does not cast
        h, w, b = (insert_cast(gm, t, amp, loss, pass_name=NAME) if isinstance(t, fx.Node) else t for t in (h, w, b))
    with gm.graph.inserting_before(loss):
        flat = gm.graph.call_method("reshape", (h, -1, hidden))
        new = gm.graph.call_function(_lce_fn(ctx), (flat, w, b, kw["target"]), options)
    with hv.fake_mode:
        flat_val = node_value(h).reshape(-1, hidden)
        fused = ops.loss_dtype(flat_val, node_value(w))
    annotate(flat, head, flat_val, pass_name=NAME)
    if fused == node_value(loss).dtype:
        annotate(new, loss, pass_name=NAME)
    else:   # the model's loss was 16-bit: the fused one (fp32) cast to it
        annotate(new, loss, cast_value(node_value(loss), fused), pass_name=NAME)
        new = insert_cast(gm, new, node_value(loss).dtype, loss, pass_name=NAME)
    loss.replace_all_uses_with(new)
    if returned:   # Liger's skip_logits: in training with labels the model returns logits=None
        out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        out.args = fx.node.map_arg(out.args, lambda a: None if a in returned else a)
    for n in reversed(side + chain):
        if not n.users:
            gm.graph.erase_node(n)
    done.append(Rewrite(region, m, 3 * hint_bytes(node_value(head), ctx), bool(returned)))
    return None


def head_loss_transform(gm: fx.GraphModule, region: Region):
    """(softcap, logit_scale) when the LM head region's linear feeds cross_entropy through casts,
    reshapes, a scale and a soft-cap only (what a fused head computes), else the reason not."""
    head = {n.name: n for n in gm.graph.nodes}[region.nodes[0]]
    if match.op_name(head) not in match.LINEAR_OPS:
        return f"the LM head is a {match.op_name(head)}, only F.linear heads are fused"
    chain, _ = _head_chain(head)
    if match.op_name(chain[-1]) != "cross_entropy":
        return f"the logits feed {match.op_name(chain[-1])!r}, not cross_entropy"
    kw = _loss_kwargs(chain[-1])
    return kw if isinstance(kw, str) else _logit_transform(chain[1:-1])


def _sums_grad_in_fp32(ctx: PassContext, weight) -> bool:
    """The setup asks for the 16-bit head weight's gradient to be summed in fp32 (TrainingSetup's
    head_grad_dtype); an fp32 weight's always is."""
    return (getattr(ctx.options.get("setup"), "head_grad_fp32", False)
            and getattr(weight, "dtype", None) in (torch.bfloat16, torch.float16))


def _lce_fn(ctx: PassContext):
    """The fused head's implementation: the Triton kernel under kernels="triton", else torch's."""
    if ctx.options.get("kernels") == "triton":
        from tailorfx.runtime.triton_ops import triton_linear_cross_entropy
        return triton_linear_cross_entropy
    return ops.chunked_linear_cross_entropy


# Between the LM head and the loss: a logit scale (Cohere) and a soft-cap c*tanh(z/c) (Gemma-2),
# fused into the chunks; anything else leaves the head unfused.
_LOGIT_OPS = frozenset({"mul", "truediv", "div", "tanh"})


def _head_chain(head: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """The nodes from the LM head down to the first that is neither a cast/reshape nor a logit
    transform (the loss, if fusable), and the returned casts of the logits met on the way."""
    chain, side, cur = [head], [], head
    while True:
        users = [u for u in cur.users if u.op != "output"]
        # a cast whose only use is the output (the precision pass restoring the logits' dtype)
        # is a returned copy of the logits, not a second consumer
        returned_casts = [u for u in users if len(users) > 1 and match.op_name(u) in _PASSTHROUGH
                          and all(x.op == "output" for x in u.users)]
        users = [u for u in users if u not in returned_casts]
        if len(users) != 1:
            return chain, side
        side += returned_casts
        chain.append(users[0])
        if match.op_name(users[0]) not in _PASSTHROUGH | _LOGIT_OPS:
            return chain, side
        cur = users[0]


def _loss_kwargs(loss: fx.Node):
    """cross_entropy's arguments by name, or why this loss is not fused."""
    kw = dict(zip(("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
                   "label_smoothing"), loss.args))
    kw.update(loss.kwargs)
    if kw.get("weight") is not None or kw.get("label_smoothing", 0.0) or kw.get("size_average") is not None \
            or kw.get("reduce") is not None:
        return "cross_entropy with class weights or label smoothing is not fused"
    if kw.get("reduction", "mean") not in ("mean", "sum"):
        return f"reduction={kw.get('reduction')!r} is not fused"
    logits2d = node_value(kw["input"])
    if not isinstance(logits2d, torch.Tensor) or logits2d.dim() != 2:
        return "cross_entropy input is not (tokens, vocab)"
    return kw


def _logit_transform(chain: list[fx.Node]):
    """(softcap, logit_scale) of the ops between head and loss, or the reason they are not fused:
    multiplications and divisions by constants (one scale, Cohere's `* logit_scale`, Granite's
    `/ logits_scaling`), then at most one soft-cap c*tanh(z/c) (Gemma-2)."""
    steps = []
    for n in chain:
        name = match.op_name(n)
        if name in _PASSTHROUGH:
            continue
        scalars = [a for a in n.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        const = float(scalars[0]) if len(scalars) == 1 and len(n.args) == 2 else None
        if name in ("truediv", "div") and const is not None and not isinstance(n.args[1], (int, float)):
            const = None   # c / z is not a scale
        steps.append((name, const))
    tanh = [i for i, (name, _) in enumerate(steps) if name == "tanh"]
    softcap, scaled = None, steps
    if len(tanh) == 1 and 1 <= tanh[0] == len(steps) - 2:
        (d, c), (m, c2) = steps[tanh[0] - 1], steps[tanh[0] + 1]
        if d in ("truediv", "div") and m == "mul" and c is not None and c == c2:
            softcap, scaled = c, steps[:tanh[0] - 1]
    scale = 1.0
    for name, c in scaled:
        if c is None or name not in ("mul", "truediv", "div") or c == 0:
            return (f"the logits pass through {[s[0] for s in steps]} before the loss; only scales by constants "
                    "and a soft-cap c*tanh(z/c) after them are fused")
        scale = scale * c if name == "mul" else scale / c
    return softcap, (scale if scaled else None)


def size_log_prob_heads(gm: fx.GraphModule, ctx: PassContext, chunking: Chunking, segments: bool, done) -> None:
    """Chunk the per-token log-prob heads a trainer's step already calls (tailorfx.trainers: TRL's
    fused_lm_head) as this pass chunks a fused loss: M from the tokens at run time, finer when
    segments are chunked."""
    for node in list(gm.graph.nodes):
        if match.op_name(node) != "chunked_token_log_probs":
            continue
        h, w = node.args[0], node.args[1]
        hv, wv = node_value(h), node_value(w)
        if ctx.seq.dims(hv) != (0,):
            continue      # its rows are not the tokens (no sequence dimension found): left as called
        ideal = SEGMENTS_HEAD_CHUNKS if segments else auto_chunks(
            hint_bytes(hv.new_empty(hv.shape[0], wv.shape[0]), ctx), hint_bytes(hv, ctx))
        m = chunking.count(gm, h, 0, ideal, node)
        node.args = (*node.args[:5], m, *node.args[6:])
        annotate(node, node, pass_name=NAME)
        region = Region("lm_head_loss", "lm_head (per-token log-probs)", (node.name,), True)
        done.append(Rewrite(region, m, 0))
