"""Hostile input for ``tests/test_fuzz.py``: hypothesis strategies of junk for every topic a service consumes.

Junk is built from the real message classes and the wire encoder, so most of it is a *valid* message
with one thing wrong: a field of the wrong type or out of range, a missing field, NaN or Inf, a tensor of
the wrong shape, a body that names another device than its topic, another wire version or kind, a
payload over ``broker.max_message_bytes``, chunks that lie about their message, a replay of what a
service already applied, an update from a device the plan does not name or computed on a model version
the parameter server has not reached, a control command that is expired, unknown, out of range or
answers to a wildcard. The rest is bytes: random, empty, truncated or extended envelopes, JSON that is
not a command.

Each :class:`Junk` is published as one or more frames on one topic, and says how many rejections it
costs each service that consumes the topic (``counts``: 2 for chunks that contradict their message, the
partial message they drop and themselves; 0 for what every consumer drops by design uncounted) and which
services drop it by design without a count (``uncounted``); docs/reliability.md#hostile-input says why.

``storm(scene, topics, n)`` draws ``n`` pieces of junk for the topics, every family of ``families`` among
them; ``draw(strategy, n)`` runs hypothesis's generation (derandomized: the same every run) and collects
``n`` examples.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import struct
import time
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import msgpack
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from edgemesh.common import wire
from edgemesh.common.jobs import render_job
from edgemesh.common.messages import (
    CodecPolicy,
    ControlCommand,
    DeviceHello,
    DeviceStats,
    DeviceStatus,
    GradientUpdate,
    JobState,
    JobSubmission,
    LocalEvaluation,
    ModelDelta,
    ModelSnapshot,
    Plan,
    PlanCluster,
    PlanDevice,
    ShardUpdate,
    SyncState,
    UpdateAck,
)
from edgemesh.common.topics import CHUNK_SEGMENT, TopicKind, Topics
from edgemesh.common.wire.tensors import Tensor
from edgemesh.local.demo import DIGITS_MODEL, DIGITS_NORMALIZATION

T = TypeVar("T")

# --- the scene ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scene:
    """What the services under fuzz hold when the storm starts (the test sets it up, then checks it)."""

    job: str = "fuzz"
    worker: str = "w0"
    """The worker under fuzz: its memory holds no batch, so it is never planned and never trains."""
    member: str = "a"
    """The one device of the plan (played by the test): its update ``(incarnation, 1)`` made model version 1."""
    gateway: str = "g"
    """A device whose hello says it cannot encode: the compressor's gateway serves it (it is not planned)."""
    incarnation: int = 7
    """Incarnation of the test's devices (hello, status and updates)."""
    model_spec: str = "digits-cnn"
    layout: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Parameter name -> shape of ``model_spec``."""
    max_message_bytes: int = 192 * 1024
    """The services' ``broker.max_message_bytes``."""
    plan_version: int = 1
    """The plan in force (at least): the planner's first, naming ``member``."""
    model_version: int = 1

    @property
    def topics(self) -> Topics:
        return Topics(self.job)

    @property
    def known(self) -> tuple[str, ...]:
        """Devices every service has heard of."""
        return (self.member, self.worker, self.gateway)


@dataclass(frozen=True, slots=True)
class Junk:
    """Frames published on one topic, and what they cost its consumers."""

    topic: str
    frames: tuple[bytes, ...]
    family: str
    counts: int = 1
    """Rejections each consuming service counts for it."""
    uncounted: frozenset[str] = frozenset()
    """Services that drop it by design without a count."""
    retained_chunks: bool = False
    """Chunk ``i`` goes to ``{topic}/chunk/{i}``, as a retained chunked message does."""

    def targets(self) -> list[tuple[str, bytes]]:
        """(topic, payload) of every frame, in order."""
        if self.retained_chunks:
            return [(f"{self.topic}/{CHUNK_SEGMENT}/{i}", f) for i, f in enumerate(self.frames)]
        return [(self.topic, f) for f in self.frames]


CHUNK_ID = "fuzzfuzzfuzzfuzz"
"""Placeholder id of drawn chunks; ``number`` gives every item's chunks an id of their own."""
NAMES_BAD = ["", "a/b", "+", "#", "-lead", ".dot", "x" * 65, "sp ace", "é", "a\x00b"]
"""Names ``check_name`` refuses."""
FUTURE = 10**6
"""A model version the parameter server will not reach during the test."""
PAST = 1e9
"""Unix time in 2001: an ``expires_at`` between -PAST and PAST is long gone."""


def number(corpus: Sequence[Junk]) -> list[Junk]:
    """``corpus`` with the placeholder chunk id of each item replaced by one unique to it (hypothesis draws
    the same simple ids again and again, and chunks of one id on one topic are one message)."""
    out = []
    for i, junk in enumerate(corpus):
        unique = f"{i:016x}"
        frames = tuple(_rename_chunk(f, unique) for f in junk.frames)
        out.append(dataclasses.replace(junk, frames=frames))
    return out


def _rename_chunk(frame: bytes, unique: str) -> bytes:
    if CHUNK_ID.encode() not in frame:
        return frame
    envelope = msgpack.unpackb(frame, raw=False)
    envelope["body"]["id"] = unique
    return msgpack.packb(envelope, use_bin_type=True)


