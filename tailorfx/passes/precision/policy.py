"""The precision pass's policy: which region or op computes in which dtype, and how a user's
override is checked (`optimize(..., precision="bf16", precision_policy={...})`)."""
from __future__ import annotations

import difflib
from typing import Any, Mapping

import torch
import torch.fx as fx

from tailorfx.rewrite import match
from tailorfx.rewrite.regions import is_weight_matmul

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LOW = "low"   # a policy value: the precision asked for (bf16 or fp16)
AUTO = "auto"  # matmul_output only: see POLICY

# The policy: region kind or op name -> the dtype it computes in. For each node the innermost
# region with an entry decides; an op entry overrides its region (casts go around that one op).
# "fp32" keeps a region as captured. Override with options["precision_policy"] = {key: value}.
POLICY: Mapping[str, str] = {
    # --- regions ---
    "attention": LOW,        # projections, RoPE, SDPA (its kernels keep softmax max/sum in fp32)
    # bf16 matmuls, as torch.autocast and Megatron. Under mini-sequence an fp32 MLP is cheap in
    # memory (its activations are recomputed per chunk, not saved) and cuts the bf16 error by a
    # quarter: LM-head weight grad at S=4096, reference model, init 1.08% -> 0.80% for +10 MiB
    # (benchmarks/precision.py). Not the default: it gives up bf16 throughput for most matmuls.
    "mlp": LOW,
    "norm": "fp32",          # mean of squares over the hidden dim needs fp32 range and rounding
    "block": "fp32",         # the residual stream: sums of many small updates, bf16 would drop them
    # The head computes in fp32: the loss needs fp32 logits anyway (S x V fp32 either way, so bf16
    # saves no memory). With "low", mini-sequence's fused head + loss still takes the fp32 master
    # weight and computes in fp32; only its input (the final norm's output) is bf16, which saves
    # S x H x 4 bytes and adds error (reference model, S=4096: 82.2 vs 86.2 MiB, LM-head weight
    # grad 1.09% vs 1.08% at init, 0.54% vs 0.52% trained).
    "lm_head_loss": "fp32",
    # --- boundaries ---
    # A norm read only by low regions rounds its normalized activation to their dtype at the
    # model's cast back to the working dtype (`weight * x.to(input_dtype)`): that tensor is saved
    # for backward, so it costs half; statistics and the weight stay fp32. "fp32" turns it off.
    "norm_output": LOW,
    # What a low region's matmuls hand on. "low": the region computes in the low dtype, each
    # matmul's result rounded to it (torch.autocast). "fp32": only matmuls and attention run in
    # the low dtype; a linear hands on its fp32 accumulator (one mixed-dtype GEMM on CUDA) and the
    # ops between matmuls (RoPE, SiLU, gating) compute in fp32, saving for backward in the low
    # dtype. Reference model, S=4096: LM-head weight grad error 1.08% -> 0.88% at init. Its cost
    # is backward transients: the fp32 glue's gradients, which for an MLP kept whole are
    # S x intermediate x 4 bytes each (+25 MiB). "auto": fp32 in attention (its glue, RoPE, saves
    # and holds little) and in MLPs that mini-sequence runs chunk by chunk (their glue lives one
    # chunk at a time: +6 MiB), "low" elsewhere.
    "matmul_output": AUTO,
    # --- ops that stay fp32 inside a low region ---
    "softmax": "fp32", "log_softmax": "fp32", "logsumexp": "fp32",        # softmax statistics
    "cross_entropy": "fp32", "nll_loss": "fp32",                          # the loss
    "sum": "fp32", "mean": "fp32", "var": "fp32", "std": "fp32", "var_mean": "fp32",
    "cumsum": "fp32",                 # reductions ("norm" names the region kind, not torch.norm)
    "layer_norm": "fp32", "rms_norm": "fp32", "group_norm": "fp32",       # norms not in a module
    # An MoE router (found from the graph: a weight matmul whose result reaches a topk before any
    # other weight matmul) and the routing weights it computes: in bf16 its logits round, tokens
    # change experts, and the router's weight gradient is off by 7-20% (Mixtral, Qwen2-MoE, OLMoE).
    "router": "fp32",
}
# Ops that only re-view their input: next to a matmul handing on bf16 they stay bf16.
VIEW_OPS = frozenset({"view", "reshape", "transpose", "permute", "contiguous", "flatten", "unflatten",
                       "unsqueeze", "squeeze", "expand", "t", "getitem"})


def resolve_policy(precision: str, override: Any = None) -> dict[str, torch.dtype]:
    """The policy with "low" resolved to `precision`; `override` entries replace defaults."""
    if precision not in DTYPES:
        raise ValueError(f"precision must be one of {sorted(DTYPES)}, got {precision!r}")
    table = dict(POLICY)
    override = dict(override.items() if isinstance(override, Mapping) else override or ())
    for key in override:
        if key not in POLICY and not _is_op_name(key):
            near = difflib.get_close_matches(str(key), list(POLICY), n=1)
            raise ValueError(f"precision_policy key {key!r} is neither a policy entry ({sorted(POLICY)}) nor a "
                             f"torch op name" + (f"; did you mean {near[0]!r}?" if near else ""))
    table.update(override)
    out = {}
    for key, value in table.items():
        if key == "matmul_output":
            if value not in (LOW, AUTO, "fp32"):
                raise ValueError(f"precision_policy['matmul_output'] must be 'low', 'fp32' or 'auto', got {value!r}")
            out[key] = value
            continue
        if value != LOW and value not in DTYPES:
            raise ValueError(f"precision_policy[{key!r}] must be 'low' or one of {sorted(DTYPES)}, got {value!r}")
        out[key] = DTYPES[precision if value == LOW else value]
    return out


def _is_op_name(key) -> bool:
    """An op a policy entry may name (e.g. "tanh": "fp32")."""
    return isinstance(key, str) and (hasattr(torch, key) or hasattr(torch.nn.functional, key)
                                     or hasattr(torch.Tensor, key))


def router_nodes(gm: fx.GraphModule) -> dict[str, str]:
    """Node name -> its router's matmul, for every MoE router: a weight matmul whose result reaches
    a topk before any other weight matmul, with what it computes from its own result alone (the
    softmax, the top-k and the normalised routing weights), not what mixes in expert outputs, and
    the views its input goes through (so it reads the fp32 hidden state, not a bf16 copy)."""
    nodes = list(gm.graph.nodes)
    if not any(match.op_name(n) == "topk" for n in nodes):   # no router in a dense model
        return {}
    nearest: dict[fx.Node, frozenset] = {}   # node -> the weight matmuls closest above it
    own: dict[fx.Node, list] = {}            # weight matmul -> the nodes computed from it alone
    for n in nodes:
        nearest[n] = frozenset({n}) if is_weight_matmul(n) else frozenset().union(
            *(nearest[a] for a in n.all_input_nodes))
        if len(nearest[n]) == 1 and n.op != "output":
            own.setdefault(next(iter(nearest[n])), []).append(n)
    out: dict[str, str] = {}
    for m, computed in own.items():
        if not any(match.op_name(n) == "topk" for n in computed):
            continue
        out.update({n.name: m.name for n in computed})
        x = m.args[0] if m.args else None
        while isinstance(x, fx.Node) and match.op_name(x) in VIEW_OPS:   # its input, re-viewed: fp32 too
            out[x.name] = m.name
            x = x.args[0] if x.args else None
    return out
