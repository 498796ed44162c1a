"""Run under torchrun: rank 1 dies mid-training; every other rank must stop with an error, not hang."""
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tailorfx  # noqa: E402
from models import hf_family  # noqa: E402

model = hf_family("llama", vocab_size=512)
ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
opt = tailorfx.optimize(model, example_inputs=dict(input_ids=ids, labels=ids), parallel=dict(tp=2))
for step in range(3):
    if step == 1 and dist.get_rank() == 1:
        os._exit(3)          # a crashed worker: no goodbye to the process group
    t = time.time()
    opt(input_ids=ids, labels=ids).loss.backward()
    print(f"rank {dist.get_rank()} step {step} {time.time() - t:.2f}s", flush=True)
