"""Name -> model module lookup, imported lazily so one missing or broken builder does not break the others."""

from __future__ import annotations

import dataclasses
import importlib
import typing
from types import ModuleType

import onnx

MODEL_NAMES = ("bert", "lstm", "gru", "bilstm", "resnext", "efficientnet", "swin", "mmoe", "sbert")


def load_module(name: str) -> ModuleType:
    """The module models.<name>; it provides Config, PAPER, TINY and build(config, seed)."""
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODEL_NAMES)}")
    module_name = f"models.{name}"
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:  # a dependency of the module is missing, not the module itself
            raise
        raise ModuleNotFoundError(f"model {name!r} has no builder yet ({module_name} does not exist)",
                                  name=module_name) from None


def build_model(name: str, tiny: bool = False, seed: int = 0, **overrides) -> onnx.ModelProto:
    """Build from the paper (or tiny) configuration with the given fields replaced."""
    module = load_module(name)
    base = module.TINY if tiny else module.PAPER
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"{name} has no config field(s) {', '.join(unknown)}; fields: {', '.join(sorted(fields))}")
    return module.build(dataclasses.replace(base, **overrides), seed=seed)


def _int_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def flag_type(hint):
    """How a command-line flag parses a Config field of type `hint` (tuple[int, ...] as "2,2,18,2"), or
    None for fields a flag cannot express (e.g. EfficientNet's stage table), which keep their value."""
    if hint in (int, float, str, bool):
        return hint
    if typing.get_origin(hint) is tuple and typing.get_args(hint) == (int, ...):
        return _int_tuple
    return None
