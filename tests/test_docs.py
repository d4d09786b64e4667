"""docs/metrics.md names exactly what the code defines: every route label the bus counts messages by, and every
metric the services register. Both sets are read from the code, never copied into this test: the route labels
from the topic families (``TopicKind``) and the router's label for a topic that is none of them (``UNROUTED``);
the metrics from every metric factory call under ``edgemesh/`` (``ServiceMetrics.counter/gauge/histogram``), each
under the service whose registry it is on, and from the host's health collector."""

from __future__ import annotations

import ast
import inspect
import re
import typing
from dataclasses import dataclass
from pathlib import Path

from edgemesh.common.bus.router import UNROUTED
from edgemesh.common.health import DeviceHealth, HealthSources
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicKind

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "edgemesh"
METRICS_DOC = ROOT / "docs" / "metrics.md"
SERVICES = PACKAGE / "services"
COMMON_METRICS = PACKAGE / "common" / "metrics.py"
FACTORIES = ("counter", "gauge", "histogram")
"""``ServiceMetrics``' factories; a counter is exported with ``_total`` appended."""
SERVICE = "<service>"
"""How the doc writes the service part of a metric every service has."""


def _doc() -> str:
    return METRICS_DOC.read_text(encoding="utf-8")


def _section(text: str, heading: str) -> str:
    """The lines under ``heading`` up to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.splitlines()
    assert heading in lines, f"docs/metrics.md has no {heading!r} section"
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines))
                if re.match(rf"#{{1,{level}}} ", lines[i])), len(lines))
    return "\n".join(lines[start:end])


def _rows(table_text: str) -> dict[str, list[str]]:
    """Each backticked name in the first cell of a table row in ``table_text`` -> the row's other cells."""
    rows: dict[str, list[str]] = {}
    for line in table_text.splitlines():
        cells = [cell.strip() for cell in line.split("|")]
        if line.startswith("|") and len(cells) > 2 and not set(cells[1]) <= {"-"}:
            for name in re.findall(r"`([^`]+)`", cells[1]):
                rows[name] = cells[2:]
    return rows


# --------------------------------------------------------------------------- routes


def code_route_labels() -> set[str]:
    """Every label the router can count a message under: a topic family, or none."""
    return {*typing.get_args(TopicKind), UNROUTED}


def test_the_route_table_lists_every_route_label_and_no_other() -> None:
    documented = set(_rows(_section(_doc(), "### Route labels")))
    code = code_route_labels()
    assert not code - documented, f"route labels missing from docs/metrics.md: {sorted(code - documented)}"
    assert not documented - code, f"docs/metrics.md lists route labels the code lacks: {sorted(documented - code)}"


# --------------------------------------------------------------------------- metrics


def _service_class_name(package: Path) -> str:
    """The ``name`` class attribute of the service class in ``package/service.py`` (``ps``, ``worker``, ...)."""
    tree = ast.parse((package / "service.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if (isinstance(item, ast.Assign) and [getattr(t, "id", None) for t in item.targets] == ["name"]
                        and isinstance(item.value, ast.Constant) and isinstance(item.value.value, str)):
                    return item.value.value
    raise AssertionError(f"{package / 'service.py'} has no service class with a name")


def _metrics_prefix_built_in(path: Path) -> str | None:
    """The service part of a ``ServiceMetrics(f"...")`` a module builds itself, its placeholders as ``<service>``."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ServiceMetrics" and node.args
                and isinstance(node.args[0], ast.JoinedStr)):
            return "".join(v.value if isinstance(v, ast.Constant) else SERVICE for v in node.args[0].values)
    return None


def _service_of(path: Path) -> str:
    """Whose registry the metrics a module registers are on: every service's (``common/metrics.py``), the one a
    module builds itself (the job host's ``<service>_host``), or its service package's."""
    if path == COMMON_METRICS:
        return SERVICE
    if (built := _metrics_prefix_built_in(path)) is not None:
        return built
    if SERVICES in path.parents and path.parent != SERVICES:
        package = SERVICES / path.relative_to(SERVICES).parts[0]
        return _service_class_name(package)
    raise AssertionError(f"{path.relative_to(ROOT)} registers metrics, but on which service's registry?")


@dataclass(frozen=True, slots=True)
class Defined:
    """A metric as the code registers it."""

    where: str
    kind: str = "gauge"
    labels: tuple[str, ...] | None = None
    """Its label names (None: not a literal list in the code, left unchecked)."""


def _labels(call: ast.Call, factory: str) -> tuple[str, ...] | None:
    """The label names a ``ServiceMetrics`` factory call gives, () if none."""
    position = list(inspect.signature(getattr(ServiceMetrics, factory)).parameters).index("labels") - 1  # self
    given = [k.value for k in call.keywords if k.arg == "labels"] or call.args[position:position + 1]
    if not given:
        return ()
    if not isinstance(given[0], ast.List | ast.Tuple):
        return None
    values = [e.value for e in given[0].elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return tuple(values) if len(values) == len(given[0].elts) else None


def code_metrics() -> dict[str, Defined]:
    """Every metric the code registers, named as the doc writes it (``edgemesh_ps_updates_total``,
    ``edgemesh_<service>_up``)."""
    found: dict[str, Defined] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in FACTORIES and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                continue
            suffix = "_total" if node.func.attr == "counter" else ""
            name = f"edgemesh_{_service_of(path)}_{node.args[0].value}{suffix}"
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            found[name] = Defined(where, node.func.attr, _labels(node, node.func.attr))
    for family in DeviceHealth(HealthSources(thermal_dir="", vcgencmd="")).collect():
        found[family.name] = Defined("edgemesh/common/health.py", family.type)
    return found


def test_code_metrics_are_read_from_every_service() -> None:
    """The reading itself: the metrics every service has, each service's own, the job host's and the health."""
    metrics = code_metrics()
    assert metrics["edgemesh_<service>_rejected_total"].labels == ("route", "reason")
    assert metrics["edgemesh_ps_step_seconds"].kind == "histogram"
    for expected in ("edgemesh_<service>_up", "edgemesh_planner_replans_total", "edgemesh_ps_updates_total",
                     "edgemesh_compressor_gateway_encode_seconds", "edgemesh_worker_mesh_steps_total",
                     "edgemesh_<service>_host_jobs_total", "edgemesh_device_cpu_temperature_celsius",
                     "edgemesh_device_throttled"):
        assert expected in metrics


def test_metrics_doc_lists_every_metric_the_code_registers_and_no_other() -> None:
    documented = {name: cells for name, cells in _rows(_doc()).items() if name.startswith("edgemesh_")}
    code = code_metrics()
    missing = sorted(f"{name} ({code[name].where})" for name in code.keys() - documented.keys())
    assert not missing, f"metrics missing from docs/metrics.md: {missing}"
    assert not documented.keys() - code.keys(), \
        f"docs/metrics.md lists metrics the code does not register: {sorted(documented.keys() - code.keys())}"
    for name, defined in code.items():
        kind, labels = documented[name][0], tuple(re.findall(r"`([^`]+)`", documented[name][1]))
        assert kind == defined.kind, f"{name} is a {defined.kind} ({defined.where}); docs/metrics.md says {kind}"
        if defined.labels is not None:
            assert sorted(labels) == sorted(defined.labels), \
                f"{name} has labels {defined.labels} ({defined.where}); docs/metrics.md says {labels}"
