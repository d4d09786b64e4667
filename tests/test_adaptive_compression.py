"""Adaptive compression: the cost-model policy (pure), the worker's link meter, and the compressor
following measured links and serving as gateway on real brokers.

Service tests run the services in-process; every wait is bounded by :data:`WAIT_S` and wakes on
the event it waits for (or polls service state every :data:`POLL_S`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from edgemesh.common import models, wire
from edgemesh.common.broker import BrokerProcess
from edgemesh.common.bus import Bus
from edgemesh.common.codecs import SMALL_TENSOR, get_codec
from edgemesh.common.config import Config, load_config
from edgemesh.common.errors import ConfigError, WireError
from edgemesh.common.messages import CodecPolicy, DeviceHello, DeviceStats, GradientUpdate, ShardUpdate
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics
from edgemesh.services.compressor.policy import (
    Adaptive,
    budget_bytes,
    choose_policy,
    wire_bytes,
)
from edgemesh.services.compressor.service import Compressor
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.planner.service import Planner
from edgemesh.services.worker.link import LinkMeter
from edgemesh.services.worker.service import Worker

WAIT_S = 30.0
T = TypeVar("T")
"""Seconds any single expected event may take."""
POLL_S = 0.05
JOB = "t-adaptive"
TOPICS = Topics(JOB)
SETTINGS = Adaptive(codec="grid", comm_share=0.5, min_density=0.001, max_density=0.25, hysteresis=0.25,
                    delay_pressure=0.1)
GRADIENT_BYTES = 4_000_000
"""A one-million-value model, for the pure policy tests."""
STEP_S = 0.1

LAYOUT = models.param_layout(models.build_model("digits-cnn"))


def stats(rate: float, *, step: float = STEP_S, gradient_bytes: int = GRADIENT_BYTES, delay: float = 0.0,
          device: str = "pi-1") -> DeviceStats:
    return DeviceStats(device=device, link_rate_bps=rate, step_time_s=step, gradient_bytes=gradient_bytes,
                       delay_index=delay)


def rate_for(nbytes: float, step: float = STEP_S) -> float:
    """The link rate at which ``nbytes`` per update take exactly ``comm_share`` of the step."""
    return nbytes / (SETTINGS.comm_share * step)


def adaptive(device: str = "pi-1", previous: CodecPolicy | None = None, default: str = "fp16",
             **kw: Any) -> CodecPolicy:
    return choose_policy(device, default_codec=default, overrides=kw.pop("overrides", {}), previous=previous,
                         adaptive=SETTINGS, **kw)


# --------------------------------------------------------------------------- policy (pure)


def test_a_fast_link_keeps_the_dense_default_codec() -> None:
    fast = stats(rate_for(2 * GRADIENT_BYTES))  # float32 fits twice over, fp16 (half of it) four times
    policy = adaptive(stats=fast)
    assert (policy.codec, policy.density, policy.reason) == ("fp16", 1.0, "adaptive")
    # a default of none is kept when float32 fits, and stepped down to fp16 when only that fits
    assert adaptive(default="none", stats=fast).codec == "none"
    assert adaptive(default="none", stats=stats(rate_for(0.6 * GRADIENT_BYTES))).codec == "fp16"


def test_a_slower_link_gets_the_adaptive_codec_at_a_lower_density() -> None:
    values = GRADIENT_BYTES // 4
    target = 0.05
    rate = rate_for(wire_bytes("grid", values, target))
    slow = adaptive(stats=stats(rate))
    assert (slow.codec, slow.reason) == ("grid", "adaptive")
    assert slow.density == pytest.approx(target, rel=0.01)
    # the estimate of the chosen policy fits the budget
    assert wire_bytes("grid", values, slow.density) <= budget_bytes(stats(rate), SETTINGS) * 1.01
    slower = adaptive(stats=stats(rate_for(wire_bytes("grid", values, target / 10))))
    assert slower.density == pytest.approx(target / 10, rel=0.01)
    # a longer step leaves more time to send: a higher density, twice the bytes
    longer = adaptive(stats=stats(rate, step=2 * STEP_S))
    assert longer.density > target
    assert wire_bytes("grid", values, longer.density) == pytest.approx(2 * wire_bytes("grid", values, target),
                                                                       rel=0.01)


def test_density_is_clamped_to_the_configured_range() -> None:
    values = GRADIENT_BYTES // 4
    assert adaptive(stats=stats(1.0)).density == SETTINGS.min_density  # 1 byte/s
    just_too_slow_for_fp16 = stats(rate_for(GRADIENT_BYTES / 2) / 1.01)
    policy = adaptive(stats=just_too_slow_for_fp16)
    assert (policy.codec, policy.density) == ("grid", SETTINGS.max_density)
    assert wire_bytes("grid", values, SETTINGS.max_density) < wire_bytes("fp16", values)


def test_noisy_stats_do_not_flap_the_policy() -> None:
    values = GRADIENT_BYTES // 4
    rate = rate_for(wire_bytes("grid", values, 0.05))
    first = adaptive(stats=stats(rate))
    for noise in (0.85, 1.15, 0.9, 1.1):  # density within 25 %: the same policy object, version unchanged
        assert adaptive(previous=first, stats=stats(rate * noise)) is first
    lower = adaptive(previous=first, stats=stats(rate / 2))
    assert (lower.codec, lower.version) == ("grid", first.version + 1)
    assert lower.density < first.density / 1.25

    # around the fp16 boundary: fp16 is kept up to 25 % over budget, and comes back only when it fits
    edge = rate_for(GRADIENT_BYTES / 2)  # fp16 takes exactly the budget
    dense = adaptive(stats=stats(edge))
    assert dense.codec == "fp16"
    assert adaptive(previous=dense, stats=stats(edge / 1.2)) is dense
    sparse = adaptive(previous=dense, stats=stats(edge / 1.3))
    assert sparse.codec == "grid"
    assert adaptive(previous=sparse, stats=stats(edge / 1.1)) is sparse
    back = adaptive(previous=sparse, stats=stats(edge))
    assert (back.codec, back.version) == ("fp16", sparse.version + 1)


@pytest.mark.parametrize("unknown", [
    stats(0.0), stats(1e6, step=0.0), stats(1e6, gradient_bytes=0), None,
], ids=["no-link-rate", "no-step-time", "no-gradient-size", "no-stats"])
def test_a_device_with_unknown_measurements_gets_the_default_codec(unknown: DeviceStats | None) -> None:
    policy = adaptive(stats=unknown)
    assert (policy.codec, policy.density, policy.reason) == ("fp16", 1.0, "default")


def test_static_mode_ignores_stats() -> None:
    first = choose_policy("pi-1", default_codec="fp16", overrides={}, previous=None)
    assert choose_policy("pi-1", default_codec="fp16", overrides={}, previous=first, stats=stats(1.0)) is first


def test_operator_and_override_pin_the_codec_and_a_pinned_sparse_codec_gets_the_adaptive_density() -> None:
    slow = stats(1.0)
    pinned_dense = adaptive(overrides={"pi-1": "none"}, stats=slow)
    assert (pinned_dense.codec, pinned_dense.density, pinned_dense.reason) == ("none", 1.0, "override")
    operator = adaptive(overrides={"pi-1": "none"}, operator={"pi-1": "topk"}, stats=slow)
    assert (operator.codec, operator.density, operator.reason) == ("topk", SETTINGS.min_density, "operator")
    # unknown measurements: the pinned codec as today
    assert adaptive(operator={"pi-1": "topk"}).density == 1.0


def test_a_device_lagging_behind_the_fleet_compresses_harder() -> None:
    values = GRADIENT_BYTES // 4
    rate = rate_for(wire_bytes("grid", values, 0.05))
    on_par = adaptive(stats=stats(rate, delay=3.0), reference_delay=3.0)
    lagging = adaptive(stats=stats(rate, delay=13.0), reference_delay=3.0)  # 10 versions over the median
    assert wire_bytes("grid", values, lagging.density) == pytest.approx(
        wire_bytes("grid", values, on_par.density) / (1 + SETTINGS.delay_pressure * 10), rel=0.01)


def test_the_gateway_flag_is_part_of_the_policy() -> None:
    first = adaptive(stats=stats(0.0))
    gateway = adaptive(previous=first, stats=stats(0.0), gateway=True)
    assert (gateway.gateway, gateway.codec, gateway.version) == (True, "fp16", first.version + 1)


def test_adaptive_settings_are_validated() -> None:
    for key, value in (("compressor.comm_share", 0), ("compressor.min_density", 0),
                       ("compressor.max_density", 1.5), ("compressor.density_hysteresis", 1),
                       ("compressor.delay_pressure", -1), ("compressor.adaptive_codec", "fp16"),
                       ("compressor.mode", "smart"), ("worker.link_rate_bps", -1)):
        with pytest.raises(ConfigError, match=key.split(".")[1]):
            load_config(env={}, overrides={key: value})
    with pytest.raises(ConfigError, match="max_density"):
        load_config(env={}, overrides={"compressor.min_density": 0.5, "compressor.max_density": 0.1})


@pytest.mark.parametrize("codec", ["grid", "topk", "threshold", "qsgd", "fp16", "none"])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1, 0.25])
def test_the_cost_model_matches_the_codecs(codec: str, density: float) -> None:
    """The estimate is within 20 % of what the codec really sends."""
    values = 200_000
    grad = np.random.default_rng(0).standard_normal(values).astype(np.float32)
    sent = len(get_codec(codec).encode(grad, CodecPolicy(device="pi-1", codec=codec, density=density)))  # type: ignore[arg-type]
    estimate = wire_bytes(codec, values, density)
    assert sent / 1.2 <= estimate <= sent * 1.2, (codec, density, sent, estimate)


def test_error_feedback_carries_over_a_change_of_density() -> None:
    """What one density did not send is sent under the next: nothing is lost when the policy changes."""
    from edgemesh.common.codecs import ErrorFeedback

    rng = np.random.default_rng(2)
    feedback, codec = ErrorFeedback(), get_codec("grid")
    grads = [rng.standard_normal(5000).astype(np.float32) for _ in range(3)]
    sent = np.zeros(5000, np.float32)
    for grad, density in zip(grads, (0.25, 0.01, 0.05), strict=True):
        policy = CodecPolicy(device="pi-1", codec="grid", density=density)
        sent += codec.decode(feedback.encode("fc1.weight", grad, codec, policy), grad.size)
    residual = feedback.residual("fc1.weight")
    assert residual is not None
    np.testing.assert_allclose(sent + residual, np.sum(grads, axis=0), atol=1e-4)


# --------------------------------------------------------------------------- link meter (pure)


def test_the_link_meter_averages_publishes_and_a_declared_rate_wins() -> None:
    meter = LinkMeter()
    assert meter.rate_bps == 0.0
    meter.observe(1000, 0.0)  # no duration: no sample
    assert meter.rate_bps == 0.0
    meter.observe(1000, 1.0)
    assert meter.rate_bps == 1000.0
    meter.observe(2000, 1.0)
    assert 1000.0 < meter.rate_bps < 2000.0  # a moving average, not the last sample
    meter.declare(5e6)
    assert meter.rate_bps == 5e6
    meter.declare(0.0)
    assert 1000.0 < meter.rate_bps < 2000.0


# --------------------------------------------------------------------------- helpers


def make_config(broker: BrokerProcess, tmp_path: Path, **extra: object) -> Config:
    return load_config(env={}, overrides={
        "broker.url": broker.url, "job": JOB, "metrics.address": "127.0.0.1:0",
        "broker.backoff_initial_s": 0.05, "broker.backoff_max_s": 0.5, "ps.state_dir": str(tmp_path / "ps"),
        "ps.eval_every": 0, "ps.fsync": False, "training.sync_policy": "async",
        "worker.ack_timeout_s": 5, "worker.stats_interval_s": 0.2, "worker.profile_seconds": 0.05,
        "compressor.default_codec": "fp16", "compressor.adaptive_codec": "grid", **extra,
    })


async def until(what: str, predicate: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    """Poll service state until ``predicate()`` is truthy; returns its value."""
    try:
        async with asyncio.timeout(timeout_s):
            while not (result := predicate()):
                await asyncio.sleep(POLL_S)
            return result
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


@contextlib.asynccontextmanager
async def services(*objs: Any) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(o.run()) for o in objs]
    try:
        yield
    finally:
        for o in objs:
            o.stop.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT_S)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors


class Tap:
    """A test client that records every message on its subscriptions, decoded as one of ``kinds`` where it can."""

    def __init__(self, bus: Bus, kinds: tuple[type, ...]) -> None:
        self.bus = bus
        self.kinds = kinds
        self.seen: list[tuple[str, Any]] = []
        self._task = asyncio.create_task(self._collect())

    async def _collect(self) -> None:
        async for msg in self.bus.messages():
            with contextlib.suppress(WireError):
                self.seen.append((msg.topic, msg.decode(self.kinds)))

    def of(self, kind: type[T], topic_part: str = "") -> list[T]:
        return [m for t, m in self.seen if isinstance(m, kind) and topic_part in t]


@contextlib.asynccontextmanager
async def tap(config: Config, *filters: str, kinds: tuple[type, ...] = (GradientUpdate, CodecPolicy)
              ) -> AsyncIterator[Tap]:
    async with Bus(config.broker, client_id=f"tap-{uuid.uuid4().hex[:8]}", metrics=ServiceMetrics("tap"),
                   subscriptions=list(filters)) as bus:
        await bus.wait_connected(WAIT_S)
        t = Tap(bus, kinds)
        try:
            yield t
        finally:
            t._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t._task


def worker_config(config: Config, device: str, **extra: object) -> Config:
    return load_config(env={}, overrides={
        "broker.url": config.broker.url, "job": JOB, "metrics.address": "127.0.0.1:0",
        "broker.backoff_max_s": 0.5, "worker.ack_timeout_s": 5, "worker.stats_interval_s": 0.2,
        "worker.profile_seconds": 0.05, "worker.device": device, **extra,
    })


def shard_bytes(update: GradientUpdate) -> int:
    """Bytes of the shards the policy's codec encoded (small tensors go fp16 whatever the density)."""
    return sum(len(s.data) for s in update.shards if s.codec != "fp16")


