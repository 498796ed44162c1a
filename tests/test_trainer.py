"""transformers.Trainer trains tailorfx's modules as it trains the model: same logged losses.

Default TrainingArguments except gradient accumulation (2 micro-batches), so the loss Trainer logs
goes through `num_items_in_batch` (token-mean over the whole accumulated batch), and labels padded
with -100 so the micro-batches hold different numbers of tokens. In make test-slow: the same under
`bf16=True` (autocast), and activation checkpointing served by tailorfx without a KV cache.
"""
import contextlib
import copy
import tempfile

import pytest
import torch
from transformers import Trainer, TrainingArguments

import tailorfx
from tailorfx.rewrite.capture import node_value
from harness import sweep_dynamo_limits
from models import batch, hf_llama


def _data(n=16, S=32, vocab=256):
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        ids = torch.randint(0, vocab, (S,), generator=g)
        labels = ids.clone()
        labels[S - 3 - 2 * (i % 5):] = -100     # 3 to 11 padded positions
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _train(model, data, **overrides):
    with tempfile.TemporaryDirectory() as d:
        args = TrainingArguments(output_dir=d, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                 max_steps=2, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                                 disable_tqdm=True, **overrides)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_logs_the_losses_of_the_unoptimized_model():
    data = _data()
    base = hf_llama()
    eager_model = copy.deepcopy(base)
    eager = _train(eager_model, data)
    example = {k: torch.stack([r[k] for r in data[:4]]) for k in ("input_ids", "labels")}
    runs = {
        "optimize": lambda m: tailorfx.optimize(m, example_inputs=example),
        # (model.compile(backend="tailorfx") is this same call, in place)
        # Dynamo's wrapper shows forward(*args, **kwargs): Trainer would drop every column
        "torch.compile": lambda m: torch.compile(m, backend="tailorfx"),
    }
    for name, wrap in runs.items():
        model = copy.deepcopy(base)
        wrapped = wrap(model)
        extra = {"remove_unused_columns": False} if name == "torch.compile" else {}
        with sweep_dynamo_limits() if name == "torch.compile" else contextlib.nullcontext():
            _check_run(name, wrapped, model, eager_model, data, eager, example, extra)


def _check_run(name, wrapped, model, eager_model, data, eager, example, extra):
    """One wrapped model trained by Trainer: eager's losses and weights, the rewrites fired."""
    losses = _train(wrapped, data, **extra)
    assert len(losses) == len(eager) == 2
    torch.testing.assert_close(losses, eager, rtol=1e-5, atol=0, msg=name)
    for (pname, p), q in zip(model.named_parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=f"{name}: {pname}")
    # the rewrites fired inside Trainer's loop: training mode with labels returns no logits
    model.train()
    assert wrapped(**example).logits is None, name
    if name == "optimize":
        touched = [t for g in wrapped.graph_records for r in g.records for t in r.touched]
        assert any("lm_head" in t for t in touched), touched


@pytest.mark.slow
def test_trainer_bf16_trains_as_eager_trainer_bf16_does():
    """Trainer(bf16=True): fp32 weights, the forward under accelerate's autocast. The module
    captures its step again under autocast, with the rewrites computing in bf16, and logs eager
    bf16's losses within 2^-8 and trains to eager bf16's weights within 1.5x of bf16's own distance
    from fp32 (the claims of docs/usage.md, as tests/test_autocast.py checks them on one step)."""
    data, base = _data(), hf_llama()
    example = {k: torch.stack([r[k] for r in data[:4]]) for k in ("input_ids", "labels")}
    fp32_model, eager_model, model = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    _train(fp32_model, data)
    eager = _train(eager_model, data, bf16=True)
    opt = tailorfx.optimize(model, example_inputs=example)
    losses = _train(opt, data, bf16=True)
    assert len(losses) == len(eager) == 2
    for got, want in zip(losses, eager):
        assert abs(got - want) <= 2 ** -8 * want, (losses, eager)

    def dist(a, b):
        return sum(((p - q) ** 2).sum() for p, q in zip(a.parameters(), b.parameters())).sqrt().item()
    assert dist(model, eager_model) <= 1.5 * dist(eager_model, fp32_model)
    # the step Trainer ran was captured under autocast and rewritten there: attention swapped, the
    # MLPs chunked, the head fused with bf16 inputs
    def fused_in_bf16(g):
        return any(getattr(n.target, "__name__", "") == "chunked_linear_cross_entropy"
                   and node_value(n.args[0]).dtype == torch.bfloat16 for n in g.rewritten.graph.nodes)
    amp = [g for g in opt.session.graphs if fused_in_bf16(g)]
    assert len(amp) == 1, [g.records for g in opt.session.graphs]
    assert {r.name: r.changed for r in amp[0].records} == {"attention": True, "minisequence": True}


