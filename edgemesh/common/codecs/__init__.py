"""Gradient codecs behind one interface, with error feedback (docs/compression.md).

``encode(grad, policy) -> bytes`` takes a flat float32 gradient; ``decode(data, numel)``
returns it (or its approximation) as flat float32 and raises ``CodecError`` for a payload
that is truncated, inconsistent or holds NaN/Inf. ``ErrorFeedback`` adds what a lossy codec
did not send to the next gradient of the same shard; a lossy codec with
``encode_with_residual`` (a ``ResidualCodec``: all of them but ``fp16``) hands it the residual
directly instead of having it decode the payload again.

Codecs: ``none`` and ``fp16`` (``dense``), ``threshold`` and ``topk`` (``sparse``), ``qsgd``,
and the paper's ``grid`` (multi-resolution grid clustering). ``codec_for`` sends tensors under
``SMALL_TENSOR`` values as ``fp16`` whatever the lossy policy. The sparse ones share the index
coding of ``indices``; ``bitpack`` holds the bit-level helpers every payload uses.
"""

from __future__ import annotations

from edgemesh.common.codecs import dense as _dense  # noqa: F401 - registers none, fp16
from edgemesh.common.codecs import grid as _grid  # noqa: F401 - registers grid
from edgemesh.common.codecs import qsgd as _qsgd  # noqa: F401 - registers qsgd
from edgemesh.common.codecs import sparse as _sparse  # noqa: F401 - registers threshold, topk
from edgemesh.common.codecs.base import (
    SMALL_TENSOR,
    Codec,
    ErrorFeedback,
    ResidualCodec,
    available_codecs,
    bytes_per_value,
    codec_for,
    get_codec,
    quick_to_decode,
)

__all__ = ["SMALL_TENSOR", "Codec", "ErrorFeedback", "ResidualCodec", "available_codecs", "bytes_per_value",
           "codec_for", "get_codec", "quick_to_decode"]
