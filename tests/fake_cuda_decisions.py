"""What optimize() decides for a model on fake CUDA tensors, forward only, as JSON on stdout.

    python tests/fake_cuda_decisions.py DEVICE         # DEVICE: cpu or cuda

For HF Llama, Qwen3 and Gemma-2 (tests/models.py's tiny configs, bf16, batch 1 x 64 tokens,
parameters without gradients) under optimize()'s default plan, kernels="triton" and
attention=SlidingWindow(16), and in fp32 Llama's default plan and a model of its own whose SDPA
call takes grouped k, v without a mask (GroupedSdpaLM), and Llama's kernels="triton" with fp32
weights under autocast to bf16 (amp-triton), each graph's decisions (passes that
changed it, the attention calls' specs, chunk counts, the head's dtypes) and what its rewritten
graph calls when run on fake tensors of DEVICE at the captured sizes: the dispatched ops and
torch's SDPA calls. Needs a torch linked with CUDA (a CPU wheel cannot index a fake CUDA tensor)
but no GPU; an op that records autograd on a fake CUDA tensor can abort the process, hence a
script of its own.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tailorfx  # noqa: E402
from models import hf_config  # noqa: E402
from tailorfx.models.build import built_on_fake_tensors, fake_mode_of  # noqa: E402
from tailorfx.passes.attention.rules import drop_causal_sdpa_masks  # noqa: E402
from tailorfx.rewrite.capture import node_value  # noqa: E402

FAMILIES = ("llama", "qwen3", "gemma2")
VARIANTS = {"default": {}, "triton": {"kernels": "triton"},
            "window": {"attention": tailorfx.attention.SlidingWindow(16)}}
EXTRA = {"flex": {"attention_kernel": "flex"}}   # gemma2's only, below
DTYPES = {"fp32": torch.float32}   # variants in another dtype than bf16 (llama's only, below)
# llama's only: fp32 weights, the forward under torch.autocast to bf16 (Trainer's bf16=True), no KV cache
AUTOCAST = {"amp-triton": {"kernels": "triton"}}
SEQ = 64


class Dispatched(TorchDispatchMode):
    """The ops dispatched (higher-order ones as `higher_order.<name>`), and the dtypes and device
    of the fused head's inputs."""
    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.ops, self.head = set(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else f"higher_order.{func.name()}"
        self.ops.add(name)
        if "linear_cross_entropy" in name:   # and whether the runtime runs its GEMMs in bf16
            from tailorfx.runtime.linear_ops import gemms_in_weight_dtype
            self.head.append([str(a.dtype) for a in args[:2]] + [args[0].device.type, gemms_in_weight_dtype(*args[:2])])
        return func(*args, **(kwargs or {}))


class Sdpa(TorchFunctionMode):
    """Each F.scaled_dot_product_attention call: whether it has a mask, is causal, its dtype, and
    the heads of q and k (k's fewer: grouped, as SDPA's enable_gqa takes them)."""
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k = args[:2]
            self.calls.append({"mask": kwargs.get("attn_mask", args[3] if len(args) > 3 else None) is not None,
                               "causal": bool(kwargs.get("is_causal", False)), "dtype": str(q.dtype),
                               "heads": [q.shape[1], k.shape[1]]})
        return func(*args, **kwargs)


def on_device(model, device: str):
    """The fake model's parameters and buffers as fake tensors of `device`, without gradients."""
    mode = fake_mode_of(model)

    def fake(t):
        f = FakeTensor(mode, torch.empty(t.shape, dtype=t.dtype, device="meta"), torch.device(device))
        return torch.nn.Parameter(f, requires_grad=False) if isinstance(t, torch.nn.Parameter) else f
    memo = {id(t): fake(t) for t in [*model.parameters(), *model.buffers()]}
    return copy.deepcopy(model, memo), fake(torch.empty(1, SEQ, dtype=torch.long))


def _int(a) -> int:
    """An int argument of a node: a constant, or another node's value at its hint."""
    v = node_value(a) if isinstance(a, torch.fx.Node) else a
    return v.node.hint if isinstance(v, torch.SymInt) else int(v)


def _target(n) -> str:
    return getattr(n.target, "__name__", str(n.target))


def graph_decisions(gm) -> list:
    """The rewritten graph's calls that carry a decision, in order."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        t = _target(n)
        if t in ("attention_call", "triton_attention", "flex_attention"):
            out.append(["attention", t, n.kwargs["kind"], [list(p) for p in n.kwargs["params"]],
                        n.kwargs.get("softcap"), bool(n.kwargs["causal"]), str(node_value(n.args[0]).dtype)])
        elif t.startswith("triton_rope"):   # and the dtype it writes where the pass fused a cast into it
            out.append(["kernel", t, str(n.kwargs.get("out_dtype"))])
        elif t.startswith("triton_"):
            out.append(["kernel", t])
        elif "token_chunked" in t:
            out.append(["chunked", t, _int(n.args[4])])
        elif "linear_cross_entropy" in t:
            out.append(["head", t, _int(n.kwargs.get("num_chunks", n.args[6] if len(n.args) > 6 else 0))])
    return out


@contextlib.contextmanager
def autocast_to_bf16(device: str, on: bool):
    """torch.autocast(device, bf16) when `on`: set directly, as torch.autocast("cuda") turns itself
    off where no CUDA device is present (the dispatcher casts fake CUDA tensors all the same)."""
    if not on:
        yield
        return
    was = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    torch.set_autocast_enabled(device, True)
    torch.set_autocast_dtype(device, torch.bfloat16)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device, was[0])
        torch.set_autocast_dtype(device, was[1])


def run_static(gm, device: str, amp: bool = False) -> dict:
    """Run the rewritten graph on fresh fake tensors at the captured sizes (their hints), under
    autocast to bf16 with `amp` (as it was captured)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def static(v):
        if isinstance(v, torch.SymInt):
            return v.node.hint
        if isinstance(v, torch.Tensor):
            shape = [d.node.hint if isinstance(d, torch.SymInt) else d for d in v.shape]
            return FakeTensor(mode, torch.empty(shape, dtype=v.dtype, device="meta"), v.device)
        return v
    args = [static(node_value(n)) for n in gm.graph.nodes if n.op == "placeholder"]
    assert all(a.device.type == device for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())
    ops, sdpa = Dispatched(), Sdpa()
    with mode, sdpa, ops, autocast_to_bf16(device, amp):
        torch.fx.Interpreter(gm).run(*args)
    return {"ops": sorted(ops.ops), "head_inputs": ops.head, "sdpa": sdpa.calls}


class GroupedSdpaAttention(torch.nn.Module):
    """Causal self-attention calling SDPA on grouped k, v without a mask (is_causal, enable_gqa), as
    hand-written models do: 4 query heads, 1 kv head."""
    def __init__(self, hidden: int, heads: int = 4):
        super().__init__()
        self.heads, self.d = heads, hidden // heads
        self.q, self.kv, self.o = (torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, 2 * self.d),
                                   torch.nn.Linear(hidden, hidden))

    def forward(self, x):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.heads, self.d).transpose(1, 2)
        k, v = (t.transpose(1, 2) for t in self.kv(x).view(B, S, 2, 1, self.d).unbind(2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(a.transpose(1, 2).reshape(B, S, -1))


class GroupedSdpaBlock(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.attn = GroupedSdpaAttention(hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                       torch.nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GroupedSdpaLM(torch.nn.Module):
    """A model of its own, not transformers': two blocks of GroupedSdpaAttention and an MLP."""
    def __init__(self, vocab: int = 256, hidden: int = 64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(GroupedSdpaBlock(hidden) for _ in range(2))
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def case(family: str, variant: str, device: str) -> dict:
    amp = variant in AUTOCAST
    # (under autocast without a KV cache, as trainers that checkpoint run: RoPE writes q, k in bf16)
    cfg = GroupedSdpaLM if family == "grouped_sdpa" else hf_config(family, **({"use_cache": False} if amp else {}))
    with built_on_fake_tensors(cfg, torch.float32 if amp else DTYPES.get(variant, torch.bfloat16)) as model:
        model, ids = on_device(model, device)
        with autocast_to_bf16(device, amp):
            opt = tailorfx.optimize(model, example_inputs={"input_ids": ids, "labels": ids}, lowering="eager",
                                    predict=False, verify=False,
                                    **{**VARIANTS, **EXTRA, **AUTOCAST}.get(variant, {}))
    graphs = []
    for g in opt.session.graphs:
        rec = {"failed": g.failed, "warnings": g.warnings[:3],
               "passes": [[r.name, bool(r.changed)] for r in g.records], "calls": graph_decisions(g.rewritten)}
        if not g.failed:
            rec.update(run_static(g.rewritten, device, amp))
        if variant in DTYPES:   # what the parallel layouts run: the captured graph, its causal masks dropped
            rec["masks_dropped_sdpa"] = run_static(drop_causal_sdpa_masks(g.original), device)["sdpa"]
        graphs.append(rec)
    return {"graphs": graphs}


def main() -> None:
    device = sys.argv[1]
    out = {}
    for family, variant in [*((f, v) for f in FAMILIES for v in VARIANTS), ("llama", "fp32"), ("grouped_sdpa", "fp32"),
                            ("gemma2", "flex"), ("llama", "amp-triton")]:
        try:
            out[f"{family}/{variant}"] = case(family, variant, device)
        except Exception as e:   # noqa: BLE001  (reported per case; the test names it)
            out[f"{family}/{variant}"] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
