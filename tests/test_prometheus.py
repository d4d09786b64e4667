"""The metrics on a real Prometheus: a small cluster of real processes (the services serving a submitted job, as
systemd runs them) is scraped by the ``prometheus`` binary with the shipped scrape configuration
(``deploy/prometheus/prometheus.yml``: its jobs, labels and settings; the test's ports as targets), and every
query of every panel of the Grafana dashboard returns data through Prometheus's HTTP API.

What a short run would not make happen on its own, the test makes happen as it happens on a fleet: one worker
cannot encode (the compressor's gateway encodes for it), a malformed control message reaches every service and
a job submission with a wrong hash reaches the hosts (the rejection panels), and one worker reads its health
from thermal zones and a ``vcgencmd`` the test writes (the Pi health row: this machine is no Raspberry Pi).

Without ``prometheus`` the test is skipped, saying what to install; under ``CI=true`` it fails (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import re
import subprocess
import time
import typing
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from helpers import inbox, make_config, require_binary, write_thermal_zones, write_vcgencmd

from edgemesh.common.config import Config
from edgemesh.common.jobs import parse_job, render_job
from edgemesh.common.messages import JobSubmission
from edgemesh.common.topics import Topics
from edgemesh.local.broker import BrokerProcess, free_port
from edgemesh.local.demo import DIGITS_MODEL, DIGITS_NORMALIZATION
from edgemesh.local.processes import LocalCluster, parent_death_signal
from edgemesh.operator.job import submission_of, submit

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[1]
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "grafana" / "dashboards" / "edgemesh.json"
JOB = "observed"
ROLES = {"edgemesh-planner": "planner", "edgemesh-ps": "ps", "edgemesh-compressor": "compressor",
         "edgemesh-worker": "worker"}
"""The scrape jobs of the shipped configuration, and the service each one scrapes."""
SCRAPE_S = 1
"""The test's scrape and evaluation interval, seconds (the shipped file's 15 s would make a short run a long one)."""
INTERVAL = f"{SCRAPE_S}s"
"""Grafana's ``$__interval``: the step of a panel's range query; here one point per scrape."""
RATE_INTERVAL = f"{max(2 * SCRAPE_S, 4 * SCRAPE_S)}s"
"""Grafana's ``$__rate_interval``: max($__interval + the scrape interval, 4 x the scrape interval)."""
START_WAIT_S = 60.0
"""How long the processes, Prometheus and the job may take to start (two cores, several torch imports)."""
DATA_WAIT_S = 60.0
"""How long every query may take to return data once the job runs."""
POLL_S = 1.0
"""How often the test asks Prometheus again while it waits: once per scrape."""
HTTP_TIMEOUT_S = 5.0
STOP_S = 10.0
"""How long Prometheus gets to stop on SIGTERM."""
NO_VALUE_IN_THIS_RUN = {
    "Waiting for other members": "the time model-parallel members wait for each other: this run's clusters are "
                                 "single devices, so the histogram has no observation and its quantile is NaN",
}
"""Panels whose queries return series but no number in this run, and why (every other query must give one)."""
PI_TEMPERATURE_C = 52.5
PI_THROTTLED = "0x50005"
"""The test-written Pi: under-voltage and throttled now (bits 0, 2) and since boot (bits 16, 18)."""
MALFORMED = b"\xc1 neither MessagePack nor JSON"


# --------------------------------------------------------------------------- Prometheus


def prometheus_binary() -> str:
    """The ``prometheus`` binary (the test is skipped without it, failed under CI=true: tests/conftest.py)."""
    return require_binary("prometheus")


