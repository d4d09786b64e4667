"""The deployment as shipped: Mosquitto on ``deploy/mosquitto/production.conf`` with its ACL, TLS with
certificates the test makes, a password per service and per device, and a client-certificate listener.

* The bus counts and logs a publish the broker refuses (an MQTT 5 PUBACK reason code), which aiomqtt
  would let pass as sent. (Mosquitto's acl_file grants every subscription and filters what it delivers,
  so a refused SUBACK, also counted, does not occur with it.)
* Anonymous clients are refused; a device logs in with a client certificate as its common name.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import WAIT_S, until
from production import CERT_DEVICE, ProductionBroker, production_broker

from edgemesh.common.bus import Bus
from edgemesh.common.config import BrokerConfig
from edgemesh.common.errors import BusError
from edgemesh.common.messages import ControlCommand, DeviceHello
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics

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
        async with bus.running():
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
        async with bus.running():
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
    async with bus.running():
        await bus.publish(TOPICS.hello(CERT_DEVICE), DeviceHello(device=CERT_DEVICE, incarnation=1, flops=1e9,
                                                                 memory_bytes=1 << 30), retain=True)
        await bus.publish(TOPICS.hello("pi-01"), DeviceHello(device="pi-01", incarnation=1, flops=1e9,
                                                             memory_bytes=1 << 30), retain=True)
        await until("the other device's topic refused", lambda: refused(metrics, "publish") == 1, WAIT_S)
    assert metrics.value("edgemesh_worker_broker_connects_total") == 1
