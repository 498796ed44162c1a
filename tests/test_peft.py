"""peft's LoRA models through tailorfx, as users fine-tune: `get_peft_model(model, LoraConfig(...))`
handed to optimize() and trained by hand or by transformers.Trainer. The frozen base weights get no
gradient and no optimizer state; the rewrites reach the blocks under peft's wrappers and name them
as `named_modules()` does."""
import copy
import os
import tempfile
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainingArguments

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
    of the adapters only; the step's peak predicted within -2%..+3%."""
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
    error = (est.forward_backward_peak_bytes - measured) / measured
    assert -0.02 <= error <= 0.03, f"{error:+.2%}"


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


def test_a_chunked_mlp_of_frozen_weights_is_predicted():
    """Mini-sequence's chunk backward costs what the step differentiates: with every weight frozen
    but one block's gate projection (LoRA's case), the chunks of the frozen block compute no weight
    gradient and the other block's one; the step's peak within -2%..+3% (the cost simulation gave
    every weight a gradient: +30.8%)."""
    model = hf_family("llama", use_cache=False)
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("layers.1.mlp.gate_proj.weight"))
    inputs = _inputs()
    opt = tailorfx.optimize(model, example_inputs=inputs)
    assert tailorfx_ops(lambda: opt(**inputs).loss.backward())["tailorfx::token_chunked_backward"] >= 1
    measured = peak_of_step(opt, model, inputs)
    error = (opt.predict_memory(S).forward_backward_peak_bytes - measured) / measured
    assert -0.02 <= error <= 0.03, f"{error:+.2%}"


def test_a_frozen_head_that_nothing_rewrites_is_predicted():
    """A graph no pass rewrites runs under eager autograd, unsplit: the LM head's input, which the
    model traces as an extra output (rewrite/lazy_outputs.py), is not held when a frozen head saves
    none (it was: +4.1% here)."""
    model = hf_family("llama", num_layers=1, hidden_size=256, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=4, use_cache=False)
    model.lm_head.weight.requires_grad_(False)
    inputs = _inputs()
    opt = tailorfx.optimize(model, example_inputs=inputs, passes=[])
    assert [g.lowering for g in opt.graph_records] == ["dynamo"]
    measured = peak_of_step(opt, model, inputs)
    error = (opt.predict_memory(S).forward_backward_peak_bytes - measured) / measured
    assert -0.02 <= error <= 0.03, f"{error:+.2%}"


def test_the_shallow_plan_hint_refuses_a_lora_model_before_any_capture():
    """A peft model's parameters are not those its config builds: no hint, and no shallow capture
    spent finding that out (the deep Llama would otherwise get one)."""
    from tailorfx.budget import Budget
    from tailorfx.setup import resolve
    from tailorfx.shallow import shallow_hint

    def no_capture(*args, **kwargs):
        raise AssertionError("a shallow capture was made")
    model = lora("llama", num_layers=16)
    ids = torch.zeros(1, 256, dtype=torch.long)
    args = (Budget.parse("1GB"), resolve(None), ((), {"input_ids": ids, "labels": ids}), {}, "eager", no_capture)
    assert shallow_hint(model, *args) is None
    with pytest.raises(AssertionError, match="shallow capture"):   # the same call reaches it without peft
        shallow_hint(model.get_base_model(), *args)


def _sft_losses_and_grads(model, grads_of, peft_config=None):
    """SFTTrainer's logged (loss, entropy, token accuracy) rows and its first step's adapter gradients."""
    import trl
    from test_trl import STEPS, FirstGrads, dataset, ops_of, tokenizer
    with tempfile.TemporaryDirectory() as d:
        args = trl.SFTConfig(output_dir=d, per_device_train_batch_size=4, max_steps=STEPS, logging_steps=1,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, packing=True,
                             max_length=64, bf16=False, seed=0)
        grads = FirstGrads(grads_of)
        torch.manual_seed(1)   # the adapters TRL's get_peft_model makes (peft_config=)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=dataset(), processing_class=tokenizer(),
                                 callbacks=[grads], peft_config=peft_config)
        counts = ops_of(trainer.train)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return [[h[k] for h in logs] for k in ("loss", "entropy", "mean_token_accuracy")], grads.grads, counts


