"""The exact-comparison helper (harness.check_exact, compare_with_eager): its derived tolerance fails
a gradient off by far more than rounding and passes one off by rounding; its float64 reference is
float64 throughout; its ratio log and tests/ratio_table.py."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import harness
from harness import Reference, check_exact, compare_with_eager, float64_reference, reduction_length
from models import batch, hf_llama, tiny_llama


@pytest.fixture(autouse=True)
def _unlogged():
    """The ratios of this file's comparisons are planted (errors made on purpose): kept out of the
    session's ratio log, which is about the rewrites."""
    before = len(harness.RATIO_LOG)
    yield
    del harness.RATIO_LOG[before:]


def perturb_largest(rel):
    """A wrap that makes the rewrite's embedding gradient wrong on one element: its largest,
    scaled by 1 + rel (before accumulation, as a wrong kernel would write it)."""
    def wrap(m):
        def hook(g):
            g = g.clone()
            i = g.abs().argmax()
            g.view(-1)[i] *= 1 + rel
            return g
        m.model.embed_tokens.weight.register_hook(hook)
        return m
    return wrap


def test_one_element_off_by_a_thousandth_fails():
    """1e-3 of the largest element of a 512 x 64 gradient: ~100x the tolerance (normwise relative
    C * U * sqrt(K) ~ 1e-5 at K = 512), whatever the thread count or ISA."""
    with pytest.raises(AssertionError, match=r"model.embed_tokens.weight: error .* > tolerance"):
        compare_with_eager(tiny_llama(), batch(pad=3), perturb_largest(1e-3))


def test_one_element_off_by_an_ulp_passes():
    """Two ulps on the largest element is rounding: well under the tolerance."""
    cmp = compare_with_eager(tiny_llama(), batch(pad=3), perturb_largest(2.0 ** -22))
    assert cmp.reference == "float64" and cmp.worst_ratio < 0.5, cmp.worst_ratio


def test_an_unperturbed_copy_is_within_an_eighth():
    """The identity 'rewrite' is eager itself: its error is eager's, its ratio at most 1 / C."""
    cmp = compare_with_eager(hf_llama(num_layers=1), batch(pad=3), lambda m: m)
    assert cmp.reference == "float64" and cmp.worst_ratio <= 1 / harness.C


def _synthetic(rel_on_one, where="max"):
    t = torch.randn(256, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    eager = t.float()
    got = eager.clone()
    i = t.abs().argmax() if where == "max" else t.abs().argmin()
    got.view(-1)[i] += rel_on_one * t.abs().max().float()
    return got, eager, Reference({"w": t}, 512, "float64")


def test_normwise_fails_a_large_error_on_any_element():
    got, eager, ref = _synthetic(1e-3, where="min")
    with pytest.raises(AssertionError, match="w: error"):
        check_exact({"w": got}, {"w": eager}, ref)


def test_normwise_passes_rounding_on_a_small_element():
    """An element near zero off by rounding of its tensor's scale: elementwise it is wrong by
    many times its size (as a tied embedding's difference of two paths can be), normwise it is
    rounding."""
    got, eager, ref = _synthetic(4 * harness.U, where="min")
    i = ref.values["w"].abs().argmin()
    assert (got.view(-1)[i] - eager.view(-1)[i]).abs() > 1e-4 * eager.view(-1)[i].abs()   # elementwise rtol fails
    assert check_exact({"w": got}, {"w": eager}, ref).worst_ratio < 0.5


def test_a_wrong_loss_fails():
    t = torch.tensor(6.25, dtype=torch.float64)
    ref = Reference({"loss": t}, 512, "float64")
    with pytest.raises(AssertionError, match="loss: error"):
        check_exact({"loss": t.float() * (1 + 1e-4)}, {"loss": t.float()}, ref)


def test_a_missing_gradient_fails():
    t = torch.ones(3, dtype=torch.float64)
    with pytest.raises(AssertionError, match="gradient presence differs for w"):
        check_exact({"w": None}, {"w": t.float()}, Reference({"w": t}, 4, "float64"))


class Upcasts(torch.nn.Module):
    """Upcasts to float32 inside, as HF norms and softmax do."""
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        h = (x @ self.w).to(torch.float32)
        return torch.softmax(h, -1, dtype=torch.float32).float().square().sum()


def test_the_reference_widens_a_models_own_float32():
    x = torch.randn(4, 8)
    model = Upcasts()
    truth = float64_reference(model, {"x": x}, lambda m, d: m(**d))
    w, x64 = model.w.detach().double().requires_grad_(), x.double()
    want = torch.softmax(x64 @ w, -1).square().sum()
    want.backward()
    assert truth.kind == "float64"
    assert truth.values["loss"].dtype == torch.float64 and torch.equal(truth.values["loss"], want.detach())
    assert torch.equal(truth.values["w"], w.grad)


class RefusesFloat64(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        if x.dtype == torch.float64:
            raise RuntimeError("no float64 kernel")
        return self.lin(x).square().mean()


def test_a_model_without_float64_falls_back_to_the_analytic_bound_and_says_so():
    x = torch.randn(4, 8)
    model = RefusesFloat64()
    truth = float64_reference(model, {"x": x}, lambda m, d: m(**d))
    assert truth.values is None and truth.kind == "analytic (RuntimeError: no float64 kernel)"
    loss = model(x)
    loss.backward()
    values = {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}
    cmp = check_exact(values, values, truth)
    assert cmp.reference.startswith("analytic") and cmp.worst_ratio == 0
    assert harness.RATIO_LOG[-1]["reference"].startswith("analytic")


def test_reduction_length_is_tokens_or_the_widest_matrix():
    assert reduction_length(tiny_llama(), batch(B=2, S=40)) == 512            # vocabulary > 80 tokens
    assert reduction_length(tiny_llama(), batch(B=4, S=300)) == 1200          # tokens
    from models import hf_gpt2
    assert reduction_length(hf_gpt2(), batch(B=2, S=40)) == 512               # the position table is a lookup


def test_each_comparison_is_logged_with_its_test(request):
    before = len(harness.RATIO_LOG)
    compare_with_eager(tiny_llama(num_layers=1), batch(S=16), lambda m: m)
    (entry,) = harness.RATIO_LOG[before:]
    assert entry["test"] == request.node.nodeid and entry["reference"] == "float64"
    assert 0 <= entry["ratio"] <= 1 / harness.C and entry["num_tensors"] == 1 + len(list(tiny_llama(1).parameters()))


def test_ratio_table_merges_configurations_and_workers(tmp_path):
    def log(path, rows):
        with open(path, "w") as f:
            json.dump({"config": {}, "comparisons": [dict(zip(("test", "tensor", "ratio", "reference"), r))
                                                     for r in rows]}, f)
    log(tmp_path / "a.json.gw0", [("t::x", "w", 0.1, "float64"), ("t::x", "b", 0.3, "float64")])
    log(tmp_path / "a.json.gw1", [("t::y", "loss", 0.05, "float64")])
    log(tmp_path / "b.json", [("t::x", "w", 0.2, "float64"), ("t::y", "v", math.inf, "analytic (x)")])
    script = os.path.join(os.path.dirname(__file__), "ratio_table.py")
    out = subprocess.run([sys.executable, script, f"one={tmp_path / 'a.json'}",
                          f"two={tmp_path / 'b.json'}"], capture_output=True, text=True, check=True).stdout
    assert "| test | one | two | max | worst tensor |" in out
    assert "| t::x | 0.300 | 0.200 | **0.300** | b |" in out
    assert "| t::y | 0.050 | inf* | **inf** | v |" in out
