"""``grid``: gradient compression by multi-resolution grid clustering (docs/compression.md).

After "The Research And Implementation Of Distributed Deep Learning Optimization
Methods For Edge Computing": gradients above a threshold are divided into intervals by their
absolute value, each is replaced by its interval's mean, and only the indices, the interval of
each value and one representative per interval are sent. The paper reports about half the
bytes of threshold compression at equal accuracy.

Algorithm, for a flat float32 gradient ``g`` and a policy (density ``d``, ``bits``):

1. Selection: exactly the entries ``threshold`` keeps at density ``d`` (same function, same
   ``t``; see ``sparse.py``): ``k`` entries with ``|g| >= t``.
2. Coarse grid: the magnitudes of the kept entries span ``[lo, hi]`` (``lo >= t``); it is cut
   into ``COARSE_CELLS`` log-spaced cells, so that the relative width of a coarse cell is
   bounded even for heavy-tailed gradients.
3. Refinement where values are dense: in rounds, the cells are halved in order of their
   weight ``count x width**2`` (the squared error a cell's mean leaves, for a locally flat
   density): every cell weighing more than half the heaviest one (and holding at least
   ``MIN_SPLIT`` values, not all equal) is halved, until ``2**bits`` cells are non-empty
   (``bits`` = ``policy.grid_levels`` if > 0, else ``DEFAULT_BITS``; at most ``MAX_BITS``) or
   no cell can be split. A populated cell is split long before an equally wide sparse one, so
   the grid ends finest where values are dense: cell widths go as density**(-1/3), the
   mean-squared-error optimal law, against density**(-1) for splitting the most populated
   cell (an equal-count grid, which leaves the few largest gradients in one wide cell) and
   density**0 for an equal-width grid. Counts come from one sort of the ``k`` magnitudes and
   ``searchsorted`` of the edges, so a round costs O(cells x log k). Empty cells are dropped.
4. Each kept value is assigned to its cell (a comparison pass per edge) and replaced by its cell's mean
   magnitude (``bincount``, clipped to the cell's [min, max]) with its own sign.

Cost: everything after the selection pass works on the ``k`` kept values only.

Payload (little-endian)::

    <I count>                        kept values
    <B L - 1>                        L = non-empty intervals (the byte is 0 and L = 0 if count = 0)
    <L x float32>                    mean magnitude of each interval, increasing
    pack_uint(code, 1 + bitlen(L-1)) per kept value: code = interval << 1 | sign
    <index section>                  shared with threshold/topk (indices.py), to the end

At 1 % density that is ~8.6 bits of index + 5 bits of code per kept value, against ~8.6 + 32
for ``threshold``.
"""

from __future__ import annotations

import struct

import numpy as np

from edgemesh.common.codecs.base import register
from edgemesh.common.codecs.bitpack import PayloadReader, pack_uint, packed_size, set_sign, unpack_uint
from edgemesh.common.codecs.indices import decode_indices, encode_indices
from edgemesh.common.codecs.sparse import check_numel, flatten, policy_density, select_threshold
from edgemesh.common.messages import CodecPolicy
from edgemesh.common.vocabulary import CodecName

DEFAULT_BITS = 4
"""Interval id bits when the policy gives no ``grid_levels``: 16 intervals."""
MAX_BITS = 8
"""Largest interval id width: 256 intervals."""
COARSE_CELLS = 4
"""Log-spaced cells of the first, coarse grid."""
MIN_SPLIT = 8
"""Fewest values a cell must hold to be split: a 32-bit mean is not worth fewer."""
MAX_ROUNDS = 64
"""Bound on refinement rounds (each halves at least one cell)."""
COMPARE_EDGES_MAX = 64
"""Most inner edges for which cells are found by one comparison pass per edge."""

HEADER = struct.Struct("<IB")


def grid_bits(policy: CodecPolicy | None) -> int:
    levels = 0 if policy is None else int(policy.grid_levels)
    return DEFAULT_BITS if levels <= 0 else min(levels, MAX_BITS)


