"""Pass manager, verifier and ordering checks; passes hold no module state."""
import copy
import gc
import operator

import pytest
import torch
import torch.fx as fx

import tailorfx
from models import VOCAB, batch, hf_llama, tiny_llama
from tailorfx.passes.minisequence import MiniSequence
from tailorfx.rewrite.capture import capture_graphs
from tailorfx.passes import PassManager, check_order
from tailorfx.rewrite.passes import PASS_META, PassContext, PassResult, VerifyError, clone, owned, verify
from tailorfx.rewrite.regions import find_regions
from tailorfx.runtime import ops


def captured():
    (c,), _ = capture_graphs(tiny_llama(num_layers=1), (), batch(S=16))
    return c


class SiluToSigmoidMul:
    """Rewrites silu(x) into x * sigmoid(x) (same values); a test pass with a visible diff."""
    name = "silu_expand"
    after = ()

    def run(self, gm, ctx):
        n_done = 0
        for n in list(gm.graph.nodes):
            if n.op == "call_function" and getattr(n.target, "__name__", "") == "silu":
                with gm.graph.inserting_after(n):
                    sig = gm.graph.call_function(torch.sigmoid, (n.args[0],))
                with gm.graph.inserting_after(sig):
                    mul = gm.graph.call_function(operator.mul, (n.args[0], sig))
                for new in (sig, mul):
                    new.meta["val"] = n.meta["example_value"]
                    new.meta[PASS_META] = self.name
                n.replace_all_uses_with(mul)
                gm.graph.erase_node(n)
                n_done += 1
        return PassResult(gm, n_done > 0, {"rewritten": n_done})


def test_manager_records_before_after_and_diff():
    c = captured()
    ctx = PassContext(find_regions(c.gm, c.seq), c.seq)
    before_code = c.gm.code
    gm, (rec,) = PassManager([SiluToSigmoidMul()]).run(c.gm, ctx)
    assert c.gm.code == before_code, "a pass must not mutate its input graph"
    assert rec.changed and rec.stats == {"rewritten": 1}
    diff = rec.diff()
    assert "-    silu = torch.nn.functional.silu" in diff
    assert "+    sigmoid = torch.sigmoid" in diff
    assert all(n.meta.get(PASS_META) == "silu_expand" for n in gm.graph.nodes if n.name.startswith("sigmoid"))


def test_verify_rejects_node_without_fake_value():
    gm = clone(captured().gm)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.meta.pop("example_value", None)
    node.meta.pop("val", None)
    with pytest.raises(VerifyError, match=f"node {node.name} .* has no fake value"):
        verify(gm)


def test_verify_rejects_broken_graph():
    gm = clone(captured().gm)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    # move a consumer before its producer: fx lint must catch the use-before-definition
    producer = next(n for n in nodes if n.users)
    producer.prepend(next(iter(producer.users)))
    with pytest.raises(VerifyError, match="graph lint failed"):
        verify(gm)


def test_verify_rejects_bad_provenance():
    gm = clone(captured().gm)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.meta[PASS_META] = ""
    with pytest.raises(VerifyError, match="empty or non-string"):
        verify(gm)


def test_order_dependencies_are_checked():
    class A:
        name, after = "a", ()

    class B:
        name, after = "b", ("a",)

    check_order([A(), B()])
    with pytest.raises(ValueError, match="'b' must run after 'a'"):
        check_order([B(), A()])
    with pytest.raises(ValueError):
        PassManager([B(), A()])


# --- passes hold no module state: what a rewritten graph runs, it owns ---------------------------


def chunked_keys(gm):
    return {n.args[0] for n in gm.graph.nodes if n.target is torch.ops.tailorfx.token_chunked.default}


def registered(key) -> bool:
    try:
        ops.chunked_region(key)
        return True
    except KeyError:
        return False


def narrow_second_mlp(model):
    """An HF Llama whose second layer has a narrower MLP: its region differs from the first's."""
    from transformers.models.llama.modeling_llama import LlamaMLP
    cfg = copy.deepcopy(model.config)
    cfg.intermediate_size = 96
    model.model.layers[1].mlp = LlamaMLP(cfg)
    return model


