"""Run under torchrun: optimize(parallel=...) on a tiny HF model equals one process.

Every rank builds the same model (same seed), computes the single-process loss and gradients on
the whole batch, then the parallel run; it writes one JSON file per rank and model to
$TAILORFX_RESULTS (results.write), and exits 1 if loss or any gradient differs (fp32, rtol 1e-4)."""
import itertools
import os
import sys
import weakref

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tailorfx  # noqa: E402
from models import hf_family  # noqa: E402
from results import grad_mismatches, leave, steps_unseen_and_predicted, write  # noqa: E402


def main(run: str, tp: int, dp: int) -> int:
    spec, *flags = run.split(":")     # "llama:loss_parallel": DTensor's loss on the logits shard
    vocab_loss = "loss_parallel" if "loss_parallel" in flags else ""
    memory = "nomem" not in flags     # ":nomem": no memory measured and predicted (a prediction is a capture)
    # ":recompute": each block checkpointed; ":ms": the head fused with its loss, the MLPs in chunks
    passes = [p for f, p in (("ms", "minisequence"), ("recompute", "recompute")) if f in flags] or None
    vocab = next((int(f[1:]) for f in flags if f[:1] == "v" and f[1:].isdigit()), 2048)   # ":v8192": that vocabulary
    # ":s96": rows of 96 tokens (a static graph's MLP is chunked where no other dim has the sequence's size:
    # the models' intermediate size is 128)
    tokens = next((int(f[1:]) for f in flags if f[:1] == "s" and f[1:].isdigit()), 128)
    # ":l4": that many blocks (under recompute a rank keeps one block's activations and every block's input)
    layers = next((int(f[1:]) for f in flags if f[:1] == "l" and f[1:].isdigit()), 2)
    # ":h256": that hidden size
    hidden = next((int(f[1:]) for f in flags if f[:1] == "h" and f[1:].isdigit()), None)
    family, _, sp = spec.partition("+")
    family, untied = family.removesuffix("-untied"), family.endswith("-untied")   # "gemma2-untied": its own head
    kw = dict(vocab_size=vocab, num_layers=layers, **({"tie_word_embeddings": False} if untied else {}),
              **({"hidden_size": hidden} if hidden else {}))
    torch.manual_seed(0)
    ref = hf_family(family, **kw)
    model = hf_family(family, **kw)
    ids = torch.randint(0, vocab, (2 * dp, tokens), generator=torch.Generator().manual_seed(1))
    out = ref(input_ids=ids, labels=ids)
    out.loss.backward()
    rank = int(os.environ["RANK"])
    # data parallel: each dp rank takes its rows (its example: the per-rank prediction is at their
    # shape); FSDP averages the gradients over dp
    rows = ids.chunk(dp)[rank // tp] if dp > 1 else ids
    layout = dict(tp=tp, dp=dp, sp=sp or None, vocab_loss=vocab_loss or "fused")
    # the layout's predicted peak without rewrites (no optimizer state), against which rewrites are
    # measured, read before the model is sharded; ":budget60": planned under 60% of it
    plain = _peak(model, layout, rows, []) if {"ms", "recompute", "budget60"} & set(flags) else None
    budget = int(0.6 * plain) if "budget60" in flags else None
    opt = tailorfx.optimize(model, example_inputs=dict(input_ids=rows, labels=rows), passes=passes,
                            parallel=layout, budget=budget, optimizer=None if budget else "adamw",
                            minisequence_chunks=2 if "ms" in flags else None)
    # whether the head's own output (before a soft-cap or scale) is still held when the loss runs
    head_out, held_at_loss, logits_none = [], [], []
    hook = model.lm_head.register_forward_hook(lambda m, a, o: head_out.append(weakref.ref(o)))
    head = opt.session.parallel.runtime.head
    fused = head.fused if head is not None else None
    if fused is not None:
        def checked(*args, **kwargs):
            held_at_loss.append(head_out[-1]() is not None)
            return fused(*args, **kwargs)
        model.loss_function = checked
    for _ in range(2):     # twice: the second step must not see state the first one left
        for p in model.parameters():
            p.grad = None
        step = opt(input_ids=rows, labels=rows)
        logits_none.append(step.logits is None)
        loss = step.loss
        del step
        loss.backward()
    hook.remove()
    if fused is not None:
        model.loss_function = fused
    full_loss = loss.detach()
    full_loss = full_loss.full_tensor() if hasattr(full_loss, "full_tensor") else full_loss.clone()
    if dp > 1:
        dist.all_reduce(full_loss)     # tp ranks hold the same loss: the mean over the world is over dp
        full_loss /= dist.get_world_size()
    def fwd_bwd():
        out = opt(input_ids=rows, labels=rows)
        out.loss.backward()
        return out
    # this rank's forward+backward peak: the memory model against the allocator, the least of several
    # steps (runtime.measure.measure_peak: where gloo's worker thread drops an all-reduce's tensor
    # last, the profiler never sees that free and the step reads high), and each step's bytes freed
    # unseen (results.steps_unseen_and_predicted), which bound its true peak from below
    repeats = 6 if {"ms", "recompute", "budget60"} & set(flags) else 5 if (tp > 1 and dp > 1) or sp else 3
    steps, unseen, predicted = (steps_unseen_and_predicted(opt, model, fwd_bwd, repeats=repeats)
                                if memory else ([], [], None))
    measured = min(steps) if steps else None
    bad = grad_mismatches(opt.named_parameters(), ref)
    num_params = len(list(opt.named_parameters()))
    sharded = sum(1 for _, p in opt.named_parameters() if hasattr(p, "full_tensor"))
    ok = (torch.allclose(full_loss, out.loss.detach(), rtol=1e-4) and not bad
          and num_params == len(list(ref.parameters())))
    write({"rank": rank, "family": family, "ok": bool(ok), "loss": float(full_loss),
           "eager_loss": float(out.loss.detach()), "sharded_params": sharded, "num_params": num_params,
           "predicted": predicted, "measured": measured, "measured_steps": steps, "unseen": unseen, "bad": bad, "styles": opt.session.parallel.report.styles, "sp": sp, "head": dict(opt.session.parallel.report.describe()).get("lm_head", ""),
           "head_output_held_at_loss": held_at_loss, "logits_none": logits_none, "fused_calls": fused.fused if fused else 0, "unfused_calls": fused.unfused if fused else 0,
           "checkpointed": [b for b, what in opt.session.parallel.report.describe() if what.startswith("recompute:")],
           "budget": budget, "rewrites": list(opt.session.parallel.report.passes),
           "plain_peak": plain,
           # one block's gathered parameters: what gloo was measured holding past FSDP2's free
           "block_bytes": sum(p.nbytes for p in ref.model.layers[0].parameters()),
           "rewritten": [f"{where}: {what}" for where, what in opt.session.parallel.report.describe()
                         if what.startswith("minisequence:")],
           "resident": sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters())}, run)
    return 0 if ok else 1


def _peak(model, layout: dict, rows: torch.Tensor, passes: list) -> int:
    """The layout's predicted peak per rank with `passes` (no optimizer state: this script takes
    no optimizer step); under tp sharded on a mesh of this world's tp ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from tailorfx.parallel import predict_rank_memory
    from tailorfx.setup import resolve
    mesh = None
    if layout["tp"] > 1:     # every rank makes it (new process groups), in the same order
        k = next(_MESHES)
        mesh = init_device_mesh("cpu", (layout["dp"], layout["tp"]), mesh_dim_names=(f"dp{k}", f"tp{k}"))[f"tp{k}"]
    return predict_rank_memory(model, passes=passes, **layout, seq_len=rows.shape[1], batch_size=rows.shape[0],
                               setup=resolve(None, param_dtype=torch.float32, optimizer=None), _mesh=mesh).peak_bytes


_MESHES = itertools.count()


if __name__ == "__main__":     # parallel_check.py TP DP FAMILY[-untied][+SP][:loss_parallel][:nomem][:recompute][:ms][:budget60][:vN][:sN][:lN][:hN] ...: one launch, several models
    failed = sum(main(f, int(sys.argv[1]), int(sys.argv[2])) for f in sys.argv[3:])
    leave(1 if failed else 0)
