"""Large payloads on the wire: split into ``chunk`` envelopes and joined again (docs/wire.md).

A payload larger than ``broker.chunk_bytes`` travels as ``chunk`` envelopes carrying ``(id, index, count)``,
joined again by a ``Reassembler`` whose buffer is bounded in bytes and time. The bus makes one call here per
message: ``frames`` on the way out, ``Receiver.take`` on the way in (which decodes through ``wire``).

A message of several chunks is also a sample of the receiver's downlink: given each payload's ``Arrival``, the
reassembler tells ``on_joined`` how many bytes the connection received from the first chunk's arrival to the
last's, and in how many seconds (every byte in that window counts, whatever message it belonged to: a link
shared with other traffic is measured as busy, not slow); from the first chunk's first byte instead, its own
bytes included, where ``Arrival.began`` says when that was read. So is a message that came whole though it is at
least ``sample_bytes`` (one the sender's chunks grew to hold, ``Bus.chunk_bytes``): its bytes over the time from
its packet's first byte to its last.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

from edgemesh.common.errors import WireError
from edgemesh.common.wire.envelope import (
    CHUNK_KIND,
    WIRE_VERSION,
    Envelope,
    decode_envelope,
    encode,
    kind_of,
    message,
    unpack,
    unpack_json,
)

T = TypeVar("T")

CHUNK_FIELDS_BYTES = 256
"""Bytes of a chunk envelope ``in_place`` reads its fields from: more than they take before the data."""
REFUSED_IDS_KEPT = 256
"""Ids of refused chunked messages remembered, so their other chunks are dropped silently."""
CHUNK_HEADROOM = 64 * 1024
"""Bytes of a packet left for the envelope, the topic and the properties when chunks grow to the broker's limit."""
UPLOAD_SMOOTHING = 0.3
"""Weight of a new sample in the moving average of the upload rate chunks grow with."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Chunk:
    """One piece of a large payload."""

    id: str
    index: int
    count: int
    size: int
    data: bytes
    """On the way out a view of the payload, on the way in a view of the packet (``split``, ``in_place``)."""

    def validate(self) -> None:
        if not 0 < len(self.id) <= 64:
            raise ValueError("chunk id length out of range")
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"chunk index {self.index} of {self.count} invalid")
        if self.size < 0:
            raise ValueError("negative size")
        if len(self.data) > self.size:
            raise ValueError(f"a chunk of {len(self.data)} bytes of a {self.size}-byte message")


message(CHUNK_KIND)(Chunk)


def split(payload: bytes, chunk_size: int) -> list[bytes]:
    """``payload`` as one envelope, or as chunk envelopes of at most ``chunk_size`` data bytes (each packed from a
    view of ``payload``: its data is copied once, into its envelope; the data comes last, see ``in_place``)."""
    if len(payload) <= chunk_size:
        return [payload]
    msg_id = uuid.uuid4().hex[:16]
    count = -(-len(payload) // chunk_size)
    with memoryview(payload) as view:
        return [encode(Chunk(id=msg_id, index=i, count=count, size=len(payload),
                             data=view[i * chunk_size:(i + 1) * chunk_size]))  # type: ignore[arg-type]
                for i in range(count)]


_BIN_LENGTH_BYTES = {0xC4: 1, 0xC5: 2, 0xC6: 4}
"""MessagePack's bin 8, 16 and 32 headers: the bytes of the length after the type byte."""
_FIELD_ORDER = ("id", "index", "count", "size")
_CHUNK_START = b"\x83" + b"".join(msgpack.packb(v) for v in ("v", WIRE_VERSION, "kind", CHUNK_KIND))
"""How a chunk envelope begins: a map of three (0x83), then its version and its kind."""


