"""A model named on the command line: a transformers model type with field overrides, a local
config.json (or the directory holding one), or `module:factory`.

    load_config("llama", ["hidden_size=4096", "num_hidden_layers=32"])   # AutoConfig.for_model
    load_config("path/to/config.json")                                   # a local file, no download
    load_config("mypkg.models:small_llama")                              # a zero-argument factory

Override values are read as int, float, bool (true/false), none, or else kept as text.
Nothing is downloaded.
"""
from __future__ import annotations

import difflib
import importlib
import json
import os
from typing import Any, Sequence


def parse_value(text: str) -> Any:
    """'4096' -> 4096, '1e-5' -> 1e-05, 'true' -> True, 'none' -> None; anything else as text."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """['hidden_size=4096', ...] -> {'hidden_size': 4096, ...}; ValueError naming a malformed item."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not key.strip().isidentifier():
            raise ValueError(f"config override {item!r} is not KEY=VALUE (e.g. hidden_size=4096)")
        out[key.strip()] = parse_value(value)
    return out


def load_config(spec: str, overrides: Sequence[str] = ()) -> Any:
    """A Hugging Face config (or a factory's result) for `spec`; ValueError with the reason when
    it names nothing loadable (an unknown model type, a missing file, a bad override)."""
    fields = parse_overrides(overrides)
    if os.path.isdir(spec) or spec.endswith(".json") or os.sep in spec:
        return _from_file(spec, fields)
    if ":" in spec:
        return _from_factory(spec, fields)
    return _from_type(spec, fields)


def _from_type(model_type: str, fields: dict) -> Any:
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if model_type not in CONFIG_MAPPING:
        near = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=3)
        hint = (f"did you mean {', '.join(near)}?" if near else
                "a transformers model type such as llama, qwen2, mistral,")
        raise ValueError(f"unknown model type {model_type!r}: {hint} or a path to a config.json, or module:factory")
    default = AutoConfig.for_model(model_type)
    known = set(default.to_dict()) | {k for k in dir(default) if not k.startswith("_")}
    config = AutoConfig.for_model(model_type, **fields)
    for key in fields:
        # a field the config does not know is kept as a stray attribute (a typo); one it converts
        # (rope_theta into rope_parameters) is consumed
        if key not in known and key in vars(config):
            near = difflib.get_close_matches(key, sorted(k for k in default.to_dict()), n=3)
            raise ValueError(f"{model_type} config has no field {key!r}"
                             + (f"; did you mean {', '.join(near)}?" if near else ""))
    return config


def _from_file(path: str, fields: dict) -> Any:
    from transformers import AutoConfig
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"no config file at {file!r}")
    try:
        with open(file) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {file!r} as JSON: {e}") from None
    model_type = data.pop("model_type", None) if isinstance(data, dict) else None
    if not model_type:
        raise ValueError(f"{file!r} has no model_type: it is not a transformers config.json")
    return AutoConfig.for_model(model_type, **{**data, **fields})


def _from_factory(spec: str, fields: dict) -> Any:
    module, _, name = spec.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"cannot import {module!r} for {spec!r}: {e}") from None
    factory = getattr(mod, name, None)
    if not callable(factory):
        raise ValueError(f"{module!r} has no callable {name!r}")
    if fields:     # overrides become the factory's keyword arguments
        return lambda: factory(**fields)
    return factory
