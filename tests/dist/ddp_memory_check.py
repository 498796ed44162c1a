"""An optimized model inside DistributedDataParallel on 2 gloo processes, under a budget: DDP's
gradient buckets (a copy of the gradients, allocated when DDP is made) are in the predicted peak
and in the plan. The model is captured before DDP wraps it (example inputs), planned there without
buckets; inside DDP its step is captured and planned again, with them:
- the buckets DDP allocates (the profiler's bytes while DDP is made, `init_sync=False` so that no
  broadcast buffer is freed unseen by gloo's thread) and the step's measured peak are each within
  -2%..+3% of the prediction, and weights + buckets + step peak fit the budget, which the plan made
  outside DDP plus the buckets would not;
- the loss and every gradient DDP averaged equal eager DDP's (rtol 1e-5);
- a tailorfx.SetupOptimizer stepping in backward, and a setup with the step in backward, are
  refused inside DDP (each rank would update with its own gradient).
Each rank prints `ok RANK`."""
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tailorfx  # noqa: E402
from models import hf_family  # noqa: E402
from results import leave  # noqa: E402
from tailorfx import planner  # noqa: E402
from tailorfx.runtime.measure import measure_peak, peak_and_net  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
base = hf_family("llama", hidden_size=256, intermediate_size=512)
ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(rank))
batch = dict(input_ids=ids, labels=ids)
BUDGET = 23 * 2**20
weights = sum(p.numel() * p.element_size() for p in base.parameters())


def near(measured: int, predicted: int) -> bool:
    return 0.98 * measured <= predicted <= 1.03 * measured


model = copy.deepcopy(base)
opt = tailorfx.optimize(model, budget=BUDGET, optimizer=None, example_inputs=batch)
outside = opt.session.graphs[-1].plan.estimate
assert outside.bucket_bytes == 0 and not opt.setup.ddp, outside
_, buckets, ddp = peak_and_net(lambda: DDP(opt, bucket_cap_mb=1, init_sync=False))


def step():
    out = ddp(**batch)
    out.loss.backward()
    return out.loss.detach()


loss = step()
inside = opt.session.graphs[-1]
assert len(opt.session.graphs) == 2 and inside.plan.options["setup"].ddp, [str(g.plan) for g in opt.session.graphs]
assert opt.setup.ddp and inside.plan.chosen.fits, inside.plan
grads = {n: p.grad.clone() for n, p in model.named_parameters()}
peaks = []
for _ in range(2):
    model.zero_grad(set_to_none=True)
    peaks.append(measure_peak(step))
pred = opt.predict_memory()
assert pred.bucket_bytes == weights and near(buckets, pred.bucket_bytes), (buckets, pred.bucket_bytes)
assert near(min(peaks), pred.dynamic_peak_bytes), (peaks, pred.dynamic_peak_bytes)
assert pred.peak_bytes <= planner.usable(BUDGET, 0.0) and weights + buckets + min(peaks) <= BUDGET
assert outside.peak_bytes + weights > planner.usable(BUDGET, 0.0), outside.peak_bytes   # the plan outside DDP would not fit
assert any("its buckets hold a copy of the gradients" in n for n in opt.session.notes), opt.session.notes
assert "DDP gradient buckets" in str(opt.report())
assert "graph 0: replaced, not run since: planned again with DDP's gradient buckets" in str(opt.report())

eager_model = copy.deepcopy(base)
eager = DDP(eager_model, bucket_cap_mb=1)
eager_loss = eager(**batch).loss
eager_loss.backward()
torch.testing.assert_close(loss, eager_loss.detach(), rtol=1e-5, atol=0)
for n, p in eager_model.named_parameters():
    torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)

for make in ("SetupOptimizer", "setup"):
    m = copy.deepcopy(base)
    s = tailorfx.TrainingSetup(optimizer_in_backward=True)
    o = tailorfx.optimize(m, setup=s, lowering="eager")
    if make == "SetupOptimizer":
        tailorfx.SetupOptimizer(m.parameters(), s)
    try:
        DDP(o)(**batch)
        raise AssertionError(f"a step in backward ({make}) ran inside DDP")
    except ValueError as e:
        assert "before" in str(e) and "averages" in str(e) and "optimizer_in_backward=False" in str(e), e
print(f"ok {rank}", flush=True)
leave(0)
