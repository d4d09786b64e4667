"""``edgemesh job``: submit a training job to the running services, follow it, steer it, export its model.

    edgemesh job submit FILE           validate the job file whole (every error named), build its model,
                                       publish it retained; the services start it when the fleet is free
    edgemesh job list                  every job on the broker and its state (and the devices out of it, why)
    edgemesh job status NAME           its state, with a live progress bar until it ends (--once: at once); the
                                       devices out of it and why, its latest evaluations
    edgemesh job pause|resume|stop NAME
    edgemesh job export NAME --format onnx|safetensors|torch --out PATH [--trust-code]

All of them are clients of the topics (docs/jobs.md): the job file on ``{job}/job``, its state on
``{job}/job/state`` (kept by the parameter server's host), commands on ``{job}/control/job``, the final
model on ``{job}/job/model``. They need only a broker the operator may write control topics on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO, TypeVar

from edgemesh import cli
from edgemesh.common.bus import Bus
from edgemesh.common.config import Config, ModelsConfig
from edgemesh.common.errors import EdgeMeshError, JobError
from edgemesh.common.jobs import JobSpec, check_model, parse_job, read_job_file
from edgemesh.common.messages import (
    ControlCommand,
    ControlReply,
    JobState,
    JobSubmission,
    ModelSnapshot,
)
from edgemesh.common.messages.jobs import EVALUATIONS_KEPT
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Filter, TopicMatch, Topics, all_job_states_filter
from edgemesh.operator.progress import ProgressLines, is_terminal

M = TypeVar("M")

RETAINED_WAIT_S = 1.0
"""How long a client collects retained messages after connecting."""
ANSWER_WAIT_S = 10.0
"""How long ``submit`` waits for the parameter server's host to queue or start the job."""
COMMAND_TTL_S = 60.0
REFRESH_S = 0.25
"""How often ``status`` redraws its progress bar (and, off a terminal, looks for a change to print)."""


def _bus(config: Config, what: str, metrics: ServiceMetrics | None = None) -> Bus:
    """A client of the broker for one command; ``metrics`` counts what it receives (a fresh registry by default)."""
    return Bus(config.broker, client_id=f"edgemesh-job-{what}-{uuid.uuid4().hex[:8]}",
               metrics=metrics or ServiceMetrics("operator"))


