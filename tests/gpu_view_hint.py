"""The plan a shallow capture gives optimize(kernels="triton", budget=) as a GPU machine makes it,
as JSON on stdout: no Triton interpreter (the kernels are torch.library.triton_ops, traced into
their launches), Triton's driver targeting sm90 (a stand-in: this machine has none; torch reads
it to find which inputs each launch writes), a GPU present where check_triton asks, and the
shallow capture's model of fake CPU tensors (shallow.py). Run without TRITON_INTERPRET, in a
process of its own: the interpreter is fixed when tailorfx's kernels are imported.

    python tests/gpu_view_hint.py

The budget: three quarters of the peak predicted for the capture with the kernels and no memory
rewrite, which a plan then has to meet.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class Sm90Driver:
    """What torch's Triton wrapper asks a driver while tracing a launch (generate_ttir)."""
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") != "1", "run without Triton's interpreter"
    triton.runtime.driver.set_active(Sm90Driver())
    import tailorfx
    from models import hf_family
    from tailorfx import api, compat, kernels, shallow
    from tailorfx.budget import Budget
    check = kernels.check_triton

    def on_a_gpu_machine(model):   # only check_triton sees a GPU: Dynamo would ask it for CUDA's RNG
        real = torch.cuda.is_available
        torch.cuda.is_available = lambda: True
        try:
            check(model)
        finally:
            torch.cuda.is_available = real
    kernels.check_triton = on_a_gpu_machine
    captured = []

    def kept(*a, **kw):
        captured.append(tailorfx.optimize(*a, **kw))
        return captured[-1]
    model = hf_family("llama", num_layers=17, hidden_size=64, intermediate_size=172, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512)
    ids = torch.randint(0, 512, (1, 256), generator=torch.Generator().manual_seed(0))
    setup = api._setup_for(model, None, None)
    with shallow.prediction_model(model.config, setup.param_dtype, shallow=True, sites=2) as (fake, _):
        whole = shallow.capture_step(tailorfx.optimize, fake, ["kernels"], 256, 1, setup=setup, kernels="triton",
                                     lowering="eager").predict_memory().peak_bytes
    budget, opts = api.pass_options(budget=Budget.parse(int(0.75 * whole)), setup=setup, kernels="triton")
    hint = shallow.shallow_hint(model, budget, setup, ((), {"input_ids": ids, "labels": ids}), opts, "eager", kept)
    opt = captured[-1] if captured else None
    print(json.dumps({
        "hint": hint._asdict() if hint else None,
        "passes": list(opt.plan[0].passes) if opt else None,
        "budget": budget.bytes, "unrewritten_peak": whole,
        "fake": opt is not None and all(isinstance(p, compat.FakeTensor) for p in opt.model.parameters()),
        "launches": sorted(opt.kernel_launches()) if opt else [],
    }))


if __name__ == "__main__":
    main()
