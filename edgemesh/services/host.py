"""Serving submitted jobs: a long-running service process that serves whatever job the fleet runs (docs/jobs.md).

A service started without ``--job`` (as the systemd units start them) is a :class:`JobHost`. It follows
every job submitted on the broker (``edgemesh/v1/+/job``, retained) and every job's state
(``edgemesh/v1/+/job/state``, retained, owned by the parameter server's host: ``parameter_server.jobs``).
When a job is running, the host builds its service for that job (``Factory``: the planner, parameter
server, compressor or worker, with the job's configuration over the host's own) and serves it with the
one runtime (``runtime.serve``) until the job ends; then it serves the next one. The process never
restarts for a job: a late joiner or a restarted host finds the job, its plan and its model retained.

A host that cannot take part in a job (a worker whose data is missing or broken, a model that does not
build here or does not fit the host's memory budget: ``budget``) says why: an event on the job's ``events``, and
for a worker its retained ``left`` status, which the job's state lists; the others train on. No job takes the host
down: whatever building the model, reading the data or any step of the job's service raises (``MemoryError``,
``RecursionError``, an exception group, any ``BaseException`` but a cancellation, ``KeyboardInterrupt`` or
``SystemExit``) ends the job on this host with the reason (the parameter server's host fails the job; a worker
leaves it), and the host serves the next job. A job that kills the process outright (``os.abort``, SIGKILL, the
out-of-memory killer) is remembered across the restart (``crash_memory``) and not served again.

``/metrics`` is the host's: its own ``edgemesh_<role>_host_*`` metrics, the host's health
(``edgemesh_device_*``, read by the host whether or not it serves a job), and the metrics of the job it serves
(or served last) as that service exports them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from prometheus_client.registry import Collector

from edgemesh.common import costs
from edgemesh.common.bus import Bus
from edgemesh.common.config import Config
from edgemesh.common.errors import EdgeMeshError, JobError, ModelError
from edgemesh.common.health import HealthSources
from edgemesh.common.jobs import JobSpec, job_config, parse_job, run_name
from edgemesh.common.messages import DeviceStatus, Event, JobState, JobSubmission
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.tasks import cancel_all
from edgemesh.common.topics import TopicMatch, Topics, all_job_states_filter, all_jobs_filter
from edgemesh.services.budget import MemoryBudget
from edgemesh.services.crash_memory import CrashMemory, Run
from edgemesh.services.runtime import Service, client_id, install_stop_signals, serve, supervise

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0
"""How long a job's service may take to stop (its last checkpoint, an offline status) before it is cancelled."""
FATAL: Final = (asyncio.CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit)
"""What still ends the host when a job's code raises it: a cancellation (the host stopping), Ctrl-C, an exit (and a
coroutine being closed)."""
STATE_FOLDER: Final = "edgemesh-state"
"""Under the working directory: the state folder of a host no setting or ``$STATE_DIRECTORY`` gives one."""


@dataclass(frozen=True, slots=True)
class ActiveJob:
    """A job this host serves: the parsed file, the submission it came in, and the configuration the host's
    service runs it with."""

    spec: JobSpec
    submission: JobSubmission
    config: Config


Factory = Callable[[ActiveJob], Awaitable["Service | None"]]
"""Builds the host's service for a job (heavy work in a thread); None when this host takes no part."""


class _Delegate(Collector):
    """The metrics of the job service a host serves (or served last), under the host's ``/metrics``."""

    def __init__(self) -> None:
        self.source: ServiceMetrics | None = None

    def collect(self) -> Iterator[Any]:
        if self.source is not None:
            yield from self.source.registry.collect()


