"""A malformed payload sent with plain ``mosquitto_pub`` to any topic a service consumes is
counted in that service's ``edgemesh_<svc>_rejected_total{reason="malformed"}`` (read over HTTP
from ``/metrics``, as Prometheus would) and training goes on."""

from __future__ import annotations

import asyncio
import subprocess
import urllib.request
from pathlib import Path

from edgemesh.common.broker import BrokerProcess
from edgemesh.common.config import load_config
from edgemesh.common.metrics import parse_metrics
from edgemesh.common.topics import Topics, matches
from edgemesh.services.compressor.service import Compressor
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.planner.service import Planner
from edgemesh.services.worker.service import Worker

WAIT_S = 60.0
POLL_S = 0.1
GARBAGE = "\x01 this is not an EdgeMesh envelope"


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return parse_metrics(resp.read().decode())


def malformed(port: int, service: str) -> float:
    return scrape(port).get((f"edgemesh_{service}_rejected_total", (("reason", "malformed"),)), 0.0)


async def until(what: str, predicate) -> None:  # noqa: ANN001
    try:
        async with asyncio.timeout(WAIT_S):
            while not await asyncio.to_thread(predicate):
                await asyncio.sleep(POLL_S)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def test_garbage_on_every_consumed_topic_is_counted_and_training_goes_on(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    base = {"broker.url": mosquitto_broker.url, "job": "rej", "metrics.address": "127.0.0.1:0",
            "ps.state_dir": str(tmp_path / "ps"), "training.sync_policy": "async"}
    cfg = load_config(env={}, overrides=base)
    services = {"planner": Planner(cfg), "ps": ParameterServer(cfg), "compressor": Compressor(cfg),
                "worker": Worker(load_config(env={}, overrides={**base, "worker.device": "w0"}))}
    worker = services["worker"]
    tasks = [asyncio.create_task(s.run()) for s in services.values()]
    try:
        await until("training to start", lambda: worker.accepted >= 3)
        t = Topics("rej")
        targets = [t.hello("w9"), t.status("w9"), t.stats("w0"), t.plan(), t.codec("w0"), t.model(),
                   t.grad("c-w0", "w0"), t.grad_raw("c-w0", "w0"), t.ack("w0"), t.control("planner"), t.control("ps"),
                   t.control("compressor"), t.control("device/w0"), t.control("all")]
        expected = {}
        for name, svc in services.items():
            filters = svc.bus._filters
            expected[name] = sum(1 for topic in targets if any(matches(f, topic) for f in filters))
            assert expected[name] >= 3, f"{name} consumes too few of the probed topics"
        for topic in targets:
            subprocess.run(["mosquitto_pub", "-h", mosquitto_broker.host, "-p", str(mosquitto_broker.port),
                            "-q", "1", "-t", topic, "-m", GARBAGE], check=True, timeout=WAIT_S)
        for name, svc in services.items():
            port = svc.metrics.port
            await until(f"{name} to count {expected[name]} malformed messages",
                        lambda port=port, name=name: malformed(port, name) >= expected[name])
            assert malformed(port, name) == expected[name]
        at = worker.accepted
        await until("training to go on", lambda: worker.accepted >= at + 5)
        assert all(not task.done() for task in tasks)
    finally:
        for svc in services.values():
            svc.stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT_S)
