"""Brokers the tests and ``edgemesh demo`` start: what every service relies on from them.

Each test runs against brokers it starts itself (see ``conftest.py``); every wait is
bounded by :data:`WAIT`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap

import aiomqtt
import paho.mqtt.reasoncodes
import pytest

from edgemesh.common.errors import BrokerError
from edgemesh.local.broker import READY_LINE, BrokerProcess, free_port, port_accepts, wait_port, wait_port_async
from edgemesh.local.embedded import EmbeddedBroker, run_embedded_broker

WAIT = 10.0
"""Seconds any single expected event may take."""


async def next_message(client: aiomqtt.Client, timeout: float = WAIT) -> aiomqtt.Message:
    """The next message delivered to ``client``; TimeoutError if none comes in time."""
    async with asyncio.timeout(timeout):
        async for message in client.messages:
            return message
    raise AssertionError("message iterator ended")  # pragma: no cover


def mqtt_client(broker: BrokerProcess | EmbeddedBroker, **kwargs: object) -> aiomqtt.Client:
    """An MQTT 3.1.1 client of ``broker`` (both brokers speak it)."""
    return aiomqtt.Client(broker.host, broker.port, timeout=WAIT, **kwargs)  # type: ignore[arg-type]


# --- messaging semantics, on both brokers ----------------------------------------------------


async def test_retained_qos1_message_reaches_a_later_subscriber(broker: BrokerProcess) -> None:
    async with mqtt_client(broker, identifier="publisher") as publisher:
        await publisher.publish("edgemesh/v1/t/plan", b"plan-v1", qos=1, retain=True)
        await publisher.publish("edgemesh/v1/t/plan", b"plan-v2", qos=1, retain=True)

    async with mqtt_client(broker, identifier="late-subscriber") as subscriber:
        await subscriber.subscribe("edgemesh/v1/t/#", qos=1)
        message = await next_message(subscriber)

    assert message.topic.value == "edgemesh/v1/t/plan"
    assert message.payload == b"plan-v2"  # the last retained message replaces the earlier one
    assert message.qos == 1
    assert message.retain


@pytest.mark.parametrize("size", [1 << 20, 5 << 20], ids=["1MiB", "5MiB"])
async def test_large_payload_round_trips(broker: BrokerProcess, size: int) -> None:
    payload = os.urandom(size)
    async with mqtt_client(broker) as subscriber, mqtt_client(broker) as publisher:
        await subscriber.subscribe("edgemesh/v1/t/model", qos=1)
        await publisher.publish("edgemesh/v1/t/model", payload, qos=1)
        message = await next_message(subscriber)
    assert len(message.payload) == size  # type: ignore[arg-type]
    assert message.payload == payload


async def test_persistent_session_receives_qos1_sent_while_offline(broker: BrokerProcess) -> None:
    async with mqtt_client(broker, identifier="worker-1", clean_session=False) as worker:
        await worker.subscribe("edgemesh/v1/t/ack/worker-1", qos=1)
    async with mqtt_client(broker) as ps:
        await ps.publish("edgemesh/v1/t/ack/worker-1", b"ack-7", qos=1)
    async with mqtt_client(broker, identifier="worker-1", clean_session=False) as worker:
        message = await next_message(worker)
    assert message.payload == b"ack-7"


# A device in its own process: connects with a retained QoS 1 will, prints "connected"
# once the broker has accepted it, then idles until it is SIGKILLed.
WILL_CLIENT = textwrap.dedent(
    """
    import sys, threading
    import paho.mqtt.client as mqtt

    host, port, topic = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    connected = threading.Event()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="doomed-device")
    client.will_set(topic, b"offline", qos=1, retain=True)
    client.on_connect = lambda *args: connected.set()
    client.connect(host, port, keepalive=60)
    client.loop_start()
    if not connected.wait(10):
        sys.exit("no CONNACK")
    print("connected", flush=True)
    threading.Event().wait()
    """
)


async def test_will_is_published_when_a_client_dies_not_when_it_disconnects(broker: BrokerProcess) -> None:
    status = "edgemesh/v1/t/device/doomed-device/status"
    async with mqtt_client(broker) as watcher:
        await watcher.subscribe(status, qos=1)

        # A clean DISCONNECT must not fire the will.
        polite = aiomqtt.Will(status, b"polite-offline", qos=1)
        async with mqtt_client(broker, identifier="polite-device", will=polite):
            pass

        device = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            WILL_CLIENT,
            broker.host,
            str(broker.port),
            status,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert device.stdout is not None
            async with asyncio.timeout(WAIT):
                line = await device.stdout.readline()
            assert line.strip() == b"connected"
            device.send_signal(signal.SIGKILL)  # the kernel closes its socket: no DISCONNECT
        finally:
            if device.returncode is None:
                device.kill()
            await device.wait()

        message = await next_message(watcher)
    assert message.payload == b"offline"

    async with mqtt_client(broker) as late:  # the will was retained
        await late.subscribe(status, qos=1)
        retained = await next_message(late)
    assert retained.payload == b"offline"


async def test_killed_broker_restarts_on_the_same_port(broker: BrokerProcess) -> None:
    port, old_pid = broker.port, broker.pid
    async with mqtt_client(broker) as survivor:
        await survivor.subscribe("edgemesh/v1/t/events")
        broker.kill()
        assert not broker.running
        assert broker.returncode == -signal.SIGKILL
        with pytest.raises(aiomqtt.MqttError):  # connected clients see the connection drop
            await next_message(survivor)

    broker.restart()

    assert broker.port == port
    assert broker.pid is not None and broker.pid != old_pid
    async with mqtt_client(broker) as subscriber, mqtt_client(broker) as publisher:
        await subscriber.subscribe("edgemesh/v1/t/events", qos=1)
        await publisher.publish("edgemesh/v1/t/events", b"back", qos=1)
        message = await next_message(subscriber)
    assert message.payload == b"back"


# --- the embedded broker ---------------------------------------------------------------------


async def test_amqtt_refuses_mqtt5_and_accepts_mqtt311(amqtt_broker: BrokerProcess) -> None:
    # amqtt answers a v5 CONNECT with a 3.1.1 CONNACK, return code 1 ("unacceptable protocol
    # version"); paho maps it to the v5 reason code 0x84, so aiomqtt raises
    #   aiomqtt.exceptions.MqttConnectError (not exported at top level; subclass of the exported
    #   aiomqtt.MqttCodeError -> aiomqtt.MqttError), raised by Client.__aenter__
    #   .rc == paho ReasonCode(Connack, "Unsupported protocol version"), .rc.value == 132
    #   str(exc) == "[code:132] Unsupported protocol version"
    with pytest.raises(aiomqtt.MqttCodeError) as caught:
        async with mqtt_client(amqtt_broker, protocol=aiomqtt.ProtocolVersion.V5):
            pass
    assert isinstance(caught.value, aiomqtt.exceptions.MqttConnectError)
    rc = caught.value.rc
    assert isinstance(rc, paho.mqtt.reasoncodes.ReasonCode)
    assert rc.value == 132
    assert rc.getName() == "Unsupported protocol version"
    assert str(caught.value) == "[code:132] Unsupported protocol version"

    async with mqtt_client(amqtt_broker, protocol=aiomqtt.ProtocolVersion.V311) as client:
        await client.subscribe("edgemesh/v1/t/#")


async def test_mosquitto_accepts_mqtt5(mosquitto_broker: BrokerProcess) -> None:
    async with mqtt_client(mosquitto_broker, protocol=aiomqtt.ProtocolVersion.V5) as client:
        await client.subscribe("edgemesh/v1/t/x", qos=1)
        await client.publish("edgemesh/v1/t/x", b"v5", qos=1)
        assert (await next_message(client)).payload == b"v5"


async def test_embedded_broker_in_process_pub_sub() -> None:
    async with EmbeddedBroker() as embedded:
        assert embedded.port > 0
        assert embedded.url == f"mqtt://127.0.0.1:{embedded.port}"
        async with mqtt_client(embedded) as subscriber, mqtt_client(embedded) as publisher:
            await subscriber.subscribe("edgemesh/v1/t/grad/+/+", qos=1)
            await publisher.publish("edgemesh/v1/t/grad/c0/d1", b"g", qos=1)
            message = await next_message(subscriber)
        assert message.topic.value == "edgemesh/v1/t/grad/c0/d1"
        assert message.payload == b"g"
    assert not port_accepts(embedded.host, embedded.port)


async def test_embedded_broker_on_a_taken_port_raises_broker_error(
    mosquitto_broker: BrokerProcess,
) -> None:
    with pytest.raises(BrokerError):
        async with EmbeddedBroker(port=mosquitto_broker.port):
            pass


async def test_run_embedded_broker_reports_ready_and_stops_on_cancel() -> None:
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    port = free_port()
    task = asyncio.create_task(run_embedded_broker("127.0.0.1", port, ready=ready.set_result))
    try:
        async with asyncio.timeout(WAIT):
            url = await ready
        assert url == f"mqtt://127.0.0.1:{port}"
        async with aiomqtt.Client("127.0.0.1", port, timeout=WAIT) as client:
            await client.subscribe("edgemesh/v1/t/#")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert not port_accepts("127.0.0.1", port)


def test_embedded_process_prints_ready_line_and_exits_cleanly_on_sigterm(amqtt_broker: BrokerProcess) -> None:
    assert f"{READY_LINE} {amqtt_broker.url}" in amqtt_broker.log_text()
    amqtt_broker.stop()
    assert amqtt_broker.returncode == 0


# --- BrokerProcess errors and helpers --------------------------------------------------------


@pytest.mark.requires_binary("mosquitto")
def test_start_fails_loudly_with_the_broker_log() -> None:
    broker = BrokerProcess.mosquitto(extra_config="no_such_option 1")
    with pytest.raises(BrokerError, match="no_such_option"):
        broker.start(timeout=WAIT)
    assert broker.pid is None


def test_start_timeout_kills_the_child() -> None:
    broker = BrokerProcess.embedded()  # a Python child cannot import amqtt within 10 ms
    with pytest.raises(BrokerError, match="did not listen"):
        broker.start(timeout=0.01)
    assert not broker.running
    assert broker.returncode is not None


def test_start_refuses_a_port_someone_else_listens_on(mosquitto_broker: BrokerProcess) -> None:
    with pytest.raises(BrokerError, match="already listens"):
        BrokerProcess.embedded(port=mosquitto_broker.port).start(timeout=WAIT)


def test_wait_port_returns_for_a_listener_and_times_out_without(mosquitto_broker: BrokerProcess) -> None:
    wait_port(mosquitto_broker.host, mosquitto_broker.port, timeout=WAIT)
    with pytest.raises(BrokerError):
        wait_port("127.0.0.1", free_port(), timeout=0.2)


async def test_wait_port_async_returns_for_a_listener_and_times_out_without() -> None:
    # Probe a plain server: amqtt leaks the server side of a connection that never sends CONNECT.
    server = await asyncio.start_server(lambda reader, writer: writer.close(), "127.0.0.1", 0)
    async with server:
        await wait_port_async("127.0.0.1", server.sockets[0].getsockname()[1], WAIT)
    with pytest.raises(BrokerError):
        await wait_port_async("127.0.0.1", free_port(), timeout=0.2)


def _page_faults(pid: int) -> int:
    """Minor page faults of process ``pid`` so far (``/proc/PID/stat``, field 10)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[7])


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="page faults are read from /proc")
async def test_mosquitto_passes_megabyte_packets_on_without_faulting_their_pages_in_again(
        mosquitto_broker: BrokerProcess) -> None:
    payload = os.urandom(1 << 20)  # a chunk as large as production.conf allows
    pid = mosquitto_broker.pid
    assert pid is not None
    async with mqtt_client(mosquitto_broker, identifier="sink") as sink, \
            mqtt_client(mosquitto_broker, identifier="source") as source:
        await sink.subscribe("edgemesh/v1/t/grad/#", qos=1)

        async def through(count: int) -> None:
            for i in range(count):
                await source.publish(f"edgemesh/v1/t/grad/c/{i}", payload, qos=1)
                assert (await next_message(sink)).payload == payload

        await through(5)  # the broker's heap grows to what it holds at once
        before = _page_faults(pid)
        await through(20)
        faults = _page_faults(pid) - before
    # each packet read and each copy passed on is a fresh megabyte without the malloc settings: ~10,000 faults
    assert faults < 1000, f"{faults} page faults for 20 packets of 1 MiB"


@pytest.mark.requires_binary("mosquitto")
def test_default_prefers_mosquitto() -> None:
    assert BrokerProcess.default().kind == "mosquitto"
