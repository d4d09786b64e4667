"""The wire format (docs/wire.md): envelopes, every message kind, tensors, rejections, chunking.

Pure unit tests: no broker. Every rejection asserts the ``WireError.reason`` a service counts it
under, because operators read those labels on the ``rejected_total`` metrics.
"""

from __future__ import annotations

import dataclasses
import json
import math

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edgemesh.common import wire
from edgemesh.common.costs import LayerCost
from edgemesh.common.errors import WireError
from edgemesh.common.messages import (
    CodecPolicy,
    ControlCommand,
    ControlReply,
    DeviceHello,
    DeviceStats,
    DeviceStatus,
    Event,
    GradientUpdate,
    JobState,
    JobSubmission,
    LayerDivision,
    LinkProbe,
    LocalEvaluation,
    MeshBegin,
    MeshReady,
    MeshSlice,
    ModelDelta,
    ModelSnapshot,
    NormPart,
    PairPart,
    Plan,
    PlanCluster,
    PlanDevice,
    ShardNorms,
    ShardSteps,
    ShardUpdate,
    SnapshotRequest,
    StepDiscard,
    StepPart,
    StepRecord,
    SyncState,
    UpdateAck,
)
from edgemesh.common.wire.chunks import Arrival, Chunk, Reassembler, Receiver, in_place, split
from edgemesh.common.wire.tensors import MAX_TENSOR_DIMS, TENSOR_DTYPES, Tensor

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
"""Hypothesis settings that keep the whole file well under a few seconds."""


# --------------------------------------------------------------------------- realistic messages


def _f32(*shape: int, seed: int = 0) -> Tensor:
    rng = np.random.default_rng(seed)
    return Tensor.from_numpy(rng.standard_normal(shape).astype(np.float32))


def _grad_bytes(n: int) -> bytes:
    return np.linspace(-1, 1, n, dtype=np.float32).tobytes()


HELLO = DeviceHello(device="pi4-07", incarnation=3, flops=2.5e9, memory_bytes=3 << 30, cores=4,
                    platform="aarch64", software="edgemesh 0.1.0", can_encode=False,
                    link_rate_bps=1.25e6, profile="pi4")
STATUS = DeviceStatus(device="pi4-07", state="offline", incarnation=3, time=1_717_000_000.5)
STATS = DeviceStats(device="jetson-1", incarnation=1, time=1_717_000_001.0, steps=420, step_time_s=0.031,
                    comm_time_s=0.012, delay_index=1.75, link_rate_bps=4e6, rss_bytes=512 << 20,
                    cpu_temp_c=61.5, model_version=418, loss=0.3125, batch_size=32, bytes_sent=9_000_000,
                    upload_time_s=0.004, downlink_rate_bps=9.5e6, latency_s=0.0021)
PLAN = Plan(version=7, created=1_717_000_002.0, model_spec="digits-cnn", dataset="digits",
            partition="dirichlet", partition_alpha=0.3, seed=11, sync_policy="adaptive", staleness_bound=3,
            devices=(PlanDevice(device="pi-a", cluster="c0", shard_index=0, shard_count=2, batch_size=16),
                     PlanDevice(device="pi-b", cluster="c1", shard_index=1, shard_count=2, batch_size=8)),
            clusters=(PlanCluster(cluster="c0", members=("pi-a",)), PlanCluster(cluster="c1", members=("pi-b",))),
            reason="join pi-b", drained=("pi-z",), batching="balanced", round_time_s=0.05)
CODEC = CodecPolicy(device="pi-a", codec="grid", density=0.05, grid_levels=4, version=2, gateway=True,
                    reason="link 0.3 MB/s")
GRADIENT = GradientUpdate(
    device="pi-a", cluster="c0", incarnation=2, seq=17, base_version=415, samples=32,
    shards=(ShardUpdate(param="conv1.weight", start=0, stop=8, codec="none", data=_grad_bytes(8 * 9)),
            ShardUpdate(param="fc.bias", start=2, stop=10, codec="fp16",
                        data=np.ones(8, dtype="<f2").tobytes())),
    loss=0.42, step_time_s=0.05, sent_at=1_717_000_003.25)
MODEL = ModelSnapshot(version=416, model_spec="digits-cnn",
                      tensors={"conv1.weight": _f32(8, 1, 3, 3), "conv1.bias": _f32(8, seed=1),
                               "fc.weight": _f32(10, 32, seed=2), "fc.bias": _f32(10, seed=3)},
                      created=1_717_000_004.0, sync_policy="sync")
DELTA = ModelDelta(version=417, base_version=416, model_spec="digits-cnn",
                   shards=(ShardUpdate(param="conv1.weight", start=0, stop=8, codec="fp16",
                                       data=np.zeros(72, dtype="<f2").tobytes()),),
                   created=1_717_000_004.5)
ACK = UpdateAck(device="pi-a", incarnation=2, seq=17, status="discarded", reason="stale", version=420, delay=5,
                resync=True)
CONTROL = ControlCommand(command="set-bound", value=4, device="pi-a", request_id="r-1", requester="ops-laptop",
                         reply_to="edgemesh/v1/lab/control-reply/ops-laptop", expires_at=1_717_000_060.0)
REPLY = ControlReply(request_id="r-1", source="ps", command="set-bound", ok=True, message="bound is 4",
                     result={"bound": 4, "policy": "ssp", "lr": 0.05, "paused": False, "note": None})
EVENT = Event(kind="replan", source="planner", time=1_717_000_005.0, message="pi-b joined",
              data={"version": 7, "devices": 2, "reason": "join", "ratio": 0.5, "forced": True})
