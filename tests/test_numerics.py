"""optimize() and the "tailorfx" backend train exactly like eager PyTorch (no rewrite asked)."""
import subprocess
import sys
import textwrap

import pytest
import torch

import tailorfx
from harness import check_exact, compare_with_eager, float64_reference, step_values, sweep_dynamo_limits
from models import batch, hf_gpt2, hf_llama, tiny_llama

MODELS = {
    "reference": lambda: tiny_llama(),
    "reference-tied": lambda: tiny_llama(tied=True),
    "hf-llama": lambda: hf_llama(),
    "hf-gpt2": lambda: hf_gpt2(),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_optimize_without_passes_matches_eager(name):
    compare_with_eager(MODELS[name](), batch(pad=3), lambda m: tailorfx.optimize(m, passes=[]), steps=2)


@pytest.mark.parametrize("name", ["reference", "hf-llama", "hf-gpt2"])
def test_backend_matches_eager(name):
    with sweep_dynamo_limits():
        compare_with_eager(MODELS[name](), batch(), lambda m: torch.compile(m, backend="tailorfx"))


def test_new_sequence_length_reuses_the_symbolic_graph():
    m = tiny_llama()
    opt = tailorfx.optimize(m, passes=[], example_inputs=batch(S=40))
    for S in (17, 64, 100):
        out = opt(**batch(S=S))
        ref = m(**batch(S=S))
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert len(opt.session.graphs) == 1, "a new length must not recompile"
    assert opt.session.graphs[0].seq.symbol is not None


def _chunked_llama():
    """HF Llama and an eager copy, the first optimized with its MLPs and head in two chunks at S=40."""
    import copy
    model = hf_llama()
    ref = copy.deepcopy(model)
    return model, ref, tailorfx.optimize(model, passes=["minisequence"], minisequence_chunks=2, example_inputs=batch(S=40))


def _step_equals_eager(opt, model, ref, S, warns=None):
    """One training step of `opt` at length S against the eager copy's: the loss and every gradient
    (fp32, check_exact); `warns`: the step must warn with that message."""
    import contextlib
    inputs = batch(S=S, pad=3)
    truth = float64_reference(ref, inputs)
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning, match=warns) if warns else contextlib.nullcontext():
        out = opt(**inputs)
    out.loss.backward()
    want = ref(**inputs)
    want.loss.backward()
    check_exact(step_values(model, out.loss), step_values(ref, want.loss), truth)


def test_a_rewritten_graph_runs_static_at_its_length_and_symbolic_at_others():
    """The eager lowering compiles at the captured sizes first; another length compiles the
    symbolic sizes once (no Dynamo recompile) and the captured length keeps its own: the loss and
    every gradient equal eager's at each, and the memory model follows the symbolic step."""
    model, ref, opt = _chunked_llama()
    (g,) = opt.session.graphs
    assert g.lowering == "eager" and g.step_static        # the rewrite ran, compiled on static shapes
    static_peak = opt.predict_memory().forward_backward_peak_bytes
    for S in (40, 64, 17, 40):
        _step_equals_eager(opt, model, ref, S)
    assert len(opt.session.graphs) == 1 and not g.step_static    # one capture; the symbolic step kept
    assert opt.predict_memory().forward_backward_peak_bytes == static_peak    # the same step at S=40
    assert opt.predict_memory(64).forward_backward_peak_bytes > static_peak


def test_a_symbolic_compile_that_fails_runs_the_new_length_under_eager_autograd(monkeypatch):
    """Should the compile for symbolic sizes fail at a new length, that length runs the rewritten
    graph's own ops under eager autograd, with a warning that says so: the loss and every gradient
    still equal eager's, and the captured length keeps its compiled graph."""
    from tailorfx import compat
    model, ref, opt = _chunked_llama()
    real = compat.aot_module_simplified

    def fail_symbolic(gm, inputs, **kw):
        if any(isinstance(d, torch.SymInt) for t in inputs if isinstance(t, torch.Tensor) for d in t.shape):
            raise RuntimeError("planted")
        return real(gm, inputs, **kw)
    monkeypatch.setattr(compat, "aot_module_simplified", fail_symbolic)
    _step_equals_eager(opt, model, ref, 64, warns="symbolic sizes failed .*planted.*eager autograd")
    _step_equals_eager(opt, model, ref, 40)
    assert opt.session.graphs[0].step_static      # the failed compile replaced nothing


def test_parameters_are_shared_with_the_model():
    m = tiny_llama()
    opt = tailorfx.optimize(m, passes=[])
    assert {id(p) for p in opt.parameters()} == {id(p) for p in m.parameters()}
    assert set(opt.state_dict()) == set(m.state_dict())   # saves and loads like the model


def test_backend_entry_point_works_without_importing_tailorfx():
    code = textwrap.dedent("""
        import sys, torch
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
        x = torch.randn(4, 8)
        assert "tailorfx" not in sys.modules
        y = torch.compile(m, backend="tailorfx")(x)
        torch.testing.assert_close(y, m(x))
        assert "tailorfx" in sys.modules
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


@pytest.mark.slow
def test_inductor_lowering_matches_eager():
    compare_with_eager(tiny_llama(num_layers=1), batch(S=32),
                       lambda m: tailorfx.optimize(m, passes=[], lowering="inductor"))
