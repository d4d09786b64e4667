"""The job board: the parameter server's host owns every job's state (docs/jobs.md).

It queues submitted jobs and starts the oldest when the fleet is free (one job at a time), follows the
running job's progress (version, accuracy, devices, bytes) in its retained state, ends it at its stop
rule (target accuracy, most versions, most minutes) after publishing the final model retained, and
answers the operators' ``control/job`` commands: status, pause, resume, stop. A job whose parameter
server fails (its model does not build, its held-out set is broken) is marked failed with the reason.

The state also says, while the job runs, which devices are out of it and why (their retained status: ``left``
with the reason, or a refused share of the plan), warns of what looks wrong (divergence, a model stuck at chance, no
device in the job, a device the plan leaves out whose own data goes untrained), and keeps the job's latest
evaluations (the parameter server's ``evaluation`` events, at most ``EVALUATIONS_KEPT``).

Every decision is published as the job's retained ``JobState``; the hosts of all services (this one
too) start and stop serving jobs from those states alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeGuard

import numpy as np

from edgemesh.common.bus import Bus
from edgemesh.common.config import Config
from edgemesh.common.data import DATA_FORMATS
from edgemesh.common.errors import EdgeMeshError
from edgemesh.common.jobs import host_model_spec
from edgemesh.common.messages import (
    ControlCommand,
    ControlReply,
    DeviceStatus,
    Event,
    JobState,
    ModelSnapshot,
    Scalar,
)
from edgemesh.common.messages.jobs import EVALUATIONS_KEPT, MAX_REASON_CHARS, JobEvaluation, JobPhase
from edgemesh.common.messages.operations import listing
from edgemesh.common.topics import PREFIX, Filter, TopicMatch, Topics
from edgemesh.common.wire.tensors import Tensor
from edgemesh.services.host import ActiveJob, JobHost, describe, survivable
from edgemesh.services.parameter_server.evaluation import Quorum
from edgemesh.services.parameter_server.guard import CHANCE_MARGIN, Evaluated
from edgemesh.services.parameter_server.service import ParameterServer

logger = logging.getLogger(__name__)

SETTLE_S = 0.5
"""After connecting, how long the board lets the retained job files and states arrive before it decides anything
(a restarted host must find a running job running, not queue it again)."""
PROGRESS_INTERVAL_S = 1.0
"""How often a running job's retained state is refreshed while it makes progress."""
COMMANDS = ("status", "pause", "resume", "stop")
IDLE_WARN_S = 10.0
"""How long a device may be online for a job whose data lives on the devices, without a place in its plan, before
the job's state warns that its data goes untrained (a device that just came waits for the next plan)."""
STUCK_EVALUATIONS = 10
"""Evaluations at chance in a row after which a running job's state says it is stuck there."""
REACHED = "reached the target accuracy"
"""How the reason of a job that reached its target begins (its last evaluation is its final accuracy)."""
EVALUATION_ECHO_S = 2.0
"""How long a job's end waits for the event of the evaluation it ends with (its accuracy is read off the parameter
server; the event comes back over the broker) to put it in the final state's evaluations."""


