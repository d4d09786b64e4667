"""Range checks the messages' ``validate()`` methods share; each raises ValueError, which the wire
turns into a ``field`` rejection."""

from __future__ import annotations

from edgemesh.common.vocabulary import check_name

__all__ = ["MAX_CLUSTER_MEMBERS", "MAX_DEVICES", "MAX_SHARDS", "check_name", "nonneg"]

MAX_DEVICES = 10_000
MAX_SHARDS = 4096
MAX_CLUSTER_MEMBERS = 256


def nonneg(name: str, value: float) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