def in_place(payload: bytes | bytearray) -> Chunk | None:
    """A chunk envelope laid out as ``split`` packs it (the envelope's body last, the chunk's data last in it),
    read without copying its data: the fields unpacked from the first ``CHUNK_FIELDS_BYTES``, the data a view
    of ``payload``. None for any other payload, and for a chunk that does not hold together (``unpack`` then
    reads it whole, and says what is wrong)."""
    if not payload.startswith(_CHUNK_START):  # most messages are no chunk: they go to ``unpack`` at once
        return None
    head = _fields(payload)
    if head is None:
        return None
    fields, at = head
    start = _data_start(payload, at)
    if start is None:
        return None
    try:  # the fields checked as any envelope's are, then the data put in
        fields_only = decode_envelope(Envelope(kind=CHUNK_KIND, body={**fields, "data": b""}, size=len(payload)),
                                      Chunk)
        chunk = dataclasses.replace(fields_only, data=memoryview(payload)[start:])  # type: ignore[arg-type]
        chunk.validate()
    except (WireError, ValueError):
        return None
    return chunk


def _fields(payload: bytes | bytearray) -> tuple[dict[str, Any], int] | None:
    """The fields of a chunk envelope before its data, in ``split``'s order, and the offset of the data's bin
    header; None if the envelope is laid out otherwise."""
    reader = msgpack.Unpacker(raw=False, strict_map_key=True)
    reader.feed(payload[:CHUNK_FIELDS_BYTES])
    try:
        if reader.read_map_header() != 3 or [reader.unpack() for _ in range(4)] != ["v", WIRE_VERSION, "kind",
                                                                                     CHUNK_KIND]:
            return None
        if reader.unpack() != "body" or reader.read_map_header() != len(_FIELD_ORDER) + 1:
            return None
        fields: dict[str, Any] = {}
        for name in _FIELD_ORDER:
            if reader.unpack() != name:
                return None
            fields[name] = reader.unpack()
        if reader.unpack() != "data":
            return None
        return fields, reader.tell()
    except (msgpack.OutOfData, msgpack.ExtraData, ValueError, TypeError):  # msgpack's FormatError is a ValueError
        return None


def _data_start(payload: bytes | bytearray, at: int) -> int | None:
    """Where the data begins after its bin header at ``at``; None unless the data runs to the payload's end."""
    width = _BIN_LENGTH_BYTES.get(payload[at]) if at < len(payload) else None
    if width is None:
        return None
    start = at + 1 + width
    if start + int.from_bytes(payload[at + 1:start], "big") != len(payload):
        return None
    return start


@dataclasses.dataclass(frozen=True, slots=True)
class Arrival:
    """When a payload was read off the connection, and the payload bytes received on it by then (its own
    included)."""

    at: float
    """``time.monotonic()`` seconds."""
    received: int
    connection: int = 0
    """Which connection: bytes are counted per connection, and a message joined across two is no sample."""
    began: float = 0.0
    """When the first byte of its packet was read (``time.monotonic()``; 0 if not known)."""


Joined = Callable[[str, int, float], None]
"""Hears of a message joined from several chunks: ``(topic, bytes, seconds)``, the payload bytes the connection
received after the first chunk's arrival up to the last's, and the seconds between the two."""


class ChunkSize:
    """The chunk size of a connection's next large message that is not retained (docs/wire.md): ``chunk_bytes``,
    or what the measured upload rate carries in ``seconds``, up to ``most`` and the largest packet the broker says
    it takes (less ``CHUNK_HEADROOM``). Where the broker says nothing it stays at ``chunk_bytes``."""

    def __init__(self, chunk_bytes: int, most: int, seconds: float) -> None:
        self.chunk_bytes, self.most, self.seconds = chunk_bytes, most, seconds
        self.upload_bps = 0.0
        """A moving average over the large messages the connection published (0: none yet)."""

    def now(self, broker_limit: int) -> int:
        """The size, given the broker's packet limit (0: it said none)."""
        if not broker_limit:
            return self.chunk_bytes
        most = min(self.most, broker_limit - CHUNK_HEADROOM)
        return max(self.chunk_bytes, min(most, int(self.upload_bps * self.seconds)))

    def uploaded(self, nbytes: int, seconds: float) -> None:
        """A message's publish, from its first piece to the broker's last PUBACK: a sample if it is large."""
        if nbytes < self.chunk_bytes or seconds <= 0:
            return
        rate = nbytes / seconds
        self.upload_bps = rate if not self.upload_bps else \
            (1 - UPLOAD_SMOOTHING) * self.upload_bps + UPLOAD_SMOOTHING * rate