def _assert_as_eager(got, grads, eager, eager_grads):
    for name, a, b in zip(("loss", "entropy", "mean_token_accuracy"), got, eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=0, msg=name)
    assert grads.keys() == eager_grads.keys() and all("lora_" in n for n in grads), sorted(grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_sft_trainer_trains_an_optimized_lora_model_through_tailorfxs_head():
    """SFTTrainer(model=optimize(peft model)): TRL's fused head is served by tailorfx on the LoRA
    model's backbone (it ran peft's LoraModel, whose output has no last_hidden_state: every step
    raised), one graph a step with the MLPs chunked; TRL's logged losses and the first step's adapter
    gradients equal eager TRL's on the peft model."""
    base = lora("llama")
    eager_model = copy.deepcopy(base)
    eager, eager_grads, _ = _sft_losses_and_grads(eager_model, eager_model)
    model = copy.deepcopy(base)
    opt = tailorfx.optimize(model, example_inputs=_inputs())
    got, grads, counts = _sft_losses_and_grads(opt, model)
    steps = [g for g in opt.graph_records
             if any("chunked_token_log_probs" in str(n.target) for n in g.rewritten.graph.nodes)]
    assert len(steps) == 1 and opt.session.runs[steps[0].index] == len(got[0]), opt.session.runs
    assert counts["tailorfx::chunked_token_log_probs_backward"] >= len(got[0]) and counts["tailorfx::token_chunked"] > 0
    assert any("TRL's fused LM head" in n for n in opt.session.notes)
    _assert_as_eager(got, grads, eager, eager_grads)


@pytest.mark.slow
def test_sft_trainers_peft_config_adds_adapters_to_an_optimized_model():
    """SFTTrainer(model=opt, peft_config=...): peft injects the adapters into the captured model's
    layers; the graph is captured again with them (dynamo's guards), and the run equals eager TRL's
    with the same peft_config. Under "all-linear" peft spares the output layer of a PreTrainedModel
    only, which the optimized model answers to be: lm_head keeps no adapter (TRL refuses one)."""
    config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    base = hf_family("llama")
    eager_model = copy.deepcopy(base)
    eager, eager_grads, _ = _sft_losses_and_grads(eager_model, eager_model, copy.deepcopy(config))
    model = copy.deepcopy(base)
    opt = tailorfx.optimize(model, example_inputs=_inputs())
    got, grads, counts = _sft_losses_and_grads(opt, model, copy.deepcopy(config))
    assert any(".down_proj.lora_A" in n for n in grads) and not any("lm_head" in n for n in grads), sorted(grads)
    assert counts["tailorfx::chunked_token_log_probs_backward"] >= len(got[0]) and counts["tailorfx::token_chunked"] > 0
    _assert_as_eager(got, grads, eager, eager_grads)
    # TRL's enable_input_require_grads hook left unregistered: the step is one graph, head included
    _assert_one_graph_a_step(opt, len(got[0]))


def _assert_one_graph_a_step(opt, steps: int, graphs: int = 1):
    """The training step a trainer ran is one graph of the backbone (MLPs chunked) and the head
    (`graphs` of them where a guard recaptures it), run on every step: TRL's
    enable_input_require_grads hook (peft with gradient checkpointing), which split it into three
    (the head apart), is not registered, and the report says so."""
    from tailorfx.trainers import INPUT_GRADS_NOTE
    step = [g for g in opt.graph_records if g.plan is not None and "recompute" in g.plan.passes]
    runs = [opt.session.runs[g.index] for g in step]
    assert len(step) == graphs and sum(runs) == steps, (opt.session.runs, len(opt.graph_records))
    for g in step:
        targets = [str(n.target) for n in g.rewritten.graph.nodes]
        assert any("chunked_token_log_probs" in t for t in targets) and any("token_chunked" in t for t in targets)
    assert INPUT_GRADS_NOTE in opt.session.notes


@pytest.mark.slow
def test_dpo_trainers_peft_config_trains_as_eager_dpo():
    """DPOTrainer(model=opt, peft_config=...): its reference is the model with the adapters
    disabled (peft's context, in a no_grad forward with checkpointing turned off), a graph of its
    own; the training step one graph (backbone and head); the logged loss, log-probs and rewards
    and the adapters' first gradients equal eager DPO's with the same peft_config (rtol 1e-4)."""
    from test_trl import dpo
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0,
                        init_lora_weights=False)
    base = hf_family("llama")
    eager_model = copy.deepcopy(base)
    eager, eager_grads = dpo(eager_model, None, eager_model, copy.deepcopy(config))
    model = copy.deepcopy(base)
    opt = tailorfx.optimize(model)
    got, grads = dpo(opt, None, model, copy.deepcopy(config))
    _assert_one_graph_a_step(opt, len(got))
    assert len(opt.graph_records) == 2 and all(opt.session.runs[g.index] == len(got) for g in opt.graph_records)
    assert eager[0]["rewards/chosen"] != 0        # random adapters: the reference differs from the policy
    for key in ("loss", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected", "logits/chosen"):
        torch.testing.assert_close([h[key] for h in got], [h[key] for h in eager], rtol=1e-4, atol=0,
                                   msg=lambda m, key=key: f"{key}: {m}")
    assert grads.keys() == eager_grads.keys() and all("lora_" in n for n in grads), sorted(grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_dpo_trainer_takes_an_optimized_peft_models_reference_from_its_adapters():
    """DPOTrainer(model=optimize(peft model)), no ref_model: accelerate's is_peft_model sees a
    PeftModel (the optimized class answers isinstance as the model's), so TRL keeps a frozen copy of
    the adapters ("ref") for the reference, as for the PeftModel itself (before, it loaded a second
    model by the config's hub name: with none, it raised), and puts its head on the causal LM under
    peft, which tailorfx serves. The logged rows and the adapters' first gradients equal eager DPO's
    on the PeftModel (rtol 1e-4); the training step runs as tailorfx's graphs; Trainer's save
    writes the adapters."""
    from peft import PeftModel
    from test_trl import dpo
    base = lora("llama")
    eager_model = copy.deepcopy(base)
    eager, eager_grads = dpo(eager_model, None, eager_model)
    model = copy.deepcopy(base)
    opt = tailorfx.optimize(model)
    assert isinstance(opt, PeftModel)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(without tailorfx's graph|not served by tailorfx)")
        got, grads = dpo(opt, None, model)
    assert "ref" in model.peft_config and any(".ref." in n for n, _ in model.named_parameters())
    # TRL swaps the "ref" adapter in for the reference and back, and peft's set_adapter leaves the
    # layers' `_active_adapter` distinct objects, which Dynamo guards on: the first step's graph
    # serves that step only, the second every step after
    _assert_one_graph_a_step(opt, len(got), graphs=2)
    assert any("TRL's fused LM head" in n for n in opt.session.notes)
    assert eager[-1]["rewards/chosen"] != 0        # the policy moved away from its reference
    for key in ("loss", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected", "logits/chosen"):
        torch.testing.assert_close([h[key] for h in got], [h[key] for h in eager], rtol=1e-4, atol=0,
                                   msg=lambda m, key=key: f"{key}: {m}")
    assert grads.keys() == eager_grads.keys() and all("lora_" in n and ".default." in n for n in grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    with tempfile.TemporaryDirectory() as d:
        Trainer(model=opt, args=TrainingArguments(output_dir=d, report_to=[], use_cpu=True)).save_model(d)
        assert "adapter_model.safetensors" in os.listdir(d) and "model.safetensors" not in os.listdir(d)


def test_trls_own_head_runs_on_a_lora_models_backbone_where_tailorfx_does_not_serve_it():
    """Where tailorfx runs the model as it is (a fallback: `_eager_reason` set, as a failed capture
    sets it), TRL's function runs on the causal LM under peft's wrapper, as TRL patches a PeftModel's
    (on the wrapper it ran peft's LoraModel as the backbone and raised); its loss equals TRL's own."""
    from trl.trainer.utils import add_fused_lm_head
    model = lora("llama")
    ref = copy.deepcopy(model)
    inputs = _inputs()
    opt = tailorfx.optimize(model, example_inputs=inputs)
    add_fused_lm_head(opt)   # as SFTTrainer does to the model it is given
    opt.__dict__["_eager_reason"] = "a capture that failed"
    with pytest.warns(UserWarning, match="runs as TRL wrote it"):
        out = opt(**inputs, fused_lm_head=True)
    add_fused_lm_head(ref.get_base_model())   # as SFTTrainer does to a PeftModel
    torch.testing.assert_close(out.loss, ref(**inputs, fused_lm_head=True).loss, rtol=1e-6, atol=0)
