"""A plain training loop: optimize() under a budget, then train as you would the model.

    python examples/plain_loop.py            # HF Llama (random init) on random tokens, 1,024 tokens a row
    python examples/plain_loop.py --tiny     # seconds (what tests/test_examples.py runs)
"""
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tailorfx

tiny = "--tiny" in sys.argv
S, layers = (64, 2) if tiny else (1024, 4)
config = LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=352, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, use_cache=False)
torch.manual_seed(0)
model = LlamaForCausalLM(config).train()
batch = {"input_ids": torch.randint(0, 4096, (2, S))}
batch["labels"] = batch["input_ids"].clone()

# the step's predicted memory with no rewrite; a budget that leaves half of its activations
plain = tailorfx.optimize(model, passes=[], example_inputs=batch).predict_memory()
budget = plain.static_bytes + (plain.peak_bytes - plain.static_bytes) // 2
try:
    opt = tailorfx.optimize(model, budget=budget, example_inputs=batch)
except tailorfx.BudgetError as e:           # names the smallest budget any plan meets, and what dominates it
    print(e)
    opt = tailorfx.optimize(model, budget=e.suggested_bytes, example_inputs=batch)
# AdamW as the plan set it up (the planner may move its step into backward to fit the budget)
optimizer = tailorfx.SetupOptimizer(model.parameters(), opt.setup)
for step in range(3):
    loss = opt(**batch).loss        # logits=None in training: the LM head is fused with the loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {step}: loss {loss.item():.4f}")
print(opt.report())
