"""Pass protocol, the verifier, and per-pass records for inspection; what every pass shares:
annotate() for the nodes it creates, own() for what its graph needs at run time. The registry of
passes and the pass manager that runs them are tailorfx.passes'."""
from __future__ import annotations

import difflib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch.fx as fx

from tailorfx import compat
from tailorfx.errors import failure_site
from tailorfx.rewrite.capture import OWNED, SeqInfo, cast_value, clone, node_value, own, owned  # noqa: F401  (re-exported)
from tailorfx.rewrite.capture import autocast_state, under_autocast
from tailorfx.rewrite.regions import RegionMap

PASS_META = "tailorfx_pass"   # node.meta key: the pass that created the node


@dataclass(frozen=True)
class PassResult:
    """What a pass returns: the (new) graph, whether it changed, and what it did."""
    gm: fx.GraphModule
    changed: bool
    stats: dict = field(default_factory=dict)
    touched: tuple[str, ...] = ()     # region paths rewritten
    skipped: tuple[str, ...] = ()     # "path: reason" for regions left as they were


@dataclass
class PassContext:
    """Everything a pass may read. Passes read nothing else (no globals, no environment)."""
    regions: RegionMap
    seq: SeqInfo
    options: dict = field(default_factory=dict)
    graph_index: int = 0
    pipeline: tuple[str, ...] = ()   # the passes of this run, in order (a pass may plan for later ones)
    # the caller's memo for what passes derive from a graph alone (costs keyed by region content);
    # dataclasses.replace keeps the same dict, so every pass of a run and every plan sharing this
    # context reuse it
    memo: dict = field(default_factory=dict)


class Pass(Protocol):
    name: str
    after: tuple[str, ...]

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult: ...


class LazyPeak:
    """A graph's predicted peak, computed when first read: a prediction traces the step with
    AOTAutograd (seconds), and only the report and a budget check read it."""

    def __init__(self, predict: Callable[[fx.GraphModule], int], gm: fx.GraphModule):
        self._predict, self._gm = predict, gm
        self._autocast = autocast_state()   # read later (the report), traced as it was captured
        self._value: Optional[int] = None
        self._done = False

    def get(self) -> Optional[int]:
        """The peak; None, with a warning, when the graph cannot be predicted."""
        if not self._done:
            self._done = True
            try:
                with under_autocast(self._autocast):
                    self._value = self._predict(self._gm)
            except Exception as e:   # the report shows "-" for it; predict_memory() raises its own error
                warnings.warn(f"cannot predict the peak of a rewritten graph: {type(e).__name__}: {e}{failure_site(e)}")
        return self._value


def peak_of(lazy: Optional[LazyPeak]) -> Optional[int]:
    """A lazy peak's value; None without one (predictions off)."""
    return lazy.get() if lazy is not None else None


@dataclass
class PassRecord:
    """One pass over one graph, kept for opt.report(), opt.graphs and opt.diff()."""
    name: str
    graph_index: int
    before: str
    after: str
    changed: bool
    touched: tuple[str, ...]
    skipped: tuple[str, ...]
    stats: dict
    before_peak: Optional[LazyPeak]
    after_peak: Optional[LazyPeak]
    seconds: float
    gm: Optional[fx.GraphModule] = None

    @property
    def peak_before(self) -> Optional[int]:
        """Predicted peak of the graph this pass was given (None: predictions off)."""
        return peak_of(self.before_peak)

    @property
    def peak_after(self) -> Optional[int]:
        """... of the graph it left."""
        return peak_of(self.after_peak)

    def diff(self) -> str:
        lines = difflib.unified_diff(self.before.splitlines(), self.after.splitlines(),
                                     f"before {self.name}", f"after {self.name}", lineterm="", n=1)
        return "\n".join(lines)


def annotate(node: fx.Node, like: Optional[fx.Node] = None, val: Any = None, *, pass_name: str) -> fx.Node:
    """Stamp a node a pass created: its fake value (`val`, else `like`'s), `like`'s module stack,
    and the pass's name (provenance, which verify checks)."""
    if val is not None or like is not None:
        v = node_value(like) if val is None else val
        node.meta["val"] = node.meta["example_value"] = v
    if like is not None and "nn_module_stack" in like.meta:
        node.meta["nn_module_stack"] = like.meta["nn_module_stack"]
    node.meta[PASS_META] = pass_name
    return node


def insert_cast(gm: fx.GraphModule, n: fx.Node, dtype, before: fx.Node, *, pass_name: str) -> fx.Node:
    """`n.to(dtype)` inserted before `before`, stamped with its fake value and n's module stack."""
    with gm.graph.inserting_before(before):
        cast = gm.graph.call_method("to", (n, dtype))
    return annotate(cast, n, val=cast_value(node_value(n), dtype), pass_name=pass_name)


def run_pass(p: Pass, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """One pass alone, as the PassManager runs it: on a copy of `gm`, recompiled if it changed."""
    res = p.run(clone(gm), ctx)
    if res.changed:
        res.gm.recompile()
    return res


class VerifyError(AssertionError):
    """A graph broke an invariant that every pass must keep."""


def verify(gm: fx.GraphModule) -> None:
    """Check a graph is well formed and carries the metadata later stages rely on.

    - fx lint passes (topological order, no dangling uses, one output);
    - every computing node whose result is used has a fake value in meta["val"] or
      meta["example_value"] (but an autocast block's entry, whose value is its context);
    - every node a pass created names that pass in meta["tailorfx_pass"] (a non-empty str).
    """
    try:
        gm.graph.lint()
    except Exception as e:  # fx raises RuntimeError with a precise message
        raise VerifyError(f"graph lint failed: {e}") from e
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method", "call_module") and n.users and \
                node_value(n) is None and not compat.is_autocast_context(n.target):
            raise VerifyError(f"node {n.name} ({n.op} {n.target}) has no fake value in meta['val']")
        if PASS_META in n.meta and not (isinstance(n.meta[PASS_META], str) and n.meta[PASS_META]):
            raise VerifyError(f"node {n.name} has an empty or non-string meta['{PASS_META}']")
