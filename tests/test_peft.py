"""peft's LoRA models through tailorfx, as users fine-tune: `get_peft_model(model, LoraConfig(...))`
handed to optimize() and trained by hand or by transformers.Trainer. The frozen base weights get no
gradient and no optimizer state; the rewrites reach the blocks under peft's wrappers and name them
as `named_modules()` does."""
import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

import tailorfx
from harness import peak_of_step, tailorfx_ops
from models import hf_family
from test_trainer import _data, _train

S = 64


def lora(family: str, num_layers: int = 2):
    """A tiny HF model of `family` with LoRA on every linear layer; B initialised at random too (peft's
    default zero B would make every A gradient zero, and equal whatever ran)."""
    base = hf_family(family, num_layers=num_layers)
    torch.manual_seed(1)
    return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0,
                                           init_lora_weights=False))


def _inputs(seed: int = 0) -> dict:
    ids = torch.randint(0, 256, (2, S), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=pytest.mark.slow),
                                    pytest.param("gemma2", marks=pytest.mark.slow)])
def test_a_lora_model_is_rewritten_exact_and_predicted(family):
    """Loss and every adapter gradient equal eager peft's, the base weights frozen; the head fused
    with the loss and every MLP chunked, under the paths named_modules() gives; the optimizer state
    of the adapters only; the step's peak not under-predicted."""
    model = lora(family)
    eager = copy.deepcopy(model)
    inputs = _inputs()
    opt = tailorfx.optimize(model, example_inputs=inputs)
    ops = tailorfx_ops(lambda: opt(**inputs).loss.backward())
    layers = model.get_base_model().config.num_hidden_layers
    assert ops["tailorfx::chunked_linear_cross_entropy_with_grads"] == 1 and ops["tailorfx::token_chunked"] == layers, ops
    modules = dict(model.named_modules())
    touched = [t.split(" (")[0] for g in opt.graph_records for r in g.records if r.changed for t in r.touched]
    assert len(touched) >= layers + 1 and all(t in modules for t in touched), touched

    model.zero_grad(set_to_none=True)
    out = opt(**inputs)
    assert out.logits is None
    out.loss.backward()
    ref = eager(**inputs)
    ref.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    trained = {n: p for n, p in eager.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    for name, p in model.named_parameters():
        if name in trained:
            assert trained[name].grad.abs().max() > 0, name
            torch.testing.assert_close(p.grad, trained[name].grad, rtol=1e-4, atol=1e-6, msg=name)
        else:
            assert p.grad is None, name

    est = opt.predict_memory(S)
    adapters = sum(p.numel() for p in trained.values())
    assert est.breakdown()["optimizer state"] == 2 * 4 * adapters   # AdamW's two fp32 moments
    measured = peak_of_step(opt, model, inputs)
    over = (est.forward_backward_peak_bytes - measured) / measured
    print(f"{family}: predicted {over:+.2%} of the measured peak")
    # a known gap (docs/memory.md, "LoRA"): predicted over the measured peak, +3.3% to +14% at these
    # sizes, where a plain model's is within -2%..+3%; never under (a budget met by the prediction holds)
    assert 0 <= over <= 0.15, f"{over:+.2%}"


def test_trainer_trains_an_optimized_lora_model_as_it_trains_the_model():
    """transformers.Trainer on optimize(peft model, offload="activations"): Trainer keeps the batch's
    columns by the base model's signature (peft's forward takes *args, **kwargs), and logs eager
    Trainer's losses, with the adapters trained to the same weights; the activations were offloaded."""
    base = lora("llama")
    data = _data()
    eager_model = copy.deepcopy(base)
    eager = _train(eager_model, data)
    model = copy.deepcopy(base)
    example = {k: torch.stack([r[k] for r in data[:4]]) for k in ("input_ids", "labels")}
    opt = tailorfx.optimize(model, passes=["minisequence", "recompute"], offload="activations",
                            example_inputs=example)
    losses: list = []
    ops = tailorfx_ops(lambda: losses.extend(_train(opt, data)))
    assert len(losses) == len(eager) == 2
    torch.testing.assert_close(losses, eager, rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)
    # a forward that no backward follows (the graph Trainer's first call compiles) reloads nothing
    assert ops["tailorfx::offload"] >= ops["tailorfx::reload"] == ops["tailorfx::reloaded"] >= 4 * 2, ops
    assert ops["tailorfx::token_chunked_backward"] > 0, ops