@dataclasses.dataclass(slots=True)
class _Partial:
    count: int
    size: int
    started: float
    parts: dict[int, bytes]
    held: int = 0
    first: Arrival | None = None
    first_bytes: int = 0
    """Data bytes of the chunk that arrived first."""


class Reassembler:
    """Joins chunks per (topic, message id) within a byte budget and a timeout.

    A partial message older than ``timeout`` is dropped; when the budget would be
    exceeded, the oldest partial messages are evicted. ``dropped`` counts both by reason,
    and ``on_drop(topic, reason)`` hears of each. ``on_joined`` hears of every message joined
    from chunks whose arrivals were given, on one connection, at two different times.
    """

    def __init__(self, *, max_bytes: int, timeout: float, clock: Callable[[], float] = time.monotonic,
                 on_drop: Callable[[str, str], None] | None = None, on_joined: Joined | None = None) -> None:
        self.max_bytes = max_bytes
        self.timeout = timeout
        self._clock = clock
        self._on_drop = on_drop
        self._on_joined = on_joined
        self._partials: OrderedDict[tuple[str, str], _Partial] = OrderedDict()
        """In the order they started (so the oldest come first)."""
        self._held = 0
        self.dropped: dict[str, int] = {}

    @property
    def held_bytes(self) -> int:
        return self._held

    def __len__(self) -> int:
        return len(self._partials)

    def _drop(self, key: tuple[str, str], reason: str) -> None:
        partial = self._partials.pop(key)
        self._held -= partial.held
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        if self._on_drop is not None:
            self._on_drop(key[0], reason)

    def expire(self) -> None:
        now = self._clock()
        while self._partials:
            key, oldest = next(iter(self._partials.items()))
            if now - oldest.started <= self.timeout:
                return
            self._drop(key, "chunk_timeout")

    def add(self, topic: str, chunk: Chunk, arrival: Arrival | None = None) -> bytes | None:
        """Store a chunk (which arrived as ``arrival`` says, if known); return the whole payload once its last
        chunk arrives."""
        self.expire()
        if chunk.size > self.max_bytes:
            raise WireError(f"chunked message of {chunk.size} bytes exceeds the reassembly budget", "oversized")
        key = (topic, chunk.id)
        partial = self._partials.get(key)
        if partial is None:
            partial = _Partial(count=chunk.count, size=chunk.size, started=self._clock(), parts={}, first=arrival,
                               first_bytes=len(chunk.data))
            self._partials[key] = partial
        elif partial.count != chunk.count or partial.size != chunk.size:
            self._drop(key, "chunk_inconsistent")
            raise WireError("chunk header disagrees with earlier chunks of the same message", "chunk")
        if chunk.index in partial.parts:
            return None
        if partial.held + len(chunk.data) > partial.size:
            self._drop(key, "chunk_inconsistent")
            raise WireError("chunks carry more bytes than their header announced", "chunk")
        while self._held + len(chunk.data) > self.max_bytes and len(self._partials) > 1:
            oldest = next(k for k in self._partials if k != key)
            self._drop(oldest, "chunk_evicted")
        partial.parts[chunk.index] = chunk.data
        partial.held += len(chunk.data)
        self._held += len(chunk.data)
        if len(partial.parts) < partial.count:
            return None
        self._partials.pop(key)
        self._held -= partial.held
        payload = b"".join(partial.parts[i] for i in range(partial.count))
        if len(payload) != partial.size:
            raise WireError(f"reassembled {len(payload)} bytes, header said {partial.size}", "chunk")
        self._joined(topic, partial.first, arrival, partial.first_bytes)
        return payload

    def _joined(self, topic: str, first: Arrival | None, last: Arrival | None, first_bytes: int) -> None:
        """Report a joined message's spread over the connection, if it is a sample (see ``on_joined``): from the
        first chunk's arrival, or from its first byte when that is known (its own bytes then count too)."""
        if self._on_joined is None or first is None or last is None or first.connection != last.connection:
            return
        began = 0 < first.began < first.at
        seconds = last.at - (first.began if began else first.at)
        nbytes = last.received - first.received + (first_bytes if began else 0)
        if seconds > 0 and last.received > first.received:
            self._on_joined(topic, nbytes, seconds)