def expected_codecs(codec: str) -> set[tuple[str, str]]:
    """(param, codec) of an update under a lossy ``codec``: fp16 for tensors under SMALL_TENSOR values."""
    return {(name, codec if math.prod(shape) >= SMALL_TENSOR else "fp16") for name, (shape, _) in LAYOUT.items()}


# --------------------------------------------------------------------------- services


async def test_the_compressor_lowers_the_density_when_the_link_slows_and_the_worker_follows(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = make_config(mosquitto_broker, tmp_path)
    planner, ps, comp = Planner(cfg), ParameterServer(cfg), Compressor(cfg)
    worker = Worker(worker_config(cfg, "w0", **{"worker.link_rate_bps": 1e12}))
    async with tap(cfg, TOPICS.all_grad()) as grads, services(planner, ps, comp, worker):
        # a fast declared link: the dense default codec
        await until("training on fp16", lambda: worker.metrics.value(
            "edgemesh_worker_gradient_bytes_total", codec="fp16") > 0 and worker.accepted >= 3)
        reported = await until("stats with a step time and the gradient size", lambda: (
            s := comp.stats.get("w0")) is not None and s.step_time_s > 0 and s.gradient_bytes and s)
        assert reported.gradient_bytes == 4 * sum(
            int(np.prod(shape)) for shape, _ in worker._layout.values())
        assert reported.link_rate_bps == 1e12
        assert comp.policies["w0"].codec == "fp16"

        # the link drops to what carries about 5 % of the values with grid
        values = reported.gradient_bytes // 4
        step = reported.step_time_s
        medium = wire_bytes("grid", values, 0.05) / (cfg.compressor.comm_share * step)
        worker.link.declare(medium)
        sparse = await until("a grid policy", lambda: (p := comp.policies["w0"]).codec == "grid" and p)
        assert cfg.compressor.min_density * 10 < sparse.density <= cfg.compressor.max_density
        await until("the worker to follow it", lambda: worker.policy is not None
                    and worker.policy.version >= sparse.version)
        first_grid_seq = worker.seq + 2  # the update in flight may still be fp16
        await until("grid updates at the PS", lambda: len([
            u for u in grads.of(GradientUpdate) if u.seq >= first_grid_seq]) >= 2)
        medium_sizes = [shard_bytes(u) for u in grads.of(GradientUpdate) if u.seq >= first_grid_seq]
        # large tensors go grid; the few small ones fp16, where grid's fixed cost buys nothing
        assert {(s.param, s.codec) for u in grads.of(GradientUpdate) if u.seq >= first_grid_seq
                for s in u.shards} == expected_codecs("grid")

        # twenty times slower: a new retained policy with a lower density, and smaller updates
        worker.link.declare(medium / 20)
        lower = await until("a lower density", lambda: (p := comp.policies["w0"]).density < sparse.density / 4 and p)
        assert lower.codec == "grid" and lower.version > sparse.version
        await until("the worker to follow the lower density", lambda: worker.policy is not None
                    and worker.policy.density == lower.density)
        after = worker.seq + 2
        grid_at_switch = ps.metrics.value("edgemesh_ps_received_gradient_bytes_total", codec="grid")
        await until("updates at the lower density", lambda: len([
            u for u in grads.of(GradientUpdate) if u.seq >= after]) >= 2)
        low_sizes = [shard_bytes(u) for u in grads.of(GradientUpdate) if u.seq >= after]
        assert max(low_sizes) < min(medium_sizes) / 2, (low_sizes, medium_sizes)
        await until("the PS to take them", lambda: ps.metrics.value(
            "edgemesh_ps_received_gradient_bytes_total", codec="grid") > grid_at_switch)

        # the compressor counted why it published, and the densities it published
        assert comp.metrics.value("edgemesh_compressor_policy_changes_total", reason="codec") >= 1
        assert comp.metrics.value("edgemesh_compressor_policy_changes_total", reason="density") >= 1
        assert comp.metrics.value("edgemesh_compressor_policy_density_count") >= 3
        assert comp.metrics.value("edgemesh_compressor_codec_devices", codec="grid") == 1
        assert worker.metrics.value("edgemesh_worker_updates_total", status="discarded", reason="codec") == 0
    # the last policy is retained for the next worker start
    async with tap(cfg, TOPICS.codec("w0")) as late:
        retained = await until("the retained policy", lambda: late.of(CodecPolicy))
        assert retained[-1].density == comp.policies["w0"].density


async def test_a_device_that_cannot_encode_trains_through_the_gateway(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    # grid for every device, its density adapted to the link this worker measures itself
    cfg = make_config(mosquitto_broker, tmp_path, **{"compressor.default_codec": "grid"})
    planner, ps, comp = Planner(cfg), ParameterServer(cfg), Compressor(cfg)
    worker = Worker(worker_config(cfg, "weak", **{"worker.can_encode": False}))
    async with tap(cfg, TOPICS.all_grad(), TOPICS.all_grad_raw()) as seen, services(planner, ps, comp, worker):
        await until("accepted updates through the gateway", lambda: worker.accepted >= 4)
        assert worker.policy is not None and worker.policy.gateway
        assert comp.policies["weak"].gateway and comp.policies["weak"].codec == "grid"

        raw = seen.of(GradientUpdate, "/grad-raw/")
        forwarded = seen.of(GradientUpdate, "/grad/")
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
            s := comp.stats.get("weak")) is not None and s.link_rate_bps > 0 and s.gradient_bytes > 0 and s)
        assert measured.gradient_bytes == 4 * sum(int(np.prod(shape)) for shape, _ in worker._layout.values())
        assert worker.link.samples >= 1 and worker.link.declared_bps == 0
        # from which the compressor chose the density it encodes with, and training goes on
        adapted = await until("a policy from the measured link", lambda: (
            p := comp.policies["weak"]).reason == "adaptive" and p)
        assert adapted.gateway and adapted.codec == "grid"
        accepted = worker.accepted
        await until("more updates accepted", lambda: worker.accepted >= accepted + 3)
        assert comp.metrics.value("edgemesh_compressor_rejected_total", reason="codec") == 0


