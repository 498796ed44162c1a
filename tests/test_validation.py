"""Bad input gets one clear error naming the parameter, the value and what is allowed; a budget
is a promise kept at every length."""
import copy

import pytest
import torch

import tailorfx
from harness import sweep_dynamo_limits
from models import batch, hf_config, hf_llama


def test_passes_given_as_a_string():
    with pytest.raises(ValueError, match=r"passes='minisequence' is not valid: give a list of pass names, "
                                         r"e.g. passes=\['minisequence'\]"):
        tailorfx.optimize(hf_llama(), passes="minisequence")


def test_unknown_pass_suggests_the_close_one():
    with pytest.raises(ValueError, match=r"unknown pass 'minisequance'.*did you mean 'minisequence'"):
        tailorfx.optimize(hf_llama(), passes=["minisequance"])


def test_precision_policy_typo():
    with pytest.raises(ValueError, match=r"precision_policy key 'mlpx'.*did you mean 'mlp'"):
        tailorfx.optimize(hf_llama(), precision="bf16", precision_policy={"mlpx": "fp32"})


@pytest.mark.parametrize("name,value", [("keep_logits", "yes"), ("strict", 1), ("minisequence_chunks", 0)])
def test_flags_and_counts(name, value):
    with pytest.raises(ValueError, match=f"{name}={value!r} is not valid"):
        tailorfx.optimize(hf_llama(), **{name: value})


@pytest.mark.parametrize("granularity", [-5, 0])
def test_max_seq_len_granularity(granularity):
    with pytest.raises(ValueError, match=f"granularity={granularity} is not valid: a positive int"):
        tailorfx.max_seq_len(hf_config("llama"), "1GB", granularity=granularity)


def test_backend_options():
    model = hf_llama()
    with sweep_dynamo_limits():
        out = torch.compile(model, backend="tailorfx", options={"passes": ["minisequence"], "minisequence_chunks": 2})(
            **batch())
    assert out.logits is None   # the fused head fired
    with pytest.raises(Exception, match=r"unknown tailorfx backend option\(s\) \['bogus'\]; allowed: \['passes'"):
        torch.compile(hf_llama(), backend="tailorfx", options={"bogus": 1})(**batch())


def test_budget_with_named_passes_is_checked():
    with pytest.raises(tailorfx.BudgetError, match=r"passes \['minisequence'\] predict a peak of .* over the "
                                                   r"budget 1KiB"):
        tailorfx.optimize(hf_llama(), budget="1KiB", passes=["minisequence"], example_inputs=batch())


@pytest.mark.slow   # make test stays under 10 minutes; make test-slow (CI) runs it
def test_a_new_length_is_rechecked_against_the_budget():
    model = hf_llama()
    planned = tailorfx.optimize(model, passes=["minisequence"], example_inputs=batch(B=1, S=64))
    fits = planned.predict_memory(64).peak_bytes
    opt = tailorfx.optimize(model, budget=int(fits * 1.05), passes=["minisequence"], example_inputs=batch(B=1, S=64))
    opt(**batch(B=1, S=60))   # shorter: fits
    with pytest.raises(tailorfx.BudgetError, match=r"at sequence length 256 the plan made for 64 predicts"):
        opt(**batch(B=1, S=256))


@pytest.mark.slow   # make test stays under 10 minutes; make test-slow (CI) runs it
def test_requested_sparse_attention_that_cannot_apply_warns():
    """A padded batch's mask cannot be proved causal: the sliding window the user asked for is not
    applied, and that is a warning naming the region and the reason (an error with strict=True)."""
    inputs = batch(S=24, pad=4)
    inputs["attention_mask"] = (inputs["labels"] != -100).long()
    window = tailorfx.attention.SlidingWindow(8)
    with pytest.warns(UserWarning, match=r"requested rewrites not applied: attention: model.layers.0.self_attn: "
                                         r"mask depends on graph input"):
        tailorfx.optimize(hf_llama(), attention=window, example_inputs=inputs)
    with pytest.raises(ValueError, match=r"strict=True"):
        tailorfx.optimize(hf_llama(), attention=window, strict=True, example_inputs=inputs)


