"""Sparsification baselines ``threshold`` and ``topk`` (docs/compression.md), and the selection ``grid`` shares.

Selection by threshold: ``t`` is the ``1 - density`` quantile of ``|g|`` on a deterministic
strided sample of at most ``SAMPLE_MAX`` values (exact for smaller tensors), never below the
smallest positive float32, so zeros are never kept and a non-zero tensor keeps at least the
sample's largest entry. The full pass then runs in L2-sized chunks (``abs``, compare,
``flatnonzero``) so no tensor-sized temporary is made; it also refuses NaN/Inf gradients.

``topk`` keeps exactly ``k = ceil(density * n)`` entries of largest ``|g|``: candidates are
selected with a sampled threshold a few standard deviations below the k-th value, then
``argpartition`` runs on the candidates only (on the whole tensor if the sample was unlucky).

Payload of both (``count`` little-endian uint32, the kept values, then the shared index
section of ``indices.py``)::

    <I count> <count x float32 LE> <index section>
"""

from __future__ import annotations

import abc
import math
import struct

import numpy as np

from edgemesh.common.codecs.base import register
from edgemesh.common.codecs.bitpack import PayloadReader
from edgemesh.common.codecs.indices import MAX_NUMEL, decode_indices, encode_indices
from edgemesh.common.errors import CodecError
from edgemesh.common.messages import CodecPolicy
from edgemesh.common.vocabulary import CodecName

DEFAULT_DENSITY = 0.01
"""Kept share of a sparsifying codec encoding without a policy."""
SAMPLE_MAX = 65_536
"""Largest sample the threshold is estimated on."""
CHUNK = 1 << 17
"""Values per chunk of the selection pass (512 KiB of float32: stays in L2)."""
TINY = np.float32(np.finfo(np.float32).smallest_subnormal)
"""Lowest threshold: ``|g| >= TINY`` keeps exactly the non-zero entries."""
TOPK_MARGIN_SIGMAS = 4.0
"""How many binomial standard deviations below the k-th sampled value ``topk`` sets its candidate threshold."""

COUNT = struct.Struct("<I")


def flatten(grad: np.ndarray, name: str) -> np.ndarray:
    flat = np.ascontiguousarray(grad, dtype=np.float32).reshape(-1)
    if flat.size > MAX_NUMEL:
        raise CodecError(f"{name} cannot encode {flat.size} values (at most {MAX_NUMEL})", "oversized")
    return flat


def policy_density(policy: CodecPolicy | None, name: str) -> float:
    density = DEFAULT_DENSITY if policy is None else float(policy.density)
    if not 0.0 < density <= 1.0:
        raise CodecError(f"{name} density {density} is not in (0, 1]", "policy")
    return density