CHUNK = Chunk(id="0123456789abcdef", index=1, count=3, size=2500, data=b"\x00\x01" * 500)
SYNC = SyncState(policy="adaptive", version=420, bound=3, deadline_s=0.42,
                 delay_indices={"pi-a": 0.25, "pi-b": 2.75}, slow=("pi-b",), time=1_717_000_006.0)
REFUSAL = DeviceStatus(device="pi3-02", state="online", incarnation=4, time=1_717_000_007.0, refused_plan=9,
                       reason="needs 812 MiB for batch 128, has 700 MiB")

MESH_PLAN = Plan(version=12, created=1_717_000_008.0, model_spec="cifar-cnn", dataset="synthetic-cifar",
                 sync_policy="sync", devices=(
                     PlanDevice(device="pi3-0", cluster="m-pi3-0", shard_index=0, shard_count=2, batch_size=32),
                     PlanDevice(device="pi5-0", cluster="m-pi3-0", shard_index=0, shard_count=2, batch_size=32),
                     PlanDevice(device="laptop-0", cluster="c-laptop-0", shard_index=1, shard_count=2, batch_size=32)),
                 clusters=(PlanCluster(cluster="m-pi3-0", members=("pi3-0", "pi5-0"), predicted_iteration_s=0.21,
                                       division=(LayerDivision(layer="conv1", counts=(9, 23)),
                                                 LayerDivision(layer="fc2", counts=(3, 7)))),
                           PlanCluster(cluster="c-laptop-0", members=("laptop-0",))),
                 round_time_s=0.21)
MESH_BEGIN = MeshBegin(cluster="m-pi3-0", device="pi3-0", plan_version=12, step=1_717_000_008_123, model_version=40)
MESH_READY = MeshReady(cluster="m-pi3-0", device="pi5-0", plan_version=12)
MESH_SLICE = MeshSlice(cluster="m-pi3-0", plan_version=12, step=1_717_000_008_123, layer="conv2", phase="bwd",
                       sender=1, tensor=_f32(4, 9, 16, 16))
SNAPSHOT_REQUEST = SnapshotRequest(device="pi5-2", version=431)
PROBE = LinkProbe(device="pi5-2", incarnation=4, time=1_717_000_009.0)
MESH_STATS = DeviceStats(device="pi5-0", incarnation=2, steps=10, step_time_s=0.2, compute_flops=8.1e9,
                         mesh_layer_busy_s={"conv1": 0.012, "conv2": 0.031})
MESH_GRADIENT = GradientUpdate(device="pi5-0", cluster="m-pi3-0", incarnation=2, seq=5, base_version=40, samples=32,
                               shards=(ShardUpdate(param="conv1.bias", start=9, stop=32, codec="none",
                                                   data=_grad_bytes(23)),), mesh_step=1_717_000_008_123,
                               plan_version=12)

JOB = JobSubmission(name="shapes", source=b'[job]\nname = "shapes"\n', sha256="ab" * 32, submitted_at=1.7e9,
                    requester="operator", params=38_282, macs_per_sample=337_536, activations_per_sample=7_434,
                    layers=(LayerCost("conv1", 16, 576, 10, 64, 64, 64),), refusal="")
JOB_STATE = JobState(name="shapes", state="running", sha256="ab" * 32, submitted_at=1.7e9, started_at=1.7e9 + 2,
                     version=41, accuracy=0.87, loss=0.4, devices=("pi-01", "pi-02"), bytes_received=2_400_000,
                     target_accuracy=0.9, device_errors={"pi-03": "data path '/data/shapes' does not exist"})
LOCAL_EVALUATION = LocalEvaluation(device="pi-01", version=40, samples=120, correct=101, loss_sum=48.2)
LEFT = DeviceStatus(device="pi-03", state="left", time=1.7e9, reason="image-folder: unknown class folder 'hexagon'")
SHARD_STEPS = ShardSteps(version=421, policy="adaptive", steps=(
    StepRecord(version=420, parts=(StepPart(device="pi-a", incarnation=7, seq=12, weight=0.375),)),
    StepRecord(version=421, rule="krum", parts=(StepPart(device="pi-a", incarnation=7, seq=13, weight=0.25),
                                                StepPart(device="pi-b", incarnation=2, seq=40, weight=0.125,
                                                         excluded=True)))),
    discards=(StepDiscard(device="pi-c", incarnation=1, seq=9, reason="stale", delay=5),))
SHARD_NORMS = ShardNorms(shard=1, parts=(NormPart(device="pi-a", incarnation=7, seq=13, squared=0.0425, pairs=(
    PairPart(device="pi-b", incarnation=2, seq=40, squared=0.0031),)),))
EXAMPLES = [HELLO, STATUS, STATS, PLAN, CODEC, GRADIENT, MODEL, DELTA, ACK, CONTROL, REPLY, EVENT, CHUNK, SYNC,
            REFUSAL, MESH_PLAN, MESH_BEGIN, MESH_READY, MESH_SLICE, MESH_STATS, MESH_GRADIENT, JOB, JOB_STATE,
            LOCAL_EVALUATION, LEFT, SNAPSHOT_REQUEST, PROBE, SHARD_STEPS, SHARD_NORMS]


