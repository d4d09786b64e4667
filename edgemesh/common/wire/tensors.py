"""A tensor on the wire: dtype name, shape and raw little-endian bytes, never pickle (docs/wire.md).

Messages hold ``Tensor`` fields; the wire decoder calls ``validate`` on each one it builds.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from edgemesh.common.errors import WireError

MAX_TENSOR_DIMS = 8
TENSOR_DTYPES = ("float32", "float16", "float64", "int64", "int32", "int8", "uint8", "bool")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Tensor:
    """A tensor on the wire: dtype name, shape and raw little-endian bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> Tensor:
        arr = np.asarray(array, order="C")  # unlike ascontiguousarray, keeps a 0-d shape ()
        name = arr.dtype.name
        if name not in TENSOR_DTYPES:
            raise WireError(f"dtype {name} cannot travel on the wire", "dtype")
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        return cls(dtype=name, shape=tuple(int(d) for d in arr.shape), data=arr.tobytes())

    def to_numpy(self) -> np.ndarray:
        """A read-only view of the bytes (copy it before writing)."""
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype).newbyteorder("<")).reshape(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def validate(self) -> None:
        if self.dtype not in TENSOR_DTYPES:
            raise WireError(f"tensor dtype {self.dtype!r} not allowed", "dtype")
        if len(self.shape) > MAX_TENSOR_DIMS or any(d < 0 for d in self.shape):
            raise WireError(f"tensor shape {self.shape} invalid", "shape")
        expected = self.numel * np.dtype(self.dtype).itemsize
        if len(self.data) != expected:
            raise WireError(
                f"tensor of dtype {self.dtype} and shape {self.shape} needs {expected} bytes, got {len(self.data)}",
                "shape",
            )
        if self.dtype.startswith("float") and not np.isfinite(self.to_numpy()).all():
            raise WireError("tensor holds NaN or Inf", "nan")
