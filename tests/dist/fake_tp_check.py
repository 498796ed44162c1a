"""tp=2 in ONE process, on torch's fake process group (its collectives return their input): each
rank's allocator peak for one step against opt.predict_memory(), larger and more finely chunked
than the gloo runs afford (a fake collective's output is the same size as gloo's). Run as
`python fake_tp_check.py OUT FAMILY TOKENS CHUNKS PASSES[,PASSES...] [nocache] [untied]` (PASSES: "+"-joined,
"-" for none; nocache: the model's config says use_cache=False; untied: its head has a weight of its own, split
over the vocabulary); writes OUT (JSON, one row per PASSES)."""
import json
import os
import sys

os.environ.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]
import torch  # noqa: E402

import tailorfx  # noqa: E402
from tailorfx import compat  # noqa: E402
from models import hf_family  # noqa: E402
from results import measured_and_predicted  # noqa: E402


def main(out: str, family: str, tokens: int, chunks: int, runs: str, nocache: bool = False,
         untied: bool = False) -> None:
    torch.set_num_threads(1)
    compat.init_fake_process_group(2)
    rows = []
    for spec in runs.split(","):
        passes = [] if spec == "-" else spec.split("+")
        torch.manual_seed(0)
        model = hf_family(family, vocab_size=2048, **({"tie_word_embeddings": False} if untied else {}))
        if nocache:
            model.config.use_cache = False
        ids = torch.randint(0, 2048, (2, tokens), generator=torch.Generator().manual_seed(1))
        opt = tailorfx.optimize(model, example_inputs=dict(input_ids=ids, labels=ids), passes=passes,
                                parallel=dict(tp=2), minisequence_chunks=chunks if "minisequence" in passes else None)

        def step():
            out = opt(input_ids=ids, labels=ids)
            out.loss.backward()
        step()
        measured, predicted = measured_and_predicted(opt, model, step)
        rows.append({"passes": passes, "measured": measured[0], "predicted": predicted, "report": str(opt.report())})
    with open(out, "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    flags = set(sys.argv[6:])
    assert flags <= {"nocache", "untied"}, flags
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], "nocache" in flags, "untied" in flags)