@pytest.mark.parametrize("make,message", [
    (lambda: tailorfx.attention.SlidingWindow(2.5), r"SlidingWindow\(window=2.5\) is not valid: an int >= 1"),
    (lambda: tailorfx.attention.SlidingWindow(0), r"SlidingWindow\(window=0\) is not valid"),
    (lambda: tailorfx.attention.BigBird(block=16.0, window=1, num_global=1, num_random=1),
     r"BigBird\(block=16.0\) is not valid"),
])
def test_attention_specs_refuse_bad_numbers(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_model_given_with_gradient_checkpointing_on_is_recomputed_by_tailorfx():
    """transformers' checkpointing (torch.utils.checkpoint around each layer) hides the MLPs from every
    pass: optimize() turns it off in the model and serves it with its recompute pass, so the MLPs are
    chunked and the blocks recomputed, and the loss and every gradient are those of the model trained
    with its own checkpointing (rtol 1e-5)."""
    import copy
    from models import hf_family
    model = hf_family("llama")
    model.gradient_checkpointing_enable()
    eager, b = copy.deepcopy(model), batch()
    opt = tailorfx.optimize(model, passes=["minisequence"], example_inputs=b)
    assert opt.is_activation_checkpointing and not model.is_gradient_checkpointing
    loss = opt(**b).loss
    loss.backward()
    g = opt.graph_records[-1]
    assert "recompute" in g.plan.passes and any(r.name == "recompute" and r.changed for r in g.records), g.plan
    chunked = [t for r in g.records if r.name == "minisequence" and r.changed for t in r.touched]
    assert sum(".mlp" in t for t in chunked) == 2, chunked
    assert any("came with transformers' activation checkpointing on" in n for n in opt.session.notes)
    ref = eager(**b).loss
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)



def test_gradient_checkpointing_turned_on_in_the_model_after_optimize_is_taken_over():
    """`model.gradient_checkpointing_enable()` on the model after optimize(): the step that finds it
    runs the layers outside the graph (Dynamo cannot trace transformers 5.25's checkpointing here), or
    in a graph compiled anew around the model's own checkpointing (transformers 5.17, the GPU machines'),
    and is not warned about as a graph break; from the next step on it is tailorfx's recompute pass, the
    step one graph again, and the loss and gradients the model's own (it was eager's on every step,
    warned about as a graph break)."""
    import copy
    import warnings
    from models import hf_family
    model, b = hf_family("llama"), batch()
    eager = copy.deepcopy(model)
    opt = tailorfx.optimize(model, passes=["minisequence"], example_inputs=b)
    model.gradient_checkpointing_enable()
    eager.gradient_checkpointing_enable()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            loss = opt(**b).loss
            loss.backward()
    assert not [w for w in seen if "not the whole training step" in str(w.message)]
    assert opt.is_activation_checkpointing   # and off in every layer of the model (any transformers' name for it)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    g = opt.graph_records[-1]
    assert list(opt.session.last_step.calls) == [g.index], opt.session.last_step.calls
    assert any(r.name == "recompute" and r.changed for r in g.records), g.plan
    assert any("turned on after optimize()" in n for n in opt.session.notes), opt.session.notes
    ref = eager(**b).loss
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)

class _PrintingBlock(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.fc1, self.fc2 = torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        print(end="")    # a graph break inside a layer that a loop calls
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class _PrintingLM(torch.nn.Module):
    def __init__(self, vocab=300, d=32):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(vocab, d), torch.nn.Linear(d, vocab)
        self.blocks = torch.nn.ModuleList(_PrintingBlock(d) for _ in range(2))

    def forward(self, ids, labels):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def test_a_step_not_all_captured_is_not_predicted():
    """A print() in a looped layer: Dynamo skips the model's forward (embedding, head and loss run
    eagerly) and compiles the layer alone, run twice per step. Predictions were silently the
    layer's alone (the same 1 MiB at every length) and its fc1 was taken for the LM head."""
    torch.manual_seed(0)
    model = _PrintingLM()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 300, (2, 64))
    with pytest.warns(UserWarning, match=r"not the whole training step: parameters emb.weight, head.weight, "
                                         r"head.bias are used by code Dynamo ran eagerly.*graph 0 ran 2 times"):
        opt = tailorfx.optimize(model, passes=[], example_inputs=(ids, ids))
    assert not [r for r in opt.regions if r.kind == "lm_head_loss"], opt.regions
    for S in (64, 4096):
        with pytest.raises(tailorfx.PredictionError, match="cannot predict one training step: parameters emb.weight"):
            opt.predict_memory(S)
    assert "not the whole training step" in str(opt.report())
    model.zero_grad(set_to_none=True)
    opt(ids, ids).backward()
    ref(ids, ids).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
