"""Junk a service consumes is counted in its ``edgemesh_<svc>_rejected_total{route,reason}`` (read over
HTTP from ``/metrics``, as Prometheus would) and skipped, and the service goes on: malformed payloads
from a plain ``mosquitto_pub`` on every consumed topic, control commands with a reply topic no one
may publish on, and bodies that name another device than their topic."""

from __future__ import annotations

import subprocess
import urllib.request
from pathlib import Path

import pytest
from helpers import Devices, control_json, devices, gradient, make_config, running, serving_ps, until

from edgemesh.common.metrics import parse_metrics
from edgemesh.common.topics import Topics, matches
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.compressor.service import Compressor
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.planner.service import Planner
from edgemesh.services.worker.service import Worker

TRAIN_S = 60.0
GARBAGE = "\x01 this is not an EdgeMesh envelope"


def rejected(port: int, service: str, reason: str, route: str = "") -> float:
    """A service's rejections for ``reason`` (on ``route``, or all routes), scraped over HTTP."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        samples = parse_metrics(resp.read().decode())
    return sum(v for (name, labels), v in samples.items() if name == f"edgemesh_{service}_rejected_total"
               and dict(labels).get("reason") == reason and (not route or dict(labels).get("route") == route))


@pytest.mark.requires_binary("mosquitto_pub")
async def test_garbage_on_every_consumed_topic_is_counted_and_training_goes_on(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = make_config(mosquitto_broker, job="rej", **{"ps.state_dir": tmp_path / "ps", "training.sync_policy": "async"})
    worker = Worker(make_config(mosquitto_broker, job="rej", **{"ps.state_dir": tmp_path / "ps",
                                                                "worker.device": "w0"}))
    services = {"planner": Planner(cfg), "ps": ParameterServer(cfg), "compressor": Compressor(cfg), "worker": worker}
    async with running(*services.values()):
        await until("training to start", lambda: worker.accepted >= 3, TRAIN_S)
        t = Topics("rej")
        targets = [t.hello("w9"), t.status("w9"), t.stats("w0"), t.plan(), t.codec("w0"), t.model(),
                   t.grad("c-w0", "w0"), t.grad_raw("c-w0", "w0"), t.ack("w0"), t.control("planner"), t.control("ps"),
                   t.control("compressor"), t.control("device/w0"), t.control("all")]
        expected = {}
        for name, svc in services.items():
            assert svc.bus is not None
            expected[name] = sum(1 for topic in targets if any(matches(f.pattern, topic) for f in svc.bus.filters))
            assert expected[name] >= 3, f"{name} consumes too few of the probed topics"
        for topic in targets:
            subprocess.run(["mosquitto_pub", "-h", mosquitto_broker.host, "-p", str(mosquitto_broker.port),
                            "-q", "1", "-t", topic, "-m", GARBAGE], check=True, timeout=TRAIN_S)
        for name, svc in services.items():
            port = svc.metrics.port
            await until(f"{name} to count {expected[name]} malformed messages",
                        lambda port=port, name=name: rejected(port, name, "malformed") >= expected[name])
            assert rejected(port, name, "malformed") == expected[name]
        at = worker.accepted
        await until("training to go on", lambda: worker.accepted >= at + 5, TRAIN_S)


async def command_answered(c: Devices, request_id: str) -> bool:
    """Whether the PS answered ``request_id`` (waits for it)."""
    return (await c.reply(request_id)).ok


@pytest.mark.parametrize("reply_to", ["edgemesh/v1/rejcmd/control-reply/+", "#", "edgemesh/v1/x/#",
                                      "t/" + "x" * 1100], ids=["plus", "hash", "tail-hash", "oversized"])
async def test_a_command_whose_reply_topic_no_one_may_publish_on_is_counted_and_skipped(
        broker: BrokerProcess, tmp_path: Path, reply_to: str) -> None:
    cfg = make_config(broker, job="rejcmd", **{"ps.state_dir": tmp_path, "ps.eval_every": 0})
    async with serving_ps(cfg, ["a"]) as (c, ps):
        port = ps.metrics.port
        await c.publish(c.topics.control("ps"), control_json("pause", requester="tester", request_id="bad",
                                                             reply_to=reply_to))
        await until("the command counted", lambda: rejected(port, "ps", "field", "control") == 1)
        assert not ps.paused  # skipped: never applied
        # the service keeps serving: the next valid command is answered, an update applied
        await c.publish(c.topics.control("ps"), control_json("status", requester="tester", request_id="ok"))
        assert await command_answered(c, "ok")
        assert not any(r.request_id == "bad" for r in c.replies)
        assert (await c.push(gradient("a", 1, 0))).status == "accepted"


async def test_a_body_that_names_another_device_than_its_topic_is_counted_and_not_handled(
        broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = make_config(broker, job="rejdev", **{"ps.state_dir": tmp_path, "ps.eval_every": 0,
                                               "training.sync_policy": "async"})
    async with serving_ps(cfg, ["a", "b"]) as (c, ps), devices(cfg, ["b"], requester="other") as other:
        port = ps.metrics.port
        # a's update on b's topic: if handled, it would be applied and acked to a
        await c.publish(c.topics.grad("c-b", "b"), gradient("a", 1, 0))
        await until("the update counted", lambda: rejected(port, "ps", "topic", "grad") == 1)
        assert ps.version == 0 and not c.acks and not other.acks
        assert (await c.push(gradient("a", 2, 0))).status == "accepted"
        assert ps.version == 1
