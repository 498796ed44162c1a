"""Attention pass on packed batches: transformers builds a block-diagonal causal mask from restarting
position_ids (no attention_mask, use_cache=False); the pass proves it a document mask and runs the
kernel with document ids computed in the graph from position_ids.

Exact: loss and every gradient equal eager's and the sum over the documents run one by one; a
user's sparse spec keeps the documents apart too; the graph serves another document layout; a mask
that reads position_ids but is not a document mask is refused, with the reason.
"""
import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tailorfx
from models import VOCAB, hf_family
from tailorfx.attention import SlidingWindow, attention_call
from tailorfx.rewrite import match
from tailorfx.runtime.packing import PackingCollator

SEQ = 32
DOCS = (7, 13, 5, 20, 9, 1, 11, 3)          # 3 rows of 32; a 1-token document; padding
OTHER_DOCS = (20, 3, 1, 15, 8, 12, 6, 2)     # the same 3 rows of 32, documents elsewhere


pytestmark = pytest.mark.usefixtures("one_thread")


def _docs(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _packed(lengths, seed=1):
    docs = _docs(lengths, seed)
    batch = PackingCollator(seq_len=SEQ)(docs)
    assert batch["input_ids"].shape == (3, SEQ) and "attention_mask" not in batch
    return docs, {k: v for k, v in batch.items() if k != "document_ids"}   # not a model input


def _loss_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _separately(model, docs):
    """Each document alone (its own row, default positions): token-sum CE over all of them / targets."""
    model.zero_grad(set_to_none=True)
    total, count = 0.0, 0
    for d in docs:
        ids = torch.tensor([d])
        logits = model(input_ids=ids).logits[0, :-1]
        total = total + F.cross_entropy(logits.float(), ids[0, 1:], reduction="sum")
        count += len(d) - 1
    loss = total / count
    loss.backward()
    return loss.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, want, rtol=1e-4):
    (loss, grads), (ref_loss, ref_grads) = got, want
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=0)
    assert grads.keys() == ref_grads.keys()
    for k, g in ref_grads.items():
        # rtol per element; atol for elements near zero, relative to the tensor's largest gradient
        torch.testing.assert_close(grads[k], g, rtol=rtol, atol=rtol * g.abs().max().item(), msg=k)


def _record(opt):
    return next(r for r in opt.graph_records[0].records if r.name == "attention")


def _check_rewritten(opt, spec="Exact()"):
    """Every attention region rewritten, each call given document ids computed from position_ids."""
    rec = _record(opt)
    regions = tuple(r.path for r in opt.graph_records[0].regions.of_kind("attention"))
    assert regions and rec.touched == regions and not rec.skipped, (rec.touched, rec.skipped)
    for path in regions:
        st = rec.stats[path]
        assert st["mask"].startswith("packed: document ids from position_ids (l_kwargs_position_ids_"), st["mask"]
        assert (st["spec"], st["causal"], st["document_ids"]) == (spec, True, "step rule on l_kwargs_position_ids_")
    gm = opt.graphs["attention"]
    calls = [n for n in gm.graph.nodes if n.target is attention_call]
    assert len(calls) == len(regions) and all("document_ids" in n.kwargs for n in calls)
    doc = calls[0].kwargs["document_ids"]
    assert all(n.kwargs["document_ids"] is doc for n in calls)          # computed once, shared
    assert match.op_name(doc) == "cumsum"
    assert not {match.op_name(n) for n in gm.graph.nodes} & {"scaled_dot_product_attention", "softmax"}


@pytest.mark.parametrize("family,attn,layers", [("llama", "sdpa", 2), ("llama", "eager", 1), ("qwen2", "sdpa", 1)])
def test_packed_batch_is_rewritten_and_exact(family, attn, layers):
    docs, inputs = _packed(DOCS)
    model = hf_family(family, num_layers=layers, attn_implementation=attn)
    ref = copy.deepcopy(model)
    opt = tailorfx.optimize(model, passes=["attention"], example_inputs=inputs, predict=False)
    _check_rewritten(opt)
    got = _loss_and_grads(opt, inputs)
    _assert_same(got, _loss_and_grads(ref, inputs))         # eager on the packed batch
    _assert_same(got, _separately(ref, docs))               # the documents one by one
    if family == "llama" and attn == "sdpa":
        # the same graph on documents placed elsewhere: the ids come from the new position_ids
        docs2, inputs2 = _packed(OTHER_DOCS, seed=2)
        assert not torch.equal(inputs2["position_ids"], inputs["position_ids"])
        got2 = _loss_and_grads(opt, inputs2)
        assert len(opt.graph_records) == 1                  # no new capture
        _assert_same(got2, _loss_and_grads(ref, inputs2))
        _assert_same(got2, _separately(ref, docs2))


