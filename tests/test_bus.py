"""The bus and its router, on real brokers: one SUBSCRIBE, typed routes, counted failures, refused logins."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from helpers import WAIT_S, until

from edgemesh.common import wire
from edgemesh.common.bus import Bus, router
from edgemesh.common.bus.router import UNSUBSCRIBED_GRACE_S, Route, Routes
from edgemesh.common.config import BrokerConfig, Config, load_config
from edgemesh.common.errors import BusError
from edgemesh.common.messages import DeviceHello, Event, Plan
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import PREFIX, Filter, TopicError, TopicMatch, Topics, match
from edgemesh.common.wire import chunks
from edgemesh.local.broker import BrokerProcess, free_port

JOB = "bus"
T = Topics(JOB)


def config(broker: BrokerProcess, **settings: str) -> Config:
    return load_config(env={}, overrides={"broker.url": broker.url, "job": JOB, "broker.backoff_initial_s": "0.05",
                                          "broker.backoff_max_s": "0.5", **settings})


def hello(device: str) -> DeviceHello:
    return DeviceHello(device=device, incarnation=1, flops=1e9, memory_bytes=1 << 30)


class Recorder:
    """A route handler that keeps what it is given, and raises for a device named ``boom``."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, object]] = []
        self.changed = asyncio.Condition()

    async def __call__(self, msg: object, match: TopicMatch) -> None:
        if getattr(msg, "device", "") == "boom":
            raise RuntimeError("a handler's bug")
        self.seen.append((match.topic, msg))
        async with self.changed:
            self.changed.notify_all()


@contextlib.asynccontextmanager
async def routed(cfg: Config, name: str = "bus") -> AsyncIterator[tuple[Bus, Recorder]]:
    """A bus routing hellos and events to a Recorder, running."""
    bus = Bus(cfg.broker, client_id=f"{name}-{uuid.uuid4().hex[:6]}", metrics=ServiceMetrics("test"))
    seen = Recorder()
    bus.route(T.hello_filter(), DeviceHello, seen)
    bus.route(T.events_filter(), Event, seen)
    async with bus:
        yield bus, seen


def rejected(bus: Bus, route: str, reason: str) -> float:
    return bus.metrics.value("edgemesh_test_rejected_total", route=route, reason=reason)


async def test_a_handler_that_raises_is_counted_and_the_router_goes_on(broker: BrokerProcess) -> None:
    cfg = config(broker)
    async with routed(cfg) as (bus, seen), routed(cfg, "sender") as (sender, _):
        await sender.publish(T.hello("boom"), hello("boom"))
        await sender.publish(T.hello("pi-1"), hello("pi-1"))
        await until("the next message handled", lambda: seen.seen, changed=seen.changed)
        assert [m.device for _, m in seen.seen] == ["pi-1"]  # type: ignore[attr-defined]
        assert rejected(bus, "hello", "handler") == 1
        assert bus.metrics.value("edgemesh_test_received_messages_total", route="hello") == 2
        assert bus.metrics.value("edgemesh_test_handler_seconds_count", route="hello") == 2


async def test_a_body_that_contradicts_its_topic_never_reaches_the_handler(broker: BrokerProcess) -> None:
    cfg = config(broker)
    async with routed(cfg) as (bus, seen), routed(cfg, "sender") as (sender, _):
        await sender.publish(T.hello("pi-1"), hello("pi-2"))  # pi-2's hello on pi-1's topic
        await sender.publish(T.hello("pi-3"), Plan(version=1, created=0.0, model_spec="m", dataset="d"))  # wrong kind
        await sender.publish(T.hello("pi-4"), hello("pi-4"))
        await until("the good hello", lambda: seen.seen, changed=seen.changed)
        assert [t for t, _ in seen.seen] == [T.hello("pi-4")]
        assert rejected(bus, "hello", "topic") == 1 and rejected(bus, "hello", "kind") == 1


