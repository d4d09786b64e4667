"""The deployment files in deploy/ and grafana/ agree with the code and actually work.

* Grafana: every metric a dashboard queries is exported by a service (names collected from
  the registries of real service objects), and panels use the provisioned datasource.
* systemd: each unit runs an existing ``edgemesh`` subcommand with flags the CLI accepts.
* Config: the example TOML and the example environment file load.
* install-pi.sh: ``bash -n`` and its argument checks (it is never run for real here).
* Mosquitto: dev.conf starts; production.conf starts with TLS and passwords and enforces
  the ACL; bridge.conf forwards EdgeMesh topics both ways. Each broker is started by the
  test on free ports of 127.0.0.1.
* Prometheus: the scrape ports are the ones the units pass to ``--metrics``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import require_binary
from production import Client, ProductionBroker, mosquitto, rewrite, site_broker_conf
from production import production_broker as start_production_broker
from prometheus_client import CollectorRegistry

from edgemesh import cli
from edgemesh.common.bus import Bus
from edgemesh.common.config import BrokerConfig, load_config
from edgemesh.common.messages import ModelSnapshot
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.common.wire.tensors import Tensor
from edgemesh.local.broker import MOSQUITTO_MALLOC, free_port
from edgemesh.services.compressor.service import Compressor
from edgemesh.services.host import JobHost
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.planner.service import Planner
from edgemesh.services.worker.service import Worker

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
GRAFANA = ROOT / "grafana"
MOSQUITTO_DIR = DEPLOY / "mosquitto"
UNIT_FILES = sorted((DEPLOY / "systemd").glob("*.service"))
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))

EDGEMESH_BIN = "/opt/edgemesh/venv/bin/edgemesh"
SERVICES = ("planner", "ps", "compressor", "worker")
METRIC_NAME = re.compile(r"\bedgemesh_[a-z0-9_]+")
WAIT_S = 10.0
"""Timeout of every wait on a broker, a connection or a message."""

# Series a family exposes, by family type (prometheus_client reports counters without
# their _total and histograms without _bucket/_sum/_count in ``family.name``).
SERIES_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "unknown": ("",),
}


# --------------------------------------------------------------------------- helpers


def exported_series(registry: CollectorRegistry) -> set[str]:
    """Every series name ``registry`` can expose, whether or not a labelled child exists yet."""
    names: set[str] = set()
    for family in registry.collect():
        names.update(family.name + suffix for suffix in SERIES_SUFFIXES[family.type])
        names.update(sample.name for sample in family.samples)
    return names


async def service_metric_names() -> set[str]:
    """Series names of all four services, from real service objects (their constructors need a loop)."""
    cfg = load_config(env={}, overrides={"job": "dashboard"})
    names: set[str] = set()
    for service in (Planner(cfg), ParameterServer(cfg), Compressor(cfg), Worker(cfg)):
        names |= exported_series(service.metrics.registry)
    for role in ("planner", "ps", "compressor", "worker"):  # the hosts that serve submitted jobs
        names |= exported_series(JobHost(role, cfg, lambda _: None).metrics.registry)  # type: ignore[arg-type,return-value]
    return names


def dashboard_queries(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every query of a dashboard: panel targets and template variables."""
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}/{key}"
            if key in ("expr", "definition") and isinstance(value, str):
                yield where, value
            elif key == "query" and isinstance(value, str):
                yield where, value
            else:
                yield from dashboard_queries(value, where)
    elif isinstance(node, list):
        for i, item in enumerate(node):
            title = item.get("title", i) if isinstance(item, dict) else i
            yield from dashboard_queries(item, f"{path}[{title}]")


@dataclass
class Unit:
    path: Path
    sections: dict[str, list[tuple[str, str]]]

    def values(self, section: str, key: str) -> list[str]:
        return [v for k, v in self.sections.get(section, []) if k == key]

    def value(self, section: str, key: str) -> str:
        found = self.values(section, key)
        assert len(found) == 1, f"{self.path.name}: expected one {key}= in [{section}], got {found}"
        return found[0]