class _Latest:
    """The latest message of each topic a route consumes, and a wake-up for whoever waits on them."""

    def __init__(self) -> None:
        self.items: dict[str, Any] = {}
        self.changed = asyncio.Event()

    def keep(self) -> Callable[[Any, TopicMatch], Awaitable[None]]:
        async def store(msg: Any, match: TopicMatch) -> None:
            self.items[match.job] = msg
            self.changed.set()
        return store

    async def wait(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until ``predicate()`` holds; False if it did not within ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while not predicate():
                    self.changed.clear()
                    await self.changed.wait()
                return True
        return predicate()


# --------------------------------------------------------------------------- submit


def prepare(path: str | Path, *, module_path: list[str] | None = None,
            trust: ModelsConfig | None = None) -> tuple[JobSpec, JobSubmission]:
    """Read and validate a job file and build its model (an entry point only from a module ``trust.allowed``
    allows, the operator's own configuration, imported from ``module_path``, the file's directory, the job's own
    ``model.module_path`` and ``trust.path``); JobError names every problem."""
    spec = read_job_file(path)
    return spec, submission_of(spec, search_path=[*(module_path or []), str(Path(path).resolve().parent)],
                               trust=trust)


def submission_of(spec: JobSpec, *, search_path: list[str], trust: ModelsConfig | None = None) -> JobSubmission:
    """The submission of a validated job: its model built (an entry point as :func:`prepare` says), its cost figures
    derived."""
    cost, layers, refusal = check_model(spec, search_path=search_path, trust=trust)
    planner = spec.settings.get("planner", {})
    if planner.get("parallelism") == "mesh" and layers is None:
        if planner.get("mesh_fallback") is not True:
            raise JobError(spec.name, [f"planner.parallelism = mesh: {refusal} (or set planner.mesh_fallback = true "
                                       "to train it data parallel)"])
        print(f"edgemesh job: {spec.name}: planner.parallelism = mesh, but {refusal}: it will train data parallel "
              "(planner.mesh_fallback)", file=sys.stderr)
    return JobSubmission(name=spec.name, source=spec.source.encode(), sha256=spec.sha256,
                               submitted_at=time.time(), params=cost.params, macs_per_sample=cost.macs_per_sample,
                               activations_per_sample=cost.activations_per_sample, layers=layers or (), refusal=refusal)


async def submit(config: Config, spec: JobSpec, submission: JobSubmission, *, wait_s: float = ANSWER_WAIT_S,
                 metrics: ServiceMetrics | None = None) -> int:
    """Publish the job (unless a different job of that name is still active) and wait for its state."""
    topics = Topics(spec.name)
    states = _Latest()
    bus = _bus(config, "submit", metrics)
    bus.route(topics.job_state_filter(), JobState, states.keep())
    async with bus:
        await states.wait(lambda: spec.name in states.items, RETAINED_WAIT_S)
        old: JobState | None = states.items.get(spec.name)
        if old is not None and not old.ended and old.sha256 != spec.sha256:
            print(f"edgemesh job: job {spec.name!r} is {old.state} with another job file; stop it first "
                  f"(edgemesh job stop {spec.name}) or give this job another name", file=sys.stderr)
            return 2
        if old is not None and not old.ended and old.sha256 == spec.sha256:
            print(f"job {spec.name} is already {old.state}")
            return 0
        await bus.publish(topics.job_file(), submission, retain=True)
        answered = await states.wait(lambda: _is(states.items.get(spec.name), submission.sha256), wait_s)
    state = states.items.get(spec.name)
    if not answered or state is None:
        print(f"job {spec.name} submitted; no parameter server took it within {wait_s:.0f}s (is one running "
              f"without --job on {config.broker.url}?)", file=sys.stderr)
        return 1
    print(f"job {spec.name} {state.state} (model {spec.model_key}, {submission.params:,} parameters)")
    return 0


def _is(state: JobState | None, sha: str) -> bool:
    return state is not None and state.sha256 == sha


# --------------------------------------------------------------------------- list, status


async def job_states(config: Config, *, metrics: ServiceMetrics | None = None) -> dict[str, JobState]:
    """Every job's retained state on the broker."""
    states = _Latest()
    bus = _bus(config, "list", metrics)
    bus.route(all_job_states_filter(), JobState, states.keep())
    async with bus:
        await asyncio.sleep(RETAINED_WAIT_S)  # retained states arrive at once; this is how long to collect them
    return dict(states.items)


def with_job(config: Config) -> Config:
    """``config`` naming a job: its own, else the job that is running (or paused) on the broker, said on standard
    error. Raises EdgeMeshError when it names none and no job is running."""
    if config.job:
        return config
    states = asyncio.run(job_states(config))
    active = sorted(name for name, state in states.items() if state.active)
    if len(active) == 1:
        print(f"(job {active[0]}, the one {states[active[0]].state})", file=sys.stderr)
        return replace(config, job=active[0])
    known = f"; the broker knows {', '.join(sorted(states))}" if states else ""
    running = f"{len(active)} jobs are running" if active else "no job is running"
    raise EdgeMeshError(f"{running}: name the job with --job NAME (or job = \"NAME\" in the configuration){known}")


def describe(state: JobState) -> str:
    """One line about a job: its state, version, accuracy, devices, bytes."""
    accuracy = f"{state.accuracy:.4f}" if state.accuracy is not None else "-"
    target = f" / {state.target_accuracy:g}" if state.target_accuracy else ""
    errors = f", {len(state.device_errors)} device(s) out" if state.device_errors else ""
    of = f" (of version {state.model_version})" if state.model_version and state.model_version != state.version \
        and state.accuracy is not None else ""
    rollbacks = f", {state.rollbacks} rollback(s)" if state.rollbacks else ""
    return (f"{state.name}: {state.state}, version {state.version}, accuracy {accuracy}{of}{target}, "
            f"{len(state.devices)} device(s){errors}, {state.bytes_received / 1e6:.2f} MB of gradients{rollbacks}"
            + (f" ({state.reason})" if state.reason else "") + (f"\n  warning: {state.warning}" if state.warning
                                                                 else ""))


def devices_out(state: JobState, indent: str = "  ") -> list[str]:
    """A line per device out of the job (it left it, or refused its share of the plan), saying why."""
    return [f"{indent}{device} is out of the job: {reason}" for device, reason in sorted(state.device_errors.items())]


def evaluation_table(state: JobState) -> list[str]:
    """The job's latest evaluations (``JobState.evaluations``), oldest first: version, accuracy, loss, time."""
    if not state.evaluations:
        return []
    lines = [f"  evaluations (the latest {EVALUATIONS_KEPT} are kept):",
             f"  {'version':>9} {'accuracy':>8} {'loss':>8}  time"]
    for e in state.evaluations:
        loss = f"{e.loss:.4f}" if e.loss is not None else "-"
        since = f" (+{e.time - state.started_at:.0f} s)" if 0 < state.started_at <= e.time else ""
        lines.append(f"  {e.version:>9} {e.accuracy:>8.4f} {loss:>8}  "
                     f"{time.strftime('%H:%M:%S', time.localtime(e.time))}{since}")
    return lines


def report(state: JobState) -> str:
    """What ``job status`` prints about a job: its line, the devices out of it and why, its latest evaluations."""
    return "\n".join([describe(state), *devices_out(state), *evaluation_table(state)])


async def list_jobs(config: Config, *, metrics: ServiceMetrics | None = None) -> int:
    states = await job_states(config, metrics=metrics)
    if not states:
        print(f"no jobs on {config.broker.url}")
        return 1
    print(f"{'job':<20} {'state':<9} {'version':>7} {'accuracy':>8} {'devices':>7} {'MB':>8}  reason")
    for name in sorted(states, key=lambda n: states[n].submitted_at):
        s = states[name]
        accuracy = f"{s.accuracy:.4f}" if s.accuracy is not None else "-"
        print(f"{name:<20} {s.state:<9} {s.version:>7} {accuracy:>8} {len(s.devices):>7} "
              f"{s.bytes_received / 1e6:>8.2f}  {s.reason}")
        if s.warning and s.active:
            print(f"{' ' * 21}warning: {s.warning}")
        for line in devices_out(s, indent=" " * 21):
            print(line)
    return 0


async def status(config: Config, name: str, *, once: bool, timeout_s: float,
                 metrics: ServiceMetrics | None = None, out: TextIO | None = None) -> int:
    """Print the job's state on ``out`` (stdout); unless ``once``, follow it with a progress bar until it ends (or
    ``timeout_s``): a bar redrawn in a terminal, else a plain line per change (``progress.ProgressLines``)."""
    out = out or sys.stdout
    states = _Latest()
    bus = _bus(config, "status", metrics)
    bus.route(Topics(name).job_state_filter(), JobState, states.keep())
    async with bus:
        if not await states.wait(lambda: name in states.items, RETAINED_WAIT_S * 3):
            print(f"no job {name!r} on {config.broker.url}", file=sys.stderr)
            return 1
        if once or states.items[name].ended:
            print(report(states.items[name]), file=out)
            return 0 if states.items[name].state != "failed" else 1
        if is_terminal(out):
            await _follow_bar(states, name, timeout_s, out)
        else:
            await _follow_lines(states, name, timeout_s, ProgressLines(out))
    final: JobState = states.items[name]
    print(report(final), file=out)
    return 0 if final.state != "failed" else 1


def _done(s: JobState) -> float:
    """How far the job is: its accuracy towards its target, or its versions towards the limit (0 without either)."""
    if s.state == "finished":
        return 1.0
    if s.target_accuracy:
        return min(1.0, (s.accuracy or 0.0) / s.target_accuracy)
    return min(1.0, s.version / s.max_versions) if s.max_versions else 0.0


def _detail(s: JobState) -> str:
    accuracy = f"{s.accuracy:.2%}" if s.accuracy is not None else "-"
    return f"accuracy {accuracy}  version {s.version}  devices {len(s.devices)}  {s.bytes_received / 1e6:.2f} MB"


async def _follow_bar(states: _Latest, name: str, timeout_s: float, out: TextIO) -> None:
    """A live progress bar (rich) on a terminal, redrawn every ``REFRESH_S``."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("[bold]{task.fields[job]}[/] {task.fields[state]}"), BarColumn(),
               TextColumn("{task.fields[detail]}"), TimeElapsedColumn())
    with Progress(*columns, transient=False, console=Console(file=out)) as bar:
        task = bar.add_task(name, total=1.0, job=name, state="", detail="")
        deadline = time.monotonic() + timeout_s if timeout_s else None
        while deadline is None or time.monotonic() < deadline:
            s: JobState = states.items[name]
            bar.update(task, completed=_done(s), state=s.state, detail=_detail(s))
            if s.ended:
                return
            await states.wait(lambda: False, REFRESH_S)


async def _follow_lines(states: _Latest, name: str, timeout_s: float, lines: ProgressLines) -> None:
    """The job's progress as plain lines (a log file, a pipe): one per change, at most one per ``lines.interval_s``,
    and the last state whatever the time."""
    deadline = time.monotonic() + timeout_s if timeout_s else None
    while True:
        s: JobState = states.items[name]
        over = s.ended or (deadline is not None and time.monotonic() >= deadline)
        lines.show(f"{name} {s.state}: {_done(s):4.0%}  {_detail(s)}", final=over)
        if over:
            return
        await states.wait(lambda: False, REFRESH_S)


# --------------------------------------------------------------------------- pause, resume, stop


async def command(config: Config, name: str, what: str, *, timeout_s: float) -> int:
    """Send ``what`` to the job's owner (the parameter server's host) and print its reply."""
    topics = Topics(name)
    requester = f"job-{uuid.uuid4().hex[:8]}"
    cmd = ControlCommand(command=what, request_id=uuid.uuid4().hex, requester=requester,
                         expires_at=time.time() + COMMAND_TTL_S)
    replies: asyncio.Queue[ControlReply] = asyncio.Queue()

    async def on_reply(reply: ControlReply, _: TopicMatch) -> None:
        if reply.request_id == cmd.request_id:
            await replies.put(reply)

    bus = _bus(config, what)
    bus.route(topics.reply_filter(requester), ControlReply, on_reply)
    async with bus:
        await bus.publish(topics.control("job"), cmd)
        try:
            async with asyncio.timeout(timeout_s):
                reply = await replies.get()
        except TimeoutError:
            print(f"no answer about job {name!r} within {timeout_s:.0f}s", file=sys.stderr)
            return 1
    print(f"job {name}: {reply.message}" if reply.ok else f"edgemesh job: {reply.message}",
          file=sys.stdout if reply.ok else sys.stderr)
    return 0 if reply.ok else 1


# --------------------------------------------------------------------------- export


async def fetch_model(config: Config, name: str, *, timeout_s: float) -> tuple[JobSpec, ModelSnapshot, JobState | None]:
    """The job file, its final model (or, while it runs, the latest retained snapshot) and its state."""
    topics = Topics(name)
    subs, finals, snapshots, states = _Latest(), _Latest(), _Latest(), _Latest()
    bus = _bus(config, "export")
    bus.route(Filter(topics.job_file(), "job"), JobSubmission, subs.keep())
    bus.route(topics.job_model_filter(), ModelSnapshot, finals.keep())
    bus.route(topics.model_filter(), ModelSnapshot, snapshots.keep())
    bus.route(topics.job_state_filter(), JobState, states.keep())
    async with bus:
        if await subs.wait(lambda: name in subs.items, RETAINED_WAIT_S * 3):  # retained: at once, or not there
            await finals.wait(lambda: name in finals.items or name in snapshots.items, timeout_s)
        await states.wait(lambda: name in states.items, RETAINED_WAIT_S)
    sub: JobSubmission | None = subs.items.get(name)
    if sub is None:
        raise EdgeMeshError(f"no job {name!r} on {config.broker.url}")
    spec = parse_job(sub.source, origin=f"job {name}")
    snap: ModelSnapshot | None = finals.items.get(name) or snapshots.items.get(name)
    if snap is None or snap.model_spec != spec.model_key:
        raise EdgeMeshError(f"job {name!r} has no model on {config.broker.url} yet")
    return spec, snap, states.items.get(name)


async def export(config: Config, name: str, *, fmt: str, out: str, search_path: list[str], timeout_s: float,
                 trust_code: bool = False) -> int:
    """Write the job's model as ``fmt`` to ``out`` with its card. An entry-point model is rebuilt only with
    ``trust_code`` (``--trust-code``), from ``search_path`` then the job's ``model.module_path``."""
    from edgemesh.common import models
    from edgemesh.operator.export import (
        ModelCard,
        check_onnx,
        export_model,
        normalization,
        trusted_model_spec,
        write_card,
    )

    spec, snap, state = await fetch_model(config, name, timeout_s=timeout_s)
    trusted_model_spec(spec, trust_code=trust_code, search_path=[*search_path, spec.model.module_path],
                       where=f"job {name!r}", otherwise="an export in any format, ONNX included, builds the model "
                       "from that code (the ONNX file it writes then runs without it)")
    module = models.build_model(spec.model_key)
    models.set_params(module, {k: t.to_numpy() for k, t in snap.tensors.items()})
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    path = export_model(module, spec.model.input_shape, fmt, out)
    if fmt == "onnx":
        error = check_onnx(module, spec.model.input_shape, path)
        print(f"onnxruntime logits match torch within {error:.2e}")
    mean, std = normalization(module)
    # the accuracy of this very model: the state's, when it is about the version kept (a running job's latest
    # snapshot is usually newer than its latest evaluation)
    accuracy = state.accuracy if state is not None and state.model_version == snap.version else None
    card = ModelCard(job=name, classes=spec.model.classes, input_shape=spec.model.input_shape,
                     mean=mean, std=std, accuracy=accuracy,
                     version=snap.version, job_sha256=spec.sha256, format=fmt, file=path.name,
                     model_key=spec.model_key, exported_at=time.time(), job_source=spec.source)
    card_path = write_card(card, path)
    print(f"job {name}: model version {snap.version} written to {path} ({fmt}), card {card_path}")
    return 0