@pytest.mark.requires_binary("mosquitto_pub")
async def test_junk_is_counted_on_its_route(mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = config(mosquitto_broker, **{"broker.max_message_bytes": str(1 << 20), "broker.chunk_bytes": "1024"})
    async with routed(cfg) as (bus, seen), routed(cfg, "sender") as (sender, _):
        pub = ["mosquitto_pub", "-h", mosquitto_broker.host, "-p", str(mosquitto_broker.port), "-q", "1"]
        subprocess.run([*pub, "-t", T.hello("pi-1"), "-m", "not msgpack"], check=True, timeout=WAIT_S)
        big = tmp_path / "big"
        big.write_bytes(b"\0" * (2 << 20))
        subprocess.run([*pub, "-t", T.events(), "-f", str(big)], check=True, timeout=WAIT_S)
        await sender.publish(T.events(), b"\0" * (2 << 20))  # chunked by the sender: refused once, as a whole
        event = Event(kind="evaluation", source="ps", time=1.0, message="x" * 4000)
        await sender.publish(T.events(), event)  # four chunks of 1 KiB, joined again
        await until("the chunked event", lambda: seen.seen, changed=seen.changed)
        assert seen.seen == [(T.events(), event)]
        assert rejected(bus, "hello", "malformed") == 1 and rejected(bus, "events", "oversized") == 2


async def test_messages_waiting_for_a_busy_handler_show_on_the_inbox_gauge(broker: BrokerProcess) -> None:
    """The inbox between the network and the router is the one queue every service has (``bench soak``
    samples it): a handler that takes its time leaves the next messages waiting there, counted."""
    cfg = config(broker)
    release = asyncio.Event()
    handled: list[str] = []

    async def busy(msg: DeviceHello, _: TopicMatch) -> None:
        handled.append(msg.device)
        await release.wait()

    bus = Bus(cfg.broker, client_id=f"busy-{uuid.uuid4().hex[:6]}", metrics=ServiceMetrics("test"))
    bus.route(T.hello_filter(), DeviceHello, busy)

    def waiting() -> float:
        return bus.metrics.value("edgemesh_test_inbox_messages")

    async with bus, routed(cfg, "sender") as (sender, _):
        for device in ("pi-1", "pi-2", "pi-3"):
            await sender.publish(T.hello(device), hello(device))
        await until("two hellos waiting behind the first", lambda: handled == ["pi-1"] and waiting() == 2)
        release.set()
        await until("the inbox drained", lambda: len(handled) == 3 and waiting() == 0)


async def test_a_partial_chunked_message_times_out_on_an_idle_bus_counted_on_its_own_route(
        mosquitto_broker: BrokerProcess) -> None:
    """Issue 14 (fuzz): a partial message was let go only when another chunk came, so the last ones never were
    (nor counted), and a drop was counted on the route of the chunk that happened to come next."""
    cfg = config(mosquitto_broker, **{"broker.reassembly_timeout_s": "0.3"})
    async with routed(cfg) as (bus, seen), routed(cfg, "sender") as (sender, _):
        event = Event(kind="evaluation", source="ps", time=1.0, message="x" * 4000)
        await sender.publish(T.events(), chunks.split(wire.encode(event), 1024)[0])  # one chunk of four, the rest lost
        await until("the partial message counted", lambda: rejected(bus, "events", "chunk_timeout") == 1)
        await sender.publish(T.events(), chunks.split(wire.encode(event), 1024)[0])
        await sender.publish(T.hello("pi-2"), chunks.split(wire.encode(hello("pi-2")) + b"\0" * 2000, 1024)[0])
        await until("both counted", lambda: rejected(bus, "events", "chunk_timeout") == 2
                    and rejected(bus, "hello", "chunk_timeout") == 1)
        assert not seen.seen


@pytest.mark.requires_binary("mosquitto")
async def test_every_route_goes_out_in_one_subscribe_and_again_on_reconnect(tmp_path: Path) -> None:
    with BrokerProcess.mosquitto(extra_config="log_type all\n", workdir=tmp_path) as broker:
        cfg = config(broker)
        bus = Bus(cfg.broker, client_id="one-subscribe", metrics=ServiceMetrics("test"))
        for filter_ in (T.plan_filter(), T.hello_filter(), T.status_filter(), T.grad_filter(), T.events_filter()):
            bus.route(filter_, (Plan, DeviceHello, Event), Recorder())
        async with bus:
            await until("the subscription", lambda: f"one-subscribe 1 {T.root}/events/chunk/+" in broker.log_text())
            assert len(re.findall(r"Received SUBSCRIBE from one-subscribe\b", broker.log_text())) == 1
            broker.kill()
            broker.start()
            await until("a reconnect", lambda: bus.connections >= 2 and bus.is_connected)
            await until("the subscription again", lambda: "Received SUBSCRIBE from one-subscribe" in broker.log_text())
            assert len(re.findall(r"Received SUBSCRIBE from one-subscribe\b", broker.log_text())) == 1


@pytest.mark.requires_binary("mosquitto")
async def test_a_publish_the_crashed_broker_never_acked_goes_out_again_on_the_next_connection(
        tmp_path: Path) -> None:
    """A gradient in flight when the broker died waited out ``operation_timeout_s`` (10 s) for a PUBACK the old
    connection would never carry, and training stood still that long after the broker came back."""
    with BrokerProcess.mosquitto(workdir=tmp_path) as broker:
        cfg = config(broker, **{"broker.operation_timeout_s": str(3 * WAIT_S), "broker.publish_timeout_s":
                                str(3 * WAIT_S)})
        async with routed(cfg, "sender") as (sender, _), routed(cfg) as (_, seen):
            os.killpg(broker.pid or 0, signal.SIGSTOP)  # alive to TCP, answering nothing
            handed = asyncio.Event()
            publish = asyncio.create_task(sender.publish(T.hello("pi-1"), hello("pi-1"), retain=True, handed=handed))
            await asyncio.wait_for(handed.wait(), WAIT_S)
            broker.kill()
            broker.start()
            async with asyncio.timeout(WAIT_S):  # well before operation_timeout_s
                await publish
            await until("the hello through the new broker", lambda: [m for _, m in seen.seen] == [hello("pi-1")])


@pytest.mark.requires_binary("mosquitto")
async def test_a_connection_lost_while_a_hook_runs_is_seen_and_the_hook_runs_again_on_the_next(
        tmp_path: Path) -> None:
    """A device's announce hook waited on a broker that had died: the loss went unseen while the hook ran, and
    the hook's publish failed after publish_timeout_s, ending the bus and its process."""
    with BrokerProcess.mosquitto(workdir=tmp_path) as broker:
        cfg = config(broker)
        calls: list[int] = []
        gate = asyncio.Event()  # the first call waits here for good: an answer that never comes

        async def announce() -> None:
            calls.append(len(calls) + 1)
            if len(calls) == 1:
                await gate.wait()
            await bus.publish(T.hello(f"pi-{len(calls)}"), hello(f"pi-{len(calls)}"), retain=True)

        bus = Bus(cfg.broker, client_id="hooked", metrics=ServiceMetrics("test"))
        bus.on_connect(announce)
        async with bus, routed(cfg) as (_, seen):
            await until("the first hook running", lambda: calls == [1])
            broker.kill()
            broker.start()
            await until("the hook again on the next connection", lambda: bus.connections == 2 and calls == [1, 2])
            await until("its hello", lambda: [m for _, m in seen.seen] == [hello("pi-2")])
            assert not gate.is_set()


async def test_a_hook_that_fails_is_logged_and_the_bus_goes_on(broker: BrokerProcess,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    async def fails() -> None:
        raise BusError("could not publish on x within 30.0s")

    cfg = config(broker)
    bus = Bus(cfg.broker, client_id="failing-hook", metrics=ServiceMetrics("test"))
    seen = Recorder()
    bus.route(T.hello_filter(), DeviceHello, seen)
    bus.on_connect(fails)
    async with bus, routed(cfg, "sender") as (sender, _):
        await until("the hook's failure logged", lambda: "fails after connecting failed: could not publish"
                    in caplog.text)
        await sender.publish(T.hello("pi-1"), hello("pi-1"))
        await until("a message routed after it", lambda: [m for _, m in seen.seen] == [hello("pi-1")])
        assert bus.is_connected


async def test_a_chunked_publish_that_finds_no_broker_fails_as_a_single_one_does() -> None:
    """Chunks go out several at once; when none can, the caller sees the one BusError a single publish gives."""
    cfg = BrokerConfig(url=f"mqtt://127.0.0.1:{free_port()}", chunk_bytes=1024, publish_timeout_s=0.2)
    bus = Bus(cfg, client_id="nowhere", metrics=ServiceMetrics("test"))  # never connected
    for size in (100, 10 * 1024):  # one piece, then ten chunks
        with pytest.raises(BusError, match="could not publish"):
            await bus.publish("edgemesh/v1/x/events", b"\x00" * size)


@pytest.mark.requires_binary("mosquitto", "mosquitto_passwd")
async def test_a_refused_login_ends_the_bus_with_an_error_instead_of_retrying(tmp_path: Path) -> None:
    """Entering a bus the broker refuses raises; a bus entered without waiting for its connection (a service's)
    ends the block it was entered in, and leaving the block raises the refusal."""
    passwords = tmp_path / "passwords"
    passwords.write_text("")
    subprocess.run(["mosquitto_passwd", "-b", str(passwords), "ops", "secret"], check=True, timeout=WAIT_S)
    with BrokerProcess.mosquitto(extra_config=f"allow_anonymous false\npassword_file {passwords}\n",
                                 workdir=tmp_path) as broker:
        for username, password in (("ops", "wrong"), ("", "")):
            broker_cfg = BrokerConfig(url=broker.url, username=username, password=password, backoff_initial_s=0.05)
            bus = Bus(broker_cfg, client_id="refused", metrics=ServiceMetrics("test"))
            with pytest.raises(BusError, match=re.escape(broker.url)):
                async with asyncio.timeout(WAIT_S), bus:  # a retry loop would run into this timeout instead
                    pass
            assert bus.connections == 0
            serving = Bus(broker_cfg, client_id="refused-service", metrics=ServiceMetrics("test"), connect_first=False)
            with pytest.raises(BusError, match=re.escape(broker.url)):
                async with asyncio.timeout(WAIT_S), serving:
                    supervisor = asyncio.create_task(serving.wait_closed())  # what a service's supervisor awaits
                    await asyncio.Event().wait()  # a service's jobs: the refusal ends them
            assert isinstance(supervisor.exception(), BusError) and serving.connections == 0
            assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]  # its cancel taken back
        # the right password connects
        bus = Bus(BrokerConfig(url=broker.url, username="ops", password="secret"), client_id="ok",
                  metrics=ServiceMetrics("test"))
        async with bus:
            assert bus.is_connected


@pytest.mark.requires_binary("mosquitto")
@pytest.mark.requires_binary("mosquitto")
async def test_a_bus_started_before_its_broker_connects_once_the_broker_is_up(tmp_path: Path) -> None:
    """A service may start before its broker: entering returns at once, the connection loop tries on, and what the
    service published meanwhile goes out once the broker is up."""
    port = free_port()
    cfg = BrokerConfig(url=f"mqtt://127.0.0.1:{port}", backoff_initial_s=0.05, backoff_max_s=0.2)
    seen = Recorder()
    bus = Bus(cfg, client_id="early", metrics=ServiceMetrics("test"), connect_first=False)
    bus.route(T.hello_filter(), DeviceHello, seen)
    async with bus:
        assert not bus.is_connected
        publishing = asyncio.create_task(bus.publish(T.hello("pi-1"), hello("pi-1"), retain=True))
        with BrokerProcess.mosquitto(port=port, workdir=tmp_path):
            await bus.wait_connected(WAIT_S)
            await publishing
            await until("its own hello back", lambda: [m for _, m in seen.seen] == [hello("pi-1")],
                        changed=seen.changed)


async def test_leaving_the_bus_leaves_no_task_behind(broker: BrokerProcess) -> None:
    before = set(asyncio.all_tasks())
    bus = Bus(config(broker).broker, client_id="tasks", metrics=ServiceMetrics("test"))
    bus.route(T.hello_filter(), DeviceHello, Recorder())
    async with bus:
        assert bus.is_connected
        assert len(set(asyncio.all_tasks()) - before) >= 2  # the connection loop and the router
        closed = asyncio.create_task(bus.wait_closed())
    await asyncio.wait_for(closed, WAIT_S)  # returns once the bus is left
    leftover = {t for t in set(asyncio.all_tasks()) - before if not t.done()}
    assert not leftover, leftover
    assert not bus.is_connected
    with pytest.raises(BusError, match="no connection"):  # entered again: connects again, here to no broker
        async with Bus(BrokerConfig(url=f"mqtt://127.0.0.1:{free_port()}", connect_timeout_s=0.3),
                       client_id="nowhere", metrics=ServiceMetrics("test")):
            pass
    assert not {t for t in set(asyncio.all_tasks()) - before if not t.done()}


async def test_a_bus_ends_when_a_handler_drops_the_cancellation(broker: BrokerProcess) -> None:
    """Python 3.11's ``asyncio.wait_for`` (under aiomqtt's publish) returns the answer that lands with a
    cancel and drops the cancel: a handler publishing then must not leave the router, and so the stopping
    service, running for ever (CI: a planner that did not stop within 100 s)."""
    cfg = config(broker)
    handling = asyncio.Event()

    async def answered_as_cancelled(msg: DeviceHello, _: TopicMatch) -> None:
        handling.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)  # the publish's PUBACK, landing with the cancel

    bus = Bus(cfg.broker, client_id=f"drops-{uuid.uuid4().hex[:6]}", metrics=ServiceMetrics("test"))
    bus.route(T.hello_filter(), DeviceHello, answered_as_cancelled)

    async def owner() -> None:
        async with bus:
            await asyncio.Event().wait()

    run = asyncio.create_task(owner())
    async with routed(cfg, "sender") as (sender, _):
        await bus.wait_connected(WAIT_S)
        await sender.publish(T.hello("pi-1"), hello("pi-1"))
        async with asyncio.timeout(WAIT_S):
            await handling.wait()
    run.cancel()
    done, _ = await asyncio.wait({run}, timeout=WAIT_S)
    assert run in done and run.cancelled(), "the bus went on after its cancellation"


