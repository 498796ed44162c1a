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
