"""The watch that says when a training step ran without tailorfx's graph: a replaced
`forward`, a submodule called directly, or a trainer's own head around the backbone."""
from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

from tailorfx import compat

def describe(fn: Any) -> str:
    """A replaced forward, as a message names it: where its code is (functools.wraps may have
    given it another function's name)."""
    func = getattr(fn, "__func__", fn)
    code = getattr(func, "__code__", None)
    if code is None:
        return type(fn).__qualname__
    return f"{getattr(func, '__globals__', {}).get('__name__', '?')}.{getattr(code, 'co_qualname', code.co_name)}"


class BypassWatch:
    """Says, once, when a training backward accumulated gradients into the model's parameters
    with no training call of a tailorfx graph since the previous backward: a replaced `forward`,
    a submodule called directly, or a trainer's own head around the backbone. It cannot live in
    `forward` (what gets replaced), so it sits on the parameters' post-accumulate-grad hooks.
    Training calls are counted over every optimized module of the process (`calls`), so a module
    a user made and dropped before training another over the same parameters says nothing."""
    calls = 0        # training calls of any OptimizedModule's graphs in this process

    def __init__(self, params, on_bypass: Callable[[], None]):
        self.seen = BypassWatch.calls        # the count at the last backward checked
        self.backward_id: Optional[int] = None
        self.said = False
        self.on_bypass = on_bypass
        me = weakref.ref(self)
        self.handles = [p.register_post_accumulate_grad_hook(lambda p, me=me: _check(me)) for p in params
                        if p.requires_grad]

    @staticmethod
    def ran(training: bool) -> None:
        """A call of a tailorfx graph (counted when it trains: the model in train mode, grads on)."""
        BypassWatch.calls += bool(training)

    def forget_calls(self) -> None:
        """The calls so far are followed by no backward (optimize()'s example call)."""
        self.seen = BypassWatch.calls

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _check(ref: Callable[[], Optional[BypassWatch]]) -> None:
    watch = ref()
    if watch is None:
        return
    pass_id = compat.backward_pass_id()
    if pass_id == watch.backward_id:
        return          # the same backward, already checked
    watch.backward_id = pass_id
    if watch.seen != BypassWatch.calls:
        watch.seen = BypassWatch.calls
    elif not watch.said:
        watch.said = True
        watch.on_bypass()


def bypass_message(replaced: Optional[str]) -> str:
    """What the bypass warning says: what happened and how to wire it."""
    what = (f"model.forward was replaced by {replaced}, which does not call tailorfx's forward"
            if replaced else "the model's parameters got gradients from code that did not call the optimized "
                             "module (a submodule such as opt.model.model called directly, or work outside "
                             "the captured graph)")
    return (f"a training step ran without tailorfx's graph: {what}. Nothing of that step was rewritten, "
            "and budgets and predictions do not cover it. Call the module optimize() returned for the whole "
            "forward (`opt(**batch).loss.backward()`); a trainer's own head goes in front of it only through "
            "what tailorfx serves (TRL's fused_lm_head is served; docs/usage.md lists the wirings)")