def test_a_message_is_one_call_into_wire_each_way() -> None:
    """The bus hands the wire a message once on the way out and once on the way in (chunks included)."""
    receiver = chunks.Receiver(max_bytes=1 << 20, budget_bytes=1 << 20, timeout_s=5)
    event = Event(kind="x", source="ps", time=1.0, message="y" * 4000)
    kind, pieces = chunks.frames(event, 1024)
    assert kind == "event" and len(pieces) > 1
    got = [receiver.take(T.events(), piece, Event) for piece in pieces]
    assert got[:-1] == [None] * (len(pieces) - 1) and got[-1] == event


async def test_what_is_published_once_a_message_is_handed_arrives_after_all_of_it(broker: BrokerProcess) -> None:
    """``handed`` is set when the last chunk is with the client, and the publish goes on to wait for the broker's
    PUBACKs; a message published from then on reaches a subscriber after the whole first one (the parameter
    server's acks after its model)."""
    cfg = config(broker, **{"broker.chunk_bytes": "1024", "broker.chunk_window": "2"})
    big = Event(kind="evaluation", source="ps", time=1.0, message="x" * 4000)  # 4 chunks, 2 in flight at once
    async with routed(cfg) as (_, seen), routed(cfg, "sender") as (sender, _):
        for _ in range(3):
            handed = asyncio.Event()
            publishing = asyncio.create_task(sender.publish(T.events(), big, handed=handed))
            async with asyncio.timeout(WAIT_S):
                await handed.wait()
            assert not publishing.done()  # the PUBACKs of the last window are still to come
            await sender.publish(T.hello("pi-1"), hello("pi-1"))
            await publishing
        await until("every message handled", lambda: len(seen.seen) == 6, changed=seen.changed)
        assert [type(m).__name__ for _, m in seen.seen] == ["Event", "DeviceHello"] * 3


