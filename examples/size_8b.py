"""Sizing a Llama-3-8B run for a GPU without one: the longest sequence, and the plan at a length.

Nothing is allocated: the model is built on fake tensors and its step predicted by the memory model.

    python examples/size_8b.py          # Llama-3-8B on an H100-80GB, pure bf16, fused optimizer
    python examples/size_8b.py --tiny   # a 2-layer model of the same widths
The same from a shell: tailorfx plan config.json --budget H100-80GB --seq 32768 --setup pure-bf16
"""
import sys

from transformers import LlamaConfig

import tailorfx

tiny = "--tiny" in sys.argv
config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=2 if tiny else 32, num_attention_heads=32, num_key_value_heads=8,
                     max_position_embeddings=131072, rope_theta=500000.0, use_cache=False)
setup = "pure-bf16-fused-optimizer"
for offload in (None, "checkpoints"):
    n = tailorfx.max_seq_len(config, "H100-80GB", setup=setup, offload=offload)
    where = "in host memory" if offload else "on the device"
    print(f"longest sequence on one H100-80GB ({setup}, block checkpoints {where}): {n:,} tokens")
