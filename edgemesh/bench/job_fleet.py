"""What the benchmarks of submitted jobs share (``bench jobs``, ``bench models``): a local fleet of real processes
started once with no job, as systemd runs them, the jobs submitted to it one after another as ``edgemesh job
submit`` does, and every job state the run sees.

The fleet is the planner (waiting for every device before its first plan), the parameter server (its state
under ``workdir/ps/state``, its held-out sets under ``workdir/ps``), the compressor and one worker per device
(its data under ``workdir/<device>``).

A benchmark trusts only the code it wrote itself: the entry-point modules it put in ``workdir/models``
(:data:`MODULES_DIR`) before starting the fleet are what the hosts allow (``models.allowed``) and where they look
for them (``models.path``), and what its submissions allow (:func:`own_modules`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from edgemesh.common.config import Config, ModelsConfig
from edgemesh.common.errors import EdgeMeshError
from edgemesh.common.jobs import JobSpec, parse_job
from edgemesh.common.messages import JobState
from edgemesh.common.topics import TopicMatch
from edgemesh.local.broker import BrokerProcess
from edgemesh.local.processes import Child, LocalCluster
from edgemesh.operator.job import submission_of, submit

START_TIMEOUT_S = 120.0
"""Longest the fleet's processes may take to start and take a submitted job."""
MODULES_DIR = "models"
"""The directory under the work directory that holds the benchmark's entry-point modules (the hosts' models.path)."""


def own_modules(*directories: str | Path) -> tuple[str, ...]:
    """The Python modules (``*.py``) in ``directories``: the entry-point modules a benchmark wrote there itself."""
    return tuple(sorted({f.stem for d in directories if d and Path(d).is_dir() for f in Path(d).glob("*.py")}))


def host_models(workdir: Path) -> list[str]:
    """The flags that make a host of the fleet allow the benchmark's own modules, from ``workdir/models``."""
    directory = workdir / MODULES_DIR
    return ["--set", f"models.path={json.dumps([str(directory)])}",
            "--set", f"models.allowed={json.dumps(list(own_modules(directory)))}"]


@dataclass(slots=True)
class Watch:
    """Every job state the run sees, with the time it arrived."""

    states: dict[str, list[tuple[float, JobState]]] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def keep(self, state: JobState, _: TopicMatch) -> None:
        self.states.setdefault(state.name, []).append((time.monotonic(), state))
        self.changed.set()

    def last(self, name: str) -> JobState | None:
        seen = self.states.get(name)
        return seen[-1][1] if seen else None

    async def until_ended(self, name: str, timeout_s: float) -> JobState | None:
        try:
            async with asyncio.timeout(timeout_s):
                while (last := self.last(name)) is None or not last.ended:
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            return None
        return last


@contextlib.contextmanager
def local_broker(config: Config, *, external: bool) -> Iterator[tuple[Config, str]]:
    """``config`` on a broker of the run's own (Mosquitto, or the embedded one) unless ``external``, with the
    broker's kind (or the external URL)."""
    if external:
        yield config, config.broker.url
        return
    broker = BrokerProcess.default()
    broker.start()
    try:
        yield replace(config, broker=replace(config.broker, url=broker.url)), broker.kind
    finally:
        broker.stop()


def spawn_fleet(cluster: LocalCluster, workdir: Path, devices: list[str]) -> dict[str, int]:
    """Start the fleet's services and one worker per device, none with a job; their process ids by name. The PS and
    the workers allow the entry-point modules written to ``workdir/models`` before (:func:`host_models`)."""
    models = host_models(workdir)
    cluster.spawn("planner", "planner", ["--set", f"planner.min_devices={len(devices)}"])
    cluster.spawn("ps", "ps", ["--state-dir", str(workdir / "ps" / "state"), "--set", f"ps.data_dir={workdir / 'ps'}",
                               *models])
    cluster.spawn("compressor", "compressor")
    for device in devices:
        cluster.spawn("worker", device, ["--device", device, "--set", f"worker.data_dir={workdir / device}", *models])
    return pids(cluster)


def pids(cluster: LocalCluster) -> dict[str, int]:
    """The process id of every child still running, by name."""
    return {c.name: c.proc.pid for c in cluster.children if c.proc.poll() is None}


def serves_since(child: Child, since: float) -> bool:
    """Whether the job service whose metrics ``child`` last exported (a host exports those of the job service it
    serves, or served last, each on a registry of its own) started at or after ``since`` (``time.time()``)."""
    created = child.samples.get((f"edgemesh_{child.role}_published_bytes_created", ()))
    return created is not None and created >= since


def job_total(cluster: LocalCluster, metric: str, since: float, role: str | None = None, **labels: str) -> float:
    """``edgemesh_{role}_{metric}`` summed over the job services (of ``role``) started since ``since``: a job's own
    figures, once it ended (scrape first). The hosts' own metrics are left out."""
    want = set(labels.items())
    return sum(v for c in cluster.children if (role is None or c.role == role) and serves_since(c, since)
               for (n, found), v in c.samples.items() if n == f"edgemesh_{c.role}_{metric}" and want <= set(found))


def host_total(cluster: LocalCluster, suffix: str) -> float:
    """The hosts' own metrics ending in ``suffix``, summed (they count over every job the process served)."""
    return sum(v for c in cluster.children for (n, _), v in c.samples.items()
               if n.startswith(f"edgemesh_{c.role}_host_") and n.endswith(suffix))


@dataclass(slots=True)
class Submitted:
    """One job submitted to the fleet and followed until it ended (or why it could not be)."""

    spec: JobSpec
    params: int = 0
    """The model's parameters (0 when it did not build)."""
    submitted: float = 0.0
    """``time.monotonic()`` at submission."""
    submitted_at: float = 0.0
    """``time.time()`` at submission (the submission's own)."""
    final: JobState | None = None
    failure: str | None = None
    """Why the job did not end on the fleet: its model did not build here, no PS took it, it ran too long."""


async def submit_and_follow(config: Config, watch: Watch, text: str, *, search_path: list[str], timeout_s: float,
                            progress: Callable[[str], None]) -> Submitted:
    """Submit the job file ``text`` as ``edgemesh job submit`` does and wait (``watch`` sees its states) until it
    ends, at most ``timeout_s`` once taken. An entry point is imported from ``search_path``, whose modules (the
    benchmark's own) are allowed beside ``config.models.allowed``."""
    spec = parse_job(text)
    run = Submitted(spec)
    trust = ModelsConfig(allowed=(*config.models.allowed, *own_modules(*search_path)), path=config.models.path)
    try:
        submission = await asyncio.to_thread(submission_of, spec, search_path=search_path, trust=trust)
    except EdgeMeshError as exc:
        run.failure = f"the job was refused at submission: {exc}"
        return run
    run.params, run.submitted_at = submission.params, submission.submitted_at
    progress(f"submitting job {spec.name} ({submission.params:,} parameters)")
    run.submitted = time.monotonic()
    if await submit(config, spec, submission, wait_s=START_TIMEOUT_S) != 0:
        run.failure = f"job {spec.name} was not taken"
        return run
    run.final = await watch.until_ended(spec.name, timeout_s)
    if run.final is None:
        run.failure = f"job {spec.name} did not end within {timeout_s:.0f}s"
    return run
