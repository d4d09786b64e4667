"""A job across a site bridge: the workers on a site broker, the services on a cloud broker.

The site broker is ``deploy/mosquitto/dev.conf`` with ``deploy/mosquitto/bridge.conf`` (``topic edgemesh/v1/#
both 1 "" sites/site1/``, TLS, the ``bridge-site1`` password, ``try_private``, ``cleansession false``); the cloud
broker is the shipped ``production.conf`` with its ACL (``tests/production.py``). Planner, parameter server and
compressor log in to the cloud over TLS as their role users, with the site's prefix (``broker.topic_prefix =
"sites/site1/"``); the workers connect to the site broker as dev.conf allows (plain, anonymous), each with its
device name. Everything between them crosses the bridge: hellos, statuses and stats and the workers' updates up;
the retained plan, codec policies and model (chunked) and the acks down.

A cloud-side client of a site (``broker.topic_prefix``) publishes and subscribes under the prefix alone, and its
routes parse what comes in as the job's own topics. A second site's bridge reaches its own prefix alone: what is
published on that site appears on the cloud under ``sites/site2/`` and nowhere else, only what is published there
comes down, and the first site's bridge user may not write the second site's topics (its control commands, its job
commands) nor the cloud's own.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import WAIT_S, inbox, running, until
from production import (
    SHIPPED_SITE,
    Client,
    ProductionBroker,
    SiteBroker,
    mosquitto,
    production_broker,
    site_broker_conf,
)

from edgemesh.common import wire
from edgemesh.common.acl import OPERATOR, SITES, bridge_client_id, bridge_user
from edgemesh.common.config import Config, load_config
from edgemesh.common.messages import ControlCommand, ControlReply, ModelSnapshot, Plan
from edgemesh.common.topics import ANY, Topics, site_prefix
from edgemesh.services.compressor.service import Compressor
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.planner.service import Planner
from edgemesh.services.worker.service import Worker

TARGET = 0.85
"""Held-out accuracy the bridged job must reach (digits; chance is 0.1)."""
TRAIN_S = 120.0
"""How long training may take on a loaded two-core host (a few seconds on an idle one)."""
DEVICES = ("pi-01", "pi-02")
LATE = "pi-03"
"""A device that joins on the site after the target is reached."""
JOIN_S = 60.0
"""How long the late device may take to be planned in and have an update applied."""
CHUNK_BYTES = 64 * 1024
"""Every service's ``broker.chunk_bytes``: digits-cnn's 153 kB model crosses the bridge in three chunks (retained
on ``model/chunk/<n>``), and so does any update larger than this; far below the cloud's ``max_packet_size``."""


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProductionBroker]:
    """The shipped production broker, this module's alone: the bridge's persistent session (``cleansession
    false``) starts empty."""
    with production_broker(tmp_path_factory.mktemp("cloud")) as broker:
        yield broker


@contextlib.contextmanager
def bridged_site(cloud: ProductionBroker, directory: Path, name: str = SHIPPED_SITE) -> Iterator[SiteBroker]:
    """Site ``name``'s broker running, its bridge to ``cloud`` connected (the retained state it reports is ``1``)."""
    site = site_broker_conf(cloud, name)
    with mosquitto(site.conf, directory, [site.port]):
        watcher = Client(site.port)
        try:
            watcher.subscribe(site.state_topic)
            try:
                while watcher.next_message() != (site.state_topic, b"1"):
                    pass
            except queue.Empty:
                pytest.fail(f"the bridge did not connect:\n{(directory / 'mosquitto.log').read_text()}")
        finally:
            watcher.close()
        yield site


def settings(topics: Topics, tmp_path: Path, **more: object) -> Config:
    """What every service and worker of the job shares, then ``more`` (dotted keys)."""
    overrides: dict[str, object] = {
        "job": topics.job, "broker.backoff_initial_s": 0.05, "broker.backoff_max_s": 0.5,
        "broker.chunk_bytes": CHUNK_BYTES, "metrics.address": "127.0.0.1:0", "ps.state_dir": tmp_path / "ps",
        "ps.eval_budget": 0.5, "planner.min_devices": len(DEVICES), "worker.ack_timeout_s": 5,
        "worker.codec_wait_s": 0.5, **more}
    return load_config(env={}, overrides={k: str(v) for k, v in overrides.items()})


