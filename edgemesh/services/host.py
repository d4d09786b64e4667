"""Serving submitted jobs: a long-running service process that serves whatever job the fleet runs (docs/jobs.md).

A service started without ``--job`` (as the systemd units start them) is a :class:`JobHost`. It follows
every job submitted on the broker (``edgemesh/v1/+/job``, retained) and every job's state
(``edgemesh/v1/+/job/state``, retained, owned by the parameter server's host: ``parameter_server.jobs``).
When a job is running, the host builds its service for that job (``Factory``: the planner, parameter
server, compressor or worker, with the job's configuration over the host's own) and serves it with the
one runtime (``runtime.serve``) until the job ends; then it serves the next one. The process never
restarts for a job: a late joiner or a restarted host finds the job, its plan and its model retained.

A host that cannot take part in a job (a worker whose data is missing or broken, a model that does not
build here) says why: an event on the job's ``events``, and for a worker its retained ``left`` status,
which the job's state lists; the others train on.

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
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

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
from edgemesh.services.runtime import Service, client_id, install_stop_signals, serve, supervise

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0
"""How long a job's service may take to stop (its last checkpoint, an offline status) before it is cancelled."""


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
        """(job, sha256) this host serves, or has given up serving (its factory refused)."""
        self.service: Service | None = None
        self.failure: BaseException | None = None
        """How the current job's service ended, if it ended on its own."""
        self.refusal: EdgeMeshError | None = None
        """Why this host takes no part in the current job (its factory refused), if it does not."""
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
        for outcome in ("served", "refused", "failed"):
            self.m_jobs.labels(outcome=outcome)
        self.m_serving = m.gauge("serving", "1 while this process serves a job")
        # not "job": Prometheus's own job label names the service, and would rename this one exported_job
        self.m_info = m.gauge("job_info", "1 for the job this process serves now", ["training_job"])

    # ------------------------------------------------------------------ running
    async def run(self, *, signals: bool = False, extra: Callable[[Bus], list[Any]] | None = None) -> None:
        """Serve jobs until ``stop``; ``extra(bus)`` adds routes and jobs of the host's own (the job board)."""
        if signals:
            install_stop_signals(self.stop)
        async with contextlib.AsyncExitStack() as stack:
            self.metrics.serve(self.cfg.metrics.address, self.cfg.metrics.port_file)
            stack.callback(self.metrics.close)
            bus = self.bus = await stack.enter_async_context(Bus(
                self.cfg.broker, client_id=client_id(f"{self.role}-host", self.cfg, self.device),
                metrics=self.metrics))
            bus.route(all_jobs_filter(), JobSubmission, self._on_submission)
            bus.route(all_job_states_filter(), JobState, self._on_state)
            jobs = extra(bus) if extra is not None else []
            self.metrics.up.set(1)
            logger.info("%s: serving submitted jobs on %s", self.role, self.cfg.broker.url)
            try:
                await supervise(self.stop, self._serve_loop(), self.health.watch(self.cfg.metrics.health_interval_s),
                                *jobs, transport=bus.run(), close=self._leave)
            finally:
                self.metrics.up.set(0)

    async def _serve_loop(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
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
        spec = self.specs[sha]
        sub = self.submissions.get(name)
        if sub is None or sub.sha256 != sha:
            sub = JobSubmission(name=name, source=spec.source.encode(), sha256=sha, submitted_at=0.0)
        self.current = (name, sha)
        self.failure = self.refusal = None
        try:
            register_costs(spec, sub)
            state = self.states.get(name)
            run = run_name(spec, state.submitted_at if state is not None else sub.submitted_at)
            cfg = job_config(self.cfg, spec, run)
            cfg = dataclasses.replace(cfg, metrics=dataclasses.replace(cfg.metrics, address="", port_file=""))
            active = ActiveJob(spec=spec, submission=sub, config=cfg)
            service = await self.factory(active)
        except EdgeMeshError as exc:
            self.refusal = exc
            self.m_jobs.labels(outcome="refused").inc()
            logger.error("%s: not taking part in job %s: %s", self.role, name, exc)
            await self._refused(name, exc)
            return
        if service is None:
            logger.info("%s: job %s does not need this host", self.role, name)
            return
        if self.wanted() != (name, sha):  # the job ended while its service was being built
            self.current = None
            self._changed_now()
            return
        self.service = service
        self._delegate.source = service.metrics
        self.m_jobs.labels(outcome="served").inc()
        self.m_serving.set(1)
        self.m_info.labels(training_job=name).set(1)
        logger.info("%s: serving job %s (model %s)", self.role, name, spec.model_key)
        self._task = asyncio.create_task(serve(service, cfg, health=self.health), name=f"{self.role}-{name}")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The job's service ended on its own: an error, or a ``stop`` command (which stops the host too)."""
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            logger.info("%s: the job's service was told to stop; stopping", self.role)
            self.stop.set()
        else:
            self.failure = error
            self.m_jobs.labels(outcome="failed").inc()
            logger.error("%s: job %s failed here: %s", self.role, self.current[0] if self.current else "?", error)
        self._changed_now()

    async def _leave(self) -> None:
        """Stop serving the current job (its service closes as at any stop: a last checkpoint, an offline status)."""
        task, service = self._task, self.service
        if self.current is not None:
            self.m_info.labels(training_job=self.current[0]).set(0)
        self.current, self._task, self.service = None, None, None
        self.m_serving.set(0)
        if task is None or service is None:
            return
        task.remove_done_callback(self._ended)  # it ends because we stop it, not on its own
        service.stop.set()
        try:
            async with asyncio.timeout(STOP_TIMEOUT_S):
                await asyncio.shield(task)
        except TimeoutError:
            logger.warning("%s: the job's service did not stop within %.0fs; cancelling it", self.role, STOP_TIMEOUT_S)
            await cancel_all([task])
        except Exception as exc:  # noqa: BLE001 - it failed on its way out: said, and the host goes on
            logger.error("%s: the job's service failed while stopping: %s", self.role, exc)
        if not task.cancelled():
            task.exception()  # read: a failure on the way out was said above

    async def _refused(self, name: str, error: EdgeMeshError) -> None:
        """Say why this host takes no part in job ``name``: an event, and a worker's retained ``left`` status."""
        if self.bus is None:
            return
        topics = Topics(name)
        source = f"device/{self.device}" if self.device else self.role
        with contextlib.suppress(EdgeMeshError):
            if self.device:
                await self.bus.publish(topics.status(self.device), DeviceStatus(
                    device=self.device, state="left", time=time.time(), reason=str(error)[:2000]), retain=True)
            await self.bus.publish(topics.events(), Event(kind="job_refused", source=source, time=time.time(),
                                                          message=str(error)[:2000], data={"job": name}))


def register_costs(spec: JobSpec, sub: JobSubmission) -> None:
    """Register the cost figures the submission carries under the job's model name (the planner plans with
    them without torch; every host checks memory with them)."""
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