async def test_a_process_probes_a_3_1_1_broker_for_mqtt_5_once(amqtt_broker: BrokerProcess,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """amqtt never answers a v5 CONNECT that carries a will: the first bus waits out the probe and falls back; a
    later bus of the same process (a job host's next job) starts with 3.1.1."""
    cfg = config(amqtt_broker)
    will = (T.status("pi-1"), b"offline")
    first = Bus(cfg.broker, client_id="first", metrics=ServiceMetrics("test"), will=will)
    with caplog.at_level("INFO", logger="edgemesh.common.bus"):
        async with first:
            assert first.protocol == "3.1.1"
        later = Bus(cfg.broker, client_id="later", metrics=ServiceMetrics("test"), will=will)
        assert later.protocol == "3.1.1"
        async with later:
            assert later.is_connected
    probed = [r.getMessage().split(":")[0] for r in caplog.records if "did not take MQTT 5" in r.getMessage()]
    assert probed == ["first"]


async def test_subscribing_again_to_a_held_route_brings_its_retained_message_and_loses_nothing(
        broker: BrokerProcess) -> None:
    """A mesh member that needs a whole snapshot again subscribes to the snapshot's route again: the broker sends
    the retained message anew, and what arrives meanwhile still finds the route (unsubscribing first counted it
    as unrouted)."""
    cfg = config(broker)
    bus = Bus(cfg.broker, client_id=f"bus-{uuid.uuid4().hex[:6]}", metrics=ServiceMetrics("test"))
    seen = Recorder()
    hellos = bus.route(T.hello_filter(), DeviceHello, seen)
    async with routed(cfg, "sender") as (sender, _), bus:
        await sender.publish(T.hello("pi-1"), hello("pi-1"), retain=True)
        await until("the retained hello", lambda: len(seen.seen) == 1, changed=seen.changed)

        async def stream() -> None:
            for n in range(50):
                await sender.publish(T.hello(f"pi-s{n}"), hello(f"pi-s{n}"))

        streaming = asyncio.create_task(stream())
        for _ in range(5):
            await bus.subscribe(hellos)
        await streaming
        await until("the stream and the retained hello five times more",
                    lambda: len(seen.seen) == 1 + 50 + 5, changed=seen.changed)
        assert sum(1 for t, _ in seen.seen if t == T.hello("pi-1")) == 6
        assert bus.filters == (T.hello_filter(),)  # one route still, not six
        assert rejected(bus, "none", "topic") == 0


async def test_what_was_sent_before_an_unsubscribe_still_reaches_the_dropped_route(broker: BrokerProcess) -> None:
    """A mesh member leaving its cluster lets go of its own delta topic while parts are on their way: what the
    broker sent before it took the UNSUBSCRIBE goes to the dropped route, not counted as unrouted junk."""
    cfg = config(broker)
    bus = Bus(cfg.broker, client_id=f"bus-{uuid.uuid4().hex[:6]}", metrics=ServiceMetrics("test"))
    seen = Recorder()
    hellos = bus.route(T.hello_filter(), DeviceHello, seen)
    bus.route(T.events_filter(), Event, seen)
    async with routed(cfg, "sender") as (sender, _), bus:
        for _ in range(3):  # the route dropped in the middle of a stream, then taken again
            seen.seen.clear()
            streaming = asyncio.gather(*(sender.publish(T.hello(f"pi-{n}"), hello(f"pi-{n}")) for n in range(200)))
            await until("the stream under way", lambda: len(seen.seen) >= 20, changed=seen.changed)
            await bus.unsubscribe(T.hello_filter())
            await streaming
            await sender.publish(T.events(), Event(kind="x", source="test", time=1.0, message="after"))
            await until("the event after the stream", lambda: any(isinstance(m, Event) for _, m in seen.seen),
                        changed=seen.changed)  # the broker sent it after every hello it sent
            assert 20 <= sum(isinstance(m, DeviceHello) for _, m in seen.seen) <= 200
            assert rejected(bus, "none", "topic") == 0
            await bus.subscribe(hellos)


def test_a_dropped_route_takes_what_arrives_for_its_grace_period_only() -> None:
    now = [0.0]
    routes = Routes(clock=lambda: now[0])
    hellos, events = Route(T.hello_filter(), DeviceHello, Recorder()), Route(T.events_filter(), Event, Recorder())
    routes.add([hellos, events])
    assert routes.drop([T.hello_filter()]) == [hellos] and routes.held == (events,)
    now[0] = UNSUBSCRIBED_GRACE_S - 0.1
    found = routes.find(T.hello("pi-1"))
    assert found is not None and found[0] is hellos and found[1].device == "pi-1"
    now[0] = UNSUBSCRIBED_GRACE_S + 0.1
    assert routes.find(T.hello("pi-1")) is None
    routes.drop([T.hello_filter()])  # dropped again, then held again: found among the held
    routes.add([hellos])
    assert routes.held == (events, hellos) and routes._dropped == []


def test_the_route_kept_for_a_topic_is_the_one_a_scan_finds_as_routes_come_and_go(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The router matches and parses a topic once, then keeps its route: what it keeps is what matching the topic
    against the routes in order finds, before and after routes are added, held again and dropped, for topics of a
    family of their own, a shard's, a chunk's, and others' under a filter that takes everything."""
    now = [0.0]
    routes = Routes(clock=lambda: now[0], cached=6)  # fewer than the topics: some are let go and matched again
    shard = Topics(JOB, 1)
    topics = [T.hello("pi-1"), T.hello("pi-2"), T.model(), T.chunk(T.model(), 3), T.grad("c0", "pi-1"),
              shard.grad("c0", "pi-1"), shard.model(), T.control("all"), T.control("device/pi-1"),
              T.control_reply("ops"), T.device_reply(T.control_reply("ops"), "pi-1"), T.events(), T.plan(),
              Topics("other").plan(), f"{PREFIX}/{JOB}/unknown", "elsewhere/plan"]
    matched: list[str] = []

    def counted(topic: str, filters: list[Filter]) -> tuple[int, TopicMatch] | None:
        matched.append(topic)
        return match(topic, filters)

    monkeypatch.setattr(router, "match", counted)

    def scanned(topic: str) -> object:
        try:
            found = match(topic, [r.filter for r in routes.held])
        except TopicError:
            return TopicError
        return None if found is None else (routes.held[found[0]], found[1])

    def found(topic: str) -> object:
        try:
            return routes.find(topic)
        except TopicError:
            return TopicError

    def check() -> None:
        for _ in range(2):  # then again, from what was kept
            for topic in topics:
                got = found(topic)
                assert got == scanned(topic), topic
                assert not isinstance(got, tuple) or got[0] is scanned(topic)[0], topic  # type: ignore[index]

    hellos = Route(T.hello_filter(), DeviceHello, Recorder())
    routes.add([hellos, Route(T.model_filter(), Plan, Recorder())])
    check()
    matched.clear()
    for topic in reversed(topics[-6:]):
        routes.find(topic)
    assert matched == []  # the last six topics seen: kept
    routes.append(Route(shard.grad_filter(), Plan, Recorder()))
    check()
    routes.add([Route(Filter(f"{PREFIX}/{JOB}/#", "events"), Event, Recorder()), hellos])  # hellos: held already
    check()
    routes.drop([T.hello_filter()])
    now[0] = UNSUBSCRIBED_GRACE_S + 1  # past the grace of the dropped route: the catch-all takes hellos
    check()
    routes.add([hellos])  # held again: after the catch-all, which takes hellos first
    check()
    routes.drop([Filter(f"{PREFIX}/{JOB}/#", "events")])
    now[0] += UNSUBSCRIBED_GRACE_S + 1
    check()