def draw(strategy: st.SearchStrategy[T], n: int) -> list[T]:
    """``n`` examples of ``strategy`` from hypothesis's generation phase, derandomized (the same every run)."""
    out: list[T] = []

    @settings(max_examples=n, derandomize=True, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(example: T) -> None:
        out.append(example)

    collect()
    return out


# --- envelopes and bodies -----------------------------------------------------------------------------


def plain(msg: Any) -> dict[str, Any]:
    """The body of ``msg`` as the wire encodes it (a plain map)."""
    return typing.cast(dict[str, Any], msgpack.unpackb(wire.encode(msg), raw=False)["body"])


def pack(kind: str, body: Any, *, version: Any = wire.WIRE_VERSION) -> bytes:
    return msgpack.packb({"v": version, "kind": kind, "body": body}, use_bin_type=True)


WRONG_VALUES: tuple[Any, ...] = (None, True, 3, -2.5, "x", b"\x01", [1, 2], {"k": 1}, msgpack.ExtType(5, b"e"))
"""Values of every type MessagePack carries; ``wrong_for(hint)`` keeps those a field of ``hint`` refuses."""


def fits(hint: Any, value: Any) -> bool:
    """Whether ``value`` has a type a field declared ``hint`` could take (its outer type only)."""
    if hint is Any:
        return True
    origin = get_origin(hint)
    if origin is Literal:
        return value in get_args(hint)
    if origin is Union or origin is types.UnionType:
        return any(fits(a, value) for a in get_args(hint))
    if origin in (tuple, list):
        return isinstance(value, list)
    if origin is dict or hint is Tensor or dataclasses.is_dataclass(hint):
        return isinstance(value, dict)
    if hint not in PLAIN_FITS:
        raise TypeError(f"no rule for {hint!r}")
    return PLAIN_FITS[hint](value)


PLAIN_FITS: dict[Any, Callable[[Any], bool]] = {
    type(None): lambda v: v is None,
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
    bytes: lambda v: isinstance(v, bytes),
}
"""The values a plain field type takes."""


def wrong_for(hint: Any) -> list[Any]:
    return [v for v in WRONG_VALUES if not fits(hint, v)]


def _float_in(hint: Any) -> bool:
    return hint is float or any(a is float for a in get_args(hint))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@dataclass(frozen=True, slots=True)
class Slot:
    """A place in a body, the keys leading to it, and the type of its value."""

    path: tuple[Any, ...]
    hint: Any
    required: bool


def slots(cls: type, body: Mapping[str, Any], path: tuple[Any, ...] = ()) -> list[Slot]:
    """Every field of ``body`` (a ``cls``) and of the dataclasses and tensors it holds, one level of lists deep."""
    hints = _hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append(Slot((*path, f.name), hint, required))
        value = body.get(f.name)
        inner = get_args(hint)
        if get_origin(hint) is tuple and inner and dataclasses.is_dataclass(inner[0]) and value:
            out += slots(inner[0], value[0], (*path, f.name, 0))
        if get_origin(hint) is dict and len(inner) == 2 and inner[1] is Tensor and value:
            key = next(iter(value))
            out += [Slot((*path, f.name, key, part), tp, True)
                    for part, tp in (("dtype", str), ("shape", list[int]), ("data", bytes))]
    return out


def _set(body: dict[str, Any], path: tuple[Any, ...], value: Any, *, delete: bool = False) -> dict[str, Any]:
    body = _copy(body)
    node: Any = body
    for key in path[:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return body


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


# --- valid messages, the seeds of junk ----------------------------------------------------------------

SEED = st.integers(0, 2**32 - 1)
Rng = np.random.Generator


def seeded(build: Callable[[Rng], T]) -> st.SearchStrategy[T]:
    """Valid messages built from one drawn seed: the fields of a valid message do not matter to junk (what is
    broken in it does, and hypothesis draws that), and one choice draws much faster than a dozen."""
    return SEED.map(lambda seed: build(np.random.default_rng(seed)))


def _inc(rng: Rng, incarnation: int | None) -> int:
    return incarnation if incarnation is not None else int(rng.integers(0, 2**40))


def hello(device: str, incarnation: int | None = None) -> st.SearchStrategy[DeviceHello]:
    return seeded(lambda r: DeviceHello(
        device=device, incarnation=_inc(r, incarnation), flops=float(r.uniform(1e3, 1e13)),
        memory_bytes=int(r.integers(1, 2**36)), cores=int(r.integers(1, 64)), can_encode=bool(r.integers(2)),
        link_rate_bps=float(r.uniform(0, 1e9)), latency_s=float(r.uniform(0, 1))))


def status(device: str, incarnation: int | None = None, state: str | None = None) -> st.SearchStrategy[DeviceStatus]:
    return seeded(lambda r: DeviceStatus(
        device=device, state=typing.cast(Any, state or ("online", "offline", "left")[int(r.integers(3))]),
        incarnation=_inc(r, incarnation), time=float(r.uniform(0, 1e9)), refused_plan=int(r.integers(0, 10)),
        reason="r" * int(r.integers(0, 20))))


def stats(device: str, incarnation: int | None = None) -> st.SearchStrategy[DeviceStats]:
    return seeded(lambda r: DeviceStats(
        device=device, incarnation=_inc(r, incarnation), step_time_s=float(r.uniform(0, 10)),
        link_rate_bps=float(r.uniform(0, 1e9)), downlink_rate_bps=float(r.uniform(0, 1e9)),
        latency_s=float(r.uniform(0, 1)), delay_index=float(r.uniform(0, 100)),
        gradient_bytes=int(r.integers(0, 2**30)), batch_size=int(r.integers(0, 512)),
        loss=float(r.uniform(0, 5)) if r.integers(2) else None,
        mesh_layer_busy_s={f"l{i}": float(r.uniform(0, 1)) for i in range(int(r.integers(0, 3)))}))


POLICIES = ("sync", "async", "ssp", "adaptive")


def plan(scene: Scene, version: int = 0) -> st.SearchStrategy[Plan]:
    m = scene.member
    return seeded(lambda r: Plan(
        version=version, created=float(r.uniform(0, 1e9)), model_spec=scene.model_spec, dataset="digits",
        sync_policy=POLICIES[int(r.integers(4))], staleness_bound=int(r.integers(0, 20)),
        devices=(PlanDevice(device=m, cluster=f"c-{m}", shard_index=0, shard_count=1, batch_size=8),),
        clusters=(PlanCluster(cluster=f"c-{m}", members=(m,)),)))


def sync_state() -> st.SearchStrategy[SyncState]:
    return seeded(lambda r: SyncState(
        policy=POLICIES[int(r.integers(4))], version=int(r.integers(0, 100)), bound=int(r.integers(0, 20)),
        deadline_s=float(r.uniform(0, 10)), delay_indices={f"d{i}": float(r.uniform(0, 10)) for i in range(3)}))


def codec_policy(device: str, version: int | None = None) -> st.SearchStrategy[CodecPolicy]:
    return seeded(lambda r: CodecPolicy(
        device=device, codec=typing.cast(Any, ("none", "fp16", "topk", "qsgd")[int(r.integers(4))]),
        density=float(r.uniform(0.001, 1.0)), version=version if version is not None else int(r.integers(0, 100)),
        gateway=bool(r.integers(2))))


def shards(scene: Scene, *, small: bool = True) -> st.SearchStrategy[tuple[ShardUpdate, ...]]:
    """Whole parameters of the model, each once, float32 (``none``): the biases alone when ``small``."""
    params = sorted(p for p, shape in scene.layout.items() if not small or len(shape) == 1)

    def build(r: Rng) -> tuple[ShardUpdate, ...]:
        chosen = r.choice(len(params), size=int(r.integers(1, min(3, len(params)) + 1)), replace=False)
        out = []
        for i in sorted(chosen):
            shape = scene.layout[params[i]]
            data = r.uniform(-1, 1, math.prod(shape)).astype(np.float32).tobytes()
            out.append(ShardUpdate(param=params[i], start=0, stop=shape[0], codec="none", data=data))
        return tuple(out)

    return seeded(build)


ZERO = st.just(0)


def gradient(scene: Scene, device: str, *, incarnation: st.SearchStrategy[int], seq: st.SearchStrategy[int],
             base: st.SearchStrategy[int], mesh_step: st.SearchStrategy[int] = ZERO,
             plan_version: st.SearchStrategy[int] = ZERO,
             shard_tuple: st.SearchStrategy[tuple[ShardUpdate, ...]] | None = None
             ) -> st.SearchStrategy[GradientUpdate]:
    """An update of ``device`` (its cluster ``c-{device}``), whole biases unless ``shard_tuple`` says."""
    return st.builds(GradientUpdate, device=st.just(device), cluster=st.just(f"c-{device}"), incarnation=incarnation,
                     seq=seq, base_version=base, samples=st.integers(1, 64),
                     shards=shard_tuple if shard_tuple is not None else shards(scene), loss=st.floats(0, 5),
                     need_snapshot=st.booleans(), mesh_step=mesh_step, plan_version=plan_version)


def snapshot(scene: Scene, version: int = 0, *, whole: bool = False) -> st.SearchStrategy[ModelSnapshot]:
    """A snapshot of zeros: of the whole model, or (small, for junk built from it) of its biases."""
    tensors = {p: Tensor(dtype="float16", shape=s, data=bytes(2 * math.prod(s))) for p, s in scene.layout.items()
               if whole or len(s) == 1}
    return seeded(lambda r: ModelSnapshot(version=version, model_spec=scene.model_spec, tensors=tensors,
                                          created=float(r.uniform(0, 1e9))))


def delta(scene: Scene, *, version: int, base: int) -> st.SearchStrategy[ModelDelta]:
    return st.builds(ModelDelta, version=st.just(version), base_version=st.just(base),
                     model_spec=st.just(scene.model_spec), shards=shards(scene))


def ack(device: str) -> st.SearchStrategy[UpdateAck]:
    return seeded(lambda r: UpdateAck(
        device=device, incarnation=int(r.integers(0, 2**40)), seq=int(r.integers(0, 10**6)),
        status=typing.cast(Any, ("accepted", "discarded", "duplicate")[int(r.integers(3))]),
        version=int(r.integers(0, 100)), delay=int(r.integers(0, 10)), resync=bool(r.integers(2))))


def command() -> st.SearchStrategy[ControlCommand]:
    """A command every service answers (``status``), the seed of junk commands."""
    return seeded(lambda r: ControlCommand(command="status", request_id=str(r.integers(0, 10**6)),
                                           requester=("operator", "fuzz")[int(r.integers(2))]))


def job_source(name: str) -> bytes:
    """A valid job file (digits) naming job ``name``."""
    return render_job({"job": {"name": name, "max_versions": 100}, "model": DIGITS_MODEL,
                       "data": {"format": "digits", **DIGITS_NORMALIZATION}}).encode()


def submission(name: str, source: bytes, sha: str | None = None) -> JobSubmission:
    """A submission of job ``name``: ``source`` with its hash (or ``sha``)."""
    return JobSubmission(name=name, source=source, submitted_at=time.time(),
                         sha256=sha if sha is not None else hashlib.sha256(source).hexdigest())


def job_state(name: str) -> st.SearchStrategy[JobState]:
    return seeded(lambda r: JobState(
        name=name, state=typing.cast(Any, ("queued", "running", "paused", "finished")[int(r.integers(4))]),
        version=int(r.integers(0, 100)), accuracy=float(r.uniform(0, 1)) if r.integers(2) else None))


def evaluation(device: str) -> st.SearchStrategy[LocalEvaluation]:
    return seeded(lambda r: LocalEvaluation(device=device, version=int(r.integers(0, 100)),
                                            samples=int(r.integers(10, 100)), correct=int(r.integers(0, 10)),
                                            loss_sum=float(r.uniform(0, 1e3))))


# --- what is wrong with each class (their ``validate``) ----------------------------------------------

NEGATIVE = [-1, -(2**40)]
OUT_OF_RANGE: dict[type, dict[str, list[Any]]] = {
    DeviceHello: {"device": NAMES_BAD, "incarnation": NEGATIVE, "flops": [0, -1.0], "memory_bytes": [0, -5],
                  "cores": [0, -1], "link_rate_bps": [-1.0], "downlink_rate_bps": [-0.5], "latency_s": [-1e-3]},
    DeviceStatus: {"device": NAMES_BAD, "refused_plan": NEGATIVE},
    DeviceStats: {"device": NAMES_BAD, "steps": NEGATIVE, "step_time_s": [-1.0], "comm_time_s": [-1.0],
                  "delay_index": [-0.1], "link_rate_bps": [-1.0], "downlink_rate_bps": [-1.0], "latency_s": [-1e-3],
                  "rss_bytes": NEGATIVE, "gradient_bytes": NEGATIVE, "upload_time_s": [-1.0], "compute_flops": [-1.0],
                  "mesh_layer_busy_s": [{"": 1.0}, {"x" * 257: 1.0}, {"l": -1.0}]},
    Plan: {"version": NEGATIVE, "round_time_s": [-1.0], "staleness_bound": NEGATIVE, "drained": [["+"]],
           "devices": [[{"device": "zz", "cluster": "nowhere", "shard_index": 0, "shard_count": 1, "batch_size": 8}],
                       [{"device": "zz", "cluster": "c-zz", "shard_index": 3, "shard_count": 1, "batch_size": 8}],
                       [{"device": "zz", "cluster": "c-zz", "shard_index": 0, "shard_count": 1, "batch_size": 0}]],
           "clusters": [[{"cluster": "c-a", "members": []}], [{"cluster": "c-a", "members": ["a", "a"]}],
                        [{"cluster": "c-a", "members": ["a", "b"]}], []]},
    SyncState: {"version": NEGATIVE, "bound": NEGATIVE, "deadline_s": [-1.0],
                "delay_indices": [{"+": 1.0}, {"d": -1.0}], "slow": [["#"]]},
    CodecPolicy: {"device": NAMES_BAD, "density": [0.0, -0.5, 1.5], "grid_levels": NEGATIVE},
    GradientUpdate: {"device": NAMES_BAD, "cluster": NAMES_BAD, "incarnation": NEGATIVE, "seq": NEGATIVE,
                     "base_version": NEGATIVE, "mesh_step": NEGATIVE, "plan_version": NEGATIVE, "samples": [0, -3],
                     "shards": [[], [{"param": "", "start": 0, "stop": 1, "codec": "none", "data": b""}],
                                [{"param": "p", "start": 3, "stop": 3, "codec": "none", "data": b""}],
                                [{"param": "p", "start": -1, "stop": 3, "codec": "none", "data": b""}],
                                [{"param": "p", "start": 0, "stop": 1, "codec": "zip", "data": b""}]]},
    UpdateAck: {"device": NAMES_BAD, "status": ["maybe"], "reason": ["because"]},
    ModelSnapshot: {"version": NEGATIVE, "tensors": [{}], "sync_policy": ["never"]},
    ModelDelta: {"base_version": NEGATIVE, "version": [0], "shards": [[]]},
    ControlCommand: {"command": ["", "c" * 65], "requester": NAMES_BAD[1:], "device": NAMES_BAD[1:],
                     "reply_to": ["a/+/b", "#", "edgemesh/v1/x/#", "t/" + "x" * 1100, "a\x00b"],
                     "request_id": ["r" * 5000]},
    JobSubmission: {"name": NAMES_BAD, "sha256": ["", "abc"], "submitted_at": [-1.0], "params": NEGATIVE,
                    "layers": [[{"name": "l", "units": 0, "macs_per_unit": 1, "params_per_unit": 1, "out_per_unit": 1,
                                 "gathered_per_unit": 1, "in_values": 1}]]},
    JobState: {"name": NAMES_BAD, "version": NEGATIVE, "devices": [["+"]], "device_errors": [{"#": "x"}]},
    LocalEvaluation: {"device": NAMES_BAD, "samples": NEGATIVE, "correct": [10**6]},
}
"""Per message class, values of a field that its ``validate()`` refuses."""


# --- junk of any message ------------------------------------------------------------------------------


PICK = st.integers(0, 2**16)
"""A selector: ``choice % len(options)`` picks one of a list built at draw time."""
EXTRA_BYTES = st.binary(min_size=1, max_size=8)


def _pick(options: Sequence[T], choice: int) -> T:
    return options[choice % len(options)]


def garbage() -> st.SearchStrategy[bytes]:
    """Bytes that are no envelope: random, empty, or MessagePack of something else."""
    ints = st.integers(-(2**63), 2**64 - 1)  # what MessagePack carries
    not_envelopes = st.one_of(ints, st.text(max_size=20), st.lists(ints, max_size=4),
                              st.dictionaries(st.sampled_from(["v", "kind", "x"]), ints, max_size=2))
    return st.one_of(st.binary(max_size=200), st.just(b""), not_envelopes.map(lambda o: msgpack.packb(o)),
                     st.just(b"\x01 this is not an EdgeMesh envelope"))


WRONG_VERSIONS = (0, 2, 99, -1, "1", None, 1.5, 2**64 - 1)
WRONG_BODIES = (3, "body", [1], None, b"\0")


@st.composite
def envelope_junk(d: st.DrawFn, seed: st.SearchStrategy[Any]) -> list[tuple[str, bytes]]:
    """A valid message's envelope broken as a whole, every way: truncated, extended, another version, another
    kind, an unknown kind, a body that is no map, no body."""
    msg = d(seed)
    kind, body, encoded = wire.kind_of(msg), plain(msg), wire.encode(msg)
    choice = d(PICK)
    others = [k for k in sorted(wire.registered_kinds()) if k not in (kind, wire.CHUNK_KIND)]
    return [("truncated", encoded[:1 + choice % (len(encoded) - 1)]),
            ("extended", encoded + d(EXTRA_BYTES)),
            ("version", pack(kind, body, version=_pick(WRONG_VERSIONS, choice))),
            ("kind", pack(_pick(others, choice), body)),
            ("kind", pack(_pick(["", "gradients", "Hello", "x" * 5000, "chunk2"], choice), body)),
            ("body", pack(kind, _pick(WRONG_BODIES, choice))),
            ("no_body", msgpack.packb({"v": 1, "kind": kind}))]


FIELD_WAYS = ("type", "type", "missing", "nan", "range", "range", "tensor")
NANS = (math.nan, math.inf, -math.inf)
BAD_TENSORS = (
    ("dtype", {"dtype": "complex64", "shape": [1], "data": b"\0" * 8}),
    ("dtype", {"dtype": "object", "shape": [1], "data": b"\0" * 8}),
    ("shape", {"dtype": "float32", "shape": [2, 2], "data": b"\0" * 12}),
    ("shape", {"dtype": "float32", "shape": [-1], "data": b""}),
    ("shape", {"dtype": "float32", "shape": [1] * 9, "data": b"\0" * 4}),
    ("nan", {"dtype": "float32", "shape": [2], "data": struct.pack("<2f", 1.0, math.nan)}),
    ("nan", {"dtype": "float16", "shape": [1], "data": np.float16(np.inf).tobytes()}),
    ("nan", {"dtype": "float64", "shape": [1], "data": struct.pack("<d", -math.inf)}),
)


@st.composite
def field_junk(d: st.DrawFn, seed: st.SearchStrategy[Any]) -> list[tuple[str, bytes]]:
    """A valid message with one field wrong, every way it can be for the drawn way and field: each value of
    a wrong type, missing, each of NaN and the Infs, each value out of range, each bad tensor."""
    msg = d(seed)
    cls, body, kind = type(msg), plain(msg), wire.kind_of(msg)
    places = slots(cls, body)
    way = d(st.sampled_from(FIELD_WAYS))
    choice = d(PICK)
    if way == "missing" and any(s.required for s in places):
        required = [s for s in places if s.required]
        return [(way, pack(kind, _set(body, _pick(required, choice + i).path, None, delete=True))) for i in range(3)]
    if way == "nan" and any(_float_in(s.hint) for s in places):
        where = _pick([s for s in places if _float_in(s.hint)], choice)
        return [(way, pack(kind, _set(body, where.path, nan))) for nan in NANS]
    if way == "range" and cls in OUT_OF_RANGE:
        name, values = _pick(sorted(OUT_OF_RANGE[cls].items()), choice)
        return [(way, pack(kind, _set(body, (name,), value))) for value in values]
    tensors = [s for s in places if len(s.path) == 3 and s.path[-1] == "data"]
    if way == "tensor" and tensors:
        return [(reason, pack(kind, _set(body, tensors[0].path[:2], bad))) for reason, bad in BAD_TENSORS]
    where = _pick([s for s in places if wrong_for(s.hint)], choice)
    values = wrong_for(where.hint)
    return [("type", pack(kind, _set(body, where.path, _pick(values, choice + i))))
            for i in range(min(3, len(values)))]


@st.composite
def oversized(d: st.DrawFn, seed: st.SearchStrategy[Any], limit: int) -> bytes:
    """A valid message padded (with a field no one reads) just past ``limit`` bytes."""
    msg = d(seed)
    return pack(wire.kind_of(msg), {**plain(msg), "pad": b"\0" * (limit + 1 + d(PICK) % 4096)})


def _chunk(id_: str, index: int, count: int, size: int, data: bytes) -> bytes:
    return pack(wire.CHUNK_KIND, {"id": id_, "index": index, "count": count, "size": size, "data": data})


def _pieces(payload: bytes, n: int) -> list[bytes]:
    step = -(-len(payload) // n)
    return [payload[i:i + step] for i in range(0, len(payload), step)]


BAD_CHUNK_FIELDS = ({"index": 9}, {"index": -1}, {"count": 0}, {"size": -1}, {"id": ""}, {"id": "i" * 65},
                    {"data": "text"}, {"count": "2"})


@st.composite
def chunk_junk(d: st.DrawFn, topic: str, inner: st.SearchStrategy[bytes], limit: int) -> list[Junk]:
    """Chunked messages that are junk, every way for a drawn payload: too large, nested, contradicting
    themselves, never completed, joining into junk, one chunk larger than its message, a bad chunk field.
    Each chunk id is the placeholder (``number``)."""
    payload = d(inner)
    payload = payload if len(payload) >= 4 else payload + b"\xc1\xc1\xc1\xc1"
    choice = d(PICK)
    retained = d(st.booleans())
    parts = _pieces(payload, 2 + choice % 3)
    n = len(parts)
    nested = _chunk("inner", 0, 1, len(payload), payload)
    pieces = _pieces(nested, n)
    ways: dict[str, tuple[list[bytes], int]] = {
        # refused at its first chunk, the rest dropped silently
        "chunk_oversized": ([_chunk(CHUNK_ID, i, n, limit + 1 + choice, p) for i, p in enumerate(parts)], 1),
        "chunk_nested": ([_chunk(CHUNK_ID, i, len(pieces), len(nested), p) for i, p in enumerate(pieces)], 1),
        # the second disagrees: the partial message is dropped, and the chunk refused
        "chunk_inconsistent": ([_chunk(CHUNK_ID, 0, n, len(payload), parts[0]),
                                _chunk(CHUNK_ID, 1, n + 1 + choice % 3, len(payload), parts[1])], 2),
        # never completed: dropped when it times out
        "chunk_partial": ([_chunk(CHUNK_ID, i, n, len(payload), p)
                           for i, p in enumerate(parts[:1 + choice % (n - 1)])], 1),
        "chunk_inner": ([_chunk(CHUNK_ID, i, n, len(payload), p) for i, p in enumerate(parts)], 1),
        "chunk_liar": ([_chunk(CHUNK_ID, 0, 2, len(parts[0]) - 1, parts[0] + b"\0")], 1),
        "chunk_field": ([pack(wire.CHUNK_KIND, {"id": CHUNK_ID, "index": 0, "count": n, "size": len(payload),
                                                "data": parts[0], **_pick(BAD_CHUNK_FIELDS, choice)})], 1),
    }
    return [Junk(topic, tuple(frames), way, counts, retained_chunks=retained)
            for way, (frames, counts) in ways.items()]


def json_junk() -> st.SearchStrategy[bytes]:
    """What ``mosquitto_pub`` may put on a control topic that is no command."""
    fixed = st.sampled_from([
        b"[1, 2]", b"3", b'"status"', b"null", b"{", b"\xff\xfe{}", b"{}", b'{"command": 3}',
        b'{"command": "status", "request_id": 12}', b'{"command": "status", "expires_at": NaN}',
        b'{"command": "status", "value": Infinity}', b'{"command": "status", "reply_to": "x/#"}',
        b'{"command": "status", "requester": "a/b"}',
    ])
    digits = st.integers(20, 6000).map(lambda n: b"9" * n)
    huge = st.one_of(
        digits.map(lambda n: b'{"command": "status", "request_id": ' + n + b"}"),
        digits.map(lambda n: b'{"command": "status", "expires_at": ' + n + b"}"),
        digits.map(lambda n: b'{"command": "set-bound", "value": ' + n + b"}"),
        digits.map(lambda n: b'{"command": "status", "value": -' + n + b"}"),
    )
    nested = st.integers(10, 200_000).map(lambda n: b"[" * n + b"]" * n)
    return st.one_of(fixed, huge, nested)


# --- per topic family ----------------------------------------------------------------------------------


def _device(topic: str) -> str:
    parts = topic.split("/")
    return parts[-2] if parts[-1] in ("hello", "status", "stats", "evaluation") else parts[-1]


SEEDS: dict[TopicKind, Callable[[Scene, str], st.SearchStrategy[Any]]] = {
    "hello": lambda s, t: hello(_device(t)),
    "status": lambda s, t: status(_device(t)),
    "stats": lambda s, t: stats(_device(t)),
    "evaluation": lambda s, t: evaluation(_device(t)),
    "plan": lambda s, t: plan(s),
    "sync": lambda s, t: sync_state(),
    "codec": lambda s, t: codec_policy(_device(t)),
    "grad": lambda s, t: gradient(s, _device(t), incarnation=st.integers(0, 2**40), seq=st.integers(0, 10**6),
                                  base=st.integers(0, 10)),
    "grad_raw": lambda s, t: gradient(s, _device(t), incarnation=st.integers(0, 2**40), seq=st.integers(0, 10**6),
                                      base=st.integers(0, 10)),
    "model": lambda s, t: snapshot(s),
    "delta": lambda s, t: delta(s, version=1, base=0),
    "ack": lambda s, t: ack(_device(t)),
    "control": lambda s, t: command(),
    "job": lambda s, t: st.builds(submission, st.just(t.split("/")[2]), st.just(job_source("other")),
                                  st.just("0" * 64)),
    "job_state": lambda s, t: job_state(t.split("/")[2]),
}
"""Valid messages of each topic family a service may consume (given the topic): the seeds of junk."""


def generic(scene: Scene, topic: str, kind: TopicKind) -> dict[str, st.SearchStrategy[list[Junk]]]:
    """Junk any topic of ``kind`` gets, by family: bytes, and a valid message of its class broken in one way."""
    out: dict[str, st.SearchStrategy[list[Junk]]] = {
        "garbage": st.lists(garbage(), min_size=1, max_size=4).map(lambda bs: [Junk(topic, (b,), "garbage")
                                                                              for b in bs])}
    if kind == "control":
        out["json"] = st.lists(json_junk(), min_size=1, max_size=3).map(lambda bs: [Junk(topic, (b,), "json")
                                                                                    for b in bs])
    if kind not in SEEDS:
        return out
    seed = SEEDS[kind](scene, topic)
    out["envelope"] = envelope_junk(seed).map(lambda fbs: [Junk(topic, (b,), f) for f, b in fbs])
    out["field"] = field_junk(seed).map(lambda fbs: [Junk(topic, (b,), f) for f, b in fbs])
    out["oversized"] = oversized(seed, scene.max_message_bytes).map(lambda b: [Junk(topic, (b,), "oversized")])
    inner = st.one_of(garbage().filter(bool), field_junk(seed).map(lambda fbs: fbs[0][1]))
    out["chunk"] = chunk_junk(topic, inner, scene.max_message_bytes)
    if kind in ("hello", "status", "stats", "evaluation", "codec", "grad", "grad_raw", "ack"):
        out["topic"] = seed.map(lambda msg: [Junk(topic, (pack(wire.kind_of(msg), {**plain(msg),
                                                                                  "device": "zz-other"}),), "topic")])
    return out


# --- junk that only the service's own rules refuse ------------------------------------------------------


def _msg(topic: str, family: str, *, counts: int = 1, uncounted: frozenset[str] = frozenset()
         ) -> Callable[[Any], Junk]:
    return lambda msg: Junk(topic, (msg if isinstance(msg, bytes) else wire.encode(msg),), family, counts, uncounted)


def semantic(scene: Scene, kind: TopicKind) -> list[st.SearchStrategy[Junk]]:
    """Valid messages a service must still refuse (replays, unknown devices, future versions, commands it
    refuses), for the topics of ``kind``."""
    return SEMANTIC[kind](scene) if kind in SEMANTIC else []


def _grad_junk(scene: Scene) -> list[st.SearchStrategy[Junk]]:
    """Gradients the parameter server refuses: from an unknown device, replays, from the future, a model-parallel
    part alone."""
    t, m, inc = scene.topics, scene.member, scene.incarnation
    replay = st.one_of(st.tuples(st.just(inc), st.integers(0, 1)), st.tuples(st.integers(0, inc - 1),
                                                                             st.integers(0, 10**6)))
    bad_payloads = st.one_of(
        shards(scene),
        st.sampled_from(sorted(scene.layout)).flatmap(lambda p: st.sampled_from([
            ShardUpdate(param=p, start=0, stop=scene.layout[p][0] + 1, codec="none", data=b""),
            ShardUpdate(param=p, start=0, stop=1, codec="none", data=b"\0" * 3),
            ShardUpdate(param=p, start=0, stop=1, codec="fp16", data=b"\0"),
            ShardUpdate(param=p, start=0, stop=1, codec="none",
                        data=np.full(math.prod(scene.layout[p][1:]), np.nan, np.float32).tobytes()),
            ShardUpdate(param="nope", start=0, stop=1, codec="none", data=b"\0" * 4),
        ])).map(lambda s: (s,)),
        shards(scene).map(lambda s: (*s, s[0])),  # a shard twice
        st.tuples(st.sampled_from(["topk", "threshold", "qsgd", "grid"]), st.binary(max_size=64)).map(
            lambda cb: (ShardUpdate(param="fc2.bias", start=0, stop=10, codec=cb[0], data=cb[1]),)),
    )
    return [
        # an update from a device the plan does not name
        gradient(scene, "zz", incarnation=st.integers(0, 9), seq=st.integers(0, 99), base=st.integers(0, 1),
                 shard_tuple=bad_payloads).map(_msg(t.grad("c-zz", "zz"), "unknown_device")),
        # a replay of the member's applied update (or one of an older incarnation), any payload
        replay.flatmap(lambda iq: gradient(scene, m, incarnation=st.just(iq[0]), seq=st.just(iq[1]),
                                           base=st.integers(0, 1), shard_tuple=bad_payloads)
                       ).map(_msg(t.grad(f"c-{m}", m), "replay")),
        # computed on a model version the server has not reached
        gradient(scene, m, incarnation=st.just(inc), seq=st.integers(2, 10**6), base=st.integers(2, FUTURE),
                 shard_tuple=bad_payloads).map(_msg(t.grad(f"c-{m}", m), "future")),
        # a model-parallel part of a step whose other members never come (the biases alone)
        gradient(scene, m, incarnation=st.just(inc), seq=st.integers(2, 10**6), base=st.just(1),
                 mesh_step=st.integers(1, 10**6), plan_version=st.sampled_from([0, scene.plan_version]),
                 shard_tuple=shards(scene)).map(_msg(t.grad(f"c-{m}", m), "mesh_partial")),
    ]


def _grad_raw_junk(scene: Scene) -> list[st.SearchStrategy[Junk]]:
    """Raw updates the gateway refuses: from devices it does not serve, an older incarnation, bad shards."""
    t, m, inc = scene.topics, scene.member, scene.incarnation
    g = scene.gateway
    raw_bad = st.one_of(
        shards(scene).map(lambda s: (dataclasses.replace(s[0], codec="fp16"), *s[1:])),
        shards(scene).map(lambda s: (dataclasses.replace(s[0], data=s[0].data + b"\0"), *s[1:])),
        shards(scene).map(lambda s: (*s, s[0])),
    )
    return [
        # raw updates from devices the gateway does not serve (their hello says they encode, or none came)
        st.sampled_from([m, scene.worker, "zz"]).flatmap(lambda dev: gradient(
            scene, dev, incarnation=st.just(inc), seq=st.integers(2, 99), base=st.just(1)).map(
            _msg(t.grad_raw(f"c-{dev}", dev), "unknown_device"))),
        # from an older incarnation of the gateway device
        gradient(scene, g, incarnation=st.integers(0, inc - 1), seq=st.integers(0, 99), base=st.just(1)).map(
            _msg(t.grad_raw(f"c-{g}", g), "incarnation")),
        gradient(scene, g, incarnation=st.just(inc), seq=st.integers(0, 99), base=st.just(1),
                 shard_tuple=raw_bad).map(_msg(t.grad_raw(f"c-{g}", g), "raw_payload")),
    ]


def _plan_junk(scene: Scene) -> list[st.SearchStrategy[Junk]]:
    """An older plan: replayed (the planner drops its own topic's old plans uncounted)."""
    t = scene.topics
    return [plan(scene, version=0).map(_msg(t.plan(), "replay", uncounted=frozenset({"planner"})))]


def _codec_junk(scene: Scene) -> list[st.SearchStrategy[Junk]]:
    """An older policy (the compressor drops its own topic's old policies uncounted)."""
    t = scene.topics
    return [st.sampled_from(scene.known).flatmap(lambda dev: codec_policy(dev, version=0).map(
        _msg(t.codec(dev), "replay", uncounted=frozenset({"compressor"}))))]


def _stats_junk(scene: Scene) -> list[st.SearchStrategy[Junk]]:
    """Stats of a device that never said hello, and of an older incarnation."""
    t, m, inc = scene.topics, scene.member, scene.incarnation
    return [stats("zz").map(_msg(t.stats("zz"), "unknown_device")),
            stats(m, incarnation=inc - 1).filter(lambda s: s.incarnation > 0).map(
                _msg(t.stats(m), "old_incarnation", counts=0))]


def _hello_junk(scene: Scene) -> list[st.SearchStrategy[Junk]]:
    """A late hello of an older incarnation."""
    t, m, inc = scene.topics, scene.member, scene.incarnation
    return [hello(m, incarnation=inc - 2).map(_msg(t.hello(m), "old_incarnation", counts=0))]


def _status_junk(scene: Scene) -> list[st.SearchStrategy[Junk]]:
    """A late offline status of an older incarnation."""
    t, m, inc = scene.topics, scene.member, scene.incarnation
    return [status(m, incarnation=inc - 2, state="offline").map(_msg(t.status(m), "old_incarnation", counts=0))]


def _model_junk(scene: Scene) -> list[st.SearchStrategy[Junk]]:
    """Model snapshots a worker refuses: a replay, another model, the wrong shapes."""
    t = scene.topics
    return [
        snapshot(scene, version=0, whole=True).map(_msg(t.model(), "replay", counts=0)),
        snapshot(scene).map(lambda s: dataclasses.replace(s, model_spec="cifar-cnn")).map(
            _msg(t.model(), "other_model")),
        snapshot(scene).map(lambda s: dataclasses.replace(s, tensors={
            k: Tensor(dtype="float32", shape=(1,), data=b"\0" * 4) for k in s.tensors})).map(
            _msg(t.model(), "shape")),
    ]


def _delta_junk(scene: Scene) -> list[st.SearchStrategy[Junk]]:
    """Model deltas a worker refuses: a replay, a gap, another model, a shard its codec cannot decode."""
    t = scene.topics
    return [
        delta(scene, version=1, base=0).map(_msg(t.model_delta(), "replay", counts=0)),
        delta(scene, version=FUTURE, base=FUTURE - 1).map(_msg(t.model_delta(), "gap", counts=0)),
        delta(scene, version=scene.model_version + 1, base=scene.model_version).map(
            lambda dl: dataclasses.replace(dl, model_spec="cifar-cnn")).map(_msg(t.model_delta(), "other_model")),
        delta(scene, version=scene.model_version + 1, base=scene.model_version).map(
            lambda dl: dataclasses.replace(dl, shards=(dataclasses.replace(dl.shards[0], data=b"\0\0\0"),))).map(
            _msg(t.model_delta(), "codec")),
    ]


def _ack_junk(scene: Scene) -> list[st.SearchStrategy[Junk]]:
    """An ack of an update the worker never sent."""
    t = scene.topics
    return [ack(scene.worker).map(_msg(t.ack(scene.worker), "stray_ack", counts=0))]


def _job_junk(scene: Scene) -> list[st.SearchStrategy[Junk]]:
    """Job files the hosts refuse: a forged hash, a broken file, one naming another job, another job's."""
    t = scene.topics
    name = scene.job
    return [
        st.builds(lambda: submission(name, job_source(name), "0" * 64)).map(_msg(t.job_file(), "forged_hash")),
        st.binary(max_size=300).map(lambda src: submission(name, src)).map(_msg(t.job_file(), "job_file")),
        st.builds(lambda: submission(name, job_source("other"))).map(_msg(t.job_file(), "names_another")),
        st.builds(lambda: submission("other", job_source("other"))).map(_msg(t.job_file(), "topic")),
    ]


def _job_state_junk(scene: Scene) -> list[st.SearchStrategy[Junk]]:
    """Another job's state on this job's topic."""
    t = scene.topics
    return [job_state("other").map(_msg(t.job_state(), "topic"))]


SEMANTIC: dict[str, Callable[[Scene], list[st.SearchStrategy[Junk]]]] = {
    "grad": _grad_junk,
    "grad_raw": _grad_raw_junk,
    "plan": _plan_junk,
    "codec": _codec_junk,
    "stats": _stats_junk,
    "hello": _hello_junk,
    "status": _status_junk,
    "model": _model_junk,
    "delta": _delta_junk,
    "ack": _ack_junk,
    "job": _job_junk,
    "job_state": _job_state_junk,
}
"""Topic kind -> valid messages a service must still refuse on its topics."""


def commands(scene: Scene, target: str) -> st.SearchStrategy[Junk]:
    """Control commands its target refuses: expired, unknown, out of range, of the wrong value type."""
    topic = scene.topics.control(target)
    known = {"status", "stop", "pause", "resume", "set-sync-policy", "set-bound", "set-lr", "snapshot", "replan",
             "drain-device", "undrain-device", "set-codec"}
    refused: dict[str, list[tuple[str, Any]]] = {
        "ps": [("set-bound", v) for v in (-1, "4", 2.5, True, None)] + [("set-lr", v) for v in (0, -1, 10, 1e9, "x",
                                                                                                  True, None)]
        + [("set-sync-policy", v) for v in ("fast", 1, None)],
        "planner": [("drain-device", v) for v in (None, 3, "a/b", "")] + [("undrain-device", None)],
        "compressor": [("set-codec", v) for v in (None, 3, "zip")],
        "job": [(c, None) for c in ("status", "pause", "resume", "stop")],
    }
    refused["all"] = refused["ps"]  # the parameter server refuses their values, the others the commands
    refused[f"device/{scene.worker}"] = [("pause", None), ("set-lr", 0.1)]
    unknown = st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=64).filter(lambda c: c not in known)
    plain_cmd = st.one_of(unknown.map(lambda c: (c, None)), st.sampled_from(refused[target]))
    reply = st.sampled_from(["", scene.topics.control_reply("fuzz")])

    @st.composite
    def build(d: st.DrawFn) -> Junk:
        expired = d(st.booleans())
        name, value = (d(st.sampled_from(sorted(known))), None) if expired else d(plain_cmd)
        cmd = ControlCommand(command=name, value=value, request_id=d(st.text("0123456789", max_size=6)),
                             requester="fuzz", reply_to=d(reply),
                             expires_at=d(st.floats(-PAST, PAST).filter(bool)) if expired else 0.0)
        if d(st.booleans()):  # as an operator types it
            body = {k: v for k, v in plain(cmd).items() if v not in ("", None, 0.0) or k == "command"}
            return Junk(topic, (json.dumps(body).encode(),), "expired" if expired else "refused")
        return Junk(topic, (wire.encode(cmd),), "expired" if expired else "refused")

    return build()


def families(scene: Scene, topics: Mapping[str, TopicKind]) -> list[tuple[str, str, st.SearchStrategy[list[Junk]]]]:
    """(topic, family, strategy) of every kind of junk for ``topics`` (topic -> its family of topics); each
    strategy draws a few pieces of junk at once."""
    table = []
    oversized: set[TopicKind] = set()  # one topic of a family is enough: each is 200 KiB
    for topic, kind in topics.items():
        table += [(topic, name, strategy) for name, strategy in generic(scene, topic, kind).items()
                  if name != "oversized" or kind not in oversized]
        oversized.add(kind)
        if kind == "control":
            table.append((topic, "command", st.lists(commands(scene, topic.split("/control/", 1)[1]), min_size=1,
                                                     max_size=4)))
        if topic in _semantic_topics(scene, kind):
            table += [(topic, f"semantic{i}", st.lists(strategy, min_size=1, max_size=3))
                      for i, strategy in enumerate(semantic(scene, kind))]
    return table


WEIGHTS = {"garbage": 2, "json": 2, "envelope": 2, "field": 3, "oversized": 1, "chunk": 1, "topic": 2, "command": 8}
"""How often each family of junk is drawn, relative to one (the semantic families: 4)."""
SLICE = 40
"""Table entries drawn together in one hypothesis example (larger examples overrun its choice buffer)."""


def storm(scene: Scene, topics: Mapping[str, TopicKind], n: int) -> list[Junk]:
    """At least ``n`` pieces of junk for ``topics``, every family of ``families`` in each round, each as often
    as ``WEIGHTS`` says; hypothesis draws what is inside (derandomized: the same every run), and the rounds
    are interleaved so that the first ``n`` hold every family."""
    weighted = [strategy for _, family, strategy in families(scene, topics) for _ in range(WEIGHTS.get(family, 4))]
    rounds = -(-n // (3 * len(weighted))) + 1  # each entry draws about three
    slices = [draw(st.tuples(*weighted[i:i + SLICE]), rounds) for i in range(0, len(weighted), SLICE)]
    out = [junk for r in range(rounds) for drawn in slices if r < len(drawn) for batch in drawn[r] for junk in batch]
    return number(out[:n])


def _semantic_topics(scene: Scene, kind: TopicKind) -> set[str]:
    """The topics of ``kind`` the semantic junk goes to (it names its own)."""
    t = scene.topics
    return {"grad": {t.grad(f"c-{scene.member}", scene.member)}, "plan": {t.plan()}, "model": {t.model()},
            "delta": {t.model_delta()}, "ack": {t.ack(scene.worker)}, "job": {t.job_file()},
            "job_state": {t.job_state()}, "grad_raw": {t.grad_raw(f"c-{scene.gateway}", scene.gateway)},
            "codec": {t.codec(scene.worker)}, "stats": {t.stats(scene.member)}, "hello": {t.hello(scene.member)},
            "status": {t.status(scene.member)}}.get(kind, set())
