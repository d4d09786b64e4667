"""Hostile input (issue 14): a storm of junk on every topic the services consume, through a real broker.

The planner, parameter server, compressor, a worker and the parameter server's job host (with its job
board) run in this process on one Mosquitto. Over 10,000 pieces of junk drawn by hypothesis
(``tests/fuzz.py``) go out in one burst; then every service must still run and answer ``status``, nothing
of the junk may have been applied (model version, plans, codec policies, jobs), and every piece must be
counted by reason in the services' ``rejected_total`` (the parameter server's ack-only discards in its
``updates_total``), except what docs/reliability.md#hostile-input says is dropped by design uncounted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fuzz import Junk, Scene, job_source, storm, submission
from helpers import (
    DIGITS_LAYOUT,
    SPLIT,
    device_hello,
    devices,
    gradient,
    inbox,
    make_config,
    member_update,
    mesh_plan,
    running,
    serving_ps,
    until,
)

from edgemesh.common.messages import (
    CodecPolicy,
    ControlCommand,
    DeviceStats,
    DeviceStatus,
    GradientUpdate,
    ModelDelta,
    ModelSnapshot,
    ShardUpdate,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Filter, TopicKind, Topics, matches, parse
from edgemesh.common.wire.tensors import Tensor
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.compressor.service import Compressor
from edgemesh.services.host import JobHost
from edgemesh.services.parameter_server import jobs as ps_jobs
from edgemesh.services.parameter_server.jobs import JobBoard
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.planner.service import Planner
from edgemesh.services.worker.service import Worker

MESSAGES = 10_200
"""Pieces of junk in the storm (each one or more frames)."""
STORM_S = 30.0
"""How long the services may take to count the storm."""
PUBLISH_WINDOW = 8
"""Frames in flight at once while publishing (their order is kept)."""
FAMILIES = {
    "garbage", "json", "truncated", "extended", "version", "kind", "body", "no_body", "type", "missing", "nan",
    "range", "dtype", "shape", "oversized", "topic", "chunk_oversized", "chunk_nested", "chunk_inconsistent",
    "chunk_partial", "chunk_inner", "chunk_liar", "chunk_field", "expired", "refused", "unknown_device", "replay",
    "future", "mesh_partial", "incarnation", "raw_payload", "old_incarnation", "other_model", "codec", "gap",
    "stray_ack", "forged_hash", "job_file", "names_another"}
"""Every family of junk ``tests/fuzz.py`` makes: the storm must send each."""
ACK_ONLY = ("stale", "future", "round_full", "replanned")
"""Discards the parameter server counts in ``updates_total`` alone (the update was well formed)."""
SERVICES = {"broker.chunk_bytes": 64 * 1024, "broker.max_message_bytes": 192 * 1024,
            "broker.reassembly_timeout_s": 2.5, "ps.mesh_assembly_timeout_s": 0.5, "ps.eval_every": 0,
            "ps.fsync": "false", "training.sync_policy": "async", "planner.replan_debounce_s": 0.1}
"""The services' settings: small messages, and partial chunked messages and model-parallel steps that
time out soon (a chunked message's frames come one after the other: a loaded machine must not time one
out between them)."""
IDLE_WORKER = {"worker.memory_bytes": 1, "worker.profile_seconds": 0.05}
"""A worker whose memory holds no batch: the planner leaves it out, so it consumes everything a worker does
and never trains."""


@dataclasses.dataclass
class Board:
    """The parameter server's job host with its job board, as ``running`` runs a service."""

    host: JobHost

    @property
    def stop(self) -> asyncio.Event:
        return self.host.stop

    @property
    def metrics(self) -> ServiceMetrics:
        return self.host.metrics

    @property
    def bus(self) -> Any:
        return self.host.bus

    async def run(self) -> None:
        await self.host.run(extra=JobBoard(self.host).attach)


def counted(name: str, svc: Any) -> Counter[str]:
    """What ``svc`` counted as rejected, by reason (the parameter server's ack-only discards too)."""
    out: Counter[str] = Counter()
    for metric in svc.metrics.registry.collect():
        for s in metric.samples:
            if s.name == f"edgemesh_{name}_rejected_total":
                out[s.labels["reason"]] += int(s.value)
            elif name == "ps" and s.name == "edgemesh_ps_updates_total":
                status, reason = s.labels["status"], s.labels["reason"]
                if status == "duplicate" or reason in ACK_ONLY:
                    out[f"ack:{reason or status}"] += int(s.value)
    return +out


