"""Cost model: attention FLOPs grow as S^2 for exact attention and as S for a sliding window; a
mini-sequence region's pointwise bytes, which the step-time model prices apart from its matmuls."""
import torch

import tailorfx
from models import batch, tiny_llama
from tailorfx.rewrite import match
from tailorfx.rewrite.cost import node_flops, region_bytes
from tailorfx.rewrite.memory import Sizer


def attention_flops(spec, S):
    opt = tailorfx.optimize(tiny_llama(num_layers=1), passes=["attention"], attention=spec,
                            example_inputs=batch(S=64), predict=False)
    g = opt.graph_records[0]
    as_int = Sizer(g.seq, S).as_int
    return sum(node_flops(n, as_int) for n in g.rewritten.graph.nodes if match.op_name(n) == "attention_call")


def test_exact_is_quadratic_and_window_linear():
    B, H, D = 2, 4, 16
    exact = [attention_flops(None, S) for S in (1024, 2048)]
    window = [attention_flops(tailorfx.attention.SlidingWindow(64), S) for S in (1024, 2048)]
    assert 3.9 < exact[1] / exact[0] < 4.1
    assert 1.9 < window[1] / window[0] < 2.1
    # causal exact attention: 4 * D FLOPs per attended (query, key) pair, S(S+1)/2 pairs per head
    assert exact[0] == B * H * (1024 * 1025 // 2) * 4 * D


def test_a_regions_pointwise_bytes_are_all_but_its_matmuls_at_any_length():
    """Llama's MLP as a mini-sequence region (the op that replaced it): SiLU reads and writes a
    B x S x intermediate tensor, the product reads two and writes one, 5 of them in all; its three
    matmuls are priced by FLOPs instead (parallel/steptime.py)."""
    opt = tailorfx.optimize(tiny_llama(num_layers=1), passes=["minisequence"], example_inputs=batch(B=2, S=64),
                            predict=False)
    g = opt.graph_records[0]
    keys = [n.args[0] for n in g.rewritten.graph.nodes if match.op_name(n) == "token_chunked"]
    assert len(keys) == 1, keys
    for S in (1024, 2048):
        assert region_bytes(keys[0], Sizer(g.seq, S).as_int) == 5 * 2 * S * 176 * 4


def test_a_regions_cost_is_keyed_by_what_it_computes_not_by_its_names():
    """Every block of a model has a segment like its neighbour's under other node names: the
    backward cost, simulated once, is memoised under a key blind to names but not to shapes."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from tailorfx.passes.minisequence.cost import structure_key

    def layer0(x, w):
        return torch.nn.functional.silu(x @ w) * x.sum()

    def layer1(hidden, weight):
        return torch.nn.functional.silu(hidden @ weight) * hidden.sum()

    a = make_fx(layer0)(torch.randn(4, 8), torch.randn(8, 8))
    b = make_fx(layer1)(torch.randn(4, 8), torch.randn(8, 8))
    assert [n.name for n in a.graph.nodes] != [n.name for n in b.graph.nodes]
    assert structure_key(a) == structure_key(b)
    assert structure_key(a) != structure_key(make_fx(layer0)(torch.randn(4, 16), torch.randn(16, 16)))
    assert structure_key(a) != structure_key(make_fx(lambda x, w: torch.relu(x @ w) * x.sum())(
        torch.randn(4, 8), torch.randn(8, 8)))
