"""The reference codecs: ``none`` (fp32 as is) and ``fp16`` (half precision)."""

from __future__ import annotations

import numpy as np

from edgemesh.common.codecs.base import check_finite, register
from edgemesh.common.errors import CodecError
from edgemesh.common.messages import CodecPolicy
from edgemesh.common.vocabulary import CodecName
from edgemesh.common.wire.half import from_half, to_half

FP16_MAX = float(np.finfo(np.float16).max)


class _Dense:
    def __init__(self, name: CodecName, dtype: type[np.floating], lossless: bool) -> None:
        self.name = name
        self.lossless = lossless
        self._dtype = np.dtype(dtype).newbyteorder("<")

    def encode(self, grad: np.ndarray, policy: CodecPolicy | None) -> bytes:
        flat = np.asarray(grad, dtype=np.float32).reshape(-1)
        if self._dtype.itemsize == 2:  # fast whatever the values (``half``), clipped to float16's range
            return to_half(np.clip(flat, -FP16_MAX, FP16_MAX)).astype(self._dtype, copy=False).tobytes()
        return flat.astype(self._dtype, copy=False).tobytes()  # one copy: float32 is little-endian here

    def decode(self, data: bytes, numel: int) -> np.ndarray:
        expected = numel * self._dtype.itemsize
        if len(data) != expected:
            raise CodecError(f"{self.name} payload has {len(data)} bytes, {numel} values need {expected}")
        # float32 as is: a read-only view of the payload, no copy
        values = np.frombuffer(data, dtype=self._dtype)
        values = from_half(values) if self._dtype.itemsize == 2 else values.astype(np.float32, copy=False)
        return check_finite(values, self.name)


NONE = register(_Dense("none", np.float32, lossless=True))
FP16 = register(_Dense("fp16", np.float16, lossless=False))