class JobBoard:
    """Queue, start, follow and end jobs, on the parameter server's host."""

    def __init__(self, host: JobHost, *, progress_interval_s: float = PROGRESS_INTERVAL_S) -> None:
        self.host = host
        self.interval = progress_interval_s
        self.bus: Bus | None = None
        self.device_errors: dict[str, dict[str, str]] = {}
        """Job -> device -> why it is out of the job."""
        self.online: dict[str, set[str]] = {}
        """Job -> the devices whose latest status is ``online``."""
        self._unplanned: dict[str, dict[str, float]] = {}
        """Job -> device online, not out of the job, but in no cluster of the plan -> since when (time.time())."""
        self.evaluations: dict[str, tuple[JobEvaluation, ...]] = {}
        """Job -> its latest evaluations, oldest first (seeded from its retained state)."""
        self._bytes_before: weakref.WeakKeyDictionary[ParameterServer, int] = weakref.WeakKeyDictionary()
        """Parameter server serving a job -> the gradient bytes the job's state counted before it started (those of
        the process before a restart: the state's count goes on from them, not from zero)."""
        self._wake = asyncio.Event()
        self._recorded = asyncio.Event()
        """Set when an evaluation is recorded."""
        self._published: dict[str, JobState] = {}
        self._ending: set[str] = set()
        host.listeners.append(self._wake.set)

    def attach(self, bus: Bus) -> list[Any]:
        """Routes on the host's bus, and the board's loop."""
        self.bus = bus
        bus.route(Filter(f"{PREFIX}/+/control/job", "control"), ControlCommand, self._on_command, json_body=True)
        bus.route(Filter(f"{PREFIX}/+/device/+/status", "status"), DeviceStatus, self._on_status)
        bus.route(Filter(f"{PREFIX}/+/events", "events"), Event, self._on_event)
        return [self._loop()]

    # ------------------------------------------------------------------ the loop
    async def _loop(self) -> None:
        assert self.bus is not None
        while not self.bus.is_connected:
            with contextlib.suppress(TimeoutError):
                await self.bus.wait_connected()
        await asyncio.sleep(SETTLE_S)
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self._tick()
            except EdgeMeshError as exc:  # the broker went away mid-publish: the next tick tries again
                logger.warning("job board: %s", exc)

    async def _tick(self) -> None:
        host, now = self.host, time.time()
        for name, sub in host.submissions.items():
            state = host.states.get(name)
            if state is None or (state.ended and (state.sha256, state.submitted_at) != (sub.sha256, sub.submitted_at)):
                # a new job, or a new submission of an ended one (the same file submitted again runs again)
                spec = host.specs[sub.sha256]
                self.evaluations.pop(name, None)
                await self._publish(JobState(name=name, state="queued", sha256=sub.sha256,
                                             submitted_at=sub.submitted_at, updated_at=now,
                                             target_accuracy=spec.target_accuracy, max_versions=spec.max_versions,
                                             max_minutes=spec.max_minutes))
        states = host.states
        if not any(s.active for s in states.values()):
            queued = sorted((s for s in states.values() if s.state == "queued" and s.sha256 in host.specs),
                            key=lambda s: (s.submitted_at, s.name))
            if queued:
                first = queued[0]
                logger.info("job board: starting job %s", first.name)
                await self._publish(replace(first, state="running", started_at=now, updated_at=now, reason=""))
                return
        for state in [s for s in states.values() if s.active]:
            await self._follow(state, now)

    async def _follow(self, state: JobState, now: float) -> None:
        """Progress of the active job this host serves; its end at the stop rule or on failure."""
        host = self.host
        ps = host.service if host.current == (state.name, state.sha256) else None
        if host.current == (state.name, state.sha256) and host.died:  # it died with this job before: not again
            await self._end(state, "failed", host.died)
            return
        if host.current == (state.name, state.sha256) and host.failure is not None:
            await self._end(state, "failed", f"the parameter server failed: {host.failure}")
            return
        if host.current == (state.name, state.sha256) and host.refusal is not None:
            await self._end(state, "failed", f"the parameter server cannot serve this job: {host.refusal}")
            return
        if not isinstance(ps, ParameterServer) or ps.state is None:
            return
        if self.host.states.get(state.name, state).state == "paused" and not ps.paused:
            await ps.control(ControlCommand(command="pause", requester="jobs"))  # a restarted PS resumes paused
        if ps not in self._bytes_before:  # its first tick: a restarted PS carries the counts of the one before on
            self._bytes_before[ps] = state.bytes_received
            ps.guard.rollbacks = max(ps.guard.rollbacks, state.rollbacks)  # ps.guard.max_rollbacks spans restarts
        progress = self._progress(state, ps)
        reason = _stop_reason(progress, now, ps.evaluator.quorum(progress.target_accuracy))
        if reason and state.state == "running":
            await self._end(progress, "finished", reason)
            return
        last = self._published.get(state.name)
        if last is None or _progress(last) != _progress(progress) or now - last.updated_at >= 10 * self.interval:
            await self._publish(replace(progress, updated_at=now))

    def _progress(self, state: JobState, ps: ParameterServer) -> JobState:
        """``state`` with the running parameter server's figures."""
        last = ps.evaluator.last
        history = self._history(state)
        devices = tuple(d.device for d in ps.plan.devices) if ps.plan else ()
        errors = dict(self.device_errors.get(state.name, {}))
        idle = self._idle(state, devices, errors, ps.plan.drained if ps.plan else ())
        return replace(state, version=ps.version, accuracy=ps.last_accuracy, loss=ps.evaluator.last_loss,
                       model_version=last.version if last is not None else 0, devices=devices,
                       bytes_received=self._bytes_before.get(ps, 0)
                       + int(ps.metrics.value("edgemesh_ps_received_gradient_bytes_total")),
                       device_errors=errors, evaluations=history, rollbacks=ps.guard.rollbacks,
                       warning=job_warning(ps.guard.diverging, history, self._classes(state))
                       or no_device_warning(devices, errors) or idle_warning(idle))

    def _idle(self, state: JobState, planned: Sequence[str], errors: Mapping[str, str],
              drained: Sequence[str]) -> list[str]:
        """The devices online for ``state``'s job, neither out of it nor drained, that the plan has left out for
        ``IDLE_WARN_S`` or longer, when the job's data lives on the devices (their data goes untrained); else []."""
        spec = self.host.specs.get(state.sha256)
        since = self._unplanned.setdefault(state.name, {})
        if spec is None or spec.data.format not in DATA_FORMATS:
            since.clear()
            return []
        now = time.time()
        left_out = self.online.get(state.name, set()) - set(planned) - set(errors) - set(drained)
        for device in set(since) - left_out:
            del since[device]
        for device in left_out:
            since.setdefault(device, now)
        return sorted(d for d, t in since.items() if now - t >= IDLE_WARN_S)

    def _classes(self, state: JobState) -> int:
        spec = self.host.specs.get(state.sha256)
        return len(spec.model.classes) if spec is not None else 0

    def _history(self, state: JobState) -> tuple[JobEvaluation, ...]:
        return self.evaluations.get(state.name, state.evaluations)

    async def _end(self, state: JobState, phase: JobPhase, reason: str) -> None:
        """End a job: its final model out (retained), then its state."""
        if state.name in self._ending:
            return
        self._ending.add(state.name)
        try:
            ps = self.host.service
            if isinstance(ps, ParameterServer) and self.host.current == (state.name, state.sha256) \
                    and ps.state is not None:
                reached = reason.startswith(REACHED)  # its last evaluation is its last model's: kept
                try:
                    kept = await self._final(ps, state, evaluate=not reached)
                except BaseException as exc:  # the model failed its last evaluation: the job fails, the host lives
                    if not survivable(exc):
                        raise
                    logger.error("job board: job %s: its final model failed: %s", state.name, describe(exc))
                    kept, phase, reason = None, "failed", f"{reason}; then its final model failed: {describe(exc)}"
                state = replace(state, version=ps.version)
                if kept is not None:  # what the state says is the kept model's: what export writes
                    state = replace(state, model_version=kept.version, accuracy=kept.accuracy,
                                    loss=kept.loss if math.isfinite(kept.loss) else None)
                await self._heard(state)
                state = replace(state, evaluations=self._history(state))
            logger.info("job board: job %s %s: %s", state.name, phase, reason)
            await self._publish(replace(state, state=phase, reason=reason, ended_at=time.time(),
                                        updated_at=time.time()))
            await self._event(state.name, f"job_{phase}", reason)
        finally:
            self._ending.discard(state.name)

    async def _final(self, ps: ParameterServer, state: JobState, *, evaluate: bool) -> Evaluated | None:
        """The model the job keeps, published float32 and retained on ``job/model`` (which ``edgemesh job export``
        reads): the model as it stands (with a sharded server, every shard's rows), evaluated now unless its target
        was reached, or the best evaluated version when that one scored higher. None if there is none."""
        assert self.bus is not None
        whole = await ps.whole_model()
        if whole is None:
            logger.error("job board: job %s: no final model, not every shard's broadcast reached version %d",
                         state.name, ps.version)
            return None
        version, params = whole
        if evaluate:
            async def report(version: int, loss: float, accuracy: float) -> None:
                self._record(state.name, version, loss, accuracy, time.time())  # in the final state, whose event
                await ps.divergence.report(version, loss, accuracy)  # may come back after it is published

            await ps.evaluator.final(version, params, report)
        kept = kept_model(ps.evaluator.last, ps.guard.best, Evaluated(version, math.nan, math.nan, params))
        assert kept.params is not None
        if kept.version != version:
            logger.info("job board: job %s keeps version %d (accuracy %.4f), its best, over its last", state.name,
                        kept.version, kept.accuracy)
        with contextlib.suppress(EdgeMeshError):
            await self.bus.publish(Topics(ps.cfg.job).job_model(), ModelSnapshot(
                version=kept.version, model_spec=ps.cfg.training.model_spec, created=time.time(),
                sync_policy=ps.policy, tensors={k: Tensor.from_numpy(np.asarray(v, dtype=np.float32))
                                                for k, v in kept.params.items()}), retain=True, kind="model")
        return kept if math.isfinite(kept.accuracy) else None

    async def _publish(self, state: JobState) -> None:
        assert self.bus is not None
        self._published[state.name] = state
        self.host.states[state.name] = state  # at once: the next tick must not decide on the old state
        await self.bus.publish(Topics(state.name).job_state(), state, retain=True)

    async def _event(self, job: str, kind: str, message: str, **data: Scalar) -> None:
        assert self.bus is not None
        with contextlib.suppress(EdgeMeshError):
            await self.bus.publish(Topics(job).events(), Event(kind=kind, source="jobs", time=time.time(),
                                                               message=message, data=data))

    # ------------------------------------------------------------------ devices
    async def _on_status(self, status: DeviceStatus, match: TopicMatch) -> None:
        """A device out of the job (it left it, or refused its share of the plan: memory) says why; back online
        with its share, it is in again."""
        errors = self.device_errors.setdefault(match.job, {})
        online = self.online.setdefault(match.job, set())
        (online.add if status.state == "online" else online.discard)(status.device)
        if status.state == "left":
            errors[status.device] = status.reason[:MAX_REASON_CHARS]
        elif status.state == "online" and status.refused_plan:
            errors[status.device] = f"refused its share of plan v{status.refused_plan}: {status.reason}"[
                :MAX_REASON_CHARS]
        elif status.state == "online":
            errors.pop(status.device, None)
        self._wake.set()

    # ------------------------------------------------------------------ evaluations
    async def _on_event(self, event: Event, match: TopicMatch) -> None:
        """An evaluation of an active job's model (the parameter server's event) goes into its history."""
        state = self.host.states.get(match.job)
        if event.kind != "evaluation" or event.source != "ps" or state is None or not state.active:
            return
        version, loss, accuracy = (event.data.get(key) for key in ("version", "loss", "accuracy"))
        if not (_number(version) and isinstance(version, int) and version >= 0 and _number(loss)
                and _number(accuracy) and 0.0 <= accuracy <= 1.0):
            self.host.metrics.reject("field", match.topic, f"an evaluation event without a version, accuracy and "
                                     f"loss: {event.data}", route="events")
            return
        self._record(match.job, version, float(loss), float(accuracy), event.time)

    def _record(self, job: str, version: int, loss: float, accuracy: float, at: float) -> None:
        """Keep an evaluation of ``job``'s model: one per version (a device's later report, or the final one heard
        back, replaces it), in version order, the latest ``EVALUATIONS_KEPT``."""
        state = self.host.states.get(job)
        kept = {e.version: e for e in self.evaluations.get(job, state.evaluations if state else ())}
        kept[version] = JobEvaluation(version=version, accuracy=accuracy, loss=loss if math.isfinite(loss) else None,
                                      time=max(0.0, at))
        self.evaluations[job] = tuple(kept[v] for v in sorted(kept))[-EVALUATIONS_KEPT:]
        self._recorded.set()
        self._wake.set()

    async def _heard(self, state: JobState) -> None:
        """Wait (up to ``EVALUATION_ECHO_S``) until the evaluation that gave ``state`` its accuracy is recorded."""
        def heard() -> bool:
            history = self._history(state)
            return state.accuracy is None or bool(history) and history[-1].accuracy == state.accuracy

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(EVALUATION_ECHO_S):
                while not heard():
                    self._recorded.clear()
                    await self._recorded.wait()

    # ------------------------------------------------------------------ control
    async def _on_command(self, cmd: ControlCommand, match: TopicMatch) -> None:
        assert self.bus is not None
        topics = Topics(match.job)
        if cmd.expires_at and time.time() > cmd.expires_at:
            self.host.metrics.reject("expired", match.topic, f"{cmd.command} expired", route="control")
            return
        ok, text = await self._apply(match.job, cmd.command)
        if not ok:
            self.host.metrics.reject("bad_command", match.topic, text, route="control")
        state = self.host.states.get(match.job)
        result: dict[str, Scalar] = {"state": state.state if state else "unknown",
                                     "version": state.version if state else 0,
                                     "accuracy": state.accuracy if state else None}
        await self.bus.publish(cmd.reply_to or topics.control_reply(cmd.requester), ControlReply(
            request_id=cmd.request_id, source="jobs", command=cmd.command, ok=ok, message=text, result=result))
        await self._event(match.job, "control", f"{cmd.command} from {cmd.requester}: {text}", command=cmd.command,
                          requester=cmd.requester, ok=ok)

    async def _apply(self, job: str, command: str) -> tuple[bool, str]:
        state = self.host.states.get(job)
        if state is None:
            return False, f"no job {job!r} was submitted"
        ps = self.host.service if self.host.current == (job, state.sha256) else None
        match command:
            case "status":
                return True, state.state
            case "pause" | "resume":
                want: JobPhase = "paused" if command == "pause" else "running"
                if not state.active:
                    return False, f"job {job} is {state.state}, not running"
                # the board's phase first: a tick while the PS writes its checkpoint must not undo the command
                self.host.states[job] = replace(state, state=want)
                if isinstance(ps, ParameterServer):
                    await ps.control(ControlCommand(command=command, requester="jobs"))
                    state = self._progress(state, ps)
                await self._publish(replace(state, state=want, reason=f"{command}d by an operator",
                                            updated_at=time.time()))
                return True, want
            case "stop":
                if state.ended:
                    return False, f"job {job} has already ended ({state.state})"
                if isinstance(ps, ParameterServer) and ps.state is not None:
                    state = self._progress(state, ps)
                await self._end(state, "stopped", "stopped by an operator")
                return True, "stopped"
        return False, f"unknown command {command!r} for a job ({', '.join(COMMANDS)})"


