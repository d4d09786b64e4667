"""Loading the configuration, in exactly one function: ``load_config``.

Precedence: defaults < TOML file < ``EDGEMESH_*`` environment < command-line overrides.
Environment names are ``EDGEMESH_<SECTION>__<FIELD>`` (``EDGEMESH_PS__CHECKPOINT_EVERY=100``,
``EDGEMESH_PS__ADAPTIVE__ALPHA=0.5`` for a nested section) or ``EDGEMESH_<FIELD>`` for top-level
fields (``EDGEMESH_JOB=lab1``). Flags arrive as dotted keys (``ps.adaptive.alpha=0.5``). From text, a
table is a JSON object and a list a JSON list or comma-separated (``models.allowed=acme,lab.nets``). Every
value is validated; problems raise ``ConfigError`` naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from edgemesh.common.config.sections import Config
from edgemesh.common.errors import ConfigError

ENV_PREFIX = "EDGEMESH_"


def _convert(tp: Any, value: Any, key: str) -> Any:
    """Coerce a TOML value or an environment/flag string to the field type (``CONVERTERS``)."""
    converter = CONVERTERS.get(get_origin(tp) or tp)
    if converter is None:
        raise ConfigError(f"{key}: unsupported type {tp!r}")
    return converter(tp, value, key)


def _choice(tp: Any, value: Any, key: str) -> Any:
    choices = get_args(tp)
    if value not in choices:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, choices))}")
    return value


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def _boolean(_: Any, value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in TRUE_WORDS + FALSE_WORDS:
        return value.lower() in TRUE_WORDS
    raise ConfigError(f"{key}: expected true/false, got {value!r}")


def _integer(_: Any, value: Any, key: str) -> int:
    try:
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise ValueError
        return int(value)
    except ValueError:
        raise ConfigError(f"{key}: expected an integer, got {value!r}") from None


def _number(_: Any, value: Any, key: str) -> float:
    try:
        if isinstance(value, bool) or not math.isfinite(number := float(value)):
            raise ValueError
        return number
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected a finite number, got {value!r}") from None


def _string(_: Any, value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


def _list(tp: Any, value: Any, key: str) -> tuple[Any, ...]:
    if isinstance(value, str):  # a JSON list, or comma-separated items
        try:
            value = json.loads(value) if value.lstrip().startswith("[") else \
                [item.strip() for item in value.split(",") if item.strip()]
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{key}: expected a JSON list: {exc}") from None
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{key}: expected a list")
    item_tp = get_args(tp)[0]
    return tuple(_convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value))


def _table(tp: Any, value: Any, key: str) -> dict[str, Any]:
    if isinstance(value, str):  # a JSON object
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{key}: expected a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a table")
    _, val_tp = get_args(tp)
    return {str(k): _convert(val_tp, v, f"{key}.{k}") for k, v in value.items()}


CONVERTERS: dict[Any, Callable[[Any, Any, str], Any]] = {
    Literal: _choice, bool: _boolean, int: _integer, float: _number, str: _string, tuple: _list, dict: _table,
}
"""A field's type (its origin for ``Literal``, ``tuple[...]`` and ``dict[...]``) -> the function that coerces a TOML
value or a string from the environment or a flag to it, naming the key in its ``ConfigError``."""


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(fields)
    if unknown:
        where = prefix.rstrip(".") or "top level"
        raise ConfigError(f"unknown setting(s) {', '.join(sorted(prefix + u for u in unknown))} in {where}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{prefix}{name}: expected a table")
            kwargs[name] = _build(typing.cast(type, tp), value, f"{prefix}{name}.")
        else:
            kwargs[name] = _convert(tp, value, prefix + name)
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{key}: {part} is not a table")
        node = child
    node[parts[-1]] = value


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    sections = {name for name, tp in typing.get_type_hints(Config).items() if dataclasses.is_dataclass(tp)}
    tree: dict[str, Any] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name == ENV_PREFIX + "CONFIG":
            continue
        levels = name[len(ENV_PREFIX):].lower().split("__")
        if len(levels) > 1 and levels[0] not in sections:
            raise ConfigError(f"{name}: unknown section {levels[0]!r}")
        _set_dotted(tree, ".".join(levels), value)
    return tree


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Load the configuration: defaults, then TOML ``path``, then ``EDGEMESH_*``, then ``overrides``.

    ``path`` may also come from ``EDGEMESH_CONFIG``. ``overrides`` maps dotted keys to values.
    """
    env = os.environ if env is None else env
    tree: dict[str, Any] = {}
    path = path or env.get(ENV_PREFIX + "CONFIG") or None
    if path:
        try:
            with open(path, "rb") as fh:
                tree = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found") from None
        except OSError as exc:
            raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
    tree = _merge(tree, _env_overrides(env))
    flag_tree: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        _set_dotted(flag_tree, key, value)
    tree = _merge(tree, flag_tree)
    return typing.cast(Config, _build(Config, tree, ""))


def with_settings(cfg: Config, tree: Mapping[str, Any]) -> Config:
    """``cfg`` with the settings of ``tree`` (nested tables, as in a TOML file) over it, validated as
    ``load_config`` validates (ConfigError names the key)."""
    return typing.cast(Config, _build(Config, _merge(dataclasses.asdict(cfg), tree), ""))


def describe(cfg: Any, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, value, doc) rows of a config, for ``edgemesh config`` and the docs."""
    rows: list[tuple[str, Any, str]] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            rows.extend(describe(value, f"{prefix}{f.name}."))
        else:
            shown = "***" if f.name == "password" and value else value
            rows.append((prefix + f.name, shown, ""))
    return rows


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} to TOML")


def to_toml(cfg: Config) -> str:
    """The whole configuration as TOML that ``load_config`` reads back to an equal Config."""
    return "\n".join(_toml_table(cfg, "")) + "\n"


def _toml_table(table: Any, name: str) -> list[str]:
    """``table``'s keys, then its sub-tables as ``[name.sub]`` (nested sections)."""
    lines = [f"\n[{name}]"] if name else []
    nested: list[str] = []
    for f in dataclasses.fields(table):
        value = getattr(table, f.name)
        if dataclasses.is_dataclass(value):
            nested += _toml_table(value, f"{name}.{f.name}" if name else f.name)
        else:
            lines.append(f"{f.name} = {_toml_value(value)}")
    return lines + nested
