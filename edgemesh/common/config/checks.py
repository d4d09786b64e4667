"""What every section's ``__post_init__`` checks with."""

from __future__ import annotations

from edgemesh.common.errors import ConfigError


def require(ok: bool, key: str, message: str) -> None:
    """Refuse the setting ``key`` with ``message`` (a ``ConfigError`` naming it) unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}: {message}")
