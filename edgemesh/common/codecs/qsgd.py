"""``qsgd``: stochastic uniform quantization (Alistarh et al., QSGD, NeurIPS 2017), a dense baseline.

Each value becomes ``sign * scale * level / s`` with ``level`` in ``[0, s]`` drawn so that its
expectation is ``|g| * s / scale``: ``level = floor(|g| * s / scale + u)``, ``u ~ U[0, 1)``.
The decoded tensor is thus an unbiased estimate of ``g``. ``scale`` is ``max |g|`` (the
max-norm variant: always a finite float32, lower variance than the 2-norm) and ``s`` is
``policy.grid_levels`` if > 0, else ``DEFAULT_LEVELS`` (at most ``MAX_LEVELS``).

Payload (little-endian)::

    <f scale> <H s>
    pack_uint(code, 1 + bitlen(s)) per value: code = level << 1 | sign

``s = 15`` costs 5 bits per value (6.4x less than fp32). The codec owns a numpy ``Generator``
(seeded from the OS unless a seed is given), so successive encodes draw fresh noise.
"""

from __future__ import annotations

import struct

import numpy as np

from edgemesh.common.codecs.base import register
from edgemesh.common.codecs.bitpack import (
    PayloadReader,
    pack_uint,
    packed_size,
    set_sign,
    uint_dtype,
    unpack_uint,
)
from edgemesh.common.errors import CodecError
from edgemesh.common.messages import CodecPolicy
from edgemesh.common.vocabulary import CodecName

DEFAULT_LEVELS = 15
"""Quantization levels when the policy gives no ``grid_levels``: 5 bits per value with the sign."""
MAX_LEVELS = 2**15 - 1
"""Most levels: 16 bits per value with the sign."""
MAX_NUMEL = 2**31 - 1
"""Largest tensor qsgd accepts, as the sparse codecs."""

CHUNK = 1 << 16
"""Values quantized at a time (256 KiB of float32 per buffer: stays in L2)."""
FLOAT32_MAX = float(np.finfo(np.float32).max)

HEADER = struct.Struct("<fH")


def qsgd_levels(policy: CodecPolicy | None) -> int:
    levels = 0 if policy is None else int(policy.grid_levels)
    return DEFAULT_LEVELS if levels <= 0 else min(levels, MAX_LEVELS)


class QSGDCodec:
    """Stochastic uniform quantization to ``s`` levels of ``max |g|``, sign kept."""

    name: CodecName = "qsgd"
    lossless = False

    def __init__(self, seed: int | None = None) -> None:
        self._rng = np.random.default_rng(seed)

    def encode(self, grad: np.ndarray, policy: CodecPolicy | None) -> bytes:
        return self._encode(grad, policy)[0]

    def encode_with_residual(self, grad: np.ndarray, policy: CodecPolicy | None) -> tuple[bytes, np.ndarray]:
        """The payload and ``grad - decode(payload)``, without unpacking."""
        data, flat, codes, scale, s = self._encode(grad, policy)
        residual = _dequantize(codes, scale, s)
        np.subtract(flat, residual, out=residual)
        return data, residual

    def _encode(self, grad: np.ndarray,
                policy: CodecPolicy | None) -> tuple[bytes, np.ndarray, np.ndarray, np.float32, int]:
        flat = np.ascontiguousarray(grad, dtype=np.float32).reshape(-1)
        if flat.size > MAX_NUMEL:
            raise CodecError(f"qsgd cannot encode {flat.size} values (at most {MAX_NUMEL})", "oversized")
        s = qsgd_levels(policy)
        width = 1 + s.bit_length()
        scale = np.float32(max(flat.max(), -flat.min())) if flat.size else np.float32(0)
        if not np.isfinite(scale):
            raise CodecError("qsgd cannot encode a gradient holding NaN or Inf", "nan")
        codes = np.zeros(flat.size, dtype=uint_dtype(width))
        if scale > 0:
            self._quantize(flat, scale, s, codes)
        else:
            np.signbit(flat, out=codes, casting="unsafe")
        data = HEADER.pack(scale, s) + pack_uint(codes, width).tobytes()
        return data, flat, codes, scale, s

    def _quantize(self, flat: np.ndarray, scale: np.float32, s: int, codes: np.ndarray) -> None:
        """``codes = level << 1 | sign`` with ``level = floor(|g| s / scale + u)``, chunk by chunk in L2."""
        factor = np.float32(s / float(scale)) if s / float(scale) < FLOAT32_MAX else None
        x = np.empty(min(flat.size, CHUNK), dtype=np.float32)
        u = np.empty_like(x)
        for start in range(0, flat.size, CHUNK):
            chunk = flat[start:start + CHUNK]
            xc, uc, out = x[: chunk.size], u[: chunk.size], codes[start:start + CHUNK]
            np.abs(chunk, out=xc)
            if factor is None:  # subnormal scale: s / scale overflows float32
                np.divide(xc, scale, out=xc)
                np.multiply(xc, np.float32(s), out=xc)
            else:
                np.multiply(xc, factor, out=xc)
            self._rng.random(out=uc, dtype=np.float32)
            xc += uc
            np.floor(xc, out=xc)
            np.minimum(xc, np.float32(s), out=xc)
            out[...] = xc
            out <<= 1
            out |= np.signbit(chunk)

    def decode(self, data: bytes, numel: int) -> np.ndarray:
        if not 0 <= numel <= MAX_NUMEL:
            raise CodecError(f"qsgd cannot decode {numel} values", "shape")
        reader = PayloadReader(data, self.name)
        scale, s = reader.unpack(HEADER)
        if not np.isfinite(scale):
            raise reader.error("scale is NaN or Inf", "nan")
        if scale < 0 or not 1 <= int(s) <= MAX_LEVELS:
            raise reader.error(f"scale {scale} or levels {s} out of range")
        width = 1 + int(s).bit_length()
        codes = unpack_uint(reader.take(packed_size(numel, width)), numel, width)
        reader.finish()
        if numel and int(codes.max()) >> 1 > int(s):
            raise reader.error(f"level above {s}")
        return _dequantize(codes, np.float32(scale), int(s))


def _dequantize(codes: np.ndarray, scale: np.float32, s: int) -> np.ndarray:
    """``sign * level * (scale / s)`` of every code ``level << 1 | sign``, chunk by chunk in L2."""
    step = np.float32(float(scale) / s)
    out = np.empty(codes.size, dtype=np.float32)
    level = np.empty(min(codes.size, CHUNK), dtype=codes.dtype)
    for start in range(0, codes.size, CHUNK):
        c, o = codes[start:start + CHUNK], out[start:start + CHUNK]
        lv = level[: c.size]
        np.right_shift(c, 1, out=lv)
        o[...] = lv
        o *= step
        np.bitwise_and(c, 1, out=lv)
        set_sign(o, lv)
    return out


QSGD = register(QSGDCodec())
