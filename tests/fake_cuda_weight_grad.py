"""The ops a chunked weight-gradient sum (kernels/weight_grad.py: the mini-sequence MLP's and the
fused head's) dispatches on fake CUDA and CPU tensors (bf16 chunk, fp32 sum), as JSON on stdout:
tests/test_fake_cuda.py runs it on a torch linked with CUDA."""
import json, torch
from torch.utils._python_dispatch import TorchDispatchMode
from tailorfx.compat import FakeTensorMode
from tailorfx.kernels.weight_grad import add_weight_grad


class Ops(TorchDispatchMode):
    def __init__(self, acc):
        super().__init__()
        self.acc, self.seen = acc, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.seen.append([str(func), [str(a.dtype) for a in args if isinstance(a, torch.Tensor)],
                          kwargs.get("out") is self.acc])
        if func is torch.ops.aten.addmm.dtype_out:   # no fake kernel in torch 2.11: its decomposition
            return kwargs["out"]                     # takes out_dtype for beta (a real GPU runs cuBLAS)
        return func(*args, **kwargs)


out = {}
with FakeTensorMode():
    for dev in ("cuda", "cpu"):
        acc = torch.zeros(32, 48, device=dev)
        g, a = (torch.empty(16, n, device=dev, dtype=torch.bfloat16) for n in (32, 48))
        with Ops(acc) as o:
            add_weight_grad(acc, g, a)
        out[dev] = o.seen
print(json.dumps(out))
