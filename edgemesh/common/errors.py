"""One exception hierarchy for EdgeMesh; convert at the boundary (``raise WireError(...) from exc``)."""

from __future__ import annotations


class EdgeMeshError(Exception):
    """Base of every error EdgeMesh raises on purpose."""


class ConfigError(EdgeMeshError):
    """A configuration file, environment variable or flag is invalid."""


class WireError(EdgeMeshError):
    """A payload could not be decoded or failed validation.

    ``reason`` is a short, low-cardinality label used for the ``rejected_total`` metrics
    (``malformed``, ``oversized``, ``version``, ``kind``, ``field``, ``shape``, ``nan``, ...).
    """

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


class CodecError(WireError):
    """A codec payload is truncated or inconsistent."""

    def __init__(self, message: str, reason: str = "codec") -> None:
        super().__init__(message, reason)


class BusError(EdgeMeshError):
    """The MQTT connection could not be established or was lost for good."""


class BrokerError(EdgeMeshError):
    """An embedded or spawned broker could not be started."""


class DataError(EdgeMeshError):
    """A data set is missing, truncated or in the wrong format."""


class ModelError(EdgeMeshError):
    """A model spec is unknown or parameters do not match it."""


class CheckpointError(EdgeMeshError):
    """A checkpoint or write-ahead log is unreadable or belongs to another model."""


class JobError(EdgeMeshError):
    """A job file (or a submitted job) is invalid; ``problems`` names each thing wrong, by its key."""

    def __init__(self, origin: str, problems: list[str]) -> None:
        self.origin = origin
        self.problems = list(problems)
        super().__init__(f"{origin}: " + "; ".join(self.problems))


class ExportError(EdgeMeshError):
    """A model could not be exported or its export (model file, model card) cannot be read back."""
