"""AOTAutograd traces of graph modules, kept for the planner and the memory model: by the module
(a weak key) and by what it computes (graph_key), so that a model planned again (at the budget a
BudgetError suggested, or a copy of it compared with eager) traces each rewritten graph once per
process."""
from __future__ import annotations

import collections
import weakref
from typing import Optional

import torch.fx as fx

from tailorfx.rewrite import memory, trace
from tailorfx.rewrite.graph_key import graph_key
from tailorfx.setup import TrainingSetup


def traced_step(gm: fx.GraphModule, partition: str, setup: Optional[TrainingSetup],
                static: bool = False) -> memory.StepGraphs:
    """memory.trace_step, kept while the graph module lives (a weak key): its sizes are symbolic in
    the sequence length, so one AOTAutograd trace serves every length (max_seq_len bisects on it).
    `static`: one at the captured length serves (a symbolic trace, if kept, is used; else one on
    static shapes, trace.captured_inputs). Keyed also by the code the module runs, so a graph
    rewritten in place is traced again; a module not traced before takes the trace of one with its
    key (rewrite/graph_key.py), as when a model is planned again."""
    in_backward = bool(setup is not None and setup.optimizer_in_backward)
    cache = _TRACED.setdefault(gm, {})
    for stale in [k for k in cache if k[2] != gm.code]:   # traces of code the module no longer runs
        del cache[stale]
    kinds = (False, True) if static else (False,)   # (static shapes?): a symbolic trace serves every length
    for kind in kinds:
        if (partition, in_backward, gm.code, kind) in cache:
            return cache[(partition, in_backward, gm.code, kind)]
    # the same trace, the optimizer steps put in its backward (Inductor's code is generated with them in)
    for kind in kinds if in_backward and partition != "inductor" else ():
        if (partition, False, gm.code, kind) in cache:
            step = trace.with_steps_in_backward(cache[(partition, False, gm.code, kind)], gm)
            cache[(partition, True, gm.code, kind)] = step
            return step
    inputs = trace.captured_inputs(gm) if static else None
    step = _by_content(gm, partition, in_backward, inputs, setup)
    cache[(partition, in_backward, gm.code, inputs is not None)] = step
    return step


def _by_content(gm: fx.GraphModule, partition: str, in_backward: bool, inputs: Optional[list],
                setup: Optional[TrainingSetup]) -> memory.StepGraphs:
    """The trace of a module with gm's key (the optimizer steps put in its backward if need be),
    else gm traced and kept under its key. Inductor's trace with the steps is its own (its code is generated with them)."""
    digest = graph_key(gm)
    if digest is None:
        return memory.trace_step(gm, inputs, partition, setup)
    for static in (False, True) if inputs is not None else (False,):   # a symbolic trace serves every length
        for kind in (True, False) if in_backward and partition != "inductor" else (in_backward,):
            if (key := (digest, partition, static, kind)) in _BY_CONTENT:
                _BY_CONTENT.move_to_end(key)
                step = _BY_CONTENT[key]
                return step if kind == in_backward else trace.with_steps_in_backward(step, gm)
    step = memory.trace_step(gm, inputs, partition, setup)
    _BY_CONTENT[(digest, partition, inputs is not None, in_backward)] = step
    while len(_BY_CONTENT) > _BY_CONTENT_SIZE:
        _BY_CONTENT.popitem(last=False)
    return step


def remember_trace(gm: fx.GraphModule, partition: str, steps_in_backward: bool, step: memory.StepGraphs,
                   static: bool = False) -> None:
    """The forward/backward the lowering made of `gm` (what runs), kept as its trace (`static`: captured sizes)."""
    _TRACED.setdefault(gm, {})[(partition, steps_in_backward, gm.code, static)] = step


_TRACED: "weakref.WeakKeyDictionary[fx.GraphModule, dict]" = weakref.WeakKeyDictionary()
# the same traces by what the module computes (rewrite/graph_key.py): a model planned again, the
# least recently used dropped past the size
_BY_CONTENT: "collections.OrderedDict[tuple, memory.StepGraphs]" = collections.OrderedDict()
_BY_CONTENT_SIZE = 16
