"""Gradient codecs behind one interface, with error feedback (DESIGN.md §6).

``encode(grad, policy) -> bytes`` takes a flat float32 gradient; ``decode(data, numel)``
returns it (or its approximation) as flat float32 and raises ``CodecError`` for a payload
that is truncated, inconsistent or holds NaN/Inf. ``ErrorFeedback`` adds what a lossy codec
did not send to the next gradient of the same shard.
"""

from __future__ import annotations

from edgemesh.common.codecs import dense as _dense  # noqa: F401 - registers none, fp16
from edgemesh.common.codecs.base import Codec, ErrorFeedback, available_codecs, get_codec

__all__ = ["Codec", "ErrorFeedback", "available_codecs", "get_codec"]