def test_examples_cover_every_registered_kind() -> None:
    """A new message kind must get a realistic example here (and so a round-trip test)."""
    assert {wire.kind_of(m) for m in EXAMPLES} == set(wire.registered_kinds())
    for kind, cls in wire.registered_kinds().items():
        assert wire.kind_of(cls) == kind


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: wire.kind_of(m))
def test_every_kind_round_trips(msg: object) -> None:
    payload = wire.encode(msg)
    decoded = wire.decode(payload, type(msg))
    assert decoded == msg
    assert type(decoded) is type(msg)
    # the envelope is plain MessagePack any client can read
    raw = msgpack.unpackb(payload, raw=False)
    assert raw["v"] == wire.WIRE_VERSION and raw["kind"] == wire.kind_of(msg)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: wire.kind_of(m))
def test_every_kind_renders_as_json_with_bytes_shown_by_length(msg: object) -> None:
    text = json.dumps(wire.to_json_dict(msg))
    assert "\\u0000" not in text  # raw bytes never leak into log lines
    for f in dataclasses.fields(msg):  # type: ignore[arg-type]
        assert f.name in json.loads(text)


def test_model_snapshot_tensors_keep_float32_values_bitwise() -> None:
    decoded = wire.decode(wire.encode(MODEL), ModelSnapshot)
    for name, tensor in MODEL.tensors.items():
        got = decoded.tensors[name].to_numpy()
        assert got.dtype == np.float32 and got.shape == tensor.shape
        assert got.tobytes() == tensor.to_numpy().tobytes()


def test_gradient_update_shards_round_trip_in_order() -> None:
    decoded = wire.decode(wire.encode(GRADIENT), GradientUpdate)
    assert [(s.param, s.start, s.stop, s.codec) for s in decoded.shards] == [
        ("conv1.weight", 0, 8, "none"), ("fc.bias", 2, 10, "fp16")]
    assert np.array_equal(np.frombuffer(decoded.shards[0].data, dtype="<f4"), np.linspace(-1, 1, 72,
                                                                                          dtype=np.float32))


def test_decode_accepts_any_of_several_expected_kinds() -> None:
    assert wire.decode(wire.encode(STATUS), (DeviceHello, DeviceStatus)) == STATUS


def test_defaults_fill_fields_an_older_sender_leaves_out() -> None:
    payload = wire.pack("hello", {"device": "pi-1", "incarnation": 0, "flops": 1e9, "memory_bytes": 1 << 30})
    hello = wire.decode(payload, DeviceHello)
    assert (hello.cores, hello.can_encode, hello.link_rate_bps, hello.profile) == (1, True, 0.0, "")


def test_unknown_body_fields_and_envelope_keys_are_ignored() -> None:
    """Forward compatibility: a newer sender may add fields with defaults."""
    body = {**msgpack.unpackb(wire.encode(ACK), raw=False)["body"], "new_field": [1, 2, {"x": b"y"}]}
    payload = msgpack.packb({"v": 1, "kind": "ack", "body": body, "trace": "abc"}, use_bin_type=True)
    assert wire.decode(payload, UpdateAck) == ACK


def test_an_int_is_accepted_for_a_float_field() -> None:
    payload = wire.pack("hello", {"device": "pi-1", "incarnation": 0, "flops": 1000000000, "memory_bytes": 1})
    hello = wire.decode(payload, DeviceHello)
    assert hello.flops == 1e9 and isinstance(hello.flops, float)


def test_scalar_fields_keep_their_json_type() -> None:
    for value in (None, True, 3, 2.5, "ssp"):
        cmd = wire.decode(wire.encode(dataclasses.replace(CONTROL, value=value)), ControlCommand)
        assert cmd.value == value and type(cmd.value) is type(value)


def test_numpy_scalars_encode_as_plain_numbers() -> None:
    stats = dataclasses.replace(STATS, steps=np.int64(5), loss=np.float32(0.5))
    decoded = wire.decode(wire.encode(stats), DeviceStats)
    assert decoded.steps == 5 and decoded.loss == 0.5


# --------------------------------------------------------------------------- never pickle


class _NotAMessage:
    def __init__(self) -> None:
        self.device = "pi-1"


@pytest.mark.parametrize("obj", [_NotAMessage(), {"device": "pi-1"}, PlanDevice(
    device="a", cluster="c", shard_index=0, shard_count=1, batch_size=1), _f32(2), DeviceHello],
    ids=["object", "dict", "unregistered-dataclass", "tensor", "message-class"])
def test_encoding_anything_but_a_registered_message_raises_type_error(obj: object) -> None:
    with pytest.raises(TypeError):
        wire.encode(obj)


def test_a_message_holding_an_arbitrary_object_is_not_pickled() -> None:
    with pytest.raises(TypeError):
        wire.encode(dataclasses.replace(EVENT, data={"x": _NotAMessage()}))  # type: ignore[dict-item]


# --------------------------------------------------------------------------- tensors


_DTYPES = st.sampled_from(TENSOR_DTYPES)


@st.composite
def _arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = np.dtype(draw(_DTYPES))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
    elements = None
    if dtype.kind == "f":
        elements = st.floats(allow_nan=False, allow_infinity=False, width=dtype.itemsize * 8)
    return draw(hnp.arrays(dtype, shape, elements=elements))


@FAST
@given(array=_arrays(), big_endian=st.booleans())
def test_tensor_round_trips_any_dtype_and_shape(array: np.ndarray, big_endian: bool) -> None:
    source = array.astype(array.dtype.newbyteorder(">")) if big_endian and array.dtype.itemsize > 1 else array
    tensor = Tensor.from_numpy(source)
    assert tensor.dtype == array.dtype.name and tensor.shape == array.shape
    assert len(tensor.data) == array.size * array.dtype.itemsize
    snap = ModelSnapshot(version=0, model_spec="m", tensors={"t": tensor})
    got = wire.decode(wire.encode(snap), ModelSnapshot).tensors["t"].to_numpy()
    assert got.dtype == array.dtype and got.shape == array.shape
    assert np.array_equal(got, array)


