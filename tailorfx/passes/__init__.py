"""One module (or package, with its helpers) per rewrite; each is pure: (GraphModule, ctx) -> PassResult.

REGISTRY maps the names users pass to `optimize(passes=[...])` to pass factories; a factory takes
the options dict and returns a Pass.
"""
from __future__ import annotations

from typing import Callable

REGISTRY: dict[str, Callable] = {}


def register(name: str):
    def deco(factory):
        REGISTRY[name] = factory
        return factory
    return deco


def available() -> list[str]:
    _load()
    return sorted(REGISTRY)


def _load() -> None:
    """Import the pass modules so they register themselves."""
    import importlib
    for mod in ("attention", "kernels", "minisequence", "precision", "recompute"):
        try:
            importlib.import_module(f"tailorfx.passes.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"tailorfx.passes.{mod}":
                raise


def make(name: str, options: dict):
    _load()
    if name not in REGISTRY:
        raise ValueError(f"unknown pass {name!r}; available passes: {', '.join(available()) or 'none'}")
    return REGISTRY[name](options)