def parse_unit(path: Path) -> Unit:
    """A systemd unit file as ``{section: [(key, value), ...]}`` (keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert not line.endswith("\\"), f"{path.name}:{number}: keep directives on one line"
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"{path.name}:{number}: not KEY=VALUE inside a section: {raw!r}"
        current.append((key.strip(), value.strip()))
    return Unit(path, sections)


INSTANCES = {"edgemesh-ps@.service": "1"}
"""The instance a template is tried with (a shard's index); the others', a device name: pi-07."""


def exec_args(unit: Unit) -> tuple[str, Any]:
    """The unit's ExecStart parsed by the real CLI parser (instance ``%i``: ``INSTANCES``, else pi-07)."""
    argv = shlex.split(unit.value("Service", "ExecStart").replace("%i", INSTANCES.get(unit.path.name, "pi-07")))
    assert argv[0] == EDGEMESH_BIN, f"{unit.path.name}: ExecStart runs {argv[0]}, not {EDGEMESH_BIN}"
    try:
        args = cli.build_parser(argv[1:]).parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"{unit.path.name}: `edgemesh` rejects ExecStart arguments {argv[1:]}")
    return argv[1], args


# --------------------------------------------------------------------------- Grafana


@pytest.mark.parametrize("dashboard", DASHBOARDS, ids=lambda p: p.name)
async def test_dashboard_queries_only_use_exported_metrics(dashboard: Path) -> None:
    exported = await service_metric_names()
    # the collection itself handles suffixes: a counter is exposed as _total only
    assert "edgemesh_ps_updates_total" in exported and "edgemesh_ps_updates" not in exported
    assert "edgemesh_ps_update_delay_versions_bucket" in exported
    assert "edgemesh_planner_devices_live" in exported and "edgemesh_compressor_devices" in exported

    board = json.loads(dashboard.read_text())
    unknown = {}
    for where, query in dashboard_queries(board):
        for name in METRIC_NAME.findall(query):
            if name not in exported:
                unknown[name] = where
    assert not unknown, f"{dashboard.name} queries metrics no service exports: {unknown}"

    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        exprs = [t.get("expr", "") for t in panel.get("targets", [])]
        assert exprs and all(METRIC_NAME.search(e) for e in exprs), f"panel {panel['title']!r} has no EdgeMesh query"


def test_dashboard_covers_the_operations_view() -> None:
    """The panels operators rely on are there: a trimmed dashboard fails here, not in an incident."""
    board = json.loads((GRAFANA / "dashboards" / "edgemesh.json").read_text())
    used = {name for _, query in dashboard_queries(board) for name in METRIC_NAME.findall(query)}
    required = {
        "edgemesh_ps_model_version", "edgemesh_ps_eval_accuracy_ratio", "edgemesh_ps_updates_total",
        "edgemesh_ps_update_delay_versions_bucket", "edgemesh_ps_step_seconds_bucket",
        "edgemesh_worker_step_seconds_bucket", "edgemesh_worker_gradient_bytes_total",
        "edgemesh_planner_devices_live", "edgemesh_compressor_policies_published_total",
    }
    for service in SERVICES:
        required |= {f"edgemesh_{service}_published_bytes_total", f"edgemesh_{service}_rejected_total",
                     f"edgemesh_{service}_broker_connected"}
    assert required <= used, f"dashboard lacks {sorted(required - used)}"


def test_dashboards_use_the_provisioned_datasource() -> None:
    import yaml  # noqa: PLC0415 - test extra
    provisioned = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uids = {ds["uid"] for ds in provisioned["datasources"] if ds["type"] == "prometheus"}
    assert uids
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "edgemesh.yml").read_text())["providers"]
    assert all(p["type"] == "file" and p["options"]["path"] for p in providers)

    for dashboard in DASHBOARDS:
        board = json.loads(dashboard.read_text())
        refs: list[Any] = []

        def collect(node: Any, refs: list[Any] = refs) -> None:
            if isinstance(node, dict):
                if "datasource" in node:
                    refs.append(node["datasource"])
                for value in node.values():
                    collect(value)
            elif isinstance(node, list):
                for item in node:
                    collect(item)

        collect(board)
        assert refs
        bad = [r for r in refs if not (isinstance(r, dict) and r.get("uid") in uids)]
        assert not bad, f"{dashboard.name}: datasource references outside {uids}: {bad[:3]}"


