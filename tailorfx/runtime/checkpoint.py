"""What makes training resumable bit for bit: a data cursor that knows its position, the RNG
states (torch, CUDA, python, numpy) as tensors and scalars (so a checkpoint loads with
`torch.load(weights_only=True)`), and atomically written, step-numbered checkpoint files.
Used by `tailorfx.runtime.train.train`."""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

CHECKPOINT_PREFIX = "step_"


# ---- data: a deterministic, resumable source of micro-batches ------------------------------

class Cursor:
    """Hands out micro-batches and can say where it is.

    * an indexable source (a list, or tailorfx.runtime.packing.PackedBatches): batch i is
      `source[i % len(source)]` (cycling epochs); the position is i;
    * an object with `state_dict()`/`load_state_dict()` (e.g. torchdata's StatefulDataLoader):
      iterated, its own state saved and restored;
    * any other iterable: iterated; on resume, the first `position` batches are skipped (so it
      must yield the same batches in the same order every time it is iterated).
    """

    def __init__(self, source: Any):
        self.source = source
        self.position = 0
        self.indexable = hasattr(source, "__getitem__") and hasattr(source, "__len__") \
            and not isinstance(source, Mapping)
        self.stateful = not self.indexable and hasattr(source, "state_dict") and hasattr(source, "load_state_dict")
        self._it = None
        if self.indexable and len(source) == 0:
            raise ValueError("the data source is empty")

    def next(self) -> Mapping[str, Any]:
        if self.indexable:
            item = self.source[self.position % len(self.source)]
        else:
            if self._it is None:
                self._it = iter(self.source)
            try:
                item = next(self._it)
            except StopIteration:
                raise ValueError(f"the data source ran out after {self.position} batches") from None
        self.position += 1
        return item

    def state_dict(self) -> dict:
        state = {"position": self.position}
        if self.stateful:
            state["source"] = self.source.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        if self.stateful:
            self.source.load_state_dict(state["source"])
        elif not self.indexable:
            self._it = iter(self.source)
            for i in range(self.position):
                try:
                    next(self._it)
                except StopIteration:
                    raise ValueError(f"cannot resume at batch {self.position}: the data source has {i}") from None


# ---- RNG and checkpoint files -----------------------------------------------------------------

def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:   # pragma: no cover - numpy ships with torch's wheels
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    # as tensors and python scalars, so the file loads with torch.load(weights_only=True)
    state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def _as_tuples(x):
    return tuple(_as_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np
        np.random.seed(seed)
    except ImportError:   # pragma: no cover
        pass


def checkpoint_path(checkpoint_dir: Union[str, os.PathLike], step: int) -> Path:
    return Path(checkpoint_dir) / f"{CHECKPOINT_PREFIX}{step:08d}.pt"


def latest_checkpoint(checkpoint_dir: Union[str, os.PathLike]) -> Optional[Path]:
    """The checkpoint of the highest step in `checkpoint_dir`, or None."""
    d = Path(checkpoint_dir)
    if not d.is_dir():
        return None
    found = sorted(p for p in d.glob(f"{CHECKPOINT_PREFIX}*.pt") if p.stem[len(CHECKPOINT_PREFIX):].isdigit())
    return found[-1] if found else None


def atomic_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