def scrape_config(shipped: dict[str, Any], targets: dict[str, list[str]]) -> dict[str, Any]:
    """The shipped scrape configuration with the test's targets (``{service: [host:port]}``) and intervals: the
    same jobs, labels and settings otherwise."""
    config = copy.deepcopy(shipped)
    config["global"].update(scrape_interval=INTERVAL, scrape_timeout=INTERVAL, evaluation_interval=INTERVAL)
    assert {job["job_name"] for job in config["scrape_configs"]} == set(ROLES), "a scrape job the test does not know"
    for job in config["scrape_configs"]:
        labels = {k: v for static in job["static_configs"] for k, v in static.get("labels", {}).items()}
        job["static_configs"] = [{"targets": targets[ROLES[job["job_name"]]], **({"labels": labels} if labels else {})}]
    return config


class Prometheus:
    """The ``prometheus`` binary on a free port of 127.0.0.1, its data and log in ``workdir``; its HTTP API."""

    def __init__(self, binary: str, config: dict[str, Any], workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config_file = workdir / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log = workdir / "prometheus.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config_file}", f"--storage.tsdb.path={workdir / 'prometheus-data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=parent_death_signal())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _get(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=HTTP_TIMEOUT_S) as resp:  # noqa: S310
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited: {self.log.read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=HTTP_TIMEOUT_S) as resp:  # noqa: S310
                return bool(resp.status == 200)
        except OSError:
            return False

    def targets(self) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/targets")["activeTargets"])

    def query(self, expr: str) -> list[dict[str, Any]]:
        """``/api/v1/query`` now: the instant vector's series."""
        data = self._get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", data
        return list(data["result"])

    def query_range(self, expr: str, start: float) -> list[dict[str, Any]]:
        """``/api/v1/query_range`` from ``start`` to now, one point per ``$__interval``: what a panel draws."""
        data = self._get("/api/v1/query_range", query=expr, start=start, end=time.time(), step=SCRAPE_S)
        return list(data["result"])

    def label_values(self, label: str, match: str) -> list[str]:
        """Grafana's ``label_values(match, label)``."""
        return list(self._get(f"/api/v1/label/{label}/values", **{"match[]": match}))


async def wait(what: str, check: Callable[[], T | None | bool], timeout_s: float, *,
               meanwhile: Callable[[], Awaitable[None]] | None = None) -> T:
    """Ask ``check()`` (blocking: Prometheus's HTTP API, a child's files) in a thread every ``POLL_S`` until it
    returns something true, running ``meanwhile()`` after every miss; fail the test after ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            while not (answer := await asyncio.to_thread(check)):
                if meanwhile is not None:
                    await meanwhile()
                await asyncio.sleep(POLL_S)
            return typing.cast(T, answer)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


# --------------------------------------------------------------------------- the dashboard


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel that queries, rows' collapsed panels included."""
    for panel in dashboard["panels"]:
        yield from (p for p in panel.get("panels", []) if p.get("targets"))
        if panel.get("targets"):
            yield panel


def expand(expr: str, variables: dict[str, str]) -> str:
    """A panel's query as Grafana sends it: template variables and ``$__interval``s replaced."""
    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__interval", INTERVAL)
    for name, value in variables.items():
        expr = re.sub(rf"\$(\{{{name}\}}|{name}\b)", value, expr)
    left = re.findall(r"\$\{?[A-Za-z_]\w*", expr)  # label_replace's "$1" is PromQL's own
    assert not left, f"template variables the test does not expand: {left} in {expr}"
    return expr


def variables(dashboard: dict[str, Any], prometheus: Prometheus, workers: list[str]) -> dict[str, str]:
    """Each template variable at the dashboard's default, "All" (its ``allValue``); its own query must list the
    cluster's worker instances."""
    values = {}
    for var in dashboard["templating"]["list"]:
        found = re.fullmatch(r"label_values\((\w+), *(\w+)\)", var["definition"])
        assert found, f"variable {var['name']}: a query the test does not run: {var['definition']}"
        metric, label = found.groups()
        assert sorted(prometheus.label_values(label, metric)) == sorted(workers), var["definition"]
        assert var["includeAll"] and var["current"]["value"] == ["$__all"], var["name"]
        values[var["name"]] = var["allValue"]
    return values


def missing_data(prometheus: Prometheus, queries: list[tuple[str, str]], since: float) -> dict[str, str]:
    """The queries that return no series now, or (outside ``NO_VALUE_IN_THIS_RUN``) no number since ``since``."""
    missing = {}
    for where, expr in queries:
        if not prometheus.query(expr):
            missing[where] = "no series"
        elif where.split(" / ")[0] not in NO_VALUE_IN_THIS_RUN:
            points = (float(v) for series in prometheus.query_range(expr, since) for _, v in series["values"])
            if not any(math.isfinite(p) for p in points):
                missing[where] = "only NaN"
    return missing


# --------------------------------------------------------------------------- the cluster


def start_cluster(broker: BrokerProcess, tmp_path: Path) -> tuple[LocalCluster, Config]:
    """The planner, the PS and the compressor serving submitted jobs, and two workers: ``w0`` a Pi (its health
    from thermal zones and a ``vcgencmd`` the test writes), ``w1`` a device that cannot encode."""
    # no health source but w0's, whatever this machine has
    config = make_config(broker, job=JOB, **{"metrics.vcgencmd": "", "metrics.thermal_dir": tmp_path / "none"})
    cluster = LocalCluster(config, tmp_path, serve_jobs=True)
    cluster.start_services(min_devices=2)
    thermal = write_thermal_zones(tmp_path / "w0-thermal", {"cpu-thermal": PI_TEMPERATURE_C})
    vcgencmd = write_vcgencmd(tmp_path / "w0-bin", throttled=PI_THROTTLED)
    cluster.spawn("worker", "w0", ["--device", "w0", "--set", f"metrics.thermal_dir={thermal}",
                                   "--set", f"metrics.vcgencmd={vcgencmd}"])
    cluster.spawn("worker", "w1", ["--device", "w1", "--set", "worker.can_encode=false"])
    return cluster, config


def metrics_ports(cluster: LocalCluster) -> dict[str, list[str]] | None:
    """``{service: [127.0.0.1:port]}`` once every child serves its metrics; fails if a child exited."""
    failure = cluster.failure()
    assert failure is None, failure
    if not all(c.port_file.exists() for c in cluster.children):
        return None
    targets: dict[str, list[str]] = {}
    for child in cluster.children:
        targets.setdefault(child.role, []).append(f"127.0.0.1:{int(child.port_file.read_text())}")
    return targets


def digits_job() -> str:
    """The demo's digits job, training until stopped (its target is out of reach in a short run)."""
    return render_job({"job": {"name": JOB, "target_accuracy": 1.0, "max_versions": 100_000},
                       "model": DIGITS_MODEL, "data": {"format": "digits", **DIGITS_NORMALIZATION},
                       "evaluation": {"every": 5}})


@pytest.fixture
def cluster(mosquitto_broker: BrokerProcess, tmp_path: Path) -> Iterator[tuple[LocalCluster, Config]]:
    started = start_cluster(mosquitto_broker, tmp_path)
    try:
        yield started
    finally:
        started[0].stop()


# --------------------------------------------------------------------------- the test


@pytest.mark.requires_binary("prometheus")
async def test_every_dashboard_query_returns_data_from_a_real_prometheus(
        cluster: tuple[LocalCluster, Config], tmp_path: Path) -> None:
    binary = prometheus_binary()
    local, config = cluster
    targets = await wait("every process's metrics port", lambda: metrics_ports(local), START_WAIT_S)
    prometheus = Prometheus(binary, scrape_config(yaml.safe_load(SCRAPE_CONFIG.read_text()), targets), tmp_path)
    try:
        await wait("prometheus to be ready", prometheus.ready, START_WAIT_S)
        expected = {(job, target) for job, role in ROLES.items() for target in targets[role]}
        await wait("every target scraped and up", lambda: {
            (t["labels"]["job"], t["labels"]["instance"]) for t in prometheus.targets() if t["health"] == "up"}
            == expected, START_WAIT_S)

        since = time.time()
        spec = parse_job(digits_job(), origin="the test's job")
        assert await submit(config, spec, await asyncio.to_thread(submission_of, spec, search_path=[]),
                            wait_s=START_WAIT_S) == 0
        await wait("both workers to train and the gateway to encode", lambda: prometheus.query(
            "min(edgemesh_worker_steps_total) > 0 and on() sum(edgemesh_compressor_gateway_updates_total) > 0"),
            START_WAIT_S)

        board = json.loads(DASHBOARD.read_text())
        assert {"CPU temperature", "Throttling and under-voltage"} <= {p["title"] for p in panels(board)}
        values = variables(board, prometheus, targets["worker"])
        queries = [(f"{panel['title']} / {target['refId']}", expand(target["expr"], values))
                   for panel in panels(board) for target in panel["targets"]]
        assert len(queries) > 50

        # rejections happen on a fleet now and then; here, sent until every service has counted one (the job's
        # services subscribe to control/all once they serve it)
        rejecting = {job: f"edgemesh_{role}_rejected_total" for job, role in ROLES.items()}
        async with inbox(config) as test:
            async def reject() -> None:
                await test.publish(Topics(JOB).control("all"), MALFORMED)
                await test.publish(Topics("not-a-job").job_file(), JobSubmission(
                    name="not-a-job", source=b"[job]", sha256="0" * 64, submitted_at=time.time()))

            await wait("every service to count a rejection", lambda: all(
                prometheus.query(f'{name}{{job="{job}", reason="malformed"}}') for job, name in rejecting.items())
                and prometheus.query('edgemesh_ps_host_rejected_total{route="job", reason="field"}'),
                DATA_WAIT_S, meanwhile=reject)

            missing: dict[str, str] = {}

            def complete() -> bool:
                missing.clear()
                missing.update(missing_data(prometheus, queries, since))
                return not missing

            codecs = iter(["fp16", "default"] * int(DATA_WAIT_S / POLL_S))

            async def steer() -> None:
                """An operator changing w0's codec: a policy published while Prometheus scrapes (the fleet's
                own policies may all have gone out between two scrapes, leaving the density panel no rate)."""
                await test.publish(Topics(JOB).control("compressor"), json.dumps({
                    "command": "set-codec", "device": "w0", "value": next(codecs)}).encode())

            try:
                await wait("every panel's query to return data", complete, DATA_WAIT_S, meanwhile=steer)
            except AssertionError:
                raise AssertionError(f"queries without data: {json.dumps(missing, indent=1)}") from None

        # the Pi health row shows the Pi, and only it: the other hosts have no source, so no series (not 0)
        pi = next(f"127.0.0.1:{int(c.port_file.read_text())}" for c in local.children if c.name == "w0")
        temperature = prometheus.query("edgemesh_device_cpu_temperature_celsius")
        assert [(s["metric"]["instance"], float(s["value"][1])) for s in temperature] == [(pi, PI_TEMPERATURE_C)]
        flags = {(s["metric"]["__name__"], s["metric"]["when"]): float(s["value"][1]) for s in prometheus.query(
            '{__name__=~"edgemesh_device_.+", when!=""}') if s["metric"]["instance"] == pi}
        assert flags[("edgemesh_device_undervoltage", "now")] == 1 and flags[("edgemesh_device_throttled", "now")] == 1
        assert flags[("edgemesh_device_frequency_capped", "since_boot")] == 0
        assert {s["metric"]["instance"] for s in prometheus.query('{__name__=~"edgemesh_device_.+"}')} == {pi}
        # the job a host serves is its own label, not Prometheus's job (which names the service)
        served = prometheus.query("max by (training_job) (edgemesh_ps_host_job_info) > 0")
        assert [s["metric"]["training_job"] for s in served] == [JOB]
    finally:
        prometheus.stop()