def consumed(scene: Scene, services: dict[str, Any]) -> dict[str, TopicKind]:
    """A concrete topic for each filter any service consumes (``+`` made a device, cluster or the job)."""
    out: dict[str, TopicKind] = {}
    for svc in services.values():
        for f in svc.bus.filters:
            if f.pattern.endswith("#"):
                continue
            for device in (scene.member, scene.gateway, "zz"):
                topic = concrete(f, scene.job, device)
                parse(topic)  # an EdgeMesh topic
                out.setdefault(topic, f.kind)
    return out


def concrete(f: Filter, job: str, device: str) -> str:
    """``f``'s pattern with its job level made ``job``, a cluster level ``c-{device}`` and a device level ``device``."""
    parts = f.pattern.split("/")
    for i, part in enumerate(parts):
        if part == "+":
            cluster = i + 1 < len(parts) and parts[i + 1] == "+"
            parts[i] = job if i == 2 else f"c-{device}" if cluster else device
    return "/".join(parts)


def consumers(junk: Junk, services: dict[str, Any]) -> list[str]:
    """The services that consume ``junk``'s topic."""
    return [name for name, svc in services.items() if any(matches(f.pattern, junk.topic) for f in svc.bus.filters)]


def state_of(planner: Planner, ps: ParameterServer, compressor: Compressor, worker: Worker, host: JobHost
             ) -> dict[str, Any]:
    """What junk must not change."""
    assert ps.state is not None and worker.plan is not None and worker.policy is not None
    return {
        "planner": (planner.version, planner.plan, sorted(planner.registry.drained), sorted(planner.registry.live())),
        "ps": (ps.version, ps.plan, ps.paused, ps.policy, ps.bound, ps.lr, digest(ps.state.params)),
        "compressor": (dict(compressor.policies), dict(compressor.operator), sorted(compressor.gateway.devices)),
        "worker": (worker.plan.version, worker.policy, worker.view.version, worker.accepted),
        "host": (dict(host.submissions), dict(host.states), sorted(host.specs), host.current),
    }


def digest(params: Mapping[str, np.ndarray] | None) -> str:
    return hashlib.sha256(b"".join(v.tobytes() for v in (params or {}).values())).hexdigest()


