"""What `train()` checkpoints and restores, and its log, kept in step with the checkpoint.

A checkpoint `step_XXXXXXXX.pt` holds the model, optimizer, scheduler and loss-scaler states, the
data position and the RNG states, written atomically, so that a run resumed from it continues bit
for bit; on resume, the JSON-lines log loses its lines past the restored step.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Optional, Union

import torch

from tailorfx.runtime.checkpoint import (
    CHECKPOINT_PREFIX, Cursor, atomic_save, checkpoint_path, latest_checkpoint, rng_state, set_rng_state,
)

LOG = logging.getLogger("tailorfx")


@dataclass
class TrainState:
    """The objects a checkpoint saves and restores, and the settings it records (`config`), which
    a resume with other settings warns about."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Optional[torch.amp.GradScaler]
    cursor: Cursor
    config: dict

    def save(self, checkpoint_dir: Union[str, os.PathLike], step: int, keep_last: Optional[int] = None) -> Path:
        """Write the checkpoint of `step` into `checkpoint_dir`, then delete all but the newest
        `keep_last` there; returns its path."""
        path = checkpoint_path(checkpoint_dir, step)
        atomic_save({"step": step, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                     "scheduler": self.scheduler.state_dict(),
                     "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                     "data": self.cursor.state_dict(), "rng": rng_state(), "config": self.config}, path)
        LOG.info("saved checkpoint %s", path)
        if keep_last is not None:
            old = sorted(Path(checkpoint_dir).glob(f"{CHECKPOINT_PREFIX}*.pt"))[:-keep_last]
            for p in old:
                p.unlink()
        return path

    def restore(self, source: Path) -> int:
        """Load the checkpoint `source` into these objects and the RNGs; returns its step."""
        state = torch.load(source, map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.cursor.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        start = int(state["step"])
        changed = {k: (v, self.config[k]) for k, v in state.get("config", {}).items() if self.config.get(k) != v}
        if changed:
            LOG.warning("resuming %s with changed settings (saved, now): %s", source, changed)
        LOG.info("resumed from %s at step %d (batch %d)", source, start, self.cursor.position)
        return start


def resume_source(resume: Union[bool, str, os.PathLike],
                  checkpoint_dir: Union[str, os.PathLike, None]) -> Optional[Path]:
    """The checkpoint `train(resume=...)` continues from: the latest in `checkpoint_dir` for True,
    the file itself for a path; None to train from scratch (resume=False, or no checkpoint yet)."""
    if not resume:
        return None
    if checkpoint_dir is None and resume is True:
        raise ValueError("resume=True needs checkpoint_dir (or pass resume=<checkpoint file>)")
    source = latest_checkpoint(checkpoint_dir) if resume is True else Path(resume)
    if source is None:
        LOG.info("no checkpoint in %s: training from scratch", checkpoint_dir)
    return source


def open_log(log_path: Union[str, os.PathLike, None], keep_through: Optional[int] = None) -> Optional[IO[str]]:
    """The JSON-lines log opened for writing (None without a path): emptied, or with its lines up
    to step `keep_through` kept when a run resumes from that step."""
    if log_path is None:
        return None
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    kept = []
    if keep_through is not None and log_path.exists():
        for line in log_path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= keep_through:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                continue
    log_file = open(log_path, "w")
    log_file.writelines(kept)
    log_file.flush()
    return log_file