class JobHost:
    """One service process serving submitted jobs, one after another. ``run()`` until ``stop`` is set."""

    def __init__(self, role: str, config: Config, factory: Factory, *, device: str = "",
                 stop: asyncio.Event | None = None) -> None:
        self.role = role
        self.cfg = config
        self.factory = factory
        self.device = device
        """The device this host trains as (workers), named in its ``left`` status."""
        self.stop = stop or asyncio.Event()
        self.submissions: dict[str, JobSubmission] = {}
        """Job name -> its latest submission."""
        self.specs: dict[str, JobSpec] = {}
        """sha256 -> the parsed job file (every one seen; job files are small)."""
        self.states: dict[str, JobState] = {}
        self.current: tuple[str, str] | None = None
        """(job, sha256) this host serves, or is out of (it refused it, its service failed, it died with it before)."""
        self.service: Service | None = None
        self.failure: EdgeMeshError | None = None
        """How the current job's service ended, if it ended on its own (any exception, described)."""
        self.refusal: EdgeMeshError | None = None
        """Why this host takes no part in the current job (its model, data or budget refused it), if it does not."""
        self.died = ""
        """Why this host gave the current job up after dying with it ('' if it did not): ``crash_memory``."""
        self.memory = CrashMemory(marker_path(role, config, device), who(role, config, device))
        self.budget = MemoryBudget.of(role, config)
        """The most memory this host's service may need for a job's model (None: it never builds one)."""
        self._run: Run | None = None
        self._unsaid: tuple[str, EdgeMeshError] | None = None
        """A failure of the current job's service not yet said on the broker (job, error)."""
        self.bus: Bus | None = None
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self.listeners: list[Callable[[], None]] = []
        """Called on every change of submissions, states or the served job (the job board wakes on it)."""
        self._delegate = _Delegate()
        m = self.metrics = ServiceMetrics(f"{role}_host")
        m.registry.register(self._delegate)
        self.health = m.export_health(HealthSources.of(config.metrics))
        """The host's temperature and throttling, which the job services it serves read too (their stats)."""
        self.m_jobs = m.counter("jobs", "Jobs this process started serving, by outcome", ["outcome"])
        for outcome in ("served", "refused", "failed", "died"):
            self.m_jobs.labels(outcome=outcome)
        self.m_serving = m.gauge("serving", "1 while this process serves a job")
        # not "job": Prometheus's own job label names the service, and would rename this one exported_job
        self.m_info = m.gauge("job_info", "1 for the job this process serves now", ["training_job"])

    # ------------------------------------------------------------------ running
    async def run(self, *, signals: bool = False, extra: Callable[[Bus], list[Any]] | None = None) -> None:
        """Serve jobs until ``stop``; ``extra(bus)`` adds routes and jobs of the host's own (the job board)."""
        if signals:
            install_stop_signals(self.stop)
        await asyncio.to_thread(self.memory.load)
        async with contextlib.AsyncExitStack() as stack:
            self.metrics.serve(self.cfg.metrics.address, self.cfg.metrics.port_file)
            stack.callback(self.metrics.close)
            bus = self.bus = Bus(self.cfg.broker, client_id=client_id(f"{self.role}-host", self.cfg, self.device),
                                 metrics=self.metrics, connect_first=False)
            bus.route(all_jobs_filter(), JobSubmission, self._on_submission)
            bus.route(all_job_states_filter(), JobState, self._on_state)
            jobs = extra(bus) if extra is not None else []
            await stack.enter_async_context(bus)
            self.metrics.up.set(1)
            logger.info("%s: serving submitted jobs on %s", self.role, self.cfg.broker.url)
            try:
                await supervise(self.stop, self._serve_loop(), self.health.watch(self.cfg.metrics.health_interval_s),
                                *jobs, transport=bus.wait_closed(), close=self._stopping)
            finally:
                self.metrics.up.set(0)

    async def _serve_loop(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            if self._unsaid is not None:
                (name, error), self._unsaid = self._unsaid, None
                await self._say_out(name, error, "job_left")
            wanted = self.wanted()
            if wanted != self.current:
                await self._leave()
                if wanted is not None:
                    await self._join(*wanted)
            self._tell()

    def wanted(self) -> tuple[str, str] | None:
        """(job, sha256) of the running (or paused) job whose file this host holds; the earliest started."""
        active = sorted((s for s in self.states.values() if s.active and s.sha256 in self.specs),
                        key=lambda s: (s.started_at, s.name))
        return (active[0].name, active[0].sha256) if active else None

    def _changed_now(self) -> None:
        self._changed.set()
        self._tell()

    def _tell(self) -> None:
        for listener in self.listeners:
            listener()

    # ------------------------------------------------------------------ consuming
    async def _on_submission(self, sub: JobSubmission, match: TopicMatch) -> None:
        if sub.name != match.job:
            self.metrics.reject("topic", match.topic, f"job {sub.name!r} on the topic of {match.job!r}", route="job")
            return
        if hashlib.sha256(sub.source).hexdigest() != sub.sha256:
            self.metrics.reject("field", match.topic, "the submission's hash is not its job file's", route="job")
            return
        spec = self.specs.get(sub.sha256)
        if spec is None:
            try:
                spec = parse_job(sub.source, origin=f"job {sub.name}")
            except JobError as exc:
                self.metrics.reject("job_file", match.topic, exc, route="job")
                return
        if spec.name != sub.name:
            self.metrics.reject("field", match.topic, f"the job file names another job than {sub.name!r}", route="job")
            return
        self.specs[sub.sha256] = spec  # kept once it is a submission of its own job
        self.submissions[sub.name] = sub
        self._changed_now()

    async def _on_state(self, state: JobState, match: TopicMatch) -> None:
        if state.name != match.job:
            self.metrics.reject("topic", match.topic, f"state of {state.name!r} on the topic of {match.job!r}",
                                route="job_state")
            return
        self.states[state.name] = state
        self._changed_now()

    # ------------------------------------------------------------------ joining and leaving
    async def _join(self, name: str, sha: str) -> None:
        """Start serving job ``name`` (file ``sha``): unless this host died with this run before, a marker first
        (``crash_memory``), then the cost figures, the budget, the service; anything any of them raises (but a
        cancellation) ends the job here with the reason, and the host goes on."""
        spec = self.specs[sha]
        sub = self.submissions.get(name)
        if sub is None or sub.sha256 != sha:
            sub = JobSubmission(name=name, source=spec.source.encode(), sha256=sha, submitted_at=0.0)
        state = self.states.get(name)
        submitted = state.submitted_at if state is not None else sub.submitted_at
        self.current, self._run = (name, sha), Run(job=name, sha256=sha, submitted_at=submitted)
        self.failure = self.refusal = None
        self.died = self.memory.recall(self._run)
        if self.died:
            self.m_jobs.labels(outcome="died").inc()
            logger.error("%s: not serving job %s again: %s", self.role, name, self.died)
            await asyncio.to_thread(self.memory.give_up, self._run, self.died)
            await self._say_out(name, EdgeMeshError(self.died), "job_refused")
            return
        await asyncio.to_thread(self.memory.starting, self._run)
        try:
            register_costs(spec, sub)
            cfg = job_config(self.cfg, spec, run_name(spec, submitted))
            cfg = dataclasses.replace(cfg, metrics=dataclasses.replace(cfg.metrics, address="", port_file=""))
            active = ActiveJob(spec=spec, submission=sub, config=cfg)
            if self.budget is not None:
                need = await asyncio.to_thread(self.budget.check, spec, cfg)
                logger.info("%s: job %s needs an estimated %s here, within %s", self.role, name, need.describe(),
                            self.budget.describe())
            service = await self.factory(active)
        except BaseException as exc:
            if not survivable(exc):
                raise
            self.memory.clear()
            self.refusal = as_error(exc)
            self.m_jobs.labels(outcome="refused").inc()
            logger.error("%s: not taking part in job %s: %s", self.role, name, self.refusal)
            await self._say_out(name, self.refusal, "job_refused")
            return
        if service is None:
            self.memory.clear()
            logger.info("%s: job %s does not need this host", self.role, name)
            return
        if self.wanted() != (name, sha):  # the job ended while its service was being built
            self.memory.clear()
            self.current = None
            self._changed_now()
            return
        self.service = service
        self._delegate.source = service.metrics
        self.m_jobs.labels(outcome="served").inc()
        self.m_serving.set(1)
        self.m_info.labels(training_job=name).set(1)
        logger.info("%s: serving job %s (model %s)", self.role, name, spec.model_key)
        self._task = asyncio.create_task(self._serve(service, cfg, self._run), name=f"{self.role}-{name}")
        self._task.add_done_callback(self._ended)

    async def _serve(self, service: Service, cfg: Config, run: Run) -> None:
        """Serve the job's service until it stops; the crash marker says ``running`` once it is up."""
        async def up() -> None:
            await asyncio.to_thread(self.memory.running, run)

        await serve(service, cfg, health=self.health, on_up=up)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The job's service ended on its own: an error (the job ends here, said by the serve loop), or a ``stop``
        command (which stops the host too)."""
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            logger.info("%s: the job's service was told to stop; stopping", self.role)
            self.stop.set()
        else:
            self.memory.clear()  # an error like any other: said, not remembered
            self.failure = as_error(error)
            self._task = self.service = None  # over: nothing to stop, nor to ask for a final model
            self.m_serving.set(0)
            self.m_jobs.labels(outcome="failed").inc()
            name = self.current[0] if self.current else "?"
            logger.error("%s: job %s failed here: %s", self.role, name, self.failure, exc_info=error)
            self._unsaid = (name, self.failure)
        self._changed_now()

    async def _stopping(self) -> None:
        """The host stops: it leaves the job it serves as at any stop, and keeps the memory of one it gave up."""
        await self._leave(over=False)

    async def _leave(self, *, over: bool = True) -> None:
        """Stop serving the current job (its service closes as at any stop: a last checkpoint, an offline status).
        ``over``: the job no longer concerns this host (the crash marker goes, a given-up run's too)."""
        task, service = self._task, self.service
        if self.current is not None:
            self.m_info.labels(training_job=self.current[0]).set(0)
        self.current, self._task, self.service, self._run = None, None, None, None
        self.m_serving.set(0)
        if task is not None and service is not None:
            task.remove_done_callback(self._ended)  # it ends because we stop it, not on its own
            service.stop.set()
            try:
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await asyncio.shield(task)
            except TimeoutError:
                logger.warning("%s: the job's service did not stop within %.0fs; cancelling it", self.role,
                               STOP_TIMEOUT_S)
                await cancel_all([task])
            except BaseException as exc:  # it failed on its way out: said, and the host goes on
                if not survivable(exc) and not (isinstance(exc, asyncio.CancelledError) and task.cancelled()):
                    raise
                logger.error("%s: the job's service failed while stopping: %s", self.role, describe(exc))
            if not task.cancelled():
                task.exception()  # read: a failure on the way out was said above
        if over or not self.memory.given_up:
            self.memory.clear()

    async def _say_out(self, name: str, error: EdgeMeshError, kind: str) -> None:
        """Say why this host is out of job ``name``: an event (``kind``), and a worker's retained ``left`` status."""
        if self.bus is None:
            return
        topics = Topics(name)
        source = f"device/{self.device}" if self.device else self.role
        with contextlib.suppress(EdgeMeshError):
            if self.device:
                await self.bus.publish(topics.status(self.device), DeviceStatus(
                    device=self.device, state="left", time=time.time(), reason=str(error)[:2000]), retain=True)
            await self.bus.publish(topics.events(), Event(kind=kind, source=source, time=time.time(),
                                                          message=str(error)[:2000], data={"job": name}))


def survivable(exc: BaseException) -> bool:
    """Whether a host goes on after a job's code raised ``exc``: anything but ``FATAL`` (in a group: if all are)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(survivable(e) for e in exc.exceptions)
    return not isinstance(exc, FATAL)


def describe(exc: BaseException) -> str:
    """``exc`` as a reason: an EdgeMeshError's message, else its type and message; each of a group's, unwrapped."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(dict.fromkeys(describe(e) for e in exc.exceptions))
    if isinstance(exc, EdgeMeshError):
        return str(exc)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def as_error(exc: BaseException) -> EdgeMeshError:
    """``exc`` as the EdgeMeshError a job's state, a status or an event says (itself if it is one)."""
    if isinstance(exc, EdgeMeshError):
        return exc
    error = EdgeMeshError(describe(exc))
    error.__cause__ = exc
    return error


def who(role: str, config: Config, device: str = "") -> str:
    """The host as a reason names it."""
    if role == "ps":
        p = config.ps
        return "the parameter server" + (f" (shard {p.shard} of {p.shards})" if p.shards > 1 else "")
    return f"device {device}" if device else f"the {role}"


def marker_path(role: str, config: Config, device: str = "") -> Path | None:
    """Where a host keeps its crash marker: the parameter server in ``ps.state_dir``; a worker in
    ``worker.state_dir``, else systemd's ``$STATE_DIRECTORY``, else ``edgemesh-state/worker-{device}`` under the
    working directory (as ``ps.state_dir``'s default); the planner and the compressor, which run no code of a job,
    in ``$STATE_DIRECTORY`` if their unit gives one (None: no memory). The file names the host (the shards of a
    server share their folder)."""
    systemd = os.environ.get("STATE_DIRECTORY", "").partition(":")[0]
    name = f"{role}-{device}" if device else role
    match role:
        case "ps":
            folder = config.ps.state_dir
            name += f"-shard-{config.ps.shard}" if config.ps.shards > 1 else ""
        case "worker":
            folder = config.worker.state_dir or systemd or str(Path(STATE_FOLDER) / name)
        case _:
            folder = systemd
    return Path(folder) / f"serving-{name}.json" if folder else None


def register_costs(spec: JobSpec, sub: JobSubmission) -> None:
    """Register the cost figures the submission carries under the job's model name (the planner plans with
    them without torch); a host that builds the model measures it itself and registers its own in their place
    (``budget``)."""
    if sub.params <= 0:
        if costs.known(spec.model_key):
            return
        raise ModelError(f"job {spec.name}: the submission carries no cost figures for its model")
    cost = costs.ModelCost(params=sub.params, macs_per_sample=sub.macs_per_sample,
                           activations_per_sample=sub.activations_per_sample)
    costs.register(spec.model_key, cost, sub.layers or None, why=sub.refusal)


async def serve_or_host(role: str, config: Config, make: Callable[[Config], Service], *, device: str = "",
                        factory: Factory | None = None) -> None:
    """Run a service until stopped (SIGINT, SIGTERM or a ``stop`` command): ``make(config)`` serving the job
    of the configuration, or, without one, a :class:`JobHost` serving the jobs operators submit with
    ``factory`` (by default ``make`` of each job's configuration)."""
    if config.job:
        await serve(make(config), config, signals=True)
        return

    async def build(active: ActiveJob) -> Service:
        return make(active.config)

    await JobHost(role, config, factory or build, device=device).run(signals=True)
