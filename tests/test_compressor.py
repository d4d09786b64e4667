"""The compressor service on real brokers: retained policies, overrides and ``set-codec``, bad
payloads, the adaptive mode following measured links (with a worker that follows it), and the
gateway that encodes for devices that cannot.

The policy itself (pure) is tested in ``test_compressor_policy.py``. The compressor runs
in-process; test clients of the broker (``helpers.inbox``) play the devices and the operator.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    DIGITS_PARAMS,
    GRADIENT_BYTES,
    WAIT_S,
    Inbox,
    control_json,
    device_stats,
    inbox,
    make_config,
    rate_for,
    running,
    until,
)

from edgemesh.common import wire
from edgemesh.common.codecs import SMALL_TENSOR, ErrorFeedback, available_codecs, get_codec
from edgemesh.common.config import Config, load_config
from edgemesh.common.errors import ConfigError, WireError
from edgemesh.common.messages import CodecPolicy, ControlReply, DeviceHello, DeviceStats, GradientUpdate, ShardUpdate
from edgemesh.common.topics import Topics
from edgemesh.common.vocabulary import CodecName
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.compressor.gateway import encode_raw
from edgemesh.services.compressor.policy import wire_bytes
from edgemesh.services.compressor.service import Compressor
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.planner.service import Planner
from edgemesh.services.worker.service import Worker

JOB = "t-compressor"
TOPICS = Topics(JOB)
TRAINING_WAIT_S = 30.0
"""Seconds one expected event of a whole training cluster (planner, PS, compressor, worker) may take."""
LAYOUT = DIGITS_PARAMS
"""The parameters of digits-cnn: what a gradient covers (its buffers, the standardization's constants, never move)."""


def compressor_config(broker: BrokerProcess, **settings: object) -> Config:
    return make_config(broker, job=JOB, **settings)


def training_config(broker: BrokerProcess, tmp_path: Path, **settings: object) -> Config:
    """A cluster training asynchronously, adaptive compression from fp16 down to grid."""
    return make_config(broker, job=JOB, **{
        "ps.state_dir": tmp_path / "ps", "ps.eval_every": 0, "ps.fsync": False, "training.sync_policy": "async",
        "worker.ack_timeout_s": 5, "worker.stats_interval_s": 0.2, "worker.profile_seconds": 0.05,
        "compressor.default_codec": "fp16", "compressor.adaptive_codec": "grid", **settings})


def worker_config(broker: BrokerProcess, device: str, **settings: object) -> Config:
    return make_config(broker, job=JOB, **{
        "worker.ack_timeout_s": 5, "worker.stats_interval_s": 0.2, "worker.profile_seconds": 0.05,
        "worker.device": device, **settings})


def devices_and_operator(config: Config) -> contextlib.AbstractAsyncContextManager[Inbox]:
    """A client playing devices and the operator: it sees codec policies and the operator's control replies."""
    return inbox(config, (TOPICS.codec_filter(), CodecPolicy), (TOPICS.reply_filter("operator"), ControlReply))


async def policy_of(box: Inbox, device: str) -> CodecPolicy:
    """The next policy published for ``device``."""
    return await box.next(CodecPolicy, lambda p: p.device == device)


async def say_hello(box: Inbox, name: str, incarnation: int = 1, *, can_encode: bool = True) -> None:
    await box.publish(TOPICS.hello(name), DeviceHello(device=name, incarnation=incarnation, flops=1e9,
                                                      memory_bytes=1 << 30, can_encode=can_encode), retain=True)


async def retained_policy(config: Config, compressor: Compressor, device: str) -> CodecPolicy:
    """What a device starting now would get: the policy the broker retained on its codec topic (the
    compressor published nothing meanwhile)."""
    published = compressor.metrics.value("edgemesh_compressor_policies_published_total")
    async with inbox(config, (TOPICS.codec_filter(device), CodecPolicy), name="late") as late:
        policy = await late.next(CodecPolicy)
    assert compressor.metrics.value("edgemesh_compressor_policies_published_total") == published
    return policy


@pytest.fixture
def unimplemented_codec(monkeypatch: pytest.MonkeyPatch) -> CodecName:
    """A codec the config names but this build lacks: ``qsgd``, hidden from the compressor."""
    import edgemesh.services.compressor.service as service

    hidden: CodecName = "qsgd"
    monkeypatch.setattr(service, "available_codecs", lambda: tuple(c for c in available_codecs() if c != hidden))
    return hidden


# --------------------------------------------------------------------------- construction


def test_the_service_refuses_a_configured_codec_it_cannot_run(unimplemented_codec: str) -> None:
    missing = unimplemented_codec
    with pytest.raises(ConfigError, match="not implemented"):
        Compressor(load_config(env={}, overrides={"job": "t", "compressor.default_codec": missing}))
    with pytest.raises(ConfigError, match="pi-1"):
        Compressor(load_config(env={}, overrides={"job": "t", "compressor.overrides": {"pi-1": missing}}))


def test_the_compressor_refuses_an_adaptive_codec_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import edgemesh.services.compressor.service as service

    monkeypatch.setattr(service, "available_codecs", lambda: ("fp16", "none"))
    with pytest.raises(ConfigError, match="adaptive_codec"):
        Compressor(load_config(env={}, overrides={"job": "t", "compressor.adaptive_codec": "topk"}))
    Compressor(load_config(env={}, overrides={"job": "t", "compressor.adaptive_codec": "topk",
                                              "compressor.mode": "static"}))


def test_the_compressor_does_not_import_torch() -> None:
    """The compressor runs on small hosts without torch."""
    code = "import sys, edgemesh.services.compressor.service; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=WAIT_S).returncode == 0


# --------------------------------------------------------------------------- policies and control


async def test_a_hello_gets_a_retained_policy_with_the_default_codec(broker: BrokerProcess) -> None:
    config = compressor_config(broker, **{"compressor.default_codec": "none"})
    compressor = Compressor(config)
    async with devices_and_operator(config) as box, running(compressor):
        await say_hello(box, "pi-1")
        policy = await policy_of(box, "pi-1")
        assert (policy.codec, policy.version, policy.density) == ("none", 1, 1.0)
        assert await retained_policy(config, compressor, "pi-1") == policy
        assert compressor.metrics.value("edgemesh_compressor_policies_published_total", codec="none") == 1
        assert compressor.metrics.value("edgemesh_compressor_devices") == 1

        # the same hello again (a broker re-delivering retained state) publishes nothing new;
        # a restart (new incarnation) re-announces the same policy
        await say_hello(box, "pi-1")
        await say_hello(box, "pi-1", incarnation=2)
        again = await policy_of(box, "pi-1")
        assert again == policy
        assert compressor.metrics.value("edgemesh_compressor_policies_published_total", codec="none") == 2


async def test_a_config_override_applies_to_its_device_only(broker: BrokerProcess) -> None:
    config = compressor_config(broker, **{"compressor.default_codec": "fp16",
                                          "compressor.overrides": json.dumps({"pi-2": "none"})})
    async with devices_and_operator(config) as box, running(Compressor(config)):
        await say_hello(box, "pi-1")
        await say_hello(box, "pi-2")
        assert (await policy_of(box, "pi-1")).codec == "fp16"
        override = await policy_of(box, "pi-2")
        assert (override.codec, override.reason) == ("none", "override")


async def test_set_codec_changes_the_retained_policy_and_survives_a_restart(broker: BrokerProcess) -> None:
    config = compressor_config(broker, **{"compressor.default_codec": "fp16"})
    command = TOPICS.control("compressor")
    async with devices_and_operator(config) as box:
        first_run = Compressor(config)
        async with running(first_run):
            await say_hello(box, "pi-1")
            first = await policy_of(box, "pi-1")
            assert (first.codec, first.version) == ("fp16", 1)

            await box.publish(command, control_json("set-codec", device="pi-1", value="none", request_id="r1"))
            reply = await box.next(ControlReply)
            assert (reply.request_id, reply.ok, reply.result["version"]) == ("r1", True, 2)
            changed = await policy_of(box, "pi-1")
            assert (changed.codec, changed.version, changed.reason) == ("none", 2, "operator")
            assert await retained_policy(config, first_run, "pi-1") == changed

        # a new compressor keeps the operator's choice and the version clock
        second = Compressor(config)
        async with running(second):
            await say_hello(box, "pi-1", incarnation=2)
            assert await policy_of(box, "pi-1") == changed
            await box.publish(command, control_json("set-codec", device="pi-1", value="default"))
            assert (await box.next(ControlReply)).ok
            back = await policy_of(box, "pi-1")
            assert (back.codec, back.version, back.reason) == ("fp16", 3, "default")
            assert second.operator == {}


async def test_set_codec_refuses_codecs_it_cannot_run(broker: BrokerProcess, unimplemented_codec: str) -> None:
    config = compressor_config(broker)
    command = TOPICS.control("compressor")
    unimplemented = unimplemented_codec
    compressor = Compressor(config)
    async with devices_and_operator(config) as box, running(compressor):
        await say_hello(box, "pi-1")
        first = await policy_of(box, "pi-1")

        await box.publish(command, control_json("set-codec", device="pi-1", value=unimplemented))
        reply = await box.next(ControlReply)
        assert not reply.ok and "not implemented" in reply.message and unimplemented in reply.message
        await box.publish(command, control_json("set-codec", device="pi-1", value="zip"))
        reply = await box.next(ControlReply)
        assert not reply.ok and "unknown codec" in reply.message
        await box.publish(command, control_json("set-codec", value="none"))
        assert not (await box.next(ControlReply)).ok  # no device
        await box.publish(command, control_json("shrink"))
        assert not (await box.next(ControlReply)).ok

        assert compressor.metrics.value("edgemesh_compressor_rejected_total", reason="bad_command") == 4
        assert compressor.policies["pi-1"] == first
        await box.publish(command, control_json("status"))
        status = await box.next(ControlReply)
        assert status.ok and status.result["policies"] == f"pi-1={first.codec}@1"

        await box.publish(command, control_json("stop"))
        assert (await box.next(ControlReply)).ok
        await until("the compressor to stop", compressor.stop.is_set)


async def test_malformed_and_misaddressed_payloads_are_counted_and_work_goes_on(broker: BrokerProcess) -> None:
    config = compressor_config(broker)
    compressor = Compressor(config)
    async with devices_and_operator(config) as box, running(compressor):
        await box.publish(TOPICS.hello("pi-1"), b"\x00garbage")
        await box.publish(TOPICS.stats("pi-1"), b"\x00garbage")
        await say_hello(box, "pi-imposter")
        await box.publish(TOPICS.hello("pi-3"), DeviceHello(device="pi-4", incarnation=1, flops=1.0,
                                                            memory_bytes=1))
        await say_hello(box, "pi-2")
        await box.publish(TOPICS.stats("pi-2"), DeviceStats(device="pi-2", link_rate_bps=1e3))
        assert (await policy_of(box, "pi-imposter")).version == 1
        assert (await policy_of(box, "pi-2")).version == 1
        await box.publish(TOPICS.control("compressor"), control_json("status"))
        status = await box.next(ControlReply)  # handled after everything above
        assert status.result["devices"] == 2
        assert compressor.metrics.value("edgemesh_compressor_rejected_total", reason="malformed") == 2
        assert compressor.metrics.value("edgemesh_compressor_rejected_total", reason="topic") == 1


# --------------------------------------------------------------------------- adaptive mode


def test_wire_round_trip_of_the_new_stats_field() -> None:
    sent = device_stats(1e6)
    assert wire.decode(wire.encode(sent), DeviceStats) == sent
    with pytest.raises(WireError):
        wire.decode(wire.encode(DeviceStats(device="pi-1", gradient_bytes=-1)), DeviceStats)


async def test_stats_move_the_retained_policy_only_past_the_hysteresis(broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = training_config(broker, tmp_path)
    comp = Compressor(cfg)
    values = GRADIENT_BYTES // 4
    rate = rate_for(wire_bytes("grid", values, 0.05))
    async with inbox(cfg, (TOPICS.codec_filter(), CodecPolicy)) as seen, running(comp):
        await say_hello(seen, "pi-1")
        first = await seen.until("the first policy", lambda: seen.of(CodecPolicy))
        assert (first[-1].codec, first[-1].reason) == ("fp16", "default")  # no stats yet

        await seen.publish(TOPICS.stats("pi-1"), device_stats(rate))
        sparse = await seen.until("a grid policy", lambda: (p := seen.of(CodecPolicy)[-1]).codec == "grid" and p)
        assert sparse.density == pytest.approx(0.05, rel=0.01)
        for noise in (1.1, 0.9, 1.15):
            await seen.publish(TOPICS.stats("pi-1"), device_stats(rate * noise))
        await seen.publish(TOPICS.stats("pi-1"), device_stats(rate / 3))
        lower = await seen.until("a lower density", lambda: (p := seen.of(CodecPolicy)[-1]).density < 0.05 and p)
        assert lower.version == sparse.version + 1  # the noisy stats in between published nothing
        assert len(seen.of(CodecPolicy)) == 3
        await seen.publish(TOPICS.stats("pi-1"), device_stats(0.0))  # link unknown again: the default codec
        back = await seen.until("the default again", lambda: (p := seen.of(CodecPolicy)[-1]).codec == "fp16" and p)
        assert back.reason == "default"
        for reason, n in (("new", 1), ("codec", 2), ("density", 1)):
            assert comp.metrics.value("edgemesh_compressor_policy_changes_total", reason=reason) == n, reason


def shard_bytes(update: GradientUpdate) -> int:
    """Bytes of the shards the policy's codec encoded (small tensors go fp16 whatever the density)."""
    return sum(len(s.data) for s in update.shards if s.codec != "fp16")


def expected_codecs(codec: CodecName) -> set[tuple[str, str]]:
    """(param, codec) of an update under a lossy ``codec``: fp16 for tensors under SMALL_TENSOR values."""
    return {(name, codec if math.prod(shape) >= SMALL_TENSOR else "fp16") for name, (shape, _) in LAYOUT.items()}


async def test_the_compressor_lowers_the_density_when_the_link_slows_and_the_worker_follows(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = training_config(mosquitto_broker, tmp_path)
    planner, ps, comp = Planner(cfg), ParameterServer(cfg), Compressor(cfg)
    worker = Worker(worker_config(mosquitto_broker, "w0", **{"worker.link_rate_bps": 1e12}))
    wait = TRAINING_WAIT_S
    async with inbox(cfg, (TOPICS.grad_filter(), GradientUpdate)) as grads, running(planner, ps, comp, worker):
        # a fast declared link: the dense default codec
        await until("training on fp16", lambda: worker.metrics.value(
            "edgemesh_worker_gradient_bytes_total", codec="fp16") > 0 and worker.accepted >= 3, wait)
        reported = await until("stats with a step time and the gradient size", lambda: (
            s := comp.stats.get("w0")) is not None and s.step_time_s > 0 and s.gradient_bytes and s, wait)
        assert reported.gradient_bytes == 4 * sum(
            int(np.prod(shape)) for shape, _ in LAYOUT.values())
        assert reported.link_rate_bps == 1e12
        assert comp.policies["w0"].codec == "fp16"

        # the link drops to what carries about 5 % of the values with grid
        values = reported.gradient_bytes // 4
        step = reported.step_time_s
        medium = wire_bytes("grid", values, 0.05) / (cfg.compressor.comm_share * step)
        worker.link.declare(medium)
        sparse = await until("a grid policy", lambda: (p := comp.policies["w0"]).codec == "grid" and p, wait)
        assert cfg.compressor.min_density * 10 < sparse.density <= cfg.compressor.max_density
        await until("the worker to follow it", lambda: worker.policy is not None
                    and worker.policy.version >= sparse.version, wait)
        first_grid_seq = worker.seq + 2  # the update in flight may still be fp16
        await grads.until("grid updates at the PS", lambda: len([
            u for u in grads.of(GradientUpdate) if u.seq >= first_grid_seq]) >= 2, wait)
        medium_sizes = [shard_bytes(u) for u in grads.of(GradientUpdate) if u.seq >= first_grid_seq]
        # large tensors go grid; the few small ones fp16, where grid's fixed cost buys nothing
        assert {(s.param, s.codec) for u in grads.of(GradientUpdate) if u.seq >= first_grid_seq
                for s in u.shards} == expected_codecs("grid")

        # twenty times slower: a new retained policy with a lower density, and smaller updates
        worker.link.declare(medium / 20)
        lower = await until("a lower density", lambda: (p := comp.policies["w0"]).density < sparse.density / 4
                            and p, wait)
        assert lower.codec == "grid" and lower.version > sparse.version
        await until("the worker to follow the lower density", lambda: worker.policy is not None
                    and worker.policy.density == lower.density, wait)
        after = worker.seq + 2
        grid_at_switch = ps.metrics.value("edgemesh_ps_received_gradient_bytes_total", codec="grid")
        await grads.until("updates at the lower density", lambda: len([
            u for u in grads.of(GradientUpdate) if u.seq >= after]) >= 2, wait)
        low_sizes = [shard_bytes(u) for u in grads.of(GradientUpdate) if u.seq >= after]
        assert max(low_sizes) < min(medium_sizes) / 2, (low_sizes, medium_sizes)
        await until("the PS to take them", lambda: ps.metrics.value(
            "edgemesh_ps_received_gradient_bytes_total", codec="grid") > grid_at_switch, wait)

        # the compressor counted why it published, and the densities it published
        assert comp.metrics.value("edgemesh_compressor_policy_changes_total", reason="codec") >= 1
        assert comp.metrics.value("edgemesh_compressor_policy_changes_total", reason="density") >= 1
        assert comp.metrics.value("edgemesh_compressor_policy_density_count") >= 3
        assert comp.metrics.value("edgemesh_compressor_codec_devices", codec="grid") == 1
        assert worker.metrics.value("edgemesh_worker_updates_total", status="discarded", reason="codec") == 0
    # the last policy is retained for the next worker start
    async with inbox(cfg, (TOPICS.codec_filter("w0"), CodecPolicy), name="late") as late:
        retained = await late.until("the retained policy", lambda: late.of(CodecPolicy), wait)
        assert retained[-1].density == comp.policies["w0"].density


# --------------------------------------------------------------------------- gateway


async def test_a_device_that_cannot_encode_trains_through_the_gateway(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    # grid for every device, its density adapted to the link this worker measures itself
    cfg = training_config(mosquitto_broker, tmp_path, **{"compressor.default_codec": "grid"})
    planner, ps, comp = Planner(cfg), ParameterServer(cfg), Compressor(cfg)
    worker = Worker(worker_config(mosquitto_broker, "weak", **{"worker.can_encode": False}))
    wait = TRAINING_WAIT_S
    async with inbox(cfg, (TOPICS.grad_filter(), GradientUpdate), (TOPICS.grad_raw_filter(), GradientUpdate)
                     ) as seen, running(planner, ps, comp, worker):
        await until("accepted updates through the gateway", lambda: worker.accepted >= 4, wait)
        assert worker.policy is not None and worker.policy.gateway
        assert comp.policies["weak"].gateway and comp.policies["weak"].codec == "grid"

        raw = seen.of(GradientUpdate, lambda t: t.kind == "grad_raw")
        forwarded = seen.of(GradientUpdate, lambda t: t.kind == "grad")
        assert raw and {s.codec for u in raw for s in u.shards} == {"none"}
        encoded = [u for u in forwarded if u.shards[0].codec != "none"]
        assert encoded and {(s.param, s.codec) for u in encoded for s in u.shards} == expected_codecs("grid")
        # forwarded as the same update: device, cluster, incarnation, seq, base version, samples
        by_seq = {u.seq: u for u in raw}
        for u in encoded:
            r = by_seq[u.seq]
            assert (u.device, u.cluster, u.incarnation, u.base_version, u.samples) == (
                r.device, r.cluster, r.incarnation, r.base_version, r.samples)
            assert [(s.param, s.start, s.stop) for s in u.shards] == [(s.param, s.start, s.stop) for s in r.shards]
        assert ps.metrics.value("edgemesh_ps_received_gradient_bytes_total", codec="grid") > 0
        gw_in = comp.metrics.value("edgemesh_compressor_gateway_bytes_total", direction="in")
        gw_out = comp.metrics.value("edgemesh_compressor_gateway_bytes_total", direction="out")
        assert 0 < gw_out < gw_in
        assert worker.metrics.value("edgemesh_worker_gradient_bytes_total", codec="grid") == 0

        # the worker measured its link and reported it with its gradient size
        measured = await until("measured link stats", lambda: (
            s := comp.stats.get("weak")) is not None and s.link_rate_bps > 0 and s.gradient_bytes > 0 and s, wait)
        assert measured.gradient_bytes == 4 * sum(int(np.prod(shape)) for shape, _ in LAYOUT.values())
        assert worker.link.samples >= 1 and worker.link.declared_bps == 0
        # from which the compressor chose the density it encodes with, and training goes on
        adapted = await until("a policy from the measured link", lambda: (
            p := comp.policies["weak"]).reason == "adaptive" and p, wait)
        assert adapted.gateway and adapted.codec == "grid"
        accepted = worker.accepted
        await until("more updates accepted", lambda: worker.accepted >= accepted + 3, wait)
        assert comp.metrics.value("edgemesh_compressor_rejected_total", reason="codec") == 0


def raw_update(seq: int, values: np.ndarray, *, device: str = "pi-1", codec: CodecName = "none",
               data: bytes | None = None) -> GradientUpdate:
    payload = data if data is not None else get_codec(codec).encode(values, None)
    return GradientUpdate(device=device, cluster=f"c-{device}", incarnation=1, seq=seq, base_version=0, samples=8,
                          shards=(ShardUpdate(param="w", start=0, stop=values.size, codec=codec, data=payload),))


async def test_the_gateway_rejects_malformed_raw_updates_and_forwards_good_ones_once(
        broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = training_config(broker, tmp_path, **{"compressor.default_codec": "grid", "compressor.mode": "static"})
    comp = Compressor(cfg)
    values = np.random.default_rng(1).standard_normal(4000).astype(np.float32)
    async with inbox(cfg, (TOPICS.grad_filter(), GradientUpdate)) as out, running(comp):
        raw_topic = TOPICS.grad_raw("c-pi-1", "pi-1")
        await say_hello(out, "pi-1", can_encode=False)
        await until("a gateway policy", lambda: (p := comp.policies.get("pi-1")) is not None and p.gateway)

        await out.publish(raw_topic, b"\x00garbage")                                       # malformed
        await out.publish(raw_topic, raw_update(1, values, codec="fp16"))                  # not raw
        await out.publish(raw_topic, raw_update(2, values, data=b"\x00" * 4001))           # not float32s
        await out.publish(raw_topic, raw_update(3, values, data=np.full(4, np.nan, np.float32).tobytes()))
        await out.publish(TOPICS.grad_raw("c-pi-1", "pi-2"), raw_update(4, values))        # wrong topic
        await out.publish(raw_topic, raw_update(5, values))
        await out.publish(raw_topic, raw_update(5, values))                                # a resend
        forwarded = await out.until("two forwards of update 5", lambda: len(out.of(GradientUpdate)) >= 2 and
                                    out.of(GradientUpdate))
        assert [u.seq for u in forwarded] == [5, 5]
        assert forwarded[0] == forwarded[1]  # the resend went out as first encoded
        (shard,) = forwarded[0].shards
        assert shard.codec == "grid" and len(shard.data) < values.nbytes
        # error feedback ran once: what was sent plus the residual is the raw gradient (the gateway's
        # error feedback has no public view: read the compressor's own)
        residual = comp.gateway.feedback["pi-1"][1].residual("w[0:4000]")
        assert residual is not None
        np.testing.assert_allclose(get_codec("grid").decode(shard.data, values.size) + residual, values, atol=1e-6)

        rejected = {reason: comp.metrics.value("edgemesh_compressor_rejected_total", reason=reason)
                    for reason in ("malformed", "codec", "nan", "topic")}
        assert rejected == {"malformed": 1, "codec": 2, "nan": 1, "topic": 1}
        assert comp.metrics.value("edgemesh_compressor_gateway_updates_total", codec="grid") == 1
        assert comp.metrics.value("edgemesh_compressor_gateway_bytes_total", direction="in") == 2 * values.nbytes
        assert not comp.stop.is_set()


def test_the_gateway_encodes_the_gradient_and_passes_the_buffers_changes_as_they_are() -> None:
    """Batch norm's statistics are not gradients: a lossy codec and its error feedback would bias them."""
    none = get_codec("none")
    grad = ShardUpdate(param="conv.weight", start=0, stop=64, codec="none",
                       data=none.encode(np.random.default_rng(0).normal(size=64 * 64).astype(np.float32), None))
    change = ShardUpdate(param="bn.running_mean", start=0, stop=64, codec="none",
                         data=none.encode(np.full(64, 0.01, np.float32), None))
    update = GradientUpdate(device="weak", cluster="c-weak", incarnation=1, seq=1, base_version=0, samples=8,
                            shards=(grad,), buffers=(change,))
    out = encode_raw(update, CodecPolicy(device="weak", codec="grid", density=0.3), ErrorFeedback())
    assert out.shards[0].codec == "grid" and out.buffers == (change,)
