"""What tailorfx did to a model: its regions, each pass's graph and diff, the predicted memory.

    python examples/inspect_graph.py [--tiny]
"""
import sys

import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

import tailorfx

S = 64 if "--tiny" in sys.argv else 1024
config = Gemma2Config(vocab_size=4096, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, use_cache=False)
torch.manual_seed(0)
model = Gemma2ForCausalLM(config).train()
batch = {"input_ids": torch.randint(0, 4096, (1, S))}
batch["labels"] = batch["input_ids"]
opt = tailorfx.optimize(model, example_inputs=batch)

for region in opt.regions:                 # blocks, attention, MLPs, norms, the LM head + loss
    print(region)
print(opt.diff("minisequence"))            # the graph code before and after the pass
print(list(opt.graphs))                    # "capture", then one graph per pass
est = opt.predict_memory(4 * S)            # the same plan at 4x the length
print(f"predicted peak at S={4 * S}: {est.peak_bytes / 2**20:.1f} MiB")
print(opt.report())
