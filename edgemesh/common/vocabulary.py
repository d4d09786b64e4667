"""The words EdgeMesh's messages, configuration and services share, each declared once, and what a
name or a topic may be.

A typo in one of them is a type error (mypy) and a decode error (the wire checks ``Literal``s).
"""

from __future__ import annotations

import re
from typing import Literal, get_args

CodecName = Literal["none", "fp16", "topk", "threshold", "qsgd", "grid"]
"""Gradient and model-delta codecs (docs/compression.md)."""
CODECS: tuple[CodecName, ...] = get_args(CodecName)
DeltaCodecName = Literal[CodecName, "auto"]
"""The model deltas' codec setting: a codec, or ``auto`` (the parameter server's choice by the policy)."""
SparseCodecName = Literal["topk", "threshold", "grid"]
"""The codecs that keep a share (the policy's density) of a gradient's values."""
SPARSE_CODECS: tuple[SparseCodecName, ...] = get_args(SparseCodecName)

SyncPolicy = Literal["sync", "async", "ssp", "adaptive"]
"""Synchronization policies of the parameter server (docs/synchronization.md)."""
SYNC_POLICIES: tuple[SyncPolicy, ...] = get_args(SyncPolicy)
ROUND_POLICIES: tuple[SyncPolicy, ...] = ("sync", "adaptive")
"""The policies whose versions are rounds: one update per cluster, applied together."""
AggregationRule = Literal["mean", "clip", "median", "trimmed-mean", "krum"]
"""How the parameter server combines a step's contributions (docs/reliability.md#robust-aggregation)."""
AGGREGATION_RULES: tuple[AggregationRule, ...] = get_args(AggregationRule)
AttackKind = Literal["", "sign-flip", "noise"]
"""What an emulated faulty worker does to its gradient before sending it (empty: nothing)."""

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


NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
"""A job, device or cluster name: 1-64 characters of ``[A-Za-z0-9_.-]``, the first a letter or digit."""
MAX_TOPIC_CHARS = 1024
"""Longest topic a message may name as its reply topic (MQTT allows 65,535 bytes; ours are far shorter)."""


def valid_name(name: str) -> bool:
    """A job, device or cluster name: 1-64 chars of ``[A-Za-z0-9_.-]``, no MQTT wildcards or ``/``."""
    return bool(NAME_PATTERN.match(name))


def check_name(kind: str, name: str) -> str:
    if not valid_name(name):
        raise ValueError(f"invalid {kind} name {name!r}: use 1-64 characters of A-Z a-z 0-9 _ . -")
    return name


def valid_topic(topic: str) -> bool:
    """A topic a message may be published on: 1-``MAX_TOPIC_CHARS`` characters, no wildcard or NUL."""
    return 0 < len(topic) <= MAX_TOPIC_CHARS and not any(c in topic for c in "+#\x00")

RoundScaling = Literal["linear", "sqrt", "none", "adascale"]
"""How a round policy's step grows with the batches it averages (``ps.round_scaling``)."""

StalenessRule = Literal["inverse", "sqrt"]
"""How an update applied ``d`` versions late is damped (``ps.staleness_rule``): ``inverse`` 1/(1+d), ``sqrt``
1/(1+sqrt(d)) (FedBuff's)."""