def _sample_magnitudes(flat: np.ndarray) -> np.ndarray:
    stride = -(-flat.size // SAMPLE_MAX)
    return np.abs(flat[::stride])


def estimate_threshold(flat: np.ndarray, density: float) -> np.float32:
    """The magnitude above which about ``density`` of ``flat`` lies (a sampled quantile, at least ``TINY``)."""
    if flat.size == 0 or density >= 1.0:
        return TINY
    sample = _sample_magnitudes(flat)
    kth = sample.size - min(sample.size, max(1, math.ceil(density * sample.size)))
    t = np.partition(sample, kth)[kth]
    return max(np.float32(t), TINY) if np.isfinite(t) else TINY  # NaN/Inf: select_at_least refuses


def select_at_least(flat: np.ndarray, t: np.float32, name: str) -> np.ndarray:
    """Sorted indices of the entries with ``|g| >= t``; NaN or Inf anywhere is a ``CodecError``."""
    n = flat.size
    size = min(n, CHUNK)
    mag = np.empty(size, dtype=np.float32)
    mask = np.empty(size, dtype=np.bool_)
    parts = []
    for start in range(0, n, CHUNK):
        chunk = flat[start:start + CHUNK]
        m, k = mag[: chunk.size], mask[: chunk.size]
        np.abs(chunk, out=m)
        if not np.isfinite(m.max()):
            raise CodecError(f"{name} cannot encode a gradient holding NaN or Inf", "nan")
        np.greater_equal(m, t, out=k)
        found = np.flatnonzero(k)
        if found.size:
            found += start
            parts.append(found)
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def select_threshold(flat: np.ndarray, density: float, name: str) -> np.ndarray:
    """The threshold selection ``threshold`` and ``grid`` share."""
    return select_at_least(flat, estimate_threshold(flat, density), name)


def select_topk(flat: np.ndarray, k: int, name: str) -> np.ndarray:
    """Sorted indices of exactly ``k`` entries of largest ``|g|``; NaN or Inf is a ``CodecError``."""
    n = flat.size
    if k >= n:
        check_encodable(flat, name)
        return np.arange(n, dtype=np.int64)
    if n > SAMPLE_MAX:
        sample = _sample_magnitudes(flat)
        expected = k * sample.size / n
        rank = math.ceil(expected + TOPK_MARGIN_SIGMAS * math.sqrt(expected) + 8)
        if rank < sample.size:
            kth = sample.size - rank
            t = np.partition(sample, kth)[kth]
            if np.isfinite(t) and t > 0:
                cand = select_at_least(flat, np.float32(t), name)
                if cand.size >= k:
                    top = np.argpartition(np.abs(flat[cand]), cand.size - k)[cand.size - k:]
                    return np.sort(cand[top])
    check_encodable(flat, name)
    return np.sort(np.argpartition(np.abs(flat), n - k)[n - k:])


def check_encodable(flat: np.ndarray, name: str) -> None:
    if flat.size and not np.isfinite(np.abs(flat).max()):
        raise CodecError(f"{name} cannot encode a gradient holding NaN or Inf", "nan")


def check_numel(numel: int, name: str) -> None:
    if not 0 <= numel <= MAX_NUMEL:
        raise CodecError(f"{name} cannot decode {numel} values", "shape")


class _Sparse(abc.ABC):
    """Indices and float32 values of the selected entries."""

    lossless = False

    def __init__(self, name: CodecName) -> None:
        self.name = name

    @abc.abstractmethod
    def select(self, flat: np.ndarray, policy: CodecPolicy | None) -> np.ndarray:
        """Sorted indices of the entries to send."""

    def encode(self, grad: np.ndarray, policy: CodecPolicy | None) -> bytes:
        return self._encode(flatten(grad, self.name), policy)[0]

    def encode_with_residual(self, grad: np.ndarray, policy: CodecPolicy | None) -> tuple[bytes, np.ndarray]:
        """The payload and ``grad - decode(payload)``: the kept entries are sent exactly, so their residual is 0."""
        flat = flatten(grad, self.name)
        data, idx = self._encode(flat, policy)
        residual = flat.copy()
        residual[idx] = 0.0
        return data, residual

    def _encode(self, flat: np.ndarray, policy: CodecPolicy | None) -> tuple[bytes, np.ndarray]:
        idx = self.select(flat, policy)
        values = flat[idx].astype("<f4", copy=False)
        return COUNT.pack(idx.size) + values.tobytes() + encode_indices(idx, flat.size), idx

    def decode(self, data: bytes, numel: int) -> np.ndarray:
        check_numel(numel, self.name)
        reader = PayloadReader(data, self.name)
        count = int(reader.unpack(COUNT)[0])
        if count > numel:
            raise reader.error(f"{count} values for a tensor of {numel}")
        if reader.remaining < 4 * count:
            raise reader.error(f"truncated: {count} values need at least {4 * count} more bytes")
        values = reader.float32(count)
        idx = decode_indices(reader, count, numel)
        reader.finish()
        out = np.zeros(numel, dtype=np.float32)
        out[idx] = values
        return out


class ThresholdCodec(_Sparse):
    """Keeps the entries with ``|g| >= t``, ``t`` a sampled quantile so that about ``density`` are kept."""

    def __init__(self) -> None:
        super().__init__("threshold")

    def select(self, flat: np.ndarray, policy: CodecPolicy | None) -> np.ndarray:
        return select_threshold(flat, policy_density(policy, self.name), self.name)


class TopKCodec(_Sparse):
    """Keeps exactly ``ceil(density * n)`` entries of largest ``|g|``."""

    def __init__(self) -> None:
        super().__init__("topk")

    def select(self, flat: np.ndarray, policy: CodecPolicy | None) -> np.ndarray:
        k = min(flat.size, math.ceil(policy_density(policy, self.name) * flat.size))
        return select_topk(flat, k, self.name)


THRESHOLD = register(ThresholdCodec())
TOPK = register(TopKCodec())

__all__ = ["THRESHOLD", "TOPK", "ThresholdCodec", "TopKCodec", "estimate_threshold", "select_threshold"]