def on_cloud(cloud: ProductionBroker, site: SiteBroker, user: str, topics: Topics, tmp_path: Path) -> Config:
    """A service of ``site``'s job on the cloud broker: TLS, its role user and password, the site's prefix."""
    broker = cloud.broker_config(user)
    return settings(topics, tmp_path, **{"broker.url": broker.url, "broker.username": user,
                                         "broker.password": broker.password, "broker.ca_file": broker.ca_file,
                                         "broker.topic_prefix": site.prefix})


def on_site(site: SiteBroker, device: str, topics: Topics, tmp_path: Path) -> Config:
    """A worker on the site broker: plain MQTT, anonymous, its device name."""
    return settings(topics, tmp_path, **{"broker.url": f"mqtt://127.0.0.1:{site.port}", "worker.device": device})


def rejections(*services: Any) -> dict[str, float]:
    """Messages the ``services`` rejected, as ``name route/reason``, where any were."""
    return {f"{getattr(s, 'device', '') or s.name} {x.labels['route']}/{x.labels['reason']}": x.value
            for s in services for family in s.metrics.registry.collect() for x in family.samples
            if x.name == f"edgemesh_{s.name}_rejected_total" and x.value}


@pytest.mark.e2e
@pytest.mark.timeout(300)
async def test_a_job_trains_across_the_site_bridge(cloud: ProductionBroker, tmp_path: Path) -> None:
    """Two workers on the site, planner, PS and compressor on the cloud: the job reaches its target.

    Across the bridge: the plan the workers follow is the cloud planner's, with their hellos in it; each has its
    codec policy from the cloud compressor; the PS applied updates of both and the acks came back; every update a
    worker sent reached the PS once (none lost, none echoed back by the bridge); a device that connects to the
    site later finds the plan and the chunked model retained there, and is planned in and trains. The workers'
    link probes are timed to the site broker's PUBACK. The cloud's ACL refused nothing the services published,
    nobody rejected a message (but a resent update the PS holds already), and the bridge connected once."""
    topics = Topics("bridged-job")
    with bridged_site(cloud, tmp_path / "site") as site:
        planner = Planner(on_cloud(cloud, site, "planner", topics, tmp_path))
        ps = ParameterServer(on_cloud(cloud, site, "ps", topics, tmp_path))
        compressor = Compressor(on_cloud(cloud, site, "compressor", topics, tmp_path))
        workers = [Worker(on_site(site, d, topics, tmp_path)) for d in DEVICES]
        async with running(planner, ps, compressor):
            async with running(*workers):
                await until("training to reach the target",
                            lambda: ps.metrics.value("edgemesh_ps_eval_accuracy_ratio") >= TARGET, TRAIN_S)
                # site to cloud: the devices' hellos made the plan; cloud to site: that plan reached the workers
                plan = planner.plan
                assert plan is not None and {d.device for d in plan.devices} == set(DEVICES), plan
                await until("the planner's plan at every worker", lambda: all(
                    w.plan is not None and planner.plan is not None and w.plan.version == planner.plan.version
                    for w in workers), WAIT_S)
                await until("a codec policy at every worker", lambda: all(w.policy is not None for w in workers),
                            WAIT_S)
                # the workers' updates crossed up and were applied, their acks crossed down
                assert set(ps.clock.high_water) >= set(DEVICES), ps.clock.high_water
                assert all(w.accepted > 0 for w in workers), [w.accepted for w in workers]
                # link probes: a round trip to the site broker's PUBACK, measured and reported
                await until("latency measured at every worker", lambda: all(
                    w.metrics.value("edgemesh_worker_latency_seconds") > 0 for w in workers), WAIT_S)
                # the model crossed in chunks: the workers measured their downlink from them
                assert all(w.metrics.value("edgemesh_worker_downlink_rate_bytes_per_second") > 0 for w in workers)
                # a device that (re)connects to the site later finds the plan and the chunked model retained there
                async with inbox(on_site(site, "fresh", topics, tmp_path), (topics.plan_filter(), Plan),
                                 (topics.model_filter(), ModelSnapshot)) as fresh:
                    await fresh.next(Plan, lambda p: p.version >= plan.version)
                    await fresh.next(ModelSnapshot)
                # and joins: its hello crosses up, the planner's new plan names it, its updates are applied
                late = Worker(on_site(site, LATE, topics, tmp_path))
                async with running(late):
                    await until("the late device's updates applied",
                                lambda: LATE in ps.clock.high_water and late.accepted > 0, JOIN_S)
                workers.append(late)
            # every update a worker published (resends included) reached the PS once; one per worker may have
            # been on its way, its PUBACK not yet counted, when the workers stopped
            sent = sum(w.metrics.value("edgemesh_worker_published_messages_total", kind="gradient") for w in workers)

            def received() -> float:
                return ps.metrics.value("edgemesh_ps_received_messages_total", route="grad")

            await until(f"{sent:g} updates at the PS", lambda: received() >= sent, WAIT_S)
            assert received() <= sent + len(workers), (received(), sent)
        assert {s.name: s.metrics.value(f"edgemesh_{s.name}_broker_refused_total")
                for s in (planner, ps, compressor)} == {"planner": 0, "ps": 0, "compressor": 0}
        assert set(rejections(planner, ps, compressor, *workers)) <= {"ps grad/queued"}, \
            rejections(planner, ps, compressor, *workers)
    assert cloud.log.read_text().count(f"as {bridge_client_id(SHIPPED_SITE)} ") == 1  # "New bridge connected ... as"