def _bounds(sorted_mags: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Start of each cell in ``sorted_mags`` and the end of the last: cell i holds ``edges[i] <= m < edges[i+1]``."""
    inner = np.searchsorted(sorted_mags, edges[1:-1], side="left")
    return np.concatenate(([0], inner, [sorted_mags.size]))


def _cells(mags: np.ndarray, inner: np.ndarray) -> np.ndarray:
    """The cell of each magnitude: how many inner edges are <= it (``searchsorted(side="right")``).

    For a few edges one comparison pass per edge beats a binary search of unsorted needles ~10x.
    """
    if inner.size > COMPARE_EDGES_MAX:
        return np.searchsorted(inner, mags, side="right")
    cell = np.zeros(mags.size, dtype=np.uint8)  # at most COMPARE_EDGES_MAX < 256
    above = np.empty(mags.size, dtype=np.bool_)
    for edge in inner:
        np.greater_equal(mags, edge, out=above)
        np.add(cell, above, out=cell)
    return cell


def cluster(mags: np.ndarray, max_intervals: int) -> tuple[np.ndarray, np.ndarray]:
    """Multi-resolution grid clustering of positive magnitudes.

    Returns ``(interval, means)``: the interval of each magnitude (int64, in ``[0, L)``) and the
    float32 mean magnitude of each of the ``L <= max_intervals`` non-empty intervals, increasing;
    each mean lies within the [min, max] of its interval's magnitudes.
    """
    k = mags.size
    if k == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
    ms = np.sort(mags)
    lo, hi = float(ms[0]), float(ms[-1])
    if lo == hi or max_intervals <= 1:
        mean = np.clip(ms.mean(dtype=np.float64), lo, hi)
        return np.zeros(k, dtype=np.int64), np.array([mean], dtype=np.float32)
    cells = min(COARSE_CELLS, max_intervals)
    coarse = np.geomspace(lo, hi, cells + 1) if lo > 0 else np.linspace(lo, hi, cells + 1)
    # float32 edges, like the magnitudes: comparisons stay exact and need no conversion
    edges = coarse.astype(np.float32)
    edges[0], edges[-1] = lo, np.inf  # the last cell is closed at hi
    bounds = _bounds(ms, edges)
    for _ in range(MAX_ROUNDS):
        counts = np.diff(bounds)
        budget = max_intervals - int(np.count_nonzero(counts))
        if budget <= 0:
            break
        first = ms[np.minimum(bounds[:-1], k - 1)]
        last = ms[np.maximum(bounds[1:] - 1, 0)]
        width = np.minimum(edges[1:], hi).astype(np.float64) - edges[:-1]
        weight = np.where((counts >= MIN_SPLIT) & (last > first), counts * width * width, 0.0)
        heaviest = weight.max()
        if heaviest <= 0:
            break
        split = np.flatnonzero(2 * weight > heaviest)
        if split.size > budget:
            split = split[np.argsort(-weight[split], kind="stable")[:budget]]
        left = edges[split].astype(np.float64)
        right = np.minimum(edges[split + 1], hi).astype(np.float64)
        # the cell holds two distinct float32 values, so its rounded midpoint lies strictly inside
        edges = np.sort(np.concatenate((edges, ((left + right) / 2).astype(np.float32))))
        bounds = _bounds(ms, edges)
    counts = np.diff(bounds)
    used = counts > 0
    cell = _cells(mags, edges[1:-1])
    remap = np.cumsum(used) - 1
    interval = remap[cell]
    sums = np.bincount(interval, weights=mags, minlength=int(used.sum()))
    means = np.clip(sums / counts[used], ms[bounds[:-1][used]], ms[bounds[1:][used] - 1])
    return interval, means.astype(np.float32)


class GridCodec:
    """Threshold selection, then each kept value replaced by its grid interval's mean (sign kept)."""

    name: CodecName = "grid"
    lossless = False

    def encode(self, grad: np.ndarray, policy: CodecPolicy | None) -> bytes:
        return self._encode(flatten(grad, self.name), policy)[0]

    def encode_with_residual(self, grad: np.ndarray, policy: CodecPolicy | None) -> tuple[bytes, np.ndarray]:
        """The payload and ``grad - decode(payload)``, without decoding."""
        flat = flatten(grad, self.name)
        data, idx, sent = self._encode(flat, policy)
        residual = flat.copy()
        residual[idx] -= sent
        return data, residual

    def _encode(self, flat: np.ndarray, policy: CodecPolicy | None) -> tuple[bytes, np.ndarray, np.ndarray]:
        idx = select_threshold(flat, policy_density(policy, self.name), self.name)
        values = flat[idx]
        negative = np.signbit(values)
        interval, means = cluster(np.abs(values), 1 << grid_bits(policy))
        width = 1 + max(0, means.size - 1).bit_length()
        codes = (interval << 1) | negative
        data = b"".join((HEADER.pack(idx.size, max(0, means.size - 1)), means.astype("<f4").tobytes(),
                         pack_uint(codes, width).tobytes(), encode_indices(idx, flat.size)))
        return data, idx, set_sign(means[interval], negative)

    def decode(self, data: bytes, numel: int) -> np.ndarray:
        check_numel(numel, self.name)
        reader = PayloadReader(data, self.name)
        count, last = (int(v) for v in reader.unpack(HEADER))
        intervals = last + 1 if count else 0
        if count > numel:
            raise reader.error(f"{count} values for a tensor of {numel}")
        if intervals > count or (count == 0 and last != 0):
            raise reader.error(f"{last + 1} intervals for {count} values")
        means = reader.float32(intervals)
        if np.any(means < 0):
            raise reader.error("negative interval mean")
        width = 1 + max(0, intervals - 1).bit_length()
        codes = unpack_uint(reader.take(packed_size(count, width)), count, width)
        idx = decode_indices(reader, count, numel)
        reader.finish()
        interval = codes >> 1
        if count and int(interval.max()) >= intervals:
            raise reader.error("interval id out of range")
        out = np.zeros(numel, dtype=np.float32)
        out[idx] = set_sign(means[interval], codes & 1)
        return out


GRID = register(GridCodec())
