"""The deployment as shipped: Mosquitto on ``deploy/mosquitto/production.conf`` with its ACL, TLS with
certificates the test makes, a password per service and per device, and a client-certificate listener.

* The bus counts and logs a publish the broker refuses (an MQTT 5 PUBACK reason code), which aiomqtt
  would let pass as sent. (Mosquitto's acl_file grants every subscription and filters what it delivers,
  so a refused SUBACK, also counted, does not occur with it.)
* Anonymous clients are refused; a device logs in with a client certificate as its common name.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import WAIT_S, inbox, running, until
from production import CERT_DEVICE, ProductionBroker, production_broker

from edgemesh.common.bus import Bus
from edgemesh.common.config import BrokerConfig, Config, load_config
from edgemesh.common.errors import BusError
from edgemesh.common.messages import ControlCommand, ControlReply, DeviceHello, SnapshotRequest
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics
from edgemesh.services.compressor.service import Compressor
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.planner.service import Planner
from edgemesh.services.worker.service import Worker

TOPICS = Topics("prod")


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProductionBroker]:
    """The shipped production broker on free ports of 127.0.0.1."""
    with production_broker(tmp_path_factory.mktemp("shipped")) as broker:
        yield broker


def refused(metrics: ServiceMetrics, operation: str) -> float:
    return metrics.value(f"edgemesh_{metrics.service}_broker_refused_total", operation=operation)


async def test_a_publish_the_acl_refuses_is_counted_and_logged(shipped: ProductionBroker,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A worker's control command is refused by the broker: counted and logged (it passed silently before)."""
    metrics = ServiceMetrics("worker")
    bus = Bus(shipped.broker_config("pi-01"), client_id="refused-pi-01", metrics=metrics)
    with caplog.at_level(logging.ERROR, logger="edgemesh.common.bus"):
        async with bus:
            await bus.publish(TOPICS.hello("pi-01"), DeviceHello(device="pi-01", incarnation=1, flops=1e9,
                                                                 memory_bytes=1 << 30))
            await bus.publish(TOPICS.control("ps"), ControlCommand(command="pause", requester="pi-01"))
            await until("the refusal counted", lambda: refused(metrics, "publish") == 1, WAIT_S)
            await bus.publish(TOPICS.control("ps"), ControlCommand(command="pause", requester="pi-01"))
            await until("the second refusal counted", lambda: refused(metrics, "publish") == 2, WAIT_S)
    assert f"refused the publish on {TOPICS.control('ps')}" in caplog.text
    assert caplog.text.count("refused the publish") == 1  # logged once per topic; every one counted
    assert TOPICS.hello("pi-01") not in caplog.text  # its own hello went through


async def test_an_anonymous_client_is_refused(shipped: ProductionBroker) -> None:
    bus = Bus(BrokerConfig(url=f"mqtt://127.0.0.1:{shipped.plain_port}"), client_id="anonymous",
              metrics=ServiceMetrics("worker"))
    with pytest.raises(BusError, match="refused the login of an anonymous client"):
        async with bus:
            pass


async def test_a_device_logs_in_with_its_client_certificate(shipped: ProductionBroker, tmp_path: Path) -> None:
    """On the certificate listener the certificate's common name is the user the ACL sees: the device
    writes its own topics and nothing else; without a certificate the TLS handshake fails."""
    cert, key = shipped.client_cert(CERT_DEVICE)
    url = f"mqtts://127.0.0.1:{shipped.cert_port}"
    metrics = ServiceMetrics("worker")
    bus = Bus(BrokerConfig(url=url, ca_file=str(shipped.ca), cert_file=str(cert), key_file=str(key),
                           connect_timeout_s=5),
              client_id=CERT_DEVICE, metrics=metrics)
    async with bus:
        await bus.publish(TOPICS.hello(CERT_DEVICE), DeviceHello(device=CERT_DEVICE, incarnation=1, flops=1e9,
                                                                 memory_bytes=1 << 30), retain=True)
        await bus.publish(TOPICS.hello("pi-01"), DeviceHello(device="pi-01", incarnation=1, flops=1e9,
                                                             memory_bytes=1 << 30), retain=True)
        await until("the other device's topic refused", lambda: refused(metrics, "publish") == 1, WAIT_S)
    assert metrics.value("edgemesh_worker_broker_connects_total") == 1


# --------------------------------------------------------------------------- the whole system under the ACL

TARGET = 0.85
"""Held-out accuracy the shipped deployment must reach (digits; chance is 0.1)."""
TRAIN_S = 120.0
DEVICES = ("pi-01", "pi-02", "pi-03")
MESH_TARGET = 0.5
"""Mesh mode trains digits more slowly per version (one sync step of the whole cluster at a time)."""
MESH_MEMORY = 273_390_000
"""Memory the devices announce in mesh mode: by the planner's cost model none holds digits-cnn's training alone at
any batch, nor two of them the iteration's 32 samples; the three do, as one model-parallel cluster, whatever
speeds and latencies they measure."""


