"""What the emulation's data files (``profiles.toml``, ``scenarios.toml``) share: reading one, and checking a
table's fields and that every figure names its source."""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from edgemesh.common.errors import ConfigError


def read(path: str | Path | None, builtin: str, what: str) -> tuple[dict[str, Any], str]:
    """The parsed TOML of ``path``, or of the built-in file ``builtin`` beside this module, and its name;
    ConfigError names ``what`` it is and why it cannot be read."""
    try:
        if path:
            text, source = Path(path).read_text(encoding="utf-8"), str(path)
        else:
            text, source = resources.files(__package__).joinpath(builtin).read_text(encoding="utf-8"), builtin
        return tomllib.loads(text), source
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{what} {path or builtin}: {exc}") from None


def sourced(where: str, table: Any, figures: Sequence[str]) -> dict[str, str]:
    """Check that ``table`` gives exactly ``figures`` (besides ``description`` and ``sources``) and a source for
    each; return the sources. ConfigError names ``where`` and the field at fault."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    unknown = set(table) - {*figures, "description", "sources"}
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    missing = [k for k in figures if k not in table]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}")
    sources = table.get("sources", {})
    if not isinstance(sources, dict):
        raise ConfigError(f"{where}.sources must be a table")
    unsourced = [k for k in figures if not (isinstance(sources.get(k), str) and sources[k].strip())]
    if unsourced:
        raise ConfigError(f"{where}: no source noted for {', '.join(unsourced)} (every figure needs one)")
    return {k: str(sources[k]) for k in figures}
