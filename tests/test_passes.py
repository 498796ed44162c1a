"""Pass manager, verifier and ordering checks."""
import operator

import pytest
import torch
import torch.fx as fx

from models import batch, tiny_llama
from tailorfx.rewrite.capture import capture_graphs
from tailorfx.rewrite.passes import (PASS_META, PassContext, PassManager, PassResult, VerifyError, check_order,
                                     clone, verify)
from tailorfx.rewrite.regions import find_regions


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
