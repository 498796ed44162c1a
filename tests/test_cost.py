"""Cost model: attention FLOPs grow as S^2 for exact attention and as S for a sliding window."""
import torch

import tailorfx
from models import batch, tiny_llama
from tailorfx.rewrite import match
from tailorfx.rewrite.cost import node_flops
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
