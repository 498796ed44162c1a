"""transformers.Trainer on 2 gloo processes (DistributedDataParallel, buckets of 1 MB, which
Dynamo's DDPOptimizer would cut the step at): the optimized model trains as the eager one (logged
losses rtol 1e-5; the weights after 3 AdamW steps, which move
each by up to 1.5e-4, within 2e-6), its step one graph with the MLPs chunked, and the
report says what DDP changes; torch.compile(backend="tailorfx") under DDP warns that its pieces run
as captured, and trains as eager too. Each rank prints `ok RANK`."""
import copy
import os
import sys
import tempfile
import warnings

import torch
from transformers import Trainer, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tailorfx  # noqa: E402
from models import hf_family  # noqa: E402
from results import leave  # noqa: E402

rank = os.environ["RANK"]
base = hf_family("llama", hidden_size=256, intermediate_size=512)    # 5.5 MiB of gradients: 4 buckets
gen = torch.Generator().manual_seed(0)
rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (16, 32), generator=gen)]


def train(model, d, **kw):
    args = TrainingArguments(output_dir=d, per_device_train_batch_size=2, max_steps=3, logging_steps=1,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
                             ddp_bucket_cap_mb=1, **kw)
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    assert type(trainer.model_wrapped).__name__ == "DistributedDataParallel", type(trainer.model_wrapped)
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def same_weights(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-6, msg=name)


with tempfile.TemporaryDirectory() as d:
    eager_model = copy.deepcopy(base)
    eager = train(eager_model, d)
    model = copy.deepcopy(base)
    opt = tailorfx.optimize(model)
    losses = train(opt, d)
    torch.testing.assert_close(losses, eager, rtol=1e-5, atol=0)
    same_weights(model, eager_model)
    assert len(opt.graph_records) == 1 and opt.session.runs[0] == 3, opt.session.runs
    chunked = [t for r in opt.graph_records[0].records if r.name == "minisequence" for t in r.touched]
    assert sum(".mlp" in t for t in chunked) == 2, chunked
    assert any("inside DistributedDataParallel: the step is one graph" in n for n in opt.session.notes)

    compiled_model = copy.deepcopy(base)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = train(torch.compile(compiled_model, backend="tailorfx"), d, remove_unused_columns=False)
    assert any("DDPOptimizer hands tailorfx the step in pieces" in str(w.message) for w in seen)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=0)
    same_weights(compiled_model, eager_model)
print(f"ok {rank}", flush=True)
leave(0)