async def test_a_cloud_side_client_of_a_site_speaks_under_its_prefix_alone(cloud: ProductionBroker,
                                                                           tmp_path: Path) -> None:
    """With ``broker.topic_prefix``, what the bus publishes goes out under the prefix, its routes take what comes in
    under it (a reply on the job's own reply topic, parsed without the prefix), and not what comes outside it."""
    topics = Topics("prefixed")
    prefix = site_prefix(SHIPPED_SITE)
    broker = cloud.broker_config(OPERATOR)
    config = settings(topics, tmp_path, **{"broker.url": broker.url, "broker.username": OPERATOR,
                                           "broker.password": broker.password, "broker.ca_file": broker.ca_file,
                                           "broker.topic_prefix": prefix})
    watcher, ps = cloud.client(OPERATOR), cloud.client("ps")
    try:
        watcher.subscribe(f"{topics.root}/#", f"{prefix}{topics.root}/#")
        async with inbox(config, (topics.reply_filter("op"), ControlReply), name="prefixed") as box:
            await box.publish(topics.control("ps"), ControlCommand(command="status", requester="op"))
            assert watcher.next_message()[0] == prefix + topics.control("ps")
            for where, request in ((topics.control_reply("op"), "outside"), (prefix + topics.control_reply("op"),
                                                                               "inside")):
                assert not ps.publish(where, wire.encode(ControlReply(request_id=request, source="ps",
                                                                      command="status", ok=True))).is_failure
            reply = await box.next(ControlReply)  # the one outside the prefix, published first, did not come
            assert reply.request_id == "inside"
            assert [match.topic for match, _ in box.received] == [topics.control_reply("op")]
    finally:
        watcher.close()
        ps.close()


@pytest.mark.timeout(120)
def test_a_sites_bridge_reaches_its_own_prefix_alone(cloud: ProductionBroker, tmp_path: Path) -> None:
    """Site 2's bridge carries what is published there up under ``sites/site2/`` alone, and down only what is
    published under that prefix; the first site's bridge user writes its own prefix alone, not site 2's control or
    job commands, nor the cloud's own. (A refused publish did not arrive: a marker the same client published after
    it did, first.)"""
    topics = Topics("two-sites")
    first, second = SITES
    command = b'{"command": "stop"}'
    with bridged_site(cloud, tmp_path / "site2", second) as site:
        local = Client(site.port)
        operator = cloud.client(OPERATOR)
        impostor = cloud.client(bridge_user(first))
        try:
            operator.subscribe(f"{topics.root}/#", f"{site_prefix(ANY)}{topics.root}/#")
            local.subscribe(f"{topics.root}/#")
            # up: a command published on site 2 reaches the cloud under site 2's prefix, and nowhere else
            assert not local.publish(topics.control("ps"), command).is_failure
            assert local.next_message() == (topics.control("ps"), command)  # its own, from the site broker
            assert operator.next_message() == (site.prefix + topics.control("ps"), command)
            # bridge-site1's credentials: site 2's control and job commands, the cloud's own jobs' refused
            for topic in (site.prefix + topics.control("ps"), site.prefix + topics.control("job"),
                          site.prefix + topics.control("all"), topics.control("ps")):
                assert impostor.publish(topic, command).is_failure, topic
            mine = site_prefix(first) + topics.control("ps")
            assert not impostor.publish(mine, b"marker").is_failure
            assert operator.next_message() == (mine, b"marker")
            # down: the cloud's command for site 1 does not reach site 2; the one for site 2 does
            assert not operator.publish(site_prefix(first) + topics.control("all"), command).is_failure
            assert not operator.publish(site.prefix + topics.control("all"), b"marker").is_failure
            assert local.next_message() == (topics.control("all"), b"marker")
        finally:
            for client in (local, operator, impostor):
                client.close()