def test_tensor_bytes_are_little_endian_and_c_ordered() -> None:
    array = np.arange(6, dtype=">i4").reshape(2, 3).T  # big-endian and not contiguous
    tensor = Tensor.from_numpy(array)
    assert tensor.shape == (3, 2)
    assert tensor.data == np.ascontiguousarray(array).astype("<i4").tobytes()


def test_to_numpy_is_read_only() -> None:
    with pytest.raises(ValueError):
        _f32(3).to_numpy()[0] = 1.0


@pytest.mark.parametrize("dtype", [np.complex64, np.uint16, object])
def test_from_numpy_refuses_dtypes_that_cannot_travel(dtype: type) -> None:
    with pytest.raises(WireError) as exc:
        Tensor.from_numpy(np.zeros(2, dtype=dtype))
    assert exc.value.reason == "dtype"


# --------------------------------------------------------------------------- rejections


def _reason(payload: bytes, expected: type | tuple[type, ...] = DeviceHello, **kw: int) -> str:
    with pytest.raises(WireError) as exc:
        wire.decode(payload, expected, **kw)
    return exc.value.reason


def _hello_body(**changes: object) -> dict[str, object]:
    body = msgpack.unpackb(wire.encode(HELLO), raw=False)["body"]
    body.update(changes)
    return body


def _model_with(tensor: dict[str, object]) -> bytes:
    body = msgpack.unpackb(wire.encode(MODEL), raw=False)["body"]
    body["tensors"]["fc.bias"] = tensor
    return wire.pack("model", body)


@pytest.mark.parametrize("payload", [
    b"",
    b"\xc1",  # a byte MessagePack never uses
    b"hello world",
    b'{"kind": "hello"}',
    wire.encode(HELLO)[:-7],  # truncated
    wire.encode(HELLO) + b"\x00",  # trailing garbage
    msgpack.packb([1, "hello", {}]),
    msgpack.packb({"v": 1, "kind": "hello"}),  # no body
    msgpack.packb({"v": 1, "kind": 5, "body": {}}),
    msgpack.packb({"v": 1, "kind": "hello", "body": [1, 2]}),
    msgpack.packb({1: 1}),  # non-string map key
], ids=["empty", "reserved-byte", "text", "json", "truncated", "trailing", "array", "no-body", "int-kind",
        "list-body", "int-key"])
def test_payloads_that_are_not_envelopes_are_malformed(payload: bytes) -> None:
    assert _reason(payload) == "malformed"


def test_a_payload_over_the_limit_is_oversized_before_parsing() -> None:
    payload = wire.encode(MODEL)
    assert _reason(payload, ModelSnapshot, max_bytes=len(payload) - 1) == "oversized"
    assert wire.decode(payload, ModelSnapshot, max_bytes=len(payload)) == MODEL


@pytest.mark.parametrize("version", [0, 2, "1", None])
def test_another_envelope_version_is_refused(version: object) -> None:
    payload = msgpack.packb({"v": version, "kind": "hello", "body": _hello_body()}, use_bin_type=True)
    assert _reason(payload) == "version"


def test_unknown_kind_is_refused() -> None:
    assert _reason(wire.pack("hello-v2", _hello_body())) == "kind"


def test_a_kind_other_than_the_expected_one_is_refused() -> None:
    assert _reason(wire.encode(STATUS), (DeviceHello, GradientUpdate)) == "kind"
    assert _reason(wire.encode(CHUNK), GradientUpdate) == "kind"


@pytest.mark.parametrize("body", [
    {k: v for k, v in _hello_body().items() if k != "device"},
    {k: v for k, v in _hello_body().items() if k != "flops"},
    _hello_body(incarnation="3"),
    _hello_body(incarnation=1.0),
    _hello_body(incarnation=True),
    _hello_body(can_encode=1),
    _hello_body(flops="fast"),
    _hello_body(flops=None),
    _hello_body(device=b"pi-1"),
    _hello_body(platform="x" * (wire.MAX_STR + 1)),
    _hello_body(incarnation=-1),
    _hello_body(flops=0.0),
    _hello_body(memory_bytes=0),
    _hello_body(cores=0),
    _hello_body(link_rate_bps=-1.0),
    _hello_body(device="pi/1"),
    _hello_body(device="pi+1"),
    _hello_body(device="#"),
    _hello_body(device=""),
    _hello_body(device="x" * 65),
], ids=["missing-device", "missing-flops", "str-int", "float-int", "bool-int", "int-bool", "str-float",
        "none-float", "bytes-str", "long-str", "negative-incarnation", "zero-flops", "zero-memory", "zero-cores",
        "negative-link", "slash-device", "plus-device", "hash-device", "empty-device", "long-device"])
def test_hello_field_errors(body: dict[str, object]) -> None:
    assert _reason(wire.pack("hello", body)) == "field"


@pytest.mark.parametrize("msg", [
    dataclasses.replace(GRADIENT, seq=-1),
    dataclasses.replace(GRADIENT, base_version=-3),
    dataclasses.replace(GRADIENT, samples=0),
    dataclasses.replace(GRADIENT, shards=()),
    dataclasses.replace(GRADIENT, cluster="c/0"),
    dataclasses.replace(GRADIENT, shards=(dataclasses.replace(GRADIENT.shards[0], start=5, stop=5),)),
    dataclasses.replace(GRADIENT, shards=(dataclasses.replace(GRADIENT.shards[0], start=-1),)),
    dataclasses.replace(GRADIENT, shards=(dataclasses.replace(GRADIENT.shards[0], param=""),)),
    dataclasses.replace(GRADIENT, shards=(dataclasses.replace(GRADIENT.shards[0], codec="zip"),)),
], ids=["negative-seq", "negative-base", "no-samples", "no-shards", "bad-cluster", "empty-shard",
        "negative-start", "empty-param", "unknown-codec"])