def kept_model(last: Evaluated | None, best: Evaluated | None, current: Evaluated) -> Evaluated:
    """The model a job keeps: the best evaluated one when it scored higher than the latest evaluation, else the
    latest evaluated (the current model, when it was evaluated last), else the current model unevaluated (the
    devices evaluated it on their shares: its accuracy is theirs, of versions near it)."""
    if last is not None and last.params is not None:
        return best if best is not None and best.better_than(last) else last
    if last is not None:
        return replace(current, loss=last.loss, accuracy=last.accuracy)
    return current


def job_warning(diverging: str, history: Sequence[JobEvaluation], classes: int) -> str:
    """What looks wrong with a running job: the guard's word that it diverges, or an accuracy that stayed at chance
    over the latest ``STUCK_EVALUATIONS`` evaluations ('' when nothing does)."""
    if diverging:
        return f"diverging: {diverging}"[:MAX_REASON_CHARS]
    if classes and len(history) >= STUCK_EVALUATIONS:
        best, chance = max(e.accuracy for e in history), 1 / classes
        if best <= chance + CHANCE_MARGIN:
            return (f"stuck at chance: the best of the latest {len(history)} evaluations is {best:.4f}, chance is "
                    f"{chance:.4f} ({classes} classes); lower training.lr, or check the data")
    return ""