# ---- a user's sparse spec: each document gets the spec on its own ------------------------------
WINDOW = SlidingWindow(4)
_REFERENCE_IMPL = "tailorfx_test_window_reference"


def _window_reference(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: WINDOW's dense reference (one document per call here)."""
    assert query.shape[0] == 1 and scaling == query.shape[-1] ** -0.5
    return WINDOW.reference(query, key, value).transpose(1, 2).contiguous(), None


def test_sparse_spec_keeps_documents_apart():
    from transformers import AttentionInterface
    AttentionInterface.register(_REFERENCE_IMPL, _window_reference)
    docs, inputs = _packed(DOCS)
    model = hf_family("llama", num_layers=2)
    ref = copy.deepcopy(model)
    ref.set_attn_implementation(_REFERENCE_IMPL)
    want = _separately(ref, docs)
    exact = _separately(copy.deepcopy(model), docs)
    assert abs(want[0] - exact[0]) > 1e-3                # the window changes the loss: ignoring it would show
    opt = tailorfx.optimize(model, passes=["attention"], attention=WINDOW, example_inputs=inputs, predict=False)
    _check_rewritten(opt, spec="SlidingWindow(window=4)")
    _assert_same(_loss_and_grads(opt, inputs), want)


# ---- hand-written masks from position_ids ----------------------------------------------------
@dataclass
class Out:
    loss: torch.Tensor


class ToyAttention(nn.Module):
    """softmax(q k^T / sqrt(D), masked) v; the mask built from position_ids by `mode`."""

    def __init__(self, mode, dim=32, heads=4):
        super().__init__()
        self.mode, self.heads = mode, heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, position_ids):
        B, S, _ = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        i = torch.arange(S, device=x.device)
        causal = i[None, :] <= i[:, None]
        pos = position_ids
        if self.mode == "restart_documents":      # a document mask, documents starting at position 0
            doc = (pos == 0).cumsum(-1)
            keep = causal & (doc[:, :, None] == doc[:, None, :])
        elif self.mode == "position_causal":      # key position <= query position: no documents
            keep = pos[:, None, :] <= pos[:, :, None]
        elif self.mode == "documents_windowed":   # documents, but only the last 3 positions of each
            doc = (pos == 0).cumsum(-1)
            keep = causal & (doc[:, :, None] == doc[:, None, :]) & (pos[:, None, :] > pos[:, :, None] - 3)
        s = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).masked_fill(~keep[:, None], float("-inf"))
        return self.out((s.softmax(-1) @ v).transpose(1, 2).reshape(B, S, -1))


class ToyBlock(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.attn = ToyAttention(mode)

    def forward(self, x, position_ids):
        return x + self.attn(x, position_ids)


class ToyModel(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.layers = nn.ModuleList([ToyBlock(mode)])

    def forward(self, x, position_ids):
        for layer in self.layers:
            x = layer(x, position_ids)
        return Out(loss=x.square().mean())


def _toy_inputs(rows=((5, 1, 10, 8), (24,)), seed=1):
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    return {"x": torch.randn(len(rows), pos.shape[1], 32, generator=torch.Generator().manual_seed(seed)),
            "position_ids": pos}


def _toy(mode):
    torch.manual_seed(0)
    model = ToyModel(mode)
    ref = copy.deepcopy(model)
    opt = tailorfx.optimize(model, passes=["attention"], example_inputs=_toy_inputs(), predict=False)
    for inputs in (_toy_inputs(), _toy_inputs(rows=((3, 3, 17, 1), (12, 12)), seed=2)):
        _assert_same(_loss_and_grads(opt, inputs), _loss_and_grads(ref, inputs), rtol=1e-5)
    return opt, _record(opt)


def test_documents_from_restarts_are_proved_with_that_rule():
    opt, rec = _toy("restart_documents")
    assert rec.touched == ("layers.0.attn",), rec.skipped
    st = rec.stats["layers.0.attn"]
    assert st["mask"].startswith("packed: document ids from position_ids (l_position_ids_: a document starts at "
                                 "each position 0); mask proved a document mask at S="), st["mask"]
    assert st["document_ids"] == "restart rule on l_position_ids_"
    code = opt.graphs["attention"].code
    assert "document_ids = " in code and "== 0" in code and "diff" not in code


@pytest.mark.parametrize("mode,reason", [
    ("position_causal", "it lets queries see later keys or keys of other documents"),
    ("documents_windowed", "it hides keys of the query's own document"),
])
def test_position_mask_that_is_not_a_document_mask_is_refused(mode, reason):
    opt, rec = _toy(mode)
    assert not rec.changed and rec.touched == ()
    (why,) = rec.skipped
    assert why.startswith("layers.0.attn: mask depends on graph input l_position_ids_") and \
        "read as packed position_ids it is not a document mask either: at S=" in why and reason in why, why
    assert opt.graphs["attention"].code == opt.graphs["capture"].code