def test_gradient_field_errors(msg: GradientUpdate) -> None:
    assert _reason(wire.encode(msg), GradientUpdate) == "field"


def test_a_model_parallel_members_part_for_a_shard_holding_none_of_its_rows_is_empty() -> None:
    """With a sharded parameter server a member sends each shard a part of every step, and each shard sends it a
    part of every delta: empty where the shard holds none of its rows. Only those may be empty."""
    assert wire.decode(wire.encode(dataclasses.replace(MESH_GRADIENT, shards=())), GradientUpdate).shards == ()
    assert wire.decode(wire.encode(dataclasses.replace(DELTA, shards=())), ModelDelta).shards == ()


@pytest.mark.parametrize("msg", [
    dataclasses.replace(STATUS, state="away"),
    dataclasses.replace(CODEC, density=0.0),
    dataclasses.replace(CODEC, density=1.5),
    dataclasses.replace(PLAN, devices=PLAN.devices + PLAN.devices[:1]),
    dataclasses.replace(PLAN, devices=(dataclasses.replace(PLAN.devices[0], cluster="c9"),)),
    dataclasses.replace(PLAN, devices=(dataclasses.replace(PLAN.devices[0], shard_index=2),)),
    dataclasses.replace(PLAN, clusters=(PlanCluster(cluster="c0", members=()),)),
    dataclasses.replace(PLAN, drained=("a+b",)),
    dataclasses.replace(MODEL, tensors={}),
    dataclasses.replace(CONTROL, command=""),
    dataclasses.replace(CONTROL, requester="ops/laptop"),
    dataclasses.replace(CONTROL, value=[1, 2]),
    dataclasses.replace(REPLY, result={"x": {"nested": 1}}),
    dataclasses.replace(CHUNK, index=3),
    dataclasses.replace(CHUNK, id=""),
    dataclasses.replace(SHARD_NORMS, parts=(dataclasses.replace(SHARD_NORMS.parts[0], pairs=(
        PairPart(device="pi-b", incarnation=2, seq=40, squared=-1.0),)),)),
    dataclasses.replace(SHARD_NORMS, parts=(dataclasses.replace(SHARD_NORMS.parts[0], pairs=(
        PairPart(device="pi-b", incarnation=2, seq=40, squared=0.5),) * 10_001),)),
], ids=["status-state", "zero-density", "big-density", "device-twice", "undeclared-cluster", "shard-index",
        "empty-cluster", "drained-name", "empty-model", "empty-command", "bad-requester", "list-value",
        "nested-result", "chunk-index", "chunk-id", "negative-distance", "too-many-distances"])
def test_other_field_errors(msg: object) -> None:
    assert _reason(wire.encode(msg), type(msg)) == "field"


@pytest.mark.parametrize("msg", [
    dataclasses.replace(HELLO, flops=math.nan),
    dataclasses.replace(HELLO, link_rate_bps=math.inf),
    dataclasses.replace(STATS, loss=math.nan),
    dataclasses.replace(STATS, cpu_temp_c=-math.inf),
    dataclasses.replace(GRADIENT, loss=math.nan),
    dataclasses.replace(CONTROL, value=math.inf),
    dataclasses.replace(EVENT, data={"ratio": math.nan}),
], ids=["flops", "link-rate", "optional-loss", "optional-temp", "grad-loss", "scalar-value", "event-data"])
def test_nan_or_inf_float_fields_are_refused_as_nan(msg: object) -> None:
    assert _reason(wire.encode(msg), type(msg)) == "nan"


@pytest.mark.parametrize("dtype,bad", [("float32", np.nan), ("float32", np.inf), ("float16", -np.inf),
                                       ("float64", np.nan)])
def test_a_float_tensor_holding_nan_or_inf_is_refused(dtype: str, bad: float) -> None:
    values = np.array([0.5, bad, 1.0], dtype=dtype)
    tensor = {"dtype": dtype, "shape": [3], "data": values.tobytes()}
    assert _reason(_model_with(tensor), ModelSnapshot) == "nan"


@pytest.mark.parametrize("tensor", [
    {"dtype": "float32", "shape": [10], "data": b"\x00" * 39},
    {"dtype": "float32", "shape": [10], "data": b"\x00" * 44},
    {"dtype": "float32", "shape": [2, 5], "data": b"\x00" * 20},
    {"dtype": "int64", "shape": [10], "data": b"\x00" * 40},
    {"dtype": "float32", "shape": [-10], "data": b""},
    {"dtype": "float32", "shape": [1] * (MAX_TENSOR_DIMS + 1), "data": b"\x00" * 4},
], ids=["short", "long", "wrong-shape", "wrong-itemsize", "negative-dim", "too-many-dims"])
def test_a_tensor_whose_bytes_disagree_with_dtype_and_shape_is_refused(tensor: dict[str, object]) -> None:
    assert _reason(_model_with(tensor), ModelSnapshot) == "shape"


@pytest.mark.parametrize("dtype", ["complex64", "object", "float8", ""])
def test_a_tensor_of_unknown_dtype_is_refused(dtype: str) -> None:
    tensor = {"dtype": dtype, "shape": [2], "data": b"\x00" * 8}
    assert _reason(_model_with(tensor), ModelSnapshot) == "dtype"