# --------------------------------------------------------------------------- the command


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh job ACTION``: submit, list, status, pause, resume, stop, export."""
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = sub.add_parser("submit", help="validate a job file and submit it to the running services")
    p.add_argument("file", help="the job file (TOML)")
    p.add_argument("--check", action="store_true", help="validate and build the model only; publish nothing")
    p.add_argument("--module-path", action="append", default=[],
                   help="a directory to import an entry-point model from, on this machine (repeatable); the "
                        "module must be one models.allowed allows")
    p.add_argument("--wait", type=float, default=ANSWER_WAIT_S, help="seconds to wait for the job to be queued")
    sub.add_parser("list", help="every job on the broker and its state")
    p = sub.add_parser("status", help="a job's state, followed with a progress bar until it ends")
    p.add_argument("name")
    p.add_argument("--once", action="store_true", help="print the state once and exit")
    p.add_argument("--timeout", type=float, default=0.0, help="stop following after this many seconds (0 = never)")
    for action in ("pause", "resume", "stop"):
        p = sub.add_parser(action, help=f"{action} a job")
        p.add_argument("name")
        p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    p = sub.add_parser("export", help="write a job's trained model (and its model card)")
    p.add_argument("name")
    p.add_argument("--format", dest="fmt", choices=("onnx", "safetensors", "torch"), default="onnx")
    p.add_argument("--out", required=True, help="the model file to write")
    p.add_argument("--module-path", action="append", default=[],
                   help="with --trust-code: a directory to import an entry-point model from (repeatable)")
    p.add_argument("--trust-code", action="store_true",
                   help="import the entry point the job names (Python code: only for a job whose code you trust)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the model")
    for action_parser in sub.choices.values():
        cli.config_flags(action_parser)
    parser.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    config = cli.load(args)
    cli.setup_logging(config.log_level if args.log_level else "WARNING")
    try:
        match args.action:
            case "submit":
                spec, submission = prepare(args.file, module_path=args.module_path, trust=config.models)
                if args.check:
                    print(f"{args.file}: job {spec.name} is valid (model {spec.model_key}, "
                          f"{submission.params:,} parameters)")
                    return 0
                return asyncio.run(submit(config, spec, submission, wait_s=args.wait))
            case "list":
                return asyncio.run(list_jobs(config))
            case "status":
                return asyncio.run(status(config, args.name, once=args.once, timeout_s=args.timeout))
            case "pause" | "resume" | "stop":
                return asyncio.run(command(config, args.name, args.action, timeout_s=args.timeout))
            case "export":
                return asyncio.run(export(config, args.name, fmt=args.fmt, out=args.out, search_path=args.module_path,
                                          timeout_s=args.timeout, trust_code=args.trust_code))
    except JobError as exc:
        print(f"edgemesh job: {exc.origin} is not a valid job:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    return 2

