"""The one way a configuration is built: defaults, then a TOML file, then CLI overrides.

Overrides are `section.field=value` strings (`model.d_model=256`, `net.initial_peers=[...]`); values
are parsed as TOML literals so numbers, booleans, lists and strings all work, and a bare word that is
not valid TOML is taken as a string. Types are checked against the dataclass fields.
"""

from __future__ import annotations

import copy
import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from swarm.config.schema import ConfigError, SwarmConfig


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _coerce(value: Any, annotation: Any, name: str) -> Any:
    """Check `value` against a field's annotation, converting where the intent is unambiguous."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], name)
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        item_types = args if len(args) != 2 or args[1] is not Ellipsis else (args[0],) * len(value)
        if len(item_types) != len(value):
            raise ConfigError(f"{name}: expected {len(item_types)} items, got {len(value)}")
        return tuple(_coerce(v, t, name) for v, t in zip(value, item_types, strict=True))
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is str and not isinstance(value, str):
        return str(value)
    if annotation in (int, float, bool, str) and not isinstance(value, annotation):
        raise ConfigError(f"{name}: expected {annotation.__name__}, got {value!r}")
    if annotation is int and isinstance(value, bool):
        raise ConfigError(f"{name}: expected int, got {value!r}")
    return value


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(values) - set(fields)
    if unknown:
        where = f"section [{prefix.rstrip('.')}]" if prefix else "top level"
        raise ConfigError(f"unknown field(s) {sorted(unknown)} in {where}; known: {sorted(fields)}")
    kwargs = {}
    for name, value in values.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix}{name}: expected a section, got {value!r}")
            kwargs[name] = _build(hint, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, f"{prefix}{name}")
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{prefix or 'config'}: {e}") from e


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *sections, leaf = dotted.split(".")
    node = tree
    for s in sections:
        node = node.setdefault(s, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {s} is not a section")
    node[leaf] = value


def load_config(
    path: str | Path | None = None,
    overrides: typing.Iterable[str] = (),
    base: dict[str, Any] | typing.Sequence[dict[str, Any]] | None = None,
) -> SwarmConfig:
    """Defaults <- `base` (a named recipe, or several, later ones winning) <- TOML file at `path` <-
    `overrides`, validated."""
    tree: dict[str, Any] = {}
    for recipe in [base] if isinstance(base, dict) else base or ():
        _merge(tree, copy.deepcopy(recipe))
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            _merge(tree, tomllib.loads(p.read_text()))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p}: {e}") from e
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        key, raw = item.split("=", 1)
        _set_path(tree, key.strip(), _parse_value(raw.strip()))
    return _build(SwarmConfig, tree, "")


def _merge(tree: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            _merge(tree[key], value)
        else:
            tree[key] = value


def replace(cfg: SwarmConfig, **sections: dict[str, Any]) -> SwarmConfig:
    """A copy of `cfg` with some fields of some sections changed, re-validated."""
    tree = cfg.to_dict()
    for section, values in sections.items():
        if isinstance(values, dict):
            tree[section].update(values)
        else:
            tree[section] = values
    return _build(SwarmConfig, tree, "")


def to_toml(cfg: SwarmConfig) -> str:
    """Render a config as TOML that `load_config` reads back to an equal config."""
    lines: list[str] = []
    top = cfg.to_dict()
    for key, value in top.items():
        if not isinstance(value, dict):
            lines.append(f"{key} = {_toml_literal(value)}")
    for key, value in top.items():
        if isinstance(value, dict):
            lines.append(f"\n[{key}]")
            lines.extend(f"{k} = {_toml_literal(v)}" for k, v in value.items() if v is not None)
    return "\n".join(lines) + "\n"


def _toml_literal(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + "".join(_toml_char(c) for c in v) + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_literal(x) for x in v) + "]"
    raise ConfigError(f"cannot write {v!r} as TOML")


def _toml_char(c: str) -> str:
    """One character of a TOML basic string; control characters are not allowed raw there."""
    if c in '"\\':
        return "\\" + c
    if ord(c) < 0x20 or ord(c) == 0x7F:
        return f"\\u{ord(c):04x}"
    return c