@pytest.mark.parametrize("tensor", [
    [1, 2, 3],
    {"dtype": "float32", "shape": [1]},
    {"dtype": "float32", "shape": 4, "data": b"\x00" * 16},
    {"dtype": "float32", "shape": [4.0], "data": b"\x00" * 16},
    {"dtype": "float32", "shape": [4], "data": "0000"},
], ids=["list", "no-data", "int-shape", "float-dim", "str-data"])
def test_a_tensor_that_is_not_a_tensor_map_is_a_field_error(tensor: object) -> None:
    assert _reason(_model_with(tensor), ModelSnapshot) == "field"  # type: ignore[arg-type]


# --------------------------------------------------------------------------- JSON control commands


def test_a_json_control_command_decodes() -> None:
    payload = json.dumps({"command": "set-bound", "value": 4}).encode()
    cmd = wire.decode_envelope(wire.unpack_json(payload, "control", max_bytes=1 << 16), ControlCommand)
    assert cmd == ControlCommand(command="set-bound", value=4)
    assert cmd.requester == "operator" and cmd.expires_at == 0.0


def test_a_json_control_command_is_validated_like_msgpack() -> None:
    payload = json.dumps({"command": "drain", "device": "pi/1"}).encode()
    with pytest.raises(WireError) as exc:
        wire.decode_envelope(wire.unpack_json(payload, "control", max_bytes=1 << 16), ControlCommand)
    assert exc.value.reason == "field"
    nan = b'{"command": "set-lr", "value": NaN}'
    with pytest.raises(WireError) as exc:
        wire.decode_envelope(wire.unpack_json(nan, "control", max_bytes=1 << 16), ControlCommand)
    assert exc.value.reason == "nan"


@pytest.mark.parametrize("payload", [
    b"set-bound 4",
    b'["set-bound", 4]',
    b'"set-bound"',
    b"4",
    b"\xff\xfe{}",
    b'{"command": ',
    b"[" * 100_000,  # deep nesting must not escape as RecursionError and kill the consume loop
    b'{"a":' * 100_000,
], ids=["text", "array", "string", "number", "not-utf8", "truncated", "deep-array", "deep-object"])
def test_json_that_is_not_an_object_is_malformed(payload: bytes) -> None:
    with pytest.raises(WireError) as exc:
        wire.unpack_json(payload, "control", max_bytes=1 << 20)
    assert exc.value.reason == "malformed"


@pytest.mark.parametrize("body", [
    b'{"command": "status", "request_id": ' + b"9" * 5000 + b"}",  # json.loads: ValueError past 4,300 digits
    b'{"command": "status", "expires_at": ' + b"9" * 400 + b"}",  # float(): OverflowError
    b'{"command": "set-bound", "value": ' + b"9" * 400 + b"}",  # an int MessagePack cannot carry
    b'{"command": "status", "value": -' + b"9" * 30 + b"}",
], ids=["digits", "float-overflow", "huge-int", "huge-negative"])
def test_json_numbers_beyond_what_msgpack_carries_are_refused_not_raised(body: bytes) -> None:
    """Issue 14 (fuzz): these escaped as ValueError and OverflowError and ended the router of every service."""
    with pytest.raises(WireError) as exc:
        wire.decode_envelope(wire.unpack_json(body, "control", max_bytes=1 << 20), ControlCommand)
    assert exc.value.reason in ("malformed", "field")


def test_oversized_json_is_refused() -> None:
    with pytest.raises(WireError) as exc:
        wire.unpack_json(b'{"command": "pause"}', "control", max_bytes=10)
    assert exc.value.reason == "oversized"


def test_from_json_body_builds_a_validated_message() -> None:
    assert wire.from_json_body(ControlCommand, {"command": "pause", "device": "pi-1"}).device == "pi-1"
    with pytest.raises(WireError):
        wire.from_json_body(ControlCommand, {"command": "pause", "device": "pi+1"})


# --------------------------------------------------------------------------- chunking


def _chunks(parts: list[bytes]) -> list[Chunk]:
    return [wire.decode(p, Chunk) for p in parts]


def test_split_keeps_a_small_payload_whole() -> None:
    payload = wire.encode(HELLO)
    assert split(payload, len(payload)) == [payload]


