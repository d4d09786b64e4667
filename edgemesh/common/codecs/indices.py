"""The index coding every sparse codec shares, so that their byte counts compare fairly.

Sorted unique indices become gaps ``r = idx[i] - idx[i-1] - 1`` (``idx[-1] = -1``), coded
with Golomb-Rice: each block of ``BLOCK`` gaps has its own parameter ``b``, and a gap is sent
as its ``b`` low bits (fixed width) plus ``r >> b`` in unary. For gaps of a random 1 % subset
that is about 8.6 bits per index against an entropy of about 8.1, and runs of neighbouring
indices cost one bit each.

Section layout for ``count > 0`` indices (``count`` itself is in the codec's header); the
section ends the payload, so the unary stream needs no length::

    b       ceil(count / BLOCK) x uint8     Rice parameter of each block
    low     for each distinct b > 0, ascending: the low bits of the gaps of the blocks with
            that b, in block order, pack_uint(width=b)
    unary   the rest of the payload         every gap's r >> b, pack_unary

``count == 0`` has an empty section. Decoding checks every part: a truncated section, a
parameter too wide for ``numel``, a unary stream holding the wrong number of values, or an
index at or past ``numel`` is a ``CodecError``; indices are increasing by construction.
"""

from __future__ import annotations

import numpy as np

from edgemesh.common.codecs.bitpack import PayloadReader, pack_uint, pack_unary, packed_size, unpack_uint, unpack_unary

BLOCK = 256
"""Gaps per Rice parameter."""
MAX_NUMEL = 2**31 - 1
"""Largest tensor a sparse codec accepts (its indices and their sums then fit int64 comfortably)."""
_CANDIDATES = (-2, -1, 0, 1)
"""Rice parameters tried per block, around floor(log2(mean gap + 1))."""
_PARAM_ROWS = 1024
"""Blocks whose parameters are chosen at a time (256 Ki gaps)."""


def max_rice(numel: int) -> int:
    """Widest Rice parameter useful for a tensor of ``numel`` values: the bits of the largest gap."""
    return max(0, numel - 1).bit_length()


def _rice_parameters(gaps: np.ndarray, numel: int) -> np.ndarray:
    """The cheapest Rice parameter of each block of ``BLOCK`` gaps, among ``_CANDIDATES``.

    Cost of parameter b for a block: ``count * (b + 1)`` low and stop bits plus ``sum(r >> b)``
    unary bits. Blocks are processed ``_PARAM_ROWS`` at a time so the temporaries stay small.
    """
    blocks = -(-gaps.size // BLOCK)
    params = np.empty(blocks, dtype=np.uint8)
    for first in range(0, blocks, _PARAM_ROWS):
        part = gaps[first * BLOCK:(first + _PARAM_ROWS) * BLOCK]
        rows = -(-part.size // BLOCK)
        counts = np.full(rows, BLOCK, dtype=np.int64)
        if part.size % BLOCK:  # the last block: zero-padded, its real count kept
            counts[-1] = part.size % BLOCK
            part = np.concatenate((part, np.zeros(BLOCK - part.size % BLOCK, dtype=part.dtype)))
        block = part.reshape(rows, BLOCK)
        base = np.floor(np.log2(block.sum(axis=1, dtype=np.int64) / counts + 1.0)).astype(np.int64)
        best_b = np.zeros(rows, dtype=np.int64)
        best_cost = np.full(rows, np.iinfo(np.int64).max, dtype=np.int64)
        for delta in _CANDIDATES:
            b = np.clip(base + delta, 0, max_rice(numel))
            cost = counts * (b + 1) + (block >> b[:, None]).sum(axis=1, dtype=np.int64)
            better = cost < best_cost
            best_b[better], best_cost[better] = b[better], cost[better]
        params[first:first + rows] = best_b
    return params


def encode_indices(idx: np.ndarray, numel: int) -> bytes:
    """The index section for sorted, unique ``idx`` in ``[0, numel)``, ``numel <= MAX_NUMEL``."""
    count = int(idx.size)
    if count == 0:
        return b""
    gaps = np.empty(count, dtype=np.int32)  # r = idx[i] - idx[i-1] - 1 < numel <= MAX_NUMEL
    gaps[0] = idx[0]
    np.subtract(idx[1:], idx[:-1], out=gaps[1:], casting="unsafe")
    gaps[1:] -= 1
    params = _rice_parameters(gaps, numel)
    per_gap = np.repeat(params, BLOCK)[:count]
    parts = [params.tobytes()]
    for b in np.unique(params).tolist():
        if b:
            parts.append(pack_uint(gaps[per_gap == b] & ((1 << b) - 1), b).tobytes())
    np.right_shift(gaps, per_gap, out=gaps)
    parts.append(pack_unary(gaps).tobytes())
    return b"".join(parts)


def decode_indices(reader: PayloadReader, count: int, numel: int) -> np.ndarray:
    """Read the index section of ``count`` indices of a ``numel``-value tensor (int64, increasing).

    The section is the rest of the payload: ``reader`` is left at its end.
    """
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    if not 0 < count <= numel <= MAX_NUMEL:
        raise reader.error(f"{count} indices for {numel} values")
    blocks = -(-count // BLOCK)
    # every gap costs at least a parameter share and one unary bit: refuse early what cannot fit
    if reader.remaining < blocks + (count + 7) // 8:
        raise reader.error(f"truncated index section for {count} indices")
    params = reader.take(blocks)
    if int(params.max()) > max_rice(numel):
        raise reader.error(f"Rice parameter {int(params.max())} too wide for {numel} values")
    per_gap = np.repeat(params, BLOCK)[:count]
    low = np.zeros(count, dtype=np.int64)
    for b in np.unique(params).tolist():
        if b:
            where = np.flatnonzero(per_gap == b)
            low[where] = unpack_uint(reader.take(packed_size(where.size, b)), where.size, b)
    gaps = unpack_unary(reader.take(reader.remaining), count, reader.codec)
    if np.any(gaps > np.right_shift(np.int64(numel - 1), per_gap)):
        raise reader.error("index gap out of range")
    np.left_shift(gaps, per_gap, out=gaps)
    gaps |= low  # r, each <= 2 numel: the sum below cannot overflow before it is checked
    if float(gaps.sum(dtype=np.float64)) + count > numel:
        raise reader.error("indices run past the tensor")
    gaps += 1
    idx = np.cumsum(gaps, out=gaps)
    idx -= 1
    if int(idx[-1]) >= numel:  # cannot happen after the check above; kept as the invariant's guard
        raise reader.error("indices run past the tensor")
    return idx
