"""The words EdgeMesh's messages, configuration and services share, each declared once.

A typo in one of them is a type error (mypy) and a decode error (the wire checks ``Literal``s).
"""

from __future__ import annotations

from typing import Literal, get_args

CodecName = Literal["none", "fp16", "topk", "threshold", "qsgd", "grid"]
"""Gradient and model-delta codecs (docs/compression.md)."""
CODECS: tuple[CodecName, ...] = get_args(CodecName)
SparseCodecName = Literal["topk", "threshold", "grid"]
"""The codecs that keep a share (the policy's density) of a gradient's values."""
SPARSE_CODECS: tuple[SparseCodecName, ...] = get_args(SparseCodecName)

SyncPolicy = Literal["sync", "async", "ssp", "adaptive"]
"""Synchronization policies of the parameter server (docs/synchronization.md)."""
SYNC_POLICIES: tuple[SyncPolicy, ...] = get_args(SyncPolicy)

Batching = Literal["uniform", "balanced"]
"""How a plan's batch sizes were chosen: the configured one for all, or sized to each device's speed."""

AckStatus = Literal["accepted", "discarded", "duplicate"]
"""The parameter server's answer to one update."""
DiscardReason = Literal["stale", "future", "round_full", "replanned", "incomplete", "unknown_device", "shape",
                        "codec", "nan"]
"""Why an update was discarded: its delay (``stale``: above the bound, ``future``: ahead of the model), its
round (``round_full``: its cluster already gave one, ``replanned``: its plan or cluster is gone,
``incomplete``: a model-parallel step whose members did not all report), its sender (``unknown_device``)
or its payload (``shape``, ``codec``, ``nan``)."""
PAYLOAD_REASONS: tuple[DiscardReason, ...] = ("shape", "codec", "nan")
AckReason = Literal["", DiscardReason]
"""An ack's reason: empty unless discarded."""


def payload_reason(reason: str) -> DiscardReason:
    """A decode failure's reason as an ack's: one of ``PAYLOAD_REASONS`` (anything else is the codec's)."""
    for known in PAYLOAD_REASONS:
        if reason == known:
            return known
    return "codec"
