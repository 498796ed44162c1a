"""The ops a chunked MLP's weight-gradient sum dispatches on fake CUDA and CPU tensors (bf16 chunk,
fp32 sum), as JSON on stdout: tests/test_fake_cuda.py runs it on a torch linked with CUDA."""
import json, torch
from torch.utils._python_dispatch import TorchDispatchMode
from tailorfx.compat import FakeTensorMode
from tailorfx.runtime.ops import add_weight_grad


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append([str(func), [str(a.dtype) for a in args if isinstance(a, torch.Tensor)]])
        return func(*args, **(kwargs or {}))


out = {}
with FakeTensorMode():
    for dev in ("cuda", "cpu"):
        acc = torch.zeros(32, 48, device=dev)
        g, a = (torch.empty(16, n, device=dev, dtype=torch.bfloat16) for n in (32, 48))
        with Ops() as o:
            add_weight_grad(acc, g, a)
        out[dev] = o.seen
print(json.dumps(out))
