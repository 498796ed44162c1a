"""The errors tailorfx raises on purpose, in the lowest layer so any module may raise them."""
from __future__ import annotations


class BudgetError(ValueError):
    """A budget no plan can meet; says the smallest peak reachable (`smallest_bytes`), the budget
    that the planner accepts for it (`suggested_bytes`: that peak plus its headroom) and what
    dominates it."""

    def __init__(self, message: str, smallest_bytes: int = 0, dominant: str = "", suggested_bytes: int = 0):
        super().__init__(message)
        self.smallest_bytes = smallest_bytes
        self.suggested_bytes = suggested_bytes or smallest_bytes
        self.dominant = dominant


class PredictionError(RuntimeError):
    """The memory model cannot predict this step (not all of it was captured, or a graph's sizes
    do not follow the sequence length); the message says which and how to fix it."""


def failure_site(e: BaseException) -> str:
    """Where a failed trace stopped in the model's code or a library's (the innermost frame of the
    traceback in neither torch nor tailorfx), and, when it read a tensor's values, that no trace
    can follow that; '' when every frame is torch's or tailorfx's."""
    import pathlib
    import traceback

    import torch
    ours = (str(pathlib.Path(torch.nn.__file__).parents[1]), str(pathlib.Path(__file__).parent))
    site = next((f for f in reversed(traceback.extract_tb(e.__traceback__)) if not f.filename.startswith(ours)), None)
    if site is None:
        return ""
    where = f" at {site.filename.split('site-packages/')[-1]}:{site.lineno} ({site.name})"
    if type(e).__name__ in ("DataDependentOutputException", "GuardOnDataDependentSymNode"):
        where += ", which reads a tensor's values (.item(), .tolist()): no trace can follow it"
    return where