# --------------------------------------------------------------------------- config


def test_example_config_loads() -> None:
    cfg = load_config(DEPLOY / "edgemesh.example.toml", env={})
    # the file is really read, and agrees with the PS unit's --state-dir
    assert cfg.job == ""  # the services serve submitted jobs: no job name anywhere
    assert cfg.worker.data_dir and cfg.ps.data_dir
    for unit in (DEPLOY / "systemd").glob("*.service"):
        assert "--job" not in unit.read_text(), unit.name
    ps_unit = parse_unit(DEPLOY / "systemd" / "edgemesh-ps.service")
    assert cfg.ps.state_dir == exec_args(ps_unit)[1].state_dir


def test_example_env_names_real_settings(tmp_path: Path) -> None:
    """Every EDGEMESH_* line of edgemesh.example.env (commented or not) is a valid setting."""
    env = {}
    for line in (DEPLOY / "edgemesh.example.env").read_text().splitlines():
        match = re.match(r"^#?(EDGEMESH_[A-Z0-9_]+)=(.*)$", line.strip())
        if match:
            env[match[1]] = match[2]
    # file settings must name files that exist: stand in for the Pi's CA certificate
    assert env.pop("EDGEMESH_BROKER__CA_FILE") == "/etc/edgemesh/ca.crt"
    (tmp_path / "ca.crt").write_text("not parsed at load time\n")
    env["EDGEMESH_BROKER__CA_FILE"] = str(tmp_path / "ca.crt")
    assert "EDGEMESH_BROKER__USERNAME" in env and "EDGEMESH_WORKER__MEMORY_BYTES" in env
    cfg = load_config(env=env)
    assert cfg.broker.username == env["EDGEMESH_BROKER__USERNAME"]
    assert cfg.worker.memory_bytes == int(env["EDGEMESH_WORKER__MEMORY_BYTES"])


# --------------------------------------------------------------------------- install script

INSTALL = DEPLOY / "install-pi.sh"