def raw_update(seq: int, values: np.ndarray, *, device: str = "pi-1", codec: str = "none",
               data: bytes | None = None) -> GradientUpdate:
    payload = data if data is not None else get_codec(codec).encode(values, None)
    return GradientUpdate(device=device, cluster=f"c-{device}", incarnation=1, seq=seq, base_version=0, samples=8,
                          shards=(ShardUpdate(param="w", start=0, stop=values.size, codec=codec,  # type: ignore[arg-type]
                                              data=payload),))


async def test_the_gateway_rejects_malformed_raw_updates_and_forwards_good_ones_once(
        broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = make_config(broker, tmp_path, **{"compressor.default_codec": "grid", "compressor.mode": "static"})
    comp = Compressor(cfg)
    values = np.random.default_rng(1).standard_normal(4000).astype(np.float32)
    async with tap(cfg, TOPICS.all_grad()) as out, services(comp):
        await until("the compressor to settle", comp.ready.is_set)
        raw_topic = TOPICS.grad_raw("c-pi-1", "pi-1")
        bus = out.bus
        await bus.publish(TOPICS.hello("pi-1"), DeviceHello(device="pi-1", incarnation=1, flops=1e9,
                                                            memory_bytes=1 << 30, can_encode=False), retain=True)
        await until("a gateway policy", lambda: (p := comp.policies.get("pi-1")) is not None and p.gateway)

        await bus.publish(raw_topic, b"\x00garbage")                                       # malformed
        await bus.publish(raw_topic, raw_update(1, values, codec="fp16"))                  # not raw
        await bus.publish(raw_topic, raw_update(2, values, data=b"\x00" * 4001))           # not float32s
        await bus.publish(raw_topic, raw_update(3, values, data=np.full(4, np.nan, np.float32).tobytes()))
        await bus.publish(TOPICS.grad_raw("c-pi-1", "pi-2"), raw_update(4, values))        # wrong topic
        await bus.publish(raw_topic, raw_update(5, values))
        await bus.publish(raw_topic, raw_update(5, values))                                # a resend
        forwarded = await until("two forwards of update 5", lambda: len(out.of(GradientUpdate)) >= 2 and
                                out.of(GradientUpdate))
        assert [u.seq for u in forwarded] == [5, 5]
        assert forwarded[0] == forwarded[1]  # the resend went out as first encoded
        (shard,) = forwarded[0].shards
        assert shard.codec == "grid" and len(shard.data) < values.nbytes
        # error feedback ran once: what was sent plus the residual is the raw gradient
        residual = comp._feedback["pi-1"][1].residual("w[0:4000]")
        assert residual is not None
        np.testing.assert_allclose(get_codec("grid").decode(shard.data, values.size) + residual, values, atol=1e-6)

        rejected = {reason: comp.metrics.value("edgemesh_compressor_rejected_total", reason=reason)
                    for reason in ("malformed", "codec", "nan", "topic")}
        assert rejected == {"malformed": 1, "codec": 2, "nan": 1, "topic": 1}
        assert comp.metrics.value("edgemesh_compressor_gateway_updates_total", codec="grid") == 1
        assert comp.metrics.value("edgemesh_compressor_gateway_bytes_total", direction="in") == 2 * values.nbytes
        assert not comp.stop.is_set()


async def test_stats_move_the_retained_policy_only_past_the_hysteresis(broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = make_config(broker, tmp_path)
    comp = Compressor(cfg)
    values = GRADIENT_BYTES // 4
    rate = rate_for(wire_bytes("grid", values, 0.05))
    async with tap(cfg, TOPICS.all_codec()) as seen, services(comp):
        await until("the compressor to settle", comp.ready.is_set)
        bus = seen.bus
        await bus.publish(TOPICS.hello("pi-1"), DeviceHello(device="pi-1", incarnation=1, flops=1e9,
                                                            memory_bytes=1 << 30), retain=True)
        first = await until("the first policy", lambda: seen.of(CodecPolicy))
        assert (first[-1].codec, first[-1].reason) == ("fp16", "default")  # no stats yet

        await bus.publish(TOPICS.stats("pi-1"), stats(rate))
        sparse = await until("a grid policy", lambda: (p := seen.of(CodecPolicy)[-1]).codec == "grid" and p)
        assert sparse.density == pytest.approx(0.05, rel=0.01)
        for noise in (1.1, 0.9, 1.15):
            await bus.publish(TOPICS.stats("pi-1"), stats(rate * noise))
        await bus.publish(TOPICS.stats("pi-1"), stats(rate / 3))
        lower = await until("a lower density", lambda: (p := seen.of(CodecPolicy)[-1]).density < 0.05 and p)
        assert lower.version == sparse.version + 1  # the noisy stats in between published nothing
        assert len(seen.of(CodecPolicy)) == 3
        await bus.publish(TOPICS.stats("pi-1"), stats(0.0))  # link unknown again: the default codec
        back = await until("the default again", lambda: (p := seen.of(CodecPolicy)[-1]).codec == "fp16" and p)
        assert back.reason == "default"
        for reason, n in (("new", 1), ("codec", 2), ("density", 1)):
            assert comp.metrics.value("edgemesh_compressor_policy_changes_total", reason=reason) == n, reason


def test_the_compressor_refuses_an_adaptive_codec_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import edgemesh.services.compressor.service as service

    monkeypatch.setattr(service, "available_codecs", lambda: ("fp16", "none"))
    with pytest.raises(ConfigError, match="adaptive_codec"):
        Compressor(load_config(env={}, overrides={"compressor.adaptive_codec": "topk"}))
    Compressor(load_config(env={}, overrides={"compressor.adaptive_codec": "topk", "compressor.mode": "static"}))


def test_wire_round_trip_of_the_new_stats_field() -> None:
    sent = stats(1e6)
    assert wire.decode(wire.encode(sent), DeviceStats) == sent
    with pytest.raises(WireError):
        wire.decode(wire.encode(DeviceStats(device="pi-1", gradient_bytes=-1)), DeviceStats)
