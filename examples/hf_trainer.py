"""transformers.Trainer on an optimized model: hand Trainer the module optimize() returns.

TrainingArguments(torch_compile_backend="tailorfx") cannot name tailorfx: accelerate checks the
name against its fixed DynamoBackend list. gradient_checkpointing=True is run by tailorfx's
recompute pass (OptimizedModule.activation_checkpointing_enable).

    python examples/hf_trainer.py [--tiny]
"""
import sys
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import tailorfx

tiny = "--tiny" in sys.argv
S = 64 if tiny else 512
config = LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, use_cache=False)
torch.manual_seed(0)
model = LlamaForCausalLM(config)
rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 4096, (16, S))]
batch = {k: torch.stack([r[k] for r in rows[:4]]) for k in ("input_ids", "labels")}

opt = tailorfx.optimize(model, example_inputs=batch)
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=2 if tiny else 8,
                             logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                             gradient_checkpointing=True)
    Trainer(model=opt, args=args, train_dataset=rows).train()
print(opt.report())
