"""Bit-level building blocks of the codec payloads: fixed-width packing, unary streams, a bounds-checked reader.

Everything is vectorized: the only Python loops run over the 8 value slots of a packed row.

Fixed-width layout (``pack_uint``): ``count`` unsigned values of ``width`` bits are stored as
``width // 8`` whole little-endian bytes per value (all values, one after another), then the
remaining ``width % 8`` high bits of every value as an LSB-first bit stream, zero-padded to a
byte. The size is ``packed_size(count, width)`` bytes, exactly ``count * width`` bits rounded up.

Unary layout (``pack_unary``): value ``q`` is ``q`` zero bits then a one bit, LSB-first,
zero-padded to a byte; the stream has no trailing zero byte.
"""

from __future__ import annotations

import struct

import numpy as np

from edgemesh.common.errors import CodecError

MAX_WIDTH = 32
"""Widest value ``pack_uint`` accepts, in bits."""

_GROUP = 64
"""Values per group of the sub-byte part: 64 values of ``r`` bits fill exactly ``r`` uint64 words."""
_CHUNK = 1 << 18
"""Values packed at a time (a multiple of ``_GROUP``), so the temporaries stay in L2."""


def uint_dtype(width: int) -> np.dtype:
    """The smallest little-endian unsigned dtype holding ``width`` bits."""
    for itemsize in (1, 2, 4, 8):
        if width <= 8 * itemsize:
            return np.dtype(f"<u{itemsize}")
    raise ValueError(f"width {width} exceeds 64 bits")


def packed_size(count: int, width: int) -> int:
    """Bytes ``pack_uint`` uses for ``count`` values of ``width`` bits."""
    whole, rem = divmod(width, 8)
    return count * whole + (count * rem + 7) // 8