@pytest.mark.slow
def test_checkpointing_through_tailorfx_fills_no_kv_cache():
    """`gradient_checkpointing_enable()` called on the optimized model (as a custom or accelerate
    loop calls it; Trainer sets `config.use_cache = args.use_cache`, False, itself): tailorfx
    recomputes the blocks and, as transformers' own checkpointing does in each layer, runs training
    calls with use_cache=False, so no layer fills a KV cache. The loss and gradients are eager
    checkpointed HF's."""
    base, inputs = hf_llama(), batch(2, 64)
    assert base.config.use_cache
    eager = copy.deepcopy(base)
    eager.gradient_checkpointing_enable()
    eager.train()
    want = eager(**inputs).loss
    want.backward()
    model = copy.deepcopy(base)
    opt = tailorfx.optimize(model)
    opt.gradient_checkpointing_enable()
    opt.train()
    out = opt(**inputs)
    out.loss.backward()
    torch.testing.assert_close(out.loss, want, rtol=1e-6, atol=0)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert out.past_key_values is None and "recompute" in opt.session.graphs[-1].plan.passes
    assert any("use_cache=False" in n for n in opt.session.notes), opt.session.notes
    assert model(**inputs).past_key_values is not None   # the model's own call keeps its cache


def test_an_accelerate_loop_trains_an_optimized_model_as_the_model():
    """A custom loop on accelerate (`Accelerator.prepare`, `accumulate` over 2 micro-batches of
    lengths that differ, `accelerator.backward`): one graph serves every micro-batch, the MLPs
    chunked, and the losses and the first accumulated gradients equal the model's own (rtol 1e-4)."""
    from accelerate import Accelerator

    def run(module, model):
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        module, optimizer = accelerator.prepare(module, torch.optim.AdamW(model.parameters(), lr=1e-3))
        g, losses, grads = torch.Generator().manual_seed(0), [], None
        for i in range(4):
            ids = torch.randint(2, 256, (2, 48 + 8 * i), generator=g)
            with accelerator.accumulate(module):
                loss = module(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and grads is None:
                    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
        return losses, grads

    base = hf_llama(2)
    eager, eager_grads = run(m := copy.deepcopy(base), m)
    model = copy.deepcopy(base)
    opt = tailorfx.optimize(model)
    got, grads = run(opt, model)
    assert len(opt.graph_records) == 1 and opt.session.runs[0] == 4, opt.session.runs
    assert any(r.name == "minisequence" and r.changed for r in opt.graph_records[0].records)
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=0)
    for name, g in grads.items():
        ref = eager_grads[name]
        assert ((g - ref).abs().max() / ref.abs().max()).item() <= 1e-4, name


def test_trainer_evaluates_and_smooths_labels_as_for_the_model():
    """Trainer reads its label names from `type(model).forward` and shifts smoothed labels for a
    class it names a causal LM: the optimized model's class takes the model's signature and name,
    so `evaluate()` reports eval_loss (on the plain wrapper it found no labels and computed none)
    and `label_smoothing_factor` gives eager's losses (it smoothed unshifted labels)."""
    def run(model):
        with tempfile.TemporaryDirectory() as d:
            args = TrainingArguments(output_dir=d, per_device_train_batch_size=4, max_steps=2, logging_steps=1,
                                     report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                                     label_smoothing_factor=0.1, per_device_eval_batch_size=4)
            trainer = Trainer(model=model, args=args, train_dataset=_data(), eval_dataset=_data(8))
            trainer.train()
            return trainer.label_names, [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer.evaluate()
    base = hf_llama(2)
    names, eager, eager_eval = run(copy.deepcopy(base))
    opt = tailorfx.optimize(copy.deepcopy(base))
    got_names, got, got_eval = run(opt)
    assert opt.session.runs and all(n > 0 for n in opt.session.runs.values())
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=0)
    assert type(opt).__name__ == "OptimizedLlamaForCausalLM" and repr(opt).startswith(type(opt).__name__)
    assert got_names == names == ["labels"]
    assert "eval_loss" in got_eval, got_eval
    torch.testing.assert_close(got_eval["eval_loss"], eager_eval["eval_loss"], rtol=1e-4, atol=0)