def idle_warning(idle: Sequence[str]) -> str:
    """Devices online for a job whose data lives on them, left out of its plan ('' when none is)."""
    if not idle:
        return ""
    are, they = ("is", "it holds") if len(idle) == 1 else ("are", "they hold")
    return (f"{listing(list(idle))} {are} online but in no cluster of the plan (idle in the training grid, or no "
            f"memory for a batch: the planner's log says which): the data {they} is not trained on")[:MAX_REASON_CHARS]


def no_device_warning(devices: Sequence[str], errors: Mapping[str, str]) -> str:
    """A running job no device trains: every device heard from is out of it (its data missing or broken, its share
    refused). It waits for a device that can join ('' while one is in the plan, or none was heard from yet)."""
    if devices or not errors:
        return ""
    return (f"no device is in the job: the {len(errors)} heard from are out of it (below); it waits for one that "
            "can join, until its stop rule")[:MAX_REASON_CHARS]


def _number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _progress(state: JobState) -> tuple[Any, ...]:
    return (state.state, state.version, state.accuracy, state.devices, state.device_errors, state.evaluations,
            state.rollbacks, state.warning)


def _stop_reason(state: JobState, now: float, quorum: Quorum | None = None) -> str:
    """Why the job's stop rule ends it now ('' while it goes on). An accuracy the devices reported reaches the target
    only with their ``quorum`` (None: the parameter server's own evaluation)."""
    if state.target_accuracy and state.accuracy is not None and state.accuracy >= state.target_accuracy and (
            quorum is None or quorum.met):
        return (f"{REACHED}: {state.accuracy:.4f} >= {state.target_accuracy:g} at version {state.model_version}"
                + (f" ({quorum})" if quorum else ""))
    if state.max_versions and state.version >= state.max_versions:
        return f"reached model version {state.version} (job.max_versions = {state.max_versions})"
    if state.max_minutes and state.started_at and now - state.started_at >= state.max_minutes * 60:
        return f"ran for {state.max_minutes:g} minutes (job.max_minutes)"
    return ""


async def serve_jobs(config: Config) -> None:
    """The parameter server's host: it serves the jobs operators submit and keeps their states (the board). With
    shards, only shard 0's host keeps the board; the others serve the jobs its states start, as every host does."""
    host = JobHost("ps", config, for_job)
    await host.run(signals=True, extra=None if config.ps.shard else JobBoard(host).attach)


async def for_job(active: ActiveJob) -> ParameterServer:
    """The parameter server of a submitted job: its model registered (built from the job file; an entry point only
    from a module this host's ``models.allowed`` allows) first."""
    await asyncio.to_thread(host_model_spec, active.spec, active.config.models)
    return ParameterServer(active.config, job=active.spec)
