"""Tensor parallelism with the single-device rewrites per rank, inside torchrun.

    torchrun --nproc-per-node 2 examples/torchrun_parallel.py [--tiny]

gloo on CPU, NCCL on CUDA. Every rank is given the same batch; parallel= shards the model with
DTensor and takes the rewrites each rank takes (budget=: chosen so each rank's peak fits).
"""
import os
import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import tailorfx

tiny = "--tiny" in sys.argv
S = 64 if tiny else 512
dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
config = LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, use_cache=False)
torch.manual_seed(0)      # the same weights and batch on every rank
model = LlamaForCausalLM(config).train()
batch = {"input_ids": torch.randint(0, 4096, (2, S))}
batch["labels"] = batch["input_ids"].clone()

opt = tailorfx.optimize(model, example_inputs=batch, parallel=dict(tp=dist.get_world_size()))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(2):
    loss = opt.step(**batch)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f}")
if dist.get_rank() == 0:
    print(opt.report())
dist.barrier()   # both ranks past every collective before either tears gloo down
dist.destroy_process_group()
# gloo objects DTensor's mesh still holds, freed while Python clears its modules at exit, can abort
# the process ("terminate called without an active exception", pytorch#65231; seen here under
# load): leave without interpreter finalization
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