def pack_uint(values: np.ndarray, width: int) -> np.ndarray:
    """Pack non-negative integers below ``2**width`` into ``packed_size(values.size, width)`` bytes."""
    if not 0 <= width <= MAX_WIDTH:
        raise ValueError(f"width {width} out of [0, {MAX_WIDTH}]")
    count = int(values.size)
    out = np.empty(packed_size(count, width), dtype=np.uint8)
    if count == 0 or width == 0:
        return out
    dtype = uint_dtype(width)
    v = np.ascontiguousarray(values.reshape(-1), dtype=dtype)
    whole, rem = divmod(width, 8)
    if whole:
        out[: count * whole].reshape(count, whole)[...] = v.view(np.uint8).reshape(count, dtype.itemsize)[:, :whole]
    if rem:
        high = v >> (8 * whole) if whole else v
        stream = out[count * whole:]
        for start in range(0, count, _CHUNK):  # chunks of a multiple of 64 values stay in L2
            part = high[start:start + _CHUNK]
            groups = -(-part.size // _GROUP)
            slots = np.zeros(groups * _GROUP, dtype=np.uint8)
            slots[: part.size] = part
            words = _join_words(_gather_lanes(slots.view("<u8"), rem).reshape(groups, 8), rem)
            first = start * rem // 8
            dest = stream[first:first + groups * _GROUP * rem // 8]
            dest[...] = words.view(np.uint8).reshape(-1)[: dest.size]
    return out


def unpack_uint(buf: np.ndarray, count: int, width: int) -> np.ndarray:
    """Inverse of ``pack_uint``; ``buf`` must hold exactly ``packed_size(count, width)`` bytes."""
    if not 0 <= width <= MAX_WIDTH or buf.size != packed_size(count, width):
        raise ValueError("packed buffer does not match count and width")
    dtype = uint_dtype(width)
    if count == 0 or width == 0:
        return np.zeros(count, dtype=dtype)
    whole, rem = divmod(width, 8)
    if whole:
        wide = np.zeros((count, dtype.itemsize), dtype=np.uint8)
        wide[:, :whole] = buf[: count * whole].reshape(count, whole)
        out = wide.view(dtype).reshape(count)
    else:
        out = np.zeros(count, dtype=dtype)
    if rem:
        high = np.empty(count, dtype=np.uint8)
        stream = buf[count * whole:]
        for start in range(0, count, _CHUNK):
            values = min(_CHUNK, count - start)
            groups = -(-values // _GROUP)
            first = start * rem // 8
            part = stream[first:first + groups * _GROUP * rem // 8]
            src = np.zeros(groups * rem * 8, dtype=np.uint8)
            src[: part.size] = part
            words = _split_words(src.view("<u8").reshape(groups, rem), rem)
            high[start:start + values] = _spread_lanes(words.reshape(-1), rem).view(np.uint8)[:values]
        if whole:
            out |= high.astype(dtype) << dtype.type(8 * whole)
        else:
            out = high.astype(dtype, copy=False)
    return out


def _gather_lanes(words: np.ndarray, rem: int) -> np.ndarray:
    """Each uint64 holds 8 values of ``rem`` bits, one per byte; squeeze them to its low ``8 * rem`` bits.

    Three halving steps: byte pairs -> 16-bit lanes of ``2 rem`` bits -> 32-bit lanes -> the word.
    ``words`` is modified in place and returned.
    """
    bits = rem
    upper = np.empty_like(words)
    for lane, low_mask in _LANES:
        np.bitwise_and(words, np.uint64(~low_mask & _ALL), out=upper)
        np.right_shift(upper, np.uint64(lane - bits), out=upper)
        np.bitwise_and(words, np.uint64(low_mask), out=words)
        np.bitwise_or(words, upper, out=words)
        bits *= 2
    return words


def _spread_lanes(words: np.ndarray, rem: int) -> np.ndarray:
    """Inverse of ``_gather_lanes``: the low ``8 * rem`` bits of each uint64 back to one value per byte."""
    upper = np.empty_like(words)
    for lane, low_mask in reversed(_LANES):
        bits = rem * lane // 8  # bits of each half-lane's content
        keep = np.uint64(low_mask & _repeat_low_bits(bits, 2 * lane))
        np.right_shift(words, np.uint64(bits), out=upper)
        np.bitwise_and(upper, keep, out=upper)
        np.left_shift(upper, np.uint64(lane), out=upper)
        np.bitwise_and(words, keep, out=words)
        np.bitwise_or(words, upper, out=words)
    return words


def _join_words(words: np.ndarray, rem: int) -> np.ndarray:
    """(groups, 8) words of ``8 rem`` bits each -> (groups, rem) uint64 words, a continuous LSB-first stream."""
    out = np.zeros((words.shape[0], rem), dtype="<u8")
    for i in range(8):
        q, r = divmod(8 * rem * i, 64)
        out[:, q] |= words[:, i] << np.uint64(r)
        if r + 8 * rem > 64:
            out[:, q + 1] |= words[:, i] >> np.uint64(64 - r)
    return out


def _split_words(packed: np.ndarray, rem: int) -> np.ndarray:
    """Inverse of ``_join_words``."""
    words = np.empty((packed.shape[0], 8), dtype="<u8")
    mask = np.uint64((1 << (8 * rem)) - 1)
    for i in range(8):
        q, r = divmod(8 * rem * i, 64)
        col = packed[:, q] >> np.uint64(r)
        if r + 8 * rem > 64:
            col |= packed[:, q + 1] << np.uint64(64 - r)
        words[:, i] = col & mask
    return words


def _repeat_low_bits(bits: int, period: int) -> int:
    """A 64-bit mask with the low ``bits`` bits of every ``period``-bit lane set."""
    return sum(((1 << bits) - 1) << shift for shift in range(0, 64, period))


_ALL = (1 << 64) - 1
_LANES = ((8, 0x00FF00FF00FF00FF), (16, 0x0000FFFF0000FFFF), (32, 0x00000000FFFFFFFF))
"""(half-lane width, mask of the low half of every lane) of the three squeeze steps."""


def set_sign(values: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """Set the sign bit of the float32 ``values`` (non-negative) where ``negative`` (bool or 0/1) is set, in place.

    A bit operation: ``np.negative(..., where=)`` is two orders of magnitude slower.
    """
    bits = values.view(np.uint32)
    bits |= np.left_shift(negative, 31, dtype=np.uint32)
    return values


def pack_unary(q: np.ndarray) -> np.ndarray:
    """Each value ``q`` as ``q`` zero bits and a one bit (LSB-first), zero-padded to a byte."""
    if q.size == 0:
        return np.empty(0, dtype=np.uint8)
    ones = q.astype(np.int64)  # position of each value's one bit: cumsum(q + 1) - 1, in place
    ones += 1
    np.cumsum(ones, out=ones)
    ones -= 1
    bits = np.zeros(int(ones[-1]) // 8 * 8 + 8, dtype=np.uint8)
    bits[ones] = 1
    return np.packbits(bits, bitorder="little")


def unpack_unary(buf: np.ndarray, count: int, codec: str) -> np.ndarray:
    """Inverse of ``pack_unary``: exactly ``count`` values, no stray one bits, no extra bytes."""
    ones = np.flatnonzero(np.unpackbits(buf, bitorder="little").view(np.bool_))  # bool: ~8x faster
    if ones.size != count:
        raise CodecError(f"{codec} unary stream holds {ones.size} values, header says {count}")
    if buf.size != (int(ones[-1]) // 8 + 1 if count else 0):
        raise CodecError(f"{codec} unary stream has trailing bytes")
    q = np.diff(ones, prepend=-1)
    q -= 1
    return q


class PayloadReader:
    """Reads a payload front to back; running past its end or leaving bytes over is a ``CodecError``."""

    def __init__(self, data: bytes, codec: str) -> None:
        self._buf = np.frombuffer(data, dtype=np.uint8)
        self._pos = 0
        self.codec = codec

    @property
    def remaining(self) -> int:
        return self._buf.size - self._pos

    def error(self, message: str, reason: str = "codec") -> CodecError:
        return CodecError(f"{self.codec} payload: {message}", reason)

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` bytes as a read-only uint8 array."""
        if n < 0 or n > self.remaining:
            raise self.error(f"truncated (needs {n} more bytes, {self.remaining} left)")
        out = self._buf[self._pos:self._pos + n]
        self._pos += n
        return out

    def unpack(self, layout: struct.Struct) -> tuple[int | float, ...]:
        return layout.unpack(self.take(layout.size).tobytes())

    def float32(self, count: int) -> np.ndarray:
        """``count`` little-endian float32 values, refused if any is NaN or Inf."""
        values = self.take(4 * count).view("<f4").astype(np.float32)
        if not np.isfinite(values).all():
            raise self.error("holds NaN or Inf", "nan")
        return values

    def finish(self) -> None:
        if self.remaining:
            raise self.error(f"{self.remaining} trailing bytes")
