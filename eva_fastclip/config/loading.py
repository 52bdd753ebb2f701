"""Loading an experiment config: read the JSON file, apply ``--set`` overrides, build the sections.

Building is strict: an unknown key is named with the closest known one, a value of the wrong type with
its key; the sections (config/sections.py) then validate the values themselves.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from pathlib import Path
from typing import Any

from .run_sections import ExperimentConfig
from .sections import ConfigError

#: a config's record of how `eva-fastclip tune` chose its layout: kept in the file, not a setting
TUNED_SECTION = "tuned"


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> ExperimentConfig:
    """Read a JSON experiment config (or the defaults), apply ``key.sub=value`` overrides, validate."""
    return config_from_raw(read_raw_config(path, overrides))


def config_from_raw(raw: dict[str, Any]) -> ExperimentConfig:
    """Validate a raw config (``read_raw_config``'s), leaving its ``tuned`` record aside."""
    return from_dict(ExperimentConfig, {k: v for k, v in raw.items() if k != TUNED_SECTION}, prefix="")


def read_raw_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The config file's JSON object with the overrides applied, not yet validated."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except json.JSONDecodeError as err:
            raise ConfigError(f"config file {path} is not valid JSON: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a JSON object at the top level")
    for item in overrides:
        _apply_override(raw, item)
    return raw


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {item!r} must look like section.key=value, e.g. train.batch_size=32")
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text  # bare strings need no quotes on the command line
    node = raw
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item!r}: {part!r} is not a section")
    node[leaf] = value


def from_dict(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    """Build dataclass ``cls`` from ``raw``, rejecting unknown keys and wrong types with the key named."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a JSON object, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {prefix + close[0]!r}?)" if close else f"; known keys: {', '.join(names)}"
            raise ConfigError(f"unknown config key {prefix + key!r}{hint}")
        kwargs[key] = _coerce(hints[key], value, prefix + key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as err:  # a required field is missing
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {err}") from None


def _coerce(hint: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, prefix=key + ".")
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(option, value, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0])
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"config key {key!r} must be a list, got {value!r}")
        (item_hint,) = typing.get_args(hint)
        return [_coerce(item_hint, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        # JSON's NaN / Infinity parse, and every comparison with NaN is False: no range check catches it
        raise ConfigError(f"config key {key!r} must be a finite number, got {value!r}")
    if hint in (int, float, str, bool) and not (isinstance(value, hint) and not _is_fake_int(hint, value)):
        raise ConfigError(f"config key {key!r} must be {hint.__name__}, got {value!r}")
    return value


def _is_fake_int(hint: type, value: Any) -> bool:
    # bool is a subclass of int in Python, but `"batch_size": true` is a mistake, not a number
    return hint is int and isinstance(value, bool)