async def test_a_storm_of_junk_on_every_consumed_topic_is_counted_and_none_of_it_applied(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    started = time.monotonic()
    scene = Scene(layout={name: shape for name, (shape, _) in DIGITS_LAYOUT.items()})
    cfg = make_config(mosquitto_broker, job=scene.job, **{"ps.state_dir": tmp_path / "ps", **SERVICES})
    worker_cfg = make_config(mosquitto_broker, job=scene.job, **{**SERVICES, **IDLE_WORKER,
                                                                  "worker.device": scene.worker})
    host_cfg = make_config(mosquitto_broker, job="", **{**SERVICES, "ps.state_dir": tmp_path / "host"})
    client_cfg = make_config(mosquitto_broker, job=scene.job, **{"broker.chunk_bytes": 16 << 20,
                                                                  "broker.max_message_bytes": 16 << 20})
    planner, ps, compressor = Planner(cfg), ParameterServer(cfg), Compressor(cfg)
    worker, host = Worker(worker_cfg), JobHost("ps", host_cfg, ps_jobs.for_job)
    services: dict[str, Any] = {"planner": planner, "ps": ps, "compressor": compressor, "worker": worker,
                                "ps_host": Board(host)}
    t = scene.topics
    async with running(*services.values()), devices(client_cfg, [scene.member]) as c:
        # the scene: the member planned and its update applied (version 1); a gateway device; the worker unplanned
        m, inc = scene.member, scene.incarnation
        await c.publish(t.hello(m), device_hello(m, incarnation=inc), retain=True)
        await c.publish(t.status(m), DeviceStatus(device=m, state="online", incarnation=inc), retain=True)
        await c.publish(t.hello(scene.gateway), dataclasses.replace(device_hello(scene.gateway, incarnation=inc),
                                                                    can_encode=False), retain=True)
        await until("the plan of the member", lambda: ps.plan is not None and worker.plan is not None
                    and [d.device for d in ps.plan.devices] == [m] and worker.plan.version == ps.plan.version)
        await until("codec policies", lambda: set(compressor.policies) >= set(scene.known)
                    and worker.policy is not None)
        assert (await c.push(gradient(m, 1, 0, incarnation=inc, codec="fp16"))).status == "accepted"
        await until("the worker's model at version 1", lambda: worker.view.version == 1)
        assert planner.plan is not None and planner.version == ps.plan.version >= scene.plan_version
        before = state_of(planner, ps, compressor, worker, host)
        held = digest(worker.view.params)
        counts_before = {name: counted(name, svc) for name, svc in services.items()}

        # the storm
        ready = time.monotonic()
        corpus = storm(scene, consumed(scene, services), MESSAGES)
        drawn = time.monotonic()
        expected: Counter[str] = Counter()
        sent: Counter[str] = Counter()
        for junk in corpus:
            for name in consumers(junk, services):
                sent[name] += 1
                if name not in junk.uncounted:
                    expected[name] += junk.counts
        frames = [ft for junk in corpus for ft in junk.targets()]
        for i in range(0, len(frames), PUBLISH_WINDOW):
            await asyncio.gather(*(c.publish(topic, payload) for topic, payload in frames[i:i + PUBLISH_WINDOW]))
        published = time.monotonic()

        # every service still answers, after all of the storm (one publisher: its messages arrive in order)
        for target in ("planner", "ps", "compressor", f"device/{scene.worker}", "job"):
            request = f"after-{target}"
            await c.publish(t.control(target), ControlCommand(command="status", requester="tester",
                                                              request_id=request))
            reply = await c.reply(request)
            assert reply.ok or target == "job", reply  # no job runs: the board says so (and counts it)
        expected["ps_host"] += 1

        def observed() -> dict[str, Counter[str]]:
            return {name: counted(name, svc) - counts_before[name] for name, svc in services.items()}

        with contextlib.suppress(AssertionError):  # the report below says what is missing
            await until("every rejection counted", lambda: all(
                sum(observed()[name].values()) >= expected[name] for name in services), STORM_S)
        report = {name: {"consumed": sent[name], "expected": expected[name], "counted": dict(observed()[name])}
                  for name in services}
        families = Counter(j.family for j in corpus)
        write_report(tmp_path, corpus, frames, report, families,
                     {"setup_s": ready - started, "draw_s": drawn - ready, "publish_s": published - drawn,
                      "counted_s": time.monotonic() - published, "total_s": time.monotonic() - started})
        for name in services:
            assert sum(observed()[name].values()) == expected[name], (name, report[name])
            assert "handler" not in observed()[name], f"{name}: a handler raised on junk"
        assert len(corpus) >= 10_000 and all(sent[name] >= 1000 for name in services), sent
        assert FAMILIES <= set(families), FAMILIES - set(families)
        assert state_of(planner, ps, compressor, worker, host) == before
        # the worker holds the model it held, or the parameter server's exact snapshot of it (an update that
        # missed a delta asks for one, replayed or not; once per version)
        assert digest(worker.view.params) in (held, digest(ps.state.params))


def write_report(tmp_path: Path, corpus: list[Junk], frames: list[tuple[str, bytes]], report: dict[str, Any],
                 families: Counter[str], timing: dict[str, float]) -> None:
    """The storm in numbers: printed, and ``fuzz-report.json`` under the test's tmp dir."""
    summary = {"messages": len(corpus), "frames": len(frames), "bytes": sum(len(p) for _, p in frames),
               "families": dict(families.most_common()), "services": report, "seconds": timing}
    (tmp_path / "fuzz-report.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    print(f"\nstorm: {len(corpus)} messages, {len(frames)} frames, {summary['bytes']} bytes; "
          + ", ".join(f"{k} {v:.1f}s" for k, v in timing.items()))
    for name, r in report.items():
        print(f"  {name}: consumed {r['consumed']}, counted {sum(r['counted'].values())} of {r['expected']}: "
              + ", ".join(f"{k}={v}" for k, v in sorted(r["counted"].items())))


@pytest.fixture(autouse=True)
def _quiet_rejections(caplog: pytest.LogCaptureFixture) -> None:
    """Rejections are logged; the storm's thousands of them are not worth keeping."""
    caplog.set_level("ERROR", logger="edgemesh.common.metrics")


# --- what the storm found: one test each ---------------------------------------------------------------


def idle_worker(broker: BrokerProcess, job: str) -> Worker:
    """Worker ``w0`` of ``job``, that is never planned (see ``IDLE_WORKER``)."""
    return Worker(make_config(broker, job=job, **{**IDLE_WORKER, "worker.device": "w0"}))


def rejections(svc: Any, name: str, route: str, reason: str) -> float:
    return svc.metrics.value(f"edgemesh_{name}_rejected_total", route=route, reason=reason)


async def test_stats_of_a_device_that_never_said_hello_are_counted_and_not_kept(mosquitto_broker: BrokerProcess
                                                                                ) -> None:
    """They were kept (a name per junk message, for ever) and not counted, by the planner and the compressor; and
    the compressor took the stats of an older incarnation of a device (its adaptive policy followed them)."""
    cfg = make_config(mosquitto_broker, job="ghosts")
    planner, compressor = Planner(cfg), Compressor(cfg)
    async with running(planner, compressor), inbox(cfg) as box:
        await box.publish(box.topics.hello("a"), device_hello("a", incarnation=5), retain=True)
        await until("a's hello", lambda: "a" in compressor.incarnations and "a" in planner.registry.hellos)
        await box.publish(box.topics.stats("a"), DeviceStats(device="a", incarnation=3, step_time_s=9.0))
        await box.publish(box.topics.stats("ghost"), DeviceStats(device="ghost", step_time_s=0.1))
        await until("both counted", lambda: rejections(planner, "planner", "stats", "unknown_device") == 1
                    and rejections(compressor, "compressor", "stats", "unknown_device") == 1)
        assert "ghost" not in planner.registry.stats and "ghost" not in compressor.stats
        assert "a" not in planner.registry.stats and "a" not in compressor.stats  # a previous run's


async def test_the_gateway_refuses_raw_updates_of_devices_it_does_not_serve(mosquitto_broker: BrokerProcess) -> None:
    """They were encoded and forwarded to the parameter server (error feedback and the last payload kept per
    name), and not counted by the compressor."""
    cfg = make_config(mosquitto_broker, job="gateway", **{"compressor.mode": "static"})
    compressor = Compressor(cfg)
    t = Topics("gateway")
    async with inbox(cfg, (t.grad_filter(), GradientUpdate)) as box, running(compressor):
        for name, encodes in (("enc", True), ("gw", False)):
            await box.publish(t.hello(name), dataclasses.replace(device_hello(name), can_encode=encodes), retain=True)
        await until("the gateway device",
                    lambda: "gw" in compressor.gateway.devices and "enc" in compressor.incarnations)
        for name in ("enc", "ghost", "gw"):
            await box.publish(t.grad_raw(f"c-{name}", name), gradient(name, 1, 0))
        forwarded = await box.next(GradientUpdate)
        assert forwarded.device == "gw"  # the others came first, and were not forwarded
        assert rejections(compressor, "compressor", "grad_raw", "unknown_device") == 2
        assert set(compressor.gateway.feedback) == {"gw"}


async def test_an_older_plan_is_counted_as_replayed_and_not_taken(mosquitto_broker: BrokerProcess, tmp_path: Path
                                                                  ) -> None:
    """The parameter server and the worker dropped it without a count."""
    cfg = make_config(mosquitto_broker, job="replay", **{"ps.state_dir": tmp_path, "ps.eval_every": 0})
    worker = idle_worker(mosquitto_broker, "replay")
    async with serving_ps(cfg, ["a"]) as (c, ps), running(worker):
        await c.publish_plan(["a"], version=3)
        await until("plan 3", lambda: ps.plan is not None and ps.plan.version == 3 and worker.plan is not None
                    and worker.plan.version == 3)
        await c.publish_plan(["a", "b"], version=2)
        await until("both counted", lambda: rejections(ps, "ps", "plan", "replayed") == 1
                    and rejections(worker, "worker", "plan", "replayed") == 1)
        assert ps.plan.version == 3 and worker.plan.version == 3


async def test_a_worker_counts_an_older_codec_policy_as_replayed_and_keeps_its_own(mosquitto_broker: BrokerProcess
                                                                                   ) -> None:
    """An older policy was applied: the worker switched codec to whatever a replay said."""
    worker = idle_worker(mosquitto_broker, "policy")
    t = Topics("policy")
    async with running(worker), inbox(make_config(mosquitto_broker, job="policy")) as box:
        await until("the worker subscribed", lambda: worker.bus is not None and worker.bus.is_connected)
        await box.publish(t.codec("w0"), CodecPolicy(device="w0", codec="fp16", version=3))
        await until("its policy", lambda: worker.policy is not None and worker.policy.version == 3)
        await box.publish(t.codec("w0"), CodecPolicy(device="w0", codec="topk", density=0.01, version=2))
        await until("the replay counted", lambda: rejections(worker, "worker", "codec", "replayed") == 1)
        assert worker.policy == CodecPolicy(device="w0", codec="fp16", version=3)


async def test_a_model_delta_of_another_model_is_counted(mosquitto_broker: BrokerProcess) -> None:
    """The worker dropped it without a count (a snapshot of another model is counted ``shape``)."""
    worker = idle_worker(mosquitto_broker, "delta")
    t = Topics("delta")
    async with running(worker), inbox(make_config(mosquitto_broker, job="delta")) as box:
        await until("the worker subscribed", lambda: worker.bus is not None and worker.bus.is_connected)
        shard = ShardUpdate(param="fc2.bias", start=0, stop=10, codec="none", data=b"\0" * 40)
        await box.publish(t.model_delta(), ModelDelta(version=2, base_version=1, model_spec="cifar-cnn",
                                                      shards=(shard,)))
        await until("the delta counted", lambda: rejections(worker, "worker", "delta", "shape") == 1)


async def test_a_resent_part_of_an_assembling_model_parallel_step_is_counted_and_the_first_kept(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    """A resent part replaced the part held, uncounted: the storm's parts of one step (several seqs of one
    device) were answered and counted once in all; and a part resent after its step was discarded was
    answered, uncounted."""
    cfg = make_config(mosquitto_broker, job="parts", **{"ps.state_dir": tmp_path, "ps.eval_every": 0,
                                                        "ps.mesh_assembly_timeout_s": 0.5,
                                                        "training.sync_policy": "sync"})
    ps = ParameterServer(cfg)
    async with devices(cfg, ["a", "b"]) as c, running(ps):
        await c.publish(c.topics.plan(), mesh_plan(["a", "b"], SPLIT), retain=True)
        await c.version_at_least(0)
        await c.until("the plan", lambda: ps.plan is not None)
        part = member_update("a", 0, seq=1, base=0)
        for update in (part, part, dataclasses.replace(part, seq=2)):  # a resend, and another update of a's part
            await c.publish(c.topics.grad("m-a", "a"), update)
        ack = await c.ack_for("a", 1)
        assert (ack.status, ack.reason) == ("discarded", "incomplete")
        assert rejections(ps, "ps", "grad", "queued") == 2 and rejections(ps, "ps", "grad", "incomplete") == 1
        # a resend after the step timed out is answered alike, and counted alike (it was acked, uncounted)
        c.forget()
        await c.publish(c.topics.grad("m-a", "a"), part)
        assert (await c.ack_for("a", 1)).reason == "incomplete"
        assert rejections(ps, "ps", "grad", "incomplete") == 2


async def test_a_worker_that_has_not_trained_yet_refuses_a_misshapen_snapshot(mosquitto_broker: BrokerProcess
                                                                              ) -> None:
    """It knew the model's shapes only once it had trained, so it took any: its view held tensors its model
    could not load."""
    worker = idle_worker(mosquitto_broker, "shapes")
    t = Topics("shapes")
    async with running(worker), inbox(make_config(mosquitto_broker, job="shapes")) as box:
        await until("the worker subscribed", lambda: worker.bus is not None and worker.bus.is_connected)
        tensors = {name: Tensor(dtype="float32", shape=(1,), data=b"\0" * 4) for name in DIGITS_LAYOUT}
        await box.publish(t.model(), ModelSnapshot(version=5, model_spec="digits-cnn", tensors=tensors))
        await until("the snapshot counted", lambda: rejections(worker, "worker", "model", "shape") == 1)
        assert not worker.view.ready


async def test_a_submission_whose_file_names_another_job_is_refused_and_its_file_not_kept(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    """The host kept the parsed file (a cache entry per junk submission) before it saw the name was wrong."""
    host = JobHost("ps", make_config(mosquitto_broker, job="", **{"ps.state_dir": tmp_path}), ps_jobs.for_job)
    async with running(Board(host)), inbox(make_config(mosquitto_broker, job="client")) as box:
        await until("the host subscribed", lambda: host.bus is not None and host.bus.is_connected)
        await box.publish(Topics("fuzz").job_file(), submission("fuzz", job_source("other")))
        await until("the submission counted", lambda: rejections(host, "ps_host", "job", "field") == 1)
        assert host.specs == {} and host.submissions == {}