# --------------------------------------------------------------------------- one call per message


def frames(msg: Any, chunk_size: int) -> tuple[str, list[bytes]]:
    """A message (or ready envelope bytes) as the payloads to publish: one envelope, or its chunks;
    with its kind (``raw`` for bytes)."""
    if isinstance(msg, (bytes, bytearray)):
        return "raw", split(bytes(msg), chunk_size)
    return kind_of(msg), split(encode(msg), chunk_size)


class Receiver:
    """Received payloads to messages, one call each (``take``): the envelope (or a UTF-8 JSON body
    where allowed), chunks joined within a byte budget and a timeout, the body checked against the
    expected kind. ``dropped`` counts partial chunked messages dropped, by reason, and
    ``on_drop(topic, reason)`` hears of each: when one contradicts itself, gives way to the budget, or
    times out (checked at every ``take`` and ``expire``)."""

    def __init__(self, *, max_bytes: int, budget_bytes: int, timeout_s: float,
                 on_drop: Callable[[str, str], None] | None = None, on_joined: Joined | None = None,
                 sample_bytes: int = 0) -> None:
        self.max_bytes = max_bytes
        self.sample_bytes = sample_bytes
        """A message that came whole is a downlink sample from this size up (0: none is)."""
        self._on_joined = on_joined
        self._reassembler = Reassembler(max_bytes=budget_bytes, timeout=timeout_s, on_drop=on_drop,
                                        on_joined=on_joined)
        self.dropped = self._reassembler.dropped
        self._refused: OrderedDict[str, None] = OrderedDict()

    @property
    def partials(self) -> int:
        """Partial chunked messages held."""
        return len(self._reassembler)

    def expire(self) -> None:
        """Drop the partial chunked messages older than the timeout."""
        self._reassembler.expire()

    def take(self, topic: str, payload: bytes, expected: type[T] | tuple[type, ...], *, json_kind: str = "",
             arrival: Arrival | None = None) -> T | None:
        """The message ``payload`` completes on ``topic``, or None while its chunks are missing.

        Raises WireError (with its reason) for a payload that is not a message of ``expected``. With
        ``json_kind``, a payload that is not MessagePack may be a JSON object, the body of that kind. ``arrival``
        (when the payload was read) makes a chunked message a downlink sample.
        """
        self._reassembler.expire()
        envelope = self._envelope(topic, payload, json_kind, arrival)
        return None if envelope is None else decode_envelope(envelope, expected)

    def _envelope(self, topic: str, payload: bytes, json_kind: str, arrival: Arrival | None) -> Envelope | None:
        chunk = in_place(payload) if len(payload) <= self.max_bytes else None
        if chunk is None:
            try:
                envelope = unpack(payload, max_bytes=self.max_bytes)
            except WireError as exc:
                if exc.reason != "malformed" or not json_kind:
                    raise
                return unpack_json(payload, json_kind, max_bytes=self.max_bytes)
            if envelope.kind != CHUNK_KIND:
                self._whole(topic, len(payload), arrival)
                return envelope
            chunk = decode_envelope(envelope, Chunk)
        if chunk.id in self._refused:
            return None  # the rest of a message already counted as rejected
        if chunk.size > self.max_bytes:
            self._refused[chunk.id] = None
            while len(self._refused) > REFUSED_IDS_KEPT:
                self._refused.popitem(last=False)
            raise WireError(f"chunked message of {chunk.size} bytes exceeds the limit", "oversized")
        whole = self._reassembler.add(topic, chunk, arrival)
        if whole is None:
            return None
        inner = unpack(whole, max_bytes=self.max_bytes)
        if inner.kind == CHUNK_KIND:
            raise WireError("a chunk inside a chunk", "chunk")
        return inner

    def _whole(self, topic: str, nbytes: int, arrival: Arrival | None) -> None:
        """Report a large message that came in one packet as a downlink sample (see ``on_joined``)."""
        if self._on_joined is None or arrival is None or not self.sample_bytes or nbytes < self.sample_bytes:
            return
        if 0 < arrival.began < arrival.at:
            self._on_joined(topic, nbytes, arrival.at - arrival.began)
