"""A model planned again traces none of its rewritten graphs a second time (rewrite/trace_cache.py),
and gets the same plan; the key a trace is kept under tells apart what traces otherwise."""
import copy

import pytest
import torch

import tailorfx
from models import hf_family
from tailorfx.rewrite import graph_key as key_mod, memory, trace_cache

VOCAB = 512


def _inputs(S: int) -> dict:
    ids = torch.randint(0, VOCAB, (1, S), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def _plan(base, inputs, budget):
    """optimize's plan of a copy of `base` under `budget`: the chosen candidate and the runners-up,
    or the BudgetError's suggested budget."""
    try:
        opt = tailorfx.optimize(copy.deepcopy(base), budget=budget, optimizer=None, example_inputs=inputs,
                                verify=False)
    except tailorfx.BudgetError as err:
        return err.suggested_bytes
    gp = opt.plan[0]
    return [(c.label, c.peak, c.added_flops, c.fits) for c in (gp.chosen, *gp.runners_up)]


def test_a_model_planned_again_at_the_budget_a_budget_error_suggests_is_traced_once(monkeypatch):
    """The workflow a BudgetError starts: it names the smallest budget a plan meets, and the user
    optimizes again at it. The second search traces nothing (every candidate's trace is found by
    its key) and the plan it takes fits (test_the_key_is_what_traces: a length or a tag of its own
    is traced again)."""
    base = hf_family("llama", num_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                     num_key_value_heads=2, vocab_size=VOCAB)
    calls = []
    real = memory.trace_step
    monkeypatch.setattr(memory, "trace_step", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    suggested = _plan(base, _inputs(32), 1 << 10)
    assert isinstance(suggested, int)
    first = len(calls)
    plan = _plan(base, _inputs(32), suggested)
    assert len(calls) == first and plan[0][3], (len(calls), first, plan)


def _graph(S: int = 32):
    """The graph Dynamo captured of a small HF Llama's training step (optimize with no pass)."""
    model = hf_family("llama", num_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=64)
    ids = torch.randint(0, 64, (1, S))
    opt = tailorfx.optimize(model, passes=[], example_inputs={"input_ids": ids, "labels": ids}, verify=False)
    return opt.graph_records[0].original


@pytest.fixture(scope="module")
def graph():
    return _graph()


def test_the_key_is_what_traces(graph):
    """Equal for a second capture of the same model; different for a length or a recompute tag;
    none for a module the key cannot describe (a submodule that is no graph). (The partition and
    whether the trace is on the captured sizes are keyed beside it: rewrite/trace_cache.py.)"""
    k = key_mod.graph_key(graph)
    assert k == key_mod.graph_key(_graph()) and key_mod.graph_key(_graph(48)) != k
    tagged = copy.deepcopy(graph)
    next(n for n in tagged.graph.nodes if n.op == "call_function").meta["recompute"] = "must_recompute"
    assert key_mod.graph_key(tagged) != k
    opaque = copy.deepcopy(graph)
    opaque.add_submodule("lin", torch.nn.Linear(2, 2))
    first = next(iter(opaque.graph.nodes))
    with opaque.graph.inserting_after(first):
        opaque.graph.call_module("lin", (first,))
    assert key_mod.graph_key(opaque) is None


def test_a_trace_made_under_no_grad_does_not_serve_a_training_step(graph):
    """An evaluation under torch.no_grad makes Dynamo capture the model again, and that graph is
    traced with no backward. The same graph traced for training afterwards (another model of the
    class, optimized under a budget) has its backward: before, the key was the same, and that
    model was planned for a forward alone (a 17-layer Llama: "no memory rewrite" at 9.06 MiB,
    against 29.58 MiB over the budget). The graph is taken without its grad-mode calls, as Dynamo
    captures it under no_grad: transformers 5.17's rotary embedding runs under its own no_grad, which a
    capture in grad mode ends by turning grad back on (5.25's sets nothing)."""
    graph = copy.deepcopy(graph)
    for n in [n for n in graph.graph.nodes if "_set_grad_enabled" in str(n.target)]:
        graph.graph.erase_node(n)
    graph.recompile()
    with torch.no_grad():
        evaluated = trace_cache.traced_step(copy.deepcopy(graph), "eager", None)
        k = key_mod.graph_key(graph)
    trained = trace_cache.traced_step(copy.deepcopy(graph), "eager", None)
    assert evaluated.bw is None and trained.bw is not None, (evaluated.bw, trained.bw)
    assert key_mod.graph_key(graph) != k


def test_the_least_recently_used_trace_is_dropped_past_the_size(graph, monkeypatch):
    """The cache holds at most _BY_CONTENT_SIZE traces (a user's process plans many models); a
    trace found again is kept over one not used since."""
    monkeypatch.setattr(trace_cache, "_BY_CONTENT", type(trace_cache._BY_CONTENT)())
    monkeypatch.setattr(trace_cache, "_BY_CONTENT_SIZE", 2)
    monkeypatch.setattr(memory, "trace_step", lambda gm, *a: object())
    graphs = []
    for i in range(3):
        g = copy.deepcopy(graph)
        next(n for n in g.graph.nodes if n.op == "call_function").meta["custom"] = {"copy": i}
        graphs.append(g)
    keys = [key_mod.graph_key(g) for g in graphs]

    def held():
        return {k[0] for k in trace_cache._BY_CONTENT}
    first = trace_cache._by_content(graphs[0], "default", False, None, None)
    trace_cache._by_content(graphs[1], "default", False, None, None)
    assert trace_cache._by_content(graphs[0], "default", False, None, None) is first   # found again
    trace_cache._by_content(graphs[2], "default", False, None, None)
    assert held() == {keys[0], keys[2]}          # graphs[1]'s, unused since, dropped


def test_chunk_backward_costs_are_simulated_once_per_process(monkeypatch):
    """Mini-sequence costs each chunked region's backward by running it on fake tensors at lengths
    a power of two apart (passes/minisequence/cost.py), which do not depend on the captured length;
    the samples are kept by the region's structure and the shapes at each length. A copy of a model
    optimized again at another length simulates nothing again, MLP regions and token segments alike,
    and its backward costs are those the first simulation gave (the samples emptied before it, for
    this test alone: at one sequence of 64 or 128 tokens both sample 64 ... 16,384)."""
    from tailorfx.passes.minisequence import cost
    from tailorfx.runtime import ops
    base = hf_family("llama", num_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                     num_key_value_heads=2, vocab_size=VOCAB)
    runs = []
    for name in ("region_chunk_grads", "segment_chunk_grads"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, **kw: runs.append(1) or _real(*a, **kw))
    ops_run = (torch.ops.tailorfx.token_chunked.default, torch.ops.tailorfx.token_segment.default)

    def backward_costs(S):
        out = []
        for mode in ("mlp", "segments"):
            opt = tailorfx.optimize(copy.deepcopy(base), passes=["minisequence"], minisequence=mode,
                                    minisequence_chunks=2, example_inputs=_inputs(S), verify=False)
            out += [(mode, n.target, ops.chunked_region(n.args[0]).cost[1]) for g in opt.graph_records
                    for n in g.rewritten.graph.nodes if n.target in ops_run]
        return out
    monkeypatch.setattr(cost, "_SAMPLES", type(cost._SAMPLES)())
    first = backward_costs(64)
    assert {t for _, t, _ in first} == set(ops_run) and runs, (first, len(runs))
    runs.clear()
    assert backward_costs(128) == first and not runs, len(runs)


def test_a_lazy_outputs_chain_is_built_when_a_gradient_reaches_it(monkeypatch):
    """A KV cache's tensors and the logits are returned detached, recomputed from the graph's inputs
    when a gradient reaches them (rewrite/lazy_outputs.py). Each chain is built then, not when the
    graph is split: the memory model's trace of each candidate and the lowering split it, and a KV
    output's chain reaches back to the inputs (2 x layers modules, a quadratic cost in depth). Built
    at the first backward through a layer's keys, it gives eager's gradients."""
    from tailorfx.rewrite import lazy_outputs
    from tailorfx.runtime.lazy_grad import _LazyVJP
    built, real = [], lazy_outputs._build
    monkeypatch.setattr(lazy_outputs, "_build", lambda *a: built.append(a[-1].name) or real(*a))
    model = hf_family("llama", num_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=VOCAB)
    ref = copy.deepcopy(model)
    inputs = _inputs(32)
    opt = tailorfx.optimize(model, passes=["minisequence"], example_inputs=inputs)
    out = opt(**inputs)
    assert out.past_key_values.layers[1].keys.grad_fn.name() == _LazyVJP.__name__ + "Backward"
    out.loss.backward()
    assert not built, built

    def through_keys(o):
        return o.loss + o.past_key_values.layers[1].keys.square().mean()
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
    through_keys(opt(**inputs)).backward()
    through_keys(ref(**inputs)).backward()
    assert len(built) == 1, built
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