def minisequence(c):
    ctx = PassContext(find_regions(c.gm, c.seq), c.seq, {"minisequence_chunks": 2})
    gm, (rec,) = PassManager([MiniSequence({"minisequence_chunks": 2})]).run(c.gm, ctx)
    assert rec.changed
    return gm


def train_step(model, gm, inputs):
    """Loss and every parameter gradient of running `gm` (a graph of `model`) on its inputs."""
    model.zero_grad(set_to_none=True)
    inputs = [a.node.hint if isinstance(a, torch.SymInt) else a for a in inputs]   # the captured length
    loss = next(o for o in gm(*inputs) if isinstance(o, torch.Tensor) and o.dim() == 0)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_rewritten_graph_owns_its_regions():
    # an MLP width no other test uses: a graph another test compiled in this process (Dynamo's
    # cache keeps it) would otherwise hold the same region key registered
    from tailorfx.models import LlamaConfig, LlamaLM
    model = LlamaLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=168, num_hidden_layers=1,
                                num_attention_heads=4, num_key_value_heads=2))
    (c,), _ = capture_graphs(model, (), batch(S=16))
    gm = minisequence(c)
    keys = chunked_keys(gm)
    assert keys and not owned(c.gm), "the pass rewrote the manager's copy, not the captured graph"
    assert set(owned(gm)) == keys
    assert all(owned(gm)[k] is ops.chunked_region(k) and isinstance(owned(gm)[k].fn, fx.GraphModule)
               for k in keys)
    assert owned(clone(gm)) == owned(gm)   # a copy of the graph runs the same regions
    del gm
    gc.collect()
    assert not any(registered(k) for k in keys), "only the graph kept its regions registered"


def test_passes_hold_no_module_state():
    """Two models rewritten in one process: deleting the first (and every graph of it) leaves the
    second exact, and the first's regions unregistered. The models share one region (same layer,
    same sizes): the second graph holds the object the first registered, so it stays."""
    model_a, model_b = narrow_second_mlp(hf_llama()), hf_llama()
    (c_a,), _ = capture_graphs(model_a, (), batch(S=24))
    gm_a = minisequence(c_a)
    (c_b,), _ = capture_graphs(model_b, (), batch(S=24))
    gm_b = minisequence(c_b)
    keys_a, keys_b = chunked_keys(gm_a), chunked_keys(gm_b)
    shared, only_a = keys_a & keys_b, keys_a - keys_b
    assert shared and only_a, (keys_a, keys_b)   # else this test checks less than it says
    assert all(owned(gm_a)[k] is owned(gm_b)[k] for k in shared)

    del model_a, c_a, gm_a
    gc.collect()
    assert not any(registered(k) for k in only_a)
    assert all(ops.chunked_region(k) is owned(gm_b)[k] for k in shared)
    loss, grads = train_step(model_b, gm_b, c_b.example_inputs)
    loss_ref, grads_ref = train_step(model_b, c_b.gm, c_b.example_inputs)   # the graph as captured
    torch.testing.assert_close(loss, loss_ref, rtol=1e-4, atol=1e-6)
    assert grads.keys() == grads_ref.keys() and len(grads) == len(list(model_b.parameters()))
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow   # make test stays under 10 minutes; make test-slow (CI) runs it
def test_optimized_modules_leave_no_regions_behind():
    """Once every optimized module is gone (Dynamo drops the compiled code it keeps in the model's
    module globals only at reset), none of their regions is registered; a backward still pending
    then runs (the lowered graphs own the regions too). Collected until a collection finds nothing
    (as a process's collector goes on): under torch 2.11 the last graphs go at the second."""
    opts = [tailorfx.optimize(m, passes=["minisequence"], minisequence_chunks=2, example_inputs=batch(S=24))
            for m in (hf_llama(), narrow_second_mlp(hf_llama()))]
    for opt in opts:
        opt(**batch(S=24)).loss.backward()
    keys = {k for opt in opts for g in opt.session.graphs for k in chunked_keys(g.rewritten)}
    assert len(keys) >= 3 and all(registered(k) for k in keys)
    pending = opts[1](**batch(S=24)).loss
    del opts, opt
    torch._dynamo.reset()   # as a user's reset drops every compiled frame: the pending backward must not need them
    gc.collect()
    pending.backward()
    del pending
    collections = 1
    while gc.collect() and collections < 10:
        collections += 1
    assert not any(registered(k) for k in keys), collections