def role_config(shipped: ProductionBroker, user: str, tmp_path: Path, topics: Topics, **settings: object) -> Config:
    """A service (over loopback, with its password) or a device (over TLS, with its own password), as the
    systemd units run them: no job in the configuration is needed here, the test names one."""
    device = user.startswith("pi-")
    broker = shipped.broker_config(user, tls=device)
    overrides: dict[str, object] = {
        "job": topics.job, "broker.url": broker.url, "broker.username": user, "broker.password": broker.password,
        "broker.ca_file": broker.ca_file, "broker.backoff_initial_s": 0.05, "broker.backoff_max_s": 0.5,
        "metrics.address": "127.0.0.1:0", "ps.state_dir": tmp_path / "ps", "ps.eval_every": 5,
        "training.sync_policy": "adaptive", "planner.min_devices": len(DEVICES),
        "worker.ack_timeout_s": 5, "worker.codec_wait_s": 0.5, **settings}
    if device:
        overrides["worker.device"] = user
    return load_config(env={}, overrides={k: str(v) for k, v in overrides.items()})


def refusals(*services: Any) -> dict[str, float]:
    """Publishes the broker refused, per service or device that had any."""
    counts = {getattr(s, "device", "") or s.name: s.metrics.value(f"edgemesh_{s.name}_broker_refused_total")
              for s in services}
    return {who: n for who, n in counts.items() if n}


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallelism", ["data", "mesh"])
async def test_the_shipped_deployment_trains_under_its_acl(shipped: ProductionBroker, tmp_path: Path,
                                                           parallelism: str) -> None:
    """Planner, PS, compressor and three workers, each with its own credentials, train to the target under
    ``adaptive``; the PS's sync state reaches the planner; control for all reaches every service; nothing
    any of them publishes is refused. In mesh mode the devices are too small to hold the model alone: one
    model-parallel cluster, trading slices on topics that name their sender. A device asks for the whole model on
    its own topic (a mesh member with a new division does), and the PS takes the request."""
    mesh = {"planner.parallelism": "mesh", "training.sync_policy": "sync"} if parallelism == "mesh" else {}
    topics = Topics(f"prod-{parallelism}")  # a job of its own: no retained plan or hello of another test
    planner = Planner(role_config(shipped, "planner", tmp_path, topics, **mesh))
    ps = ParameterServer(role_config(shipped, "ps", tmp_path, topics, **mesh))
    compressor = Compressor(role_config(shipped, "compressor", tmp_path, topics, **mesh))
    workers = [Worker(role_config(shipped, d, tmp_path, topics, **mesh, **(
        {"worker.memory_bytes": MESH_MEMORY} if mesh else {}))) for d in DEVICES]
    target = MESH_TARGET if mesh else TARGET
    operator = role_config(shipped, "operator", tmp_path, topics)
    async with running(planner, ps, compressor, *workers), inbox(
            operator, (topics.reply_filter("operator"), ControlReply)) as box:
        await until("training to reach the target",
                    lambda: ps.metrics.value("edgemesh_ps_eval_accuracy_ratio") >= target, TRAIN_S)
        if mesh:
            assert planner.plan is not None and [len(c.members) for c in planner.plan.clusters] == [3], planner.plan
        else:
            # adaptive batch shrinking works in production: the planner has the PS's retained sync state
            await until("the sync state at the planner", lambda: planner.sync_state is not None
                        and planner.sync_state.policy == "adaptive", WAIT_S)
        # the operator's command for everyone reaches every service and device
        await box.publish(topics.control("all"), ControlCommand(command="status", requester="operator",
                                                                request_id="all"))
        everyone = {"planner", "ps", "compressor", *(f"device/{d}" for d in DEVICES)}

        def answered() -> set[str]:
            return {r.source for r in box.of(ControlReply) if r.request_id == "all"}

        with contextlib.suppress(AssertionError):
            await box.until("a reply from everyone", lambda: answered() >= everyone)
        assert answered() >= everyone
        # a device's request for the whole model, with its own credentials, reaches the PS
        requests = ps.metrics.value("edgemesh_ps_received_messages_total", route="snapshot_request")
        device = role_config(shipped, "pi-01", tmp_path, topics)
        async with inbox(device, name="asker") as pi:
            await pi.publish(topics.snapshot_request("pi-01"), SnapshotRequest(device="pi-01", version=0))
            await until("the PS to take the request", lambda: ps.metrics.value(
                "edgemesh_ps_received_messages_total", route="snapshot_request") > requests, WAIT_S)
            assert pi.bus.metrics.value("edgemesh_asker_broker_refused_total") == 0
        assert ps.metrics.value("edgemesh_ps_rejected_total", route="snapshot_request") == 0
        if mesh:
            assert all(w.metrics.value("edgemesh_worker_mesh_steps_total", outcome="done") > 0 for w in workers)
        assert refusals(planner, ps, compressor, *workers) == {}