def test_split_chunks_carry_id_index_count_and_size_within_the_limit() -> None:
    payload = wire.encode(MODEL)
    size = 1024
    parts = split(payload, size)
    chunks = _chunks(parts)
    assert len(parts) == -(-len(payload) // size)
    assert [c.index for c in chunks] == list(range(len(parts)))
    assert {c.count for c in chunks} == {len(parts)} and {c.size for c in chunks} == {len(payload)}
    assert len({c.id for c in chunks}) == 1
    assert all(len(c.data) <= size for c in chunks)
    assert all(len(p) <= size + 128 for p in parts)  # the header is a small, fixed overhead
    assert b"".join(c.data for c in chunks) == payload
    assert split(payload, size)[0] != parts[0]  # each split gets a fresh message id


@FAST
@given(payload=st.binary(max_size=3000), chunk_size=st.integers(1, 400), data=st.data())
def test_split_and_reassemble_in_any_order_with_duplicates(payload: bytes, chunk_size: int,
                                                           data: st.DataObject) -> None:
    parts = split(payload, chunk_size)
    if len(payload) <= chunk_size:
        assert parts == [payload]
        return
    chunks = _chunks(parts)
    order = data.draw(st.permutations(range(len(chunks))))
    dupes = data.draw(st.lists(st.integers(0, len(chunks) - 1), max_size=10))
    deliveries = list(order)
    for d in dupes:  # a duplicate goes anywhere after its first delivery
        first = deliveries.index(d)
        deliveries.insert(data.draw(st.integers(first + 1, len(deliveries))), d)
    r = Reassembler(max_bytes=len(payload), timeout=60.0)
    results = []
    seen: set[int] = set()
    for i in deliveries:
        seen.add(i)
        out = r.add("edgemesh/v1/j/model", chunks[i])
        if out is not None:
            results.append((len(seen), out))
            break
        assert r.held_bytes <= r.max_bytes
    assert results == [(len(chunks), payload)]
    assert r.held_bytes == 0 and len(r) == 0 and r.dropped == {}


def test_a_received_chunk_is_read_in_place_its_data_a_view_of_the_packet() -> None:
    payload = wire.encode(MODEL)
    packets = [bytearray(p) for p in split(payload, 1024)]  # as paho reads them: each into a buffer of its own
    chunks = [in_place(p) for p in packets]
    assert all(c is not None for c in chunks)
    assert [dataclasses.replace(c, data=bytes(c.data)) for c in chunks] == _chunks([bytes(p) for p in packets])
    for chunk, packet in zip(chunks, packets, strict=True):
        assert isinstance(chunk.data, memoryview) and chunk.data.obj is packet  # no copy of the data
        assert packet.endswith(chunk.data)
    r = Receiver(max_bytes=1 << 20, budget_bytes=1 << 20, timeout_s=60.0)
    taken = [r.take("t", p, ModelSnapshot) for p in packets]
    assert taken[:-1] == [None] * (len(packets) - 1) and taken[-1] == MODEL


@pytest.mark.parametrize("body", [
    {"id": "a", "index": "0", "count": 2, "size": 10, "data": b"x"},  # a field of the wrong type
    {"id": "a", "index": 0, "count": 2, "size": 10, "data": "x"},  # data that is no bin
    {"id": "a", "index": 3, "count": 2, "size": 10, "data": b"x"},  # an index past the count
    {"index": 0, "id": "a", "count": 2, "size": 10, "data": b"x"},  # fields in another order
    {"id": "a", "index": 0, "count": 2, "size": 10, "data": b"x", "more": 1},  # a newer sender's field
])
def test_a_chunk_not_laid_out_as_split_lays_it_out_is_read_whole_and_judged_as_before(body: dict) -> None:
    payload = msgpack.packb({"v": wire.WIRE_VERSION, "kind": wire.CHUNK_KIND, "body": body}, use_bin_type=True)
    assert in_place(bytearray(payload)) is None
    r = Receiver(max_bytes=1 << 20, budget_bytes=1 << 20, timeout_s=60.0)
    try:
        out = r.take("t", bytearray(payload), ModelSnapshot)
    except WireError as exc:  # what the whole envelope's checks say of it
        assert exc.reason in {"field", "malformed"}
    else:
        assert out is None and r.partials == 1  # a good chunk, held for the rest of its message
    truncated = split(wire.encode(MODEL), 1024)[0][:40]  # cut within its fields
    assert in_place(bytearray(truncated)) is None
    with pytest.raises(WireError):
        r.take("t", truncated, ModelSnapshot)


def test_interleaved_messages_and_topics_reassemble_separately() -> None:
    a, b = b"A" * 1000, b"B" * 1000
    ca, cb = _chunks(split(a, 300)), _chunks(split(b, 300))
    same_id_other_topic = [dataclasses.replace(c, data=c.data.lower()) for c in ca]
    r = Reassembler(max_bytes=10_000, timeout=60.0)
    done = []
    for x, y, z in zip(ca, cb, same_id_other_topic, strict=True):
        done += [r.add("t/1", x), r.add("t/1", y), r.add("t/2", z)]
    assert [d for d in done if d is not None] == [a, b, a.lower()]
    assert r.held_bytes == 0


def _clock() -> tuple[list[float], Reassembler]:
    now = [0.0]
    return now, Reassembler(max_bytes=10_000, timeout=5.0, clock=lambda: now[0])


def test_a_partial_message_older_than_the_timeout_is_dropped() -> None:
    now, r = _clock()
    chunks = _chunks(split(b"x" * 1000, 400))
    assert r.add("t", chunks[0]) is None
    assert r.held_bytes == 400 and len(r) == 1
    now[0] = 5.0
    r.expire()
    assert len(r) == 1  # not yet older than the timeout
    now[0] = 5.01
    r.expire()
    assert r.held_bytes == 0 and len(r) == 0
    assert r.dropped == {"chunk_timeout": 1}
    # the rest arrives late: the message is never delivered, only held until it times out too
    assert r.add("t", chunks[1]) is None and r.add("t", chunks[2]) is None
    now[0] = 20.0
    r.expire()
    assert r.held_bytes == 0 and r.dropped == {"chunk_timeout": 2}


def test_adding_a_chunk_expires_stale_partials() -> None:
    now, r = _clock()
    old = _chunks(split(b"o" * 1000, 400))
    r.add("t", old[0])
    now[0] = 100.0
    new = _chunks(split(b"n" * 500, 400))
    assert r.add("t", new[0]) is None
    assert r.dropped == {"chunk_timeout": 1}
    assert r.add("t", new[1]) == b"n" * 500
    assert r.held_bytes == 0


def test_the_byte_budget_evicts_the_oldest_partial() -> None:
    r = Reassembler(max_bytes=1000, timeout=60.0)
    a = _chunks(split(b"a" * 800, 400))
    b = _chunks(split(b"b" * 800, 400))
    c = _chunks(split(b"c" * 800, 400))
    r.add("t", a[0])
    r.add("t", b[0])
    assert r.held_bytes == 800
    r.add("t", c[0])  # 1200 > 1000: a (the oldest) goes
    assert r.dropped == {"chunk_evicted": 1} and r.held_bytes == 800
    assert r.add("t", b[1]) == b"b" * 800  # b still completes
    assert r.add("t", a[1]) is None  # a was evicted
    assert r.held_bytes <= r.max_bytes


def test_a_message_larger_than_the_budget_is_oversized() -> None:
    r = Reassembler(max_bytes=500, timeout=60.0)
    with pytest.raises(WireError) as exc:
        r.add("t", _chunks(split(b"z" * 501, 100))[0])
    assert exc.value.reason == "oversized"
    assert r.held_bytes == 0


@pytest.mark.parametrize("change", [{"count": 4}, {"size": 999}], ids=["count", "size"])
def test_inconsistent_chunk_headers_raise_and_drop_the_partial(change: dict[str, int]) -> None:
    r = Reassembler(max_bytes=10_000, timeout=60.0)
    chunks = _chunks(split(b"q" * 1000, 400))
    r.add("t", chunks[0])
    with pytest.raises(WireError) as exc:
        r.add("t", dataclasses.replace(chunks[1], **change))
    assert exc.value.reason == "chunk"
    assert r.held_bytes == 0 and len(r) == 0 and r.dropped == {"chunk_inconsistent": 1}


def test_chunks_carrying_more_bytes_than_their_header_cannot_grow_past_the_budget() -> None:
    r = Reassembler(max_bytes=1000, timeout=60.0)
    liar = Chunk(id="liar", index=0, count=5, size=1000, data=b"x" * 600)
    r.add("t", liar)
    with pytest.raises(WireError) as exc:
        r.add("t", dataclasses.replace(liar, index=1))
    assert exc.value.reason == "chunk"
    assert r.held_bytes == 0 and len(r) == 0


def test_chunks_adding_up_to_fewer_bytes_than_announced_are_refused() -> None:
    r = Reassembler(max_bytes=1000, timeout=60.0)
    r.add("t", Chunk(id="m", index=0, count=2, size=10, data=b"abc"))
    with pytest.raises(WireError) as exc:
        r.add("t", Chunk(id="m", index=1, count=2, size=10, data=b"def"))
    assert exc.value.reason == "chunk"
    assert r.held_bytes == 0 and len(r) == 0


def test_a_chunk_holding_more_bytes_than_its_whole_message_is_refused_once() -> None:
    """Issue 14 (fuzz): it was counted twice, as the partial message it started (``chunk_inconsistent``) and as
    itself (``chunk``)."""
    receiver = Receiver(max_bytes=1 << 20, budget_bytes=1 << 20, timeout_s=60.0)
    liar = wire.encode(Chunk(id="liar", index=0, count=2, size=3, data=b"12345"))
    with pytest.raises(WireError) as exc:
        receiver.take("t", liar, Event)
    assert exc.value.reason == "field" and receiver.dropped == {}


def test_a_message_of_several_chunks_reports_the_bytes_and_seconds_between_its_first_and_last() -> None:
    """The downlink sample (``Bus.on_joined``): every byte the connection read after the first chunk up to the last
    counts (other traffic in between too); one chunk, unknown arrivals, or a reconnect in between give none."""
    joined: list[tuple[str, int, float]] = []
    r = Reassembler(max_bytes=10_000, timeout=60.0, on_joined=lambda *sample: joined.append(sample))
    chunks = _chunks(split(b"j" * 1000, 400))
    assert r.add("t", chunks[0], Arrival(at=10.0, received=450)) is None
    assert r.add("t", chunks[1], Arrival(at=10.5, received=1450)) is None  # 550 bytes of something else first
    assert r.add("t", chunks[2], Arrival(at=11.0, received=1700)) == b"j" * 1000
    assert joined == [("t", 1250, 1.0)]
    r.add("t", Chunk(id="one", index=0, count=1, size=3, data=b"abc"), Arrival(at=12.0, received=1750))
    for arrivals in ([None, None, None], [Arrival(13.0, 10, connection=1), None, Arrival(14.0, 900, connection=2)],
                     [Arrival(15.0, 10), Arrival(15.0, 410), Arrival(15.0, 900)]):
        for chunk, arrival in zip(_chunks(split(b"k" * 1000, 400)), arrivals, strict=True):
            r.add("t", chunk, arrival)
    assert joined == [("t", 1250, 1.0)]
    # where the first chunk's first byte was read is known, its own bytes and read time count too (a few large
    # chunks would otherwise leave out a large share)
    for chunk, arrival in zip(_chunks(split(b"m" * 1000, 400)), [Arrival(20.0, 2200, began=19.5), Arrival(20.5, 2600),
                                                                 Arrival(21.0, 2800)], strict=True):
        r.add("t", chunk, arrival)
    assert joined[-1] == ("t", 600 + 400, 1.5)


def test_a_duplicate_chunk_is_held_once() -> None:
    r = Reassembler(max_bytes=10_000, timeout=60.0)
    chunks = _chunks(split(b"d" * 1000, 400))
    r.add("t", chunks[0])
    r.add("t", chunks[0])
    assert r.held_bytes == 400
    r.add("t", chunks[1])
    assert r.add("t", chunks[2]) == b"d" * 1000
    assert r.held_bytes == 0
