"""Region finder: blocks, attention, MLP, norms, LM head + loss; token-wise classification."""
import pytest
import torch

from models import batch, hf_gpt2, hf_llama, tiny_llama
from tailorfx.rewrite import match
from tailorfx.rewrite.capture import capture_graphs
from tailorfx.rewrite.regions import find_regions, normalize_path


def regions_of(model, S=40):
    graphs, _ = capture_graphs(model, (), batch(S=S))
    return [(c, find_regions(c.gm, c.seq)) for c in graphs]


def total_counts(found):
    out = {}
    for _, rmap in found:
        for k, v in rmap.counts().items():
            out[k] = out.get(k, 0) + v
    return out


@pytest.mark.parametrize("n", [1, 3])
def test_reference_llama_counts(n):
    found = regions_of(tiny_llama(num_layers=n))
    assert total_counts(found) == {"block": n, "attention": n, "mlp": n, "norm": 2 * n + 1, "lm_head_loss": 1}
    rmap = found[0][1]
    assert [r.path for r in rmap.of_kind("mlp")] == [f"model.layers.{i}.mlp" for i in range(n)]
    assert [r.path for r in rmap.of_kind("attention")] == [f"model.layers.{i}.self_attn" for i in range(n)]
    assert rmap.of_kind("lm_head_loss")[0].path == "lm_head"


def test_tied_head_still_found():
    found = regions_of(tiny_llama(num_layers=2, tied=True))
    assert total_counts(found)["lm_head_loss"] == 1


def test_hf_llama_counts():
    assert total_counts(regions_of(hf_llama(num_layers=2))) == {
        "block": 2, "attention": 2, "mlp": 2, "norm": 5, "lm_head_loss": 1}


def test_hf_gpt2_counts_and_kinds():
    found = regions_of(hf_gpt2(num_layers=2))
    assert total_counts(found) == {"block": 2, "attention": 2, "mlp": 2, "norm": 5, "lm_head_loss": 1}
    c, rmap = found[0]
    nodes = {n.name: n for n in c.gm.graph.nodes}
    for norm in rmap.of_kind("norm"):   # GPT-2's norms are LayerNorm
        assert {match.op_name(nodes[x]) for x in norm.nodes} == {"layer_norm"}
    mlp_ops = {match.op_name(nodes[x]) for x in rmap.of_kind("mlp")[0].nodes}
    assert "tanh" in mlp_ops and "addmm" in mlp_ops   # GELU (tanh approximation) between Conv1D's


def test_token_wise_classification():
    (c, rmap), = regions_of(tiny_llama(num_layers=1))
    nodes = {n.name: n for n in c.gm.graph.nodes}
    cls = rmap.node_class
    assert all(r.token_wise for r in rmap.of_kind("mlp") + rmap.of_kind("norm") + rmap.of_kind("lm_head_loss"))
    assert not any(r.token_wise for r in rmap.of_kind("attention") + rmap.of_kind("block"))
    sdpa = [n for n in nodes if match.op_name(nodes[n]) == "scaled_dot_product_attention"]
    assert sdpa and all(cls[n] == "mix" for n in sdpa)
    loss = [n for n in nodes if match.op_name(nodes[n]) == "cross_entropy"]
    assert [cls[n] for n in loss] == ["reduce"]
    # the label shift (pad, then [:, 1:]) moves tokens along the sequence
    assert cls[next(n for n in nodes if match.op_name(nodes[n]) == "pad")] == "mix"
    # RoPE's cat is along the head dim: still token-wise
    cats = [n for n in nodes if match.op_name(nodes[n]) == "cat" and "self_attn" in str(nodes[n].meta.get("nn_module_stack"))]
    assert cats and all(cls[n] == "token" for n in cats)


def test_explicit_attention_mixes_positions():
    """Q K^T softmax V written out: scores have two sequence dims, softmax runs over keys."""
    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            w = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1)
            y = (w @ v).cumsum(dim=1)
            return y.mean(dim=-1)

    graphs, _ = capture_graphs(Attn(), (torch.randn(2, 24, 16),))
    (c,) = graphs
    rmap = find_regions(c.gm, c.seq)
    by_op = {match.op_name(n): rmap.node_class[n.name] for n in c.gm.graph.nodes}
    assert by_op["linear"] == "token" and by_op["softmax"] == "mix"
    assert by_op["cumsum"] == "mix" and by_op["mean"] == "token"


@pytest.mark.parametrize("raw,norm", [
    ("L['self'].model.layers[0]._modules['mlp']", "model.layers.0.mlp"),
    ("L['self'].model.layers.0.mlp", "model.layers.0.mlp"),
    ("L['self'].transformer.h[11]['attn']", "transformer.h.11.attn"),
])
def test_normalize_path(raw, norm):
    assert normalize_path(raw) == norm