def test_install_script_syntax() -> None:
    result = subprocess.run(["bash", "-n", str(INSTALL)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    head = INSTALL.read_text().splitlines()
    assert head[0] == "#!/usr/bin/env bash" and "set -euo pipefail" in head
    assert os.access(INSTALL, os.X_OK)


@pytest.mark.parametrize("args", [
    [],
    ["/src"],
    ["/src", "gateway"],
    ["--frobnicate", "/src", "worker"],
    ["--device", "bad/name", "/src", "worker"],
    ["--device"],
    ["/src", "ps@x"],
], ids=["no-args", "no-role", "unknown-role", "unknown-option", "bad-device", "missing-value", "bad-shard"])
def test_install_script_rejects_bad_arguments(args: list[str], tmp_path: Path) -> None:
    # Only cat, basename and dirname on PATH: should the argument checks ever let a bad
    # call through, the script stops at its first system command instead of installing.
    for tool in ("cat", "basename", "dirname"):
        found = shutil.which(tool)
        assert found
        (tmp_path / tool).symlink_to(found)
    bash = shutil.which("bash")
    assert bash
    result = subprocess.run([bash, str(INSTALL), *args], capture_output=True, text=True, timeout=30,
                            env={"PATH": str(tmp_path), "HOME": str(tmp_path)})
    assert result.returncode == 2, result.stdout + result.stderr
    assert "error:" in result.stderr and "Usage:" in result.stderr


def test_install_script_help() -> None:
    result = subprocess.run(["bash", str(INSTALL), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    assert "Usage:" in result.stdout and "worker" in result.stdout


# --------------------------------------------------------------------------- systemd


def test_every_service_has_a_unit() -> None:
    names = {p.name for p in UNIT_FILES}
    for service in SERVICES:
        assert f"edgemesh-{service}.service" in names or f"edgemesh-{service}@.service" in names, service


def test_the_mosquitto_drop_in_gives_the_system_broker_the_local_brokers_malloc_settings() -> None:
    unit = parse_unit(DEPLOY / "systemd" / "mosquitto.service.d" / "edgemesh.conf")
    assert set(unit.sections) == {"Service"}
    assert unit.value("Service", "Environment") == f"GLIBC_TUNABLES={MOSQUITTO_MALLOC}"


@pytest.mark.parametrize("path", UNIT_FILES, ids=lambda p: p.name)
def test_unit_runs_a_real_subcommand(path: Path) -> None:
    unit = parse_unit(path)
    assert {"Unit", "Service", "Install"} <= set(unit.sections)
    command, args = exec_args(unit)
    service = path.name.removeprefix("edgemesh-").split("@")[0].removesuffix(".service")
    assert command == service and cli.COMMANDS[command][0].startswith("edgemesh.services.")
    assert args.config == "/etc/edgemesh/edgemesh.toml"
    host, _, port = args.metrics.rpartition(":")
    assert host == "0.0.0.0" and port.isdigit()  # noqa: S104 - the unit's scrape address

    # the services send READY=1 and feed the watchdog (edgemesh/common/systemd.py)
    assert unit.value("Service", "Type") == "notify"
    assert unit.value("Service", "NotifyAccess") == "main"
    assert int(unit.value("Service", "WatchdogSec")) >= 10
    assert unit.value("Service", "User") == "edgemesh"
    assert unit.value("Service", "EnvironmentFile") == "-/etc/edgemesh/edgemesh.env"
    assert unit.value("Service", "Restart") == "on-failure"
    assert unit.value("Service", "KillSignal") == "SIGTERM"
    for key, expected in (("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("ProtectHome", "yes"),
                          ("PrivateTmp", "yes"), ("ProtectKernelTunables", "yes"),
                          ("ProtectControlGroups", "yes"), ("LockPersonality", "yes"),
                          ("RestrictAddressFamilies", "AF_INET AF_INET6 AF_UNIX")):
        assert unit.value("Service", key) == expected, key
    for key in ("RestartSec", "TimeoutStopSec"):
        assert unit.value("Service", key).isdigit(), key
    # edgemesh exits 2 on a broker still unreachable at start-up too: that must be retried
    assert not unit.values("Service", "RestartPreventExitStatus")
    # ... and the start limit must not give up on it: a start that fails on the broker takes
    # publish_timeout_s + RestartSec, so such failures must not fill the burst within the interval
    slowest_cycle = BrokerConfig().publish_timeout_s + int(unit.value("Service", "RestartSec"))
    burst, interval = int(unit.value("Unit", "StartLimitBurst")), int(unit.value("Unit", "StartLimitIntervalSec"))
    assert burst * slowest_cycle > interval

    if service == "ps":
        assert unit.value("Service", "StateDirectory") == "edgemesh/ps"
        assert args.state_dir == "/var/lib/edgemesh/ps"
    elif service == "worker":  # its incarnation counter ($STATE_DIRECTORY)
        assert unit.value("Service", "StateDirectory") == "edgemesh/worker-%i"
    else:
        assert not unit.values("Service", "StateDirectory")  # ProtectSystem=strict: nothing else to write
    if service == "worker":
        assert path.name.endswith("@.service") and args.device == "pi-07"  # the instance name
        assert unit.value("Service", "MemoryMax").endswith("M")
    if path.name == "edgemesh-ps@.service":  # shard 1: the count is the configuration's, the port its own
        assert args.set == ["ps.shard=1"] and port == "9491"
        assert unit.value("Unit", "Conflicts") == "edgemesh-ps.service"


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = require_binary("systemd-analyze")
    # verify insists that ExecStart's binary exists, and cannot verify a bare template
    for path in UNIT_FILES:
        text = path.read_text().replace(EDGEMESH_BIN, sys.executable)
        (tmp_path / path.name.replace("@.", "@pi-07.")).write_text(text)
    result = subprocess.run([analyze, "verify", *sorted(str(p) for p in tmp_path.iterdir())],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if str(tmp_path) in line]
    assert not complaints, "\n".join(complaints)


# --------------------------------------------------------------------------- Prometheus


def test_prometheus_scrapes_the_unit_ports() -> None:
    import yaml  # noqa: PLC0415 - test extra
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    unit_ports = {}
    for path in UNIT_FILES:
        if path.name in INSTANCES:  # the shards' ports, one per index, are in a commented-out job
            continue
        command, args = exec_args(parse_unit(path))
        unit_ports[command] = int(args.metrics.rpartition(":")[2])
    scraped: dict[str, set[int]] = {}
    for job in config["scrape_configs"]:
        service = job["job_name"].removeprefix("edgemesh-")
        targets = [t for sc in job.get("static_configs", []) for t in sc["targets"]]
        assert targets, job["job_name"]
        scraped[service] = {int(t.rpartition(":")[2]) for t in targets}
    assert set(scraped) == set(SERVICES)
    for service, ports in scraped.items():
        assert ports == {unit_ports[service]}, f"{service}: Prometheus scrapes {ports}, unit serves {unit_ports}"


# --------------------------------------------------------------------------- Mosquitto


def test_dev_broker_config_starts(tmp_path: Path) -> None:
    port = free_port()
    conf = (MOSQUITTO_DIR / "dev.conf").read_text()
    assert re.search(r"^set_tcp_nodelay true$", conf, re.MULTILINE)
    conf = rewrite(conf, r"listener 1883 127\.0\.0\.1", f"listener {port} 127.0.0.1")
    with mosquitto(conf, tmp_path, [port]):
        client = Client(port)  # anonymous
        try:
            assert not client.reason.is_failure, client.reason
            client.subscribe("edgemesh/v1/dev/#")
            assert not client.publish("edgemesh/v1/dev/events", b"hi").is_failure
            assert client.next_message() == ("edgemesh/v1/dev/events", b"hi")
        finally:
            client.close()


def test_production_packet_limit_fits_a_chunk() -> None:
    conf = (MOSQUITTO_DIR / "production.conf").read_text()
    match = re.search(r"^max_packet_size (\d+)$", conf, re.MULTILINE)
    assert match, "production.conf sets no max_packet_size"
    limit = int(match[1])
    assert limit >= BrokerConfig().chunk_bytes + 64 * 1024  # a chunk plus envelope and topic
    for line in ("allow_anonymous false", "set_tcp_nodelay true", "listener 8883"):
        assert re.search(rf"^{line}$", conf, re.MULTILINE), line


@pytest.fixture(scope="module")
def production_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProductionBroker]:
    """deploy/mosquitto/production.conf and acl, with test certificates, passwords and ports."""
    with start_production_broker(tmp_path_factory.mktemp("production-broker")) as broker:
        yield broker


def test_production_broker_refuses_strangers(production_broker: ProductionBroker) -> None:
    anonymous = Client(production_broker.plain_port)
    wrong = Client(production_broker.tls_port, "pi-01", "wrong", ca=production_broker.ca)
    try:
        assert anonymous.reason.is_failure and wrong.reason.is_failure
    finally:
        anonymous.close()
        wrong.close()


def test_production_acl_roles(production_broker: ProductionBroker) -> None:
    job = "acl"
    topics = Topics(job)
    worker = production_broker.client("pi-01")
    ps = production_broker.client("ps", tls=False)  # a service on the broker host, over loopback
    operator = production_broker.client("operator")
    try:
        def allowed(client: Client, topic: str, retain: bool = False) -> bool:
            return not client.publish(topic, b"x", retain=retain).is_failure

        # the operator alone writes control commands
        assert allowed(operator, topics.control("ps"))
        assert allowed(operator, topics.control("device/pi-01"))
        assert not allowed(worker, topics.control("ps"))
        assert not allowed(worker, topics.control("all"))
        assert not allowed(ps, topics.control("all"))
        # a worker writes as itself only
        assert allowed(worker, topics.hello("pi-01"), retain=True)
        assert allowed(worker, Topics.chunk(topics.hello("pi-01"), 0), retain=True)
        assert allowed(worker, topics.grad("c0", "pi-01"))
        assert allowed(worker, topics.device_reply(topics.control_reply("ctl-1234"), "pi-01"))  # answers as itself
        assert not allowed(worker, topics.control_reply("ctl-1234"))
        assert not allowed(worker, topics.status("pi-02"), retain=True)
        assert not allowed(worker, topics.grad("c0", "pi-02"))
        # model-parallel slices: sent as itself, backward ones to another member (denied before)
        assert allowed(worker, topics.mesh("m-pi-01", "conv1", "fwd", "pi-01"))
        assert allowed(worker, topics.mesh_backward("m-pi-01", "conv2", "pi-02", "pi-01"))
        assert not allowed(worker, topics.mesh_backward("m-pi-01", "conv2", "pi-01", "pi-02"))
        assert not allowed(worker, topics.mesh("m-pi-01", "conv1", "fwd", "pi-02"))
        assert allowed(worker, topics.snapshot_request("pi-01"))  # a mesh member's request for the model
        assert not allowed(worker, topics.snapshot_request("pi-02"))
        assert allowed(worker, topics.probe("pi-01"))  # its link probe, timed to the PUBACK
        assert not allowed(worker, topics.probe("pi-02"))
        assert not allowed(worker, topics.plan(), retain=True)
        assert not allowed(worker, topics.model(), retain=True)
        assert not allowed(worker, topics.ack("pi-01"))
        # services write their own topics, retained chunks included
        assert allowed(ps, topics.ack("pi-02"))
        assert allowed(ps, Topics.chunk(topics.model(), 3), retain=True)
        assert not allowed(ps, topics.plan(), retain=True)
        # jobs: the operator submits, the PS's host keeps their state and final model
        assert allowed(operator, topics.job_file(), retain=True)
        assert allowed(operator, Topics.chunk(topics.job_file(), 1), retain=True)
        assert not allowed(worker, topics.job_file(), retain=True)
        assert not allowed(worker, topics.job_state(), retain=True)
        assert allowed(ps, topics.job_state(), retain=True)
        assert allowed(ps, Topics.chunk(topics.job_model(), 2), retain=True)
        assert not allowed(ps, topics.job_file(), retain=True)
        assert allowed(worker, topics.evaluation("pi-01"))
        assert allowed(worker, topics.status("pi-01"), retain=True)  # "left": its data is broken
        # what adaptive batching and the audit trail need (denied before: silently dropped)
        assert allowed(ps, topics.sync(), retain=True)
        assert allowed(worker, topics.events())
        assert not allowed(worker, topics.sync(), retain=True)
        # a sharded parameter server: each shard's gradients, acks and model
        shard = topics.for_shard(1)
        assert allowed(worker, shard.grad("c0", "pi-01"))
        assert not allowed(worker, shard.grad("c0", "pi-02"))
        assert not allowed(worker, shard.ack("pi-01"))
        assert not allowed(worker, shard.model(), retain=True)
        assert allowed(ps, shard.ack("pi-02"))
        assert allowed(ps, Topics.chunk(shard.model(), 1), retain=True)
        assert allowed(ps, shard.model_delta())

        # reads: a worker sees its own acks and control commands, not another device's.
        # The PS publishes the denied message first; per-publisher order makes the
        # allowed one that follows arrive first if the denied one was filtered.
        worker.subscribe(f"{topics.root}/ack/+", f"{topics.root}/control/#", f"{topics.root}/shard/+/ack/+")
        assert allowed(ps, topics.ack("pi-02"))
        assert allowed(ps, topics.ack("pi-01"))
        assert worker.next_message()[0] == topics.ack("pi-01")
        assert allowed(ps, shard.ack("pi-02"))
        assert allowed(ps, shard.ack("pi-01"))
        assert worker.next_message()[0] == shard.ack("pi-01")
        assert allowed(operator, topics.control("ps"))
        assert allowed(operator, topics.control("device/pi-02"))
        assert allowed(operator, topics.control("device/pi-01"))
        assert worker.next_message()[0] == topics.control("device/pi-01")
        assert worker.messages.empty()
        planner = production_broker.client("planner", tls=False)
        try:
            planner.subscribe(topics.sync())
            assert allowed(ps, topics.sync(), retain=True)
            assert planner.next_message()[0] == topics.sync()  # the planner reads the PS's sync state
        finally:
            planner.close()
    finally:
        for client in (worker, ps, operator):
            client.close()


async def test_production_broker_carries_a_chunked_model_over_tls(
    production_broker: ProductionBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The PS's retained model, several chunks long, reaches a worker through TLS, passwords and ACL."""
    monkeypatch.setenv("SSL_CERT_FILE", str(production_broker.ca))  # how edgemesh.env names a private CA
    topics = Topics("chunks")
    url = f"mqtts://127.0.0.1:{production_broker.tls_port}"
    weights = np.arange(200_000, dtype=np.float32)  # 800 kB: four chunks of 256 KiB
    snapshot = ModelSnapshot(version=7, model_spec="digits-cnn", tensors={"w": Tensor.from_numpy(weights)})

    ps_cfg = BrokerConfig(url=url, username="ps", password=ProductionBroker.password("ps"), publish_timeout_s=WAIT_S)
    ps_metrics = ServiceMetrics("ps")
    async with Bus(ps_cfg, client_id="test-ps", metrics=ps_metrics) as ps_bus:
        sent = await ps_bus.publish(topics.model(), snapshot, retain=True)
    assert sent > 3 * ps_cfg.chunk_bytes

    worker_cfg = BrokerConfig(url=url, username="pi-01", password=ProductionBroker.password("pi-01"))
    worker_metrics = ServiceMetrics("worker")
    worker_bus = Bus(worker_cfg, client_id="test-pi-01", metrics=worker_metrics)
    got: asyncio.Queue[tuple[str, ModelSnapshot]] = asyncio.Queue()

    async def keep(snap: ModelSnapshot, where: TopicMatch) -> None:
        await got.put((where.topic, snap))

    worker_bus.route(topics.model_filter(), ModelSnapshot, keep)
    async with worker_bus:
        topic, received = await asyncio.wait_for(got.get(), WAIT_S)
    assert topic == topics.model() and received.version == 7
    assert received.tensors["w"].data == weights.tobytes()
    assert worker_metrics.value("edgemesh_worker_rejected_total") == 0


def test_bridge_forwards_both_ways(production_broker: ProductionBroker, tmp_path: Path) -> None:
    """A site broker (dev.conf + bridge.conf) and the production broker as the cloud."""
    topics = Topics("bridged")
    site_broker = site_broker_conf(production_broker)

    with mosquitto(site_broker.conf, tmp_path, [site_broker.port]):
        site = Client(site_broker.port)
        cloud = production_broker.client("operator")
        try:
            site.subscribe(site_broker.state_topic, f"{topics.root}/control/#")
            while site.next_message() != (site_broker.state_topic, b"1"):  # the bridge reports itself connected
                pass
            cloud.subscribe(f"{site_broker.prefix}{topics.root}/#")  # the site's topics, under its prefix
            # site to cloud: a device's hello
            assert not site.publish(topics.hello("pi-09"), b"hello", retain=True).is_failure
            assert cloud.next_message() == (site_broker.prefix + topics.hello("pi-09"), b"hello")
            # cloud to site: an operator's command (the bridge subscribed before it forwarded the hello)
            assert not cloud.publish(site_broker.prefix + topics.control("ps"), b'{"command": "pause"}').is_failure
            assert site.next_message() == (topics.control("ps"), b'{"command": "pause"}')
        finally:
            site.close()
            cloud.close()
