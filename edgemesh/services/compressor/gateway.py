"""The compressor's gateway (docs/compression.md): devices whose hello says ``can_encode = false`` send raw float32
updates on ``grad-raw/{cluster}/{device}``; every shard is encoded with that device's policy and its own error
feedback for the device, and the update (same device, incarnation, seq, base version) is forwarded on
``grad/{cluster}/{device}``. A resent raw update (same incarnation and seq) is forwarded again as first encoded,
so error feedback is applied once.

Raw updates are encoded one at a time, in a thread, in arrival order. This module must not import torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from edgemesh.common import wire
from edgemesh.common.codecs import ErrorFeedback, codec_for, get_codec
from edgemesh.common.errors import WireError
from edgemesh.common.messages import CodecPolicy, DeviceHello, GradientUpdate, ShardUpdate
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.services.compressor.policy import FP32_BYTES

RAW_CODEC = "none"
"""The only codec accepted on ``grad-raw``: float32 as is."""
ENCODE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
"""Buckets of the histogram of the time one raw update takes to encode."""


class Gateway:
    """The devices the gateway serves, their error feedback and the last update forwarded for each."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.devices: set[str] = set()
        """Devices whose latest hello says they cannot encode."""
        self.feedback: dict[str, tuple[int, ErrorFeedback]] = {}
        """Error feedback per device, with the incarnation it belongs to."""
        self._forwarded: dict[str, tuple[tuple[int, int], bytes, int]] = {}
        """Per device, the last forwarded update: ((incarnation, seq), envelope, shard bytes)."""
        m = metrics
        self.m_bytes = m.counter("gateway_bytes", "Gradient bytes through the gateway: raw in, encoded out",
                                 ["direction"])
        self.m_updates = m.counter("gateway_updates", "Raw updates encoded and forwarded", ["codec"])
        self.m_seconds = m.histogram("gateway_encode_seconds", "Time to encode one raw update", ENCODE_BUCKETS)
        for direction in ("in", "out"):
            self.m_bytes.labels(direction=direction)

    def hello(self, hello: DeviceHello) -> None:
        """Serve the device, or stop serving it, as its hello says."""
        if hello.can_encode:
            self.devices.discard(hello.device)
        else:
            self.devices.add(hello.device)

    async def encode(self, update: GradientUpdate, known: int | None, policy: Callable[[], CodecPolicy]) -> bytes:
        """The envelope of ``update`` encoded with the device's ``policy()`` (asked for only when the update is not a
        resend), to forward to the PS. WireError for a device the gateway does not serve, or an incarnation older
        than ``known`` (the latest the device said hello with)."""
        device = update.device
        if device not in self.devices:
            raise WireError(f"raw update of {device}, whose hello does not ask for the gateway", "unknown_device")
        if known is not None and update.incarnation < known:
            raise WireError(f"raw update of {device} from old incarnation {update.incarnation}", "incarnation")
        raw_bytes = sum(len(s.data) for s in update.shards)
        key = (update.incarnation, update.seq)
        last = self._forwarded.get(device)
        if last is not None and last[0] == key:  # a resend: the same encoding, error feedback untouched
            payload, out_bytes = last[1], last[2]
        else:
            payload, out_bytes = await self._encode(update, policy())
            self._forwarded[device] = (key, payload, out_bytes)
        self.m_bytes.labels(direction="in").inc(raw_bytes)
        self.m_bytes.labels(direction="out").inc(out_bytes)
        return payload

    async def _encode(self, update: GradientUpdate, policy: CodecPolicy) -> tuple[bytes, int]:
        """A new update encoded in a thread with the device's error feedback: its envelope and shard bytes."""
        feedback = self.feedback.get(update.device)
        if feedback is None or feedback[0] != update.incarnation:
            feedback = (update.incarnation, ErrorFeedback())
            self.feedback[update.device] = feedback
        started = asyncio.get_running_loop().time()
        encoded = await asyncio.to_thread(encode_raw, update, policy, feedback[1])
        self.m_seconds.observe(asyncio.get_running_loop().time() - started)
        payload = wire.encode(encoded)
        self.m_updates.labels(codec=policy.codec).inc()
        return payload, sum(len(s.data) for s in encoded.shards)


def encode_raw(update: GradientUpdate, policy: CodecPolicy, feedback: ErrorFeedback) -> GradientUpdate:
    """``update`` with every raw float32 shard encoded per ``policy`` (in a thread); its buffers' changes, which
    are not gradients, pass as they are."""
    raw = get_codec(RAW_CODEC)
    decoded = []
    for s in update.shards:  # check every shard before error feedback changes for any
        if s.codec != RAW_CODEC:
            raise WireError(f"grad-raw shard {s.param} is {s.codec!r}, not {RAW_CODEC!r}", "codec")
        if not s.data or len(s.data) % FP32_BYTES:
            raise WireError(f"grad-raw shard {s.param} has {len(s.data)} bytes, not whole float32s", "codec")
        decoded.append((s, raw.decode(s.data, len(s.data) // FP32_BYTES)))
    keys = [(s.param, s.start, s.stop) for s, _ in decoded]
    if len(set(keys)) != len(keys):
        raise WireError("a grad-raw shard appears twice", "shape")
    shards = []
    for s, values in decoded:
        codec = codec_for(policy.codec, values.size)
        shards.append(ShardUpdate(param=s.param, start=s.start, stop=s.stop, codec=codec.name,
                                  data=feedback.encode(f"{s.param}[{s.start}:{s.stop}]", values, codec, policy)))
    return dataclasses.replace(update, shards=tuple(shards))
