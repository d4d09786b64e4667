"""``simulate``: one run of a fleet under one policy on the virtual clock, and its result.

A run reads top to bottom as the fleet lives it:

1. the planner's first plan names every device (the run's clock starts there, as ``bench fleet``'s does) and each
   device holds version 0;
2. a device starts a step on the newest model it holds (after a ``resync`` ack, one at least as new as the ack
   names): a real gradient on a batch of its shard, the plan's batch size; the step lasts its FLOPs over the
   board's training rate, throttled spells slowing it (``Board.step_end``);
3. its update, encoded under its codec, goes up its link (stalls and drop-outs hold it) to the parameter server,
   whose scheduler, aggregation and optimizer (:mod:`edgemesh.simulate.server`) judge and apply it, one update
   after another, taking ``ps_update_s`` for each and ``ps_broadcast_s`` for each model it publishes;
4. every model message goes down every device's link in turn (``Downlink``), and the acks behind the models
   published before them;
5. a device that drops out is left out of a new plan once the planner notices (``detect_s``), and is planned in
   again, with a fresh snapshot, ``detect_s`` after it is back; every ``planner.rebalance_interval_s`` the planner
   re-balances batches to the speeds the devices' stats would report;
   under ``planner.parallelism = "mesh"`` the plan is the planner's training grid, and a model-parallel cluster
   steps as one (``Crew``): its first member starts the cluster's step once every member holds the model, the
   step lasts as its members' shares of each layer and their exchanges do, and the update is the whole model's
   gradient on the cluster's batch (what the cluster computes together), its rows pushed by each member;
6. every ``eval_interval_s`` the model, if it moved, is evaluated on the held-out split.

The run is seeded: the scenario's timelines, the model's initial weights, the partition, every batch and every
dropout draw, so the same settings give the same trajectory.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

import numpy as np

from edgemesh.bench.fleet import (
    BATCH,
    DEFAULT_BUDGET_S,
    DEFAULT_FLEET,
    DEFAULT_TARGET,
    EVAL_INTERVAL_S,
    FINAL_EVALUATIONS,
    MODEL,
    staleness_bound,
)
from edgemesh.bench.runs import device_names, fleet_profiles
from edgemesh.common.config import Config, load_config
from edgemesh.common.data import BatchIterator, Dataset, load_dataset, split_indices
from edgemesh.common.emulation.dynamics import Timeline
from edgemesh.common.emulation.profiles import DeviceProfile
from edgemesh.common.emulation.scenarios import Scenario, load_scenarios
from edgemesh.common.errors import ConfigError
from edgemesh.common.messages import GradientUpdate, Plan, PlanDevice
from edgemesh.common.vocabulary import CODECS, SYNC_POLICIES, CodecName, SyncPolicy
from edgemesh.services.parameter_server.scheduler import Ack
from edgemesh.services.worker.trainer import shard_weights
from edgemesh.simulate import job as simulated_job
from edgemesh.simulate.events import EventQueue
from edgemesh.simulate.fleet import Board, Crew, Downlink, Planner, check_mesh
from edgemesh.simulate.model import Encoder, SharedModel
from edgemesh.simulate.reference import FEDBUFF_SHARE, REFERENCE_POLICIES, ReferencePolicy
from edgemesh.simulate.server import VERSIONS_KEPT, Server

TIMER_SLACK_S = 1e-9
"""Virtual seconds past a scheduler's deadline it is asked again: float rounding would leave it just short."""

Policy = SyncPolicy | ReferencePolicy
"""What a run's parameter server follows: a service policy, or a peer's rule for comparison (``reference.py``)."""
POLICIES: tuple[Policy, ...] = (*SYNC_POLICIES, *REFERENCE_POLICIES)
Parallelism = Literal["data", "mesh"]
PARALLELISMS: tuple[Parallelism, ...] = ("data", "mesh")


@dataclass(frozen=True, slots=True, kw_only=True)
class SimSettings:
    """One simulated run: the fleet, its scenario and policy, the seed, and what the run measures."""

    fleet: tuple[str, ...] = DEFAULT_FLEET
    """Device profiles, one per device (``profiles.toml``)."""
    scenario: str = "steady"
    policy: Policy = "sync"
    parallelism: Parallelism | None = None
    """``planner.parallelism`` of the run (None: the configuration's, or the job's)."""
    seed: int = 0
    """Seeds the scenario's timelines, the initial weights, the partition and every batch."""
    lr: float | None = None
    """The learning rate (None: ``training.lr`` of the configuration)."""
    target: float = DEFAULT_TARGET
    budget_s: float = DEFAULT_BUDGET_S
    """Virtual (board) seconds of training."""
    eval_interval_s: float = EVAL_INTERVAL_S
    """Evaluate the model, if it moved, every this many virtual seconds."""
    codec: CodecName | None = None
    """Every device's gradient codec (None: ``compressor.default_codec``, what a device is given before the
    compressor's adaptive policy speaks)."""
    detect_s: float | None = None
    """Virtual seconds from a drop-out (or a return) to the planner's new plan (None: ``planner.replan_debounce_s``:
    the broker publishes the will as the connection resets, and the planner debounces)."""
    overrides: Mapping[str, str] = field(default_factory=dict)
    """Settings by dotted key, as ``--set`` gives them (``ps.round_scaling``, ``training.momentum``, ...)."""
    stop_at_target: bool = False
    """End the run at the first evaluation at or above ``target`` (a search for a learning rate)."""
    compute_scale: tuple[float, ...] = ()
    """One factor per device on its board's training rate (empty: every board at its profile's rate): a fleet whose
    speeds the profiles do not list, such as ``fleet.straggler_fleet``'s spread of one profile."""
    buffer_share: float = FEDBUFF_SHARE
    """``fedbuff``: the buffer ``K`` as a share of the plan's devices."""
    wall_limit_s: float | None = None
    """End the run after this many wall seconds (a scale trial that must not run for hours); None: no limit."""
    job_file: str = ""
    """A user's job file: its model, settings and data instead of ``bench fleet``'s (``simulate/job.py``)."""
    data_dir: str = ""
    """The folder the job's data paths are relative to ('': ``worker.data_dir``)."""
    boards: Mapping[str, DeviceProfile] = field(default_factory=dict)
    """Boards ``fleet`` may name beside the profiles (``simulate --live``: a running job's devices as measured)."""
    ps_update_s: float = 0.0
    """Virtual seconds the parameter server spends on each update it receives (the bus's delivery, decoding,
    applying, logging, acking and publishing), one update after another; 0: none, the server answers at the update's
    arrival. docs/simulation.md gives what ``bench fleet`` measured."""
    ps_broadcast_s: float = 0.0
    """Virtual seconds the parameter server spends on each model it publishes (encoding the delta, handing it to the
    bus) before it takes its next update; the model goes out, and the step's acks after it, when that is done. 0:
    none. Under ``async`` every update is a version, so this is a cost per update there and a cost per round under
    ``sync``."""


@dataclass(frozen=True, slots=True)
class SimRun:
    """What one run measured (virtual seconds throughout)."""

    policy: Policy
    seed: int
    time_to_target_s: float | None
    final_accuracy: float | None
    """Mean of the last ``FINAL_EVALUATIONS`` evaluations."""
    best_accuracy: float
    versions: int
    updates: int
    """Updates applied."""
    discarded: dict[str, int]
    """Updates discarded, by reason."""
    steps_refused: int
    diverged: bool
    """The last evaluation's loss is not finite, or its accuracy fell more than ``ps.guard.accuracy_drop`` below the
    best."""
    curve: list[tuple[float, int, float, float]]
    """(virtual seconds, version, accuracy, loss) of every evaluation."""
    gradients: int
    """Steps the devices computed (applied or not)."""
    elapsed_s: float
    wall_s: float
    plans: int
    details: dict[str, Any] = field(default_factory=dict)
    parallelism: Parallelism = "data"

    def summary(self) -> dict[str, Any]:
        """The run as JSON-ready figures."""
        return {"policy": self.policy, "parallelism": self.parallelism, "seed": self.seed,
                "time_to_target_s": self.time_to_target_s,
                "final_accuracy": self.final_accuracy, "best_accuracy": self.best_accuracy,
                "versions": self.versions, "updates": self.updates, "discarded": dict(self.discarded),
                "steps_refused": self.steps_refused, "diverged": self.diverged, "gradients": self.gradients,
                "seconds_per_version": round(self.elapsed_s / self.versions, 4) if self.versions else None,
                "elapsed_s": round(self.elapsed_s, 3), "wall_s": round(self.wall_s, 2), "plans": self.plans,
                **self.details,
                "curve": [[round(t, 3), v, round(a, 4), round(loss, 4) if math.isfinite(loss) else None]
                          for t, v, a, loss in self.curve]}


def sim_config(settings: SimSettings, devices: int) -> Config:
    """The services' configuration of a run: ``bench fleet``'s (its model and batch, its staleness bound, balanced
    batches), or a user's job's, then the user's settings, then the run's policy, seed and
    learning rate."""
    if settings.job_file:
        run: dict[str, object] = {"sync_policy": service_policy(settings.policy), "seed": settings.seed}
        if settings.lr is not None:
            run["lr"] = settings.lr
        planner: dict[str, object] = {"parallelism": settings.parallelism} if settings.parallelism else {}
        return simulated_job.config(settings.job_file, dict(settings.overrides), {"training": run, "planner": planner})
    overrides = {"training.model_spec": MODEL, "training.batch_size": str(BATCH),
                 "training.staleness_bound": str(staleness_bound(settings.policy, devices)),
                 "planner.batching": "balanced",
                 **settings.overrides, "training.sync_policy": service_policy(settings.policy),
                 "training.seed": str(settings.seed)}
    if settings.lr is not None:
        overrides["training.lr"] = repr(settings.lr)
    if settings.parallelism:
        overrides["planner.parallelism"] = settings.parallelism
    return load_config(env={}, overrides=overrides)


def service_policy(policy: Policy) -> SyncPolicy:
    """The service policy the configuration names for ``policy`` (a reference policy's nearest: ``async``, whose
    workers never wait for a round)."""
    return "async" if policy in REFERENCE_POLICIES else cast(SyncPolicy, policy)


def check(settings: SimSettings) -> None:
    """ConfigError naming what ``settings`` get wrong that the configuration does not check."""
    _check_names(settings)
    if settings.compute_scale and (len(settings.compute_scale) != len(settings.fleet)
                                   or not all(f > 0 for f in settings.compute_scale)):
        raise ConfigError("compute_scale needs one factor > 0 per device of the fleet")
    if not 0 < settings.buffer_share <= 1:
        raise ConfigError("buffer_share must be in (0, 1]")
    if not settings.fleet:
        raise ConfigError("the fleet needs at least one device")
    if not (settings.budget_s > 0 and settings.eval_interval_s > 0 and 0 < settings.target <= 1):
        raise ConfigError("the budget and evaluation interval must be > 0, the target in (0, 1]")
    if settings.lr is not None and not settings.lr > 0:
        raise ConfigError("the learning rate must be > 0")
    if not (math.isfinite(settings.ps_update_s) and settings.ps_update_s >= 0):
        raise ConfigError("the parameter server's seconds per update must be >= 0")
    if not (math.isfinite(settings.ps_broadcast_s) and settings.ps_broadcast_s >= 0):
        raise ConfigError("the parameter server's seconds per published model must be >= 0")


def _check_names(settings: SimSettings) -> None:
    """ConfigError for a policy, parallelism or codec ``settings`` names that does not exist."""
    if settings.policy not in POLICIES:
        raise ConfigError(f"unknown policy {settings.policy!r}; known: {', '.join(POLICIES)}")
    if settings.parallelism is not None and settings.parallelism not in PARALLELISMS:
        raise ConfigError(f"unknown parallelism {settings.parallelism!r}; known: {', '.join(PARALLELISMS)}")
    if settings.codec is not None and settings.codec not in CODECS:
        raise ConfigError(f"unknown codec {settings.codec!r}; known: {', '.join(CODECS)}")


@dataclass(slots=True)
class Device:
    """One simulated device: its board and downlink, its worker's codec, plan share, batches and step state."""

    index: int
    board: Board
    downlink: Downlink
    encoder: Encoder
    me: PlanDevice | None = None
    batches: BatchIterator | None = None
    shard_key: tuple[Any, ...] | None = None
    seq: int = 0
    busy: bool = False
    """A step computing, or its update not answered yet: the worker waits for its ack before the next."""
    wanted: int = 0
    """The version the next step must start from at least (an ack's ``resync``)."""
    left: bool = False
    """Out of the plans since a drop-out the planner noticed."""


@dataclass(frozen=True, slots=True)
class Hardware:
    """What a run's fleet is made of: its configuration, boards (timelines seeded), scenarios and device names.
    ``bench policies`` replays the same boards in ``bench headroom``'s idealized fleets."""

    cfg: Config
    boards: dict[str, Board]
    scenarios: Mapping[str, Scenario]
    names: list[tuple[str, str]]
    """(device, profile) of every device."""


def hardware(settings: SimSettings) -> Hardware:
    """The boards of ``settings``' fleet in its scenario, seeded (ConfigError for an unknown profile or scenario)."""
    check(settings)
    overrides = dict(settings.overrides)
    profiles = fleet_profiles(list(settings.fleet), settings.fleet[0], overrides, settings.boards)
    scenarios = load_scenarios(overrides.get("worker.emulation_scenarios") or None, profiles=set(profiles))
    if settings.scenario not in scenarios:
        raise ConfigError(f"unknown scenario {settings.scenario!r}; known: {', '.join(sorted(scenarios))}")
    scenario = scenarios[settings.scenario]
    names = device_names(list(settings.fleet))
    cfg = sim_config(settings, len(names))
    check_mesh(cfg)
    scale = settings.compute_scale or (1.0,) * len(names)
    boards = {name: Board.of(name, profiles[p], Timeline.of(scenario, p, name, settings.seed),
                             cfg.training.model_spec, scale=f)
              for (name, p), f in zip(names, scale, strict=True)}
    return Hardware(cfg, boards, scenarios, names)


class Simulation:
    """One run (module docstring)."""

    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        fleet = hardware(settings)
        self.cfg = cfg = fleet.cfg
        t = cfg.training
        self.detect_s = cfg.planner.replan_debounce_s if settings.detect_s is None else settings.detect_s
        codec: CodecName = settings.codec or cfg.compressor.default_codec
        self.boards = fleet.boards
        self.train, self.test = (
            simulated_job.data(settings.job_file, settings.data_dir or cfg.worker.data_dir, t.seed)
            if settings.job_file else load_dataset(t.dataset, t.dataset_path or None, seed=t.seed))
        self.model = SharedModel(t.model_spec, t.seed)
        self.server = Server(cfg, settings.policy, self.model.initial(), buffers=self.model.buffers,
                             momenta=self.model.momenta, classes=self.test.num_classes,
                             buffer_share=settings.buffer_share)
        self.planner = Planner(cfg, self.boards, codec)
        self.devices = {name: Device(i, b, Downlink(b, self.server.published),
                                     Encoder(name, codec, cfg.compressor.static_density))
                        for i, (name, b) in enumerate(self.boards.items())}
        self.present = set(self.devices)
        self.plan: Plan | None = None
        self.queue = EventQueue()
        self.waiting: set[str] = set()
        """Devices waiting for a version not yet published."""
        self.timer_at: float | None = None
        self.curve: list[tuple[float, int, float, float]] = []
        self.gradients = 0
        self.plans = 0
        self.ps_free_at = 0.0
        """When the parameter server is done with its last turn, the models it published included."""
        self.inbox: deque[tuple[GradientUpdate, int]] = deque()
        """Updates through the link that the parameter server has not finished (``ps_update_s``), oldest first."""
        self.crews: dict[str, tuple[str, ...]] = {}
        """The members of every model-parallel cluster of the plan, by its first member (who steps for it)."""
        self.crew_boards: dict[str, Crew] = {}
        self.passengers: set[str] = set()
        """Members of a model-parallel cluster other than its first: they step only as part of its steps."""

    # ------------------------------------------------------------------ the run
    def run(self) -> SimRun:
        started = time.perf_counter()
        s = self.settings
        self.server.publish_snapshot(0.0)  # the retained model every device holds when the run's clock starts
        for d in self.devices.values():
            d.downlink.join(len(self.server.published), held=0)
        self._replan(self.planner.plan(self.present, 0.0, "start"), 0.0)
        for name, board in self.boards.items():
            for drop in board.drops(s.budget_s):
                self.queue.at(drop.start_s + self.detect_s, functools.partial(self._on_leave, name))
        self._every(s.eval_interval_s, self._evaluate)
        self._every(self.cfg.planner.rebalance_interval_s, self._rebalance)
        self._evaluate(0.0)
        deadline = math.inf if s.wall_limit_s is None else started + s.wall_limit_s
        self.queue.run_until(s.budget_s, stop=lambda: (s.stop_at_target and self._reached() is not None)
                             or time.perf_counter() > deadline)
        if not self.curve or self.curve[-1][1] != self.server.version:
            self._evaluate(self.queue.now)
        return self._result(time.perf_counter() - started)

    def _every(self, interval: float, action: Callable[[float], None]) -> None:
        def tick(t: float) -> None:
            action(t)
            self.queue.at(t + interval, tick)
        self.queue.at(interval, tick)

    # ------------------------------------------------------------------ devices
    def _members(self, name: str) -> tuple[str, ...]:
        """The devices a step of ``name`` takes: its cluster's members if it steps for a model-parallel one."""
        return self.crews.get(name, (name,))

    def _start(self, name: str, t: float) -> None:
        """``name`` starts its next step if it may: in the plan, answered, connected, holding the model it needs
        (a model-parallel cluster's first member: every member connected and holding it)."""
        d = self.devices[name]
        if d.busy or d.me is None or self.plan is None or name in self.passengers:
            return
        members = [self.devices[m] for m in self._members(name)]
        drop = next((e for m in members if (e := m.board.out_at(t)) is not None), None)
        if drop is not None:  # out: it computes nothing until it is back
            self.queue.at(drop.end_s, functools.partial(self._start, name))
            return
        wanted = max(m.wanted for m in members)
        whens = [m.downlink.when(wanted) for m in members]
        if any(w is None for w in whens):
            self.waiting.add(name)
            return
        when = max(w for w in whens if w is not None)
        if when > t:
            self.queue.at(when, functools.partial(self._start, name))
            return
        self._step(d, t)

    def _step(self, d: Device, t: float) -> None:
        """A real gradient on the model ``d`` holds; its update leaves when the step is done and arrives when its
        bytes are through the link."""
        assert d.me is not None and d.batches is not None and self.plan is not None
        base = min(self.devices[m].downlink.holds(t) for m in self._members(d.me.device))
        x, y = next(d.batches)
        d.seq += 1
        update = self.model.update(base, self.server.held[base], x, y, _seed(self.settings.seed, d.index, d.seq))
        message, nbytes = d.encoder.encode(update, plan=self.plan, me=d.me, seq=d.seq, base_version=base,
                                           samples=len(y))
        d.busy = True
        self.gradients += 1
        unit: Board | Crew = self.crew_boards.get(d.me.device, d.board)
        arrives = unit.upload_end(unit.step_end(t, len(y)), nbytes)
        self.queue.at(arrives, functools.partial(self._arrive, message, nbytes))

    def _arrive(self, message: GradientUpdate, nbytes: int, t: float) -> None:
        """An update's bytes are through: the parameter server takes it once done with those before it (and with
        the models it published), ``ps_update_s`` each."""
        s = self.settings
        if s.ps_update_s <= 0 and s.ps_broadcast_s <= 0:
            self._answer(self.server.receive(message, nbytes, t), t)
            return
        self.inbox.append((message, nbytes))
        if len(self.inbox) == 1:  # the server is idle, or publishing: this update is its next
            self.queue.at(max(t, self.ps_free_at) + s.ps_update_s, self._serve)

    def _serve(self, t: float) -> None:
        """The parameter server is done with its oldest update: its turn, then the next update's."""
        message, nbytes = self.inbox[0]
        done = self._turn(lambda: self.server.receive(message, nbytes, t), t)
        self.inbox.popleft()
        if self.inbox:
            self.queue.at(done + self.settings.ps_update_s, self._serve)

    def _turn(self, turn: Callable[[], list[Ack]], t: float, since: int | None = None) -> float:
        """One turn of the parameter server at ``t``: the models it publishes (from message ``since`` on, if the
        turn already ran) go out ``ps_broadcast_s`` apart, after anything it was still publishing, and its acks after
        them (the service acks a step once its model is handed to the bus). When it is done."""
        first = len(self.server.published) if since is None else since
        acks = turn()
        published, done = self.server.published, t
        if self.settings.ps_broadcast_s > 0 and len(published) > first:
            done = max(t, self.ps_free_at)
            for i in range(first, len(published)):
                done += self.settings.ps_broadcast_s
                published[i] = replace(published[i], at=done)
        self.ps_free_at = max(self.ps_free_at, done)
        if done > t:
            self.queue.at(done, functools.partial(self._answer, acks))
        else:
            self._answer(acks, t)
        return done

    def _on_ack(self, name: str, ack: Ack, version: int, t: float) -> None:
        d = self.devices[name]
        if ack.update.seq == d.seq:
            d.busy = False
        if ack.resync:
            d.wanted = max(d.wanted, version)
        self._start(name, t)

    def _on_leave(self, name: str, t: float) -> None:
        """The planner noticed the drop-out of ``name`` (if it is still out): a plan without it; its return is
        planned ``detect_s`` after it is back."""
        drop = self.boards[name].out_at(t)
        if drop is None or name not in self.present:
            return
        self.present.discard(name)
        self.devices[name].left = True
        self._replan(self.planner.plan(self.present, t, "leave"), t)
        self.queue.at(drop.end_s + self.detect_s, functools.partial(self._on_join, name))

    def _on_join(self, name: str, t: float) -> None:
        """``name`` is back: it asks for the model whole (it missed deltas), and the planner plans it in."""
        d = self.devices[name]
        self.present.add(name)
        d.left = False
        d.downlink.join(self.server.publish_snapshot(t))
        d.wanted = self.server.version
        self._replan(self.planner.plan(self.present, t, "join"), t)

    # ------------------------------------------------------------------ the planner and the parameter server
    def _replan(self, plan: Plan, t: float) -> None:
        """A plan reaches the devices (each takes its shard of the data) and the parameter server."""
        self.plan = plan
        self.plans += 1
        members = {m.device: m for m in plan.devices}
        self._crew(plan)
        indices: list[np.ndarray] | None = None
        for name, d in self.devices.items():
            d.me = members.get(name)
            if d.me is None:
                continue
            key = (d.me.shard_index, d.me.shard_count, shard_weights(plan))
            if key != d.shard_key:
                if indices is None:
                    indices = split_indices(self.train.y, d.me.shard_count, scheme=plan.partition,
                                            alpha=plan.partition_alpha, seed=plan.seed, weights=key[2])
                part = indices[d.me.shard_index]
                data = Dataset(f"{self.train.name}[{key[0]}/{key[1]}]", self.train.x[part], self.train.y[part],
                               self.train.num_classes)
                d.batches = BatchIterator(data, d.me.batch_size, seed=_seed(self.settings.seed, d.index, plan.version))
                d.shard_key = key
            assert d.batches is not None
            d.batches.batch_size = d.me.batch_size
        self._turn(lambda: self.server.replanned(plan, t), t)
        for name in members:
            self._start(name, t)

    def _crew(self, plan: Plan) -> None:
        """The model-parallel clusters of ``plan``: who steps for each, and how long its steps take."""
        self.crews, self.crew_boards, self.passengers = {}, {}, set()
        for c in plan.clusters:
            if len(c.members) > 1:
                lead = c.members[0]
                self.crews[lead] = tuple(c.members)
                self.crew_boards[lead] = Crew.of(c, self.boards, {m: self.planner.info(m) for m in c.members},
                                                 plan.model_spec, self.planner.wire)
                self.passengers.update(c.members[1:])

    def _rebalance(self, t: float) -> None:
        plan = self.planner.rebalance(t)
        if plan is not None:
            self._replan(plan, t)

    def _answer(self, acks: list[Ack], t: float) -> None:
        """After the parameter server's turn: its acks on their way, its scheduler's next deadline, the devices
        waiting for a version that is out now, and the weights no device can start from dropped."""
        version = self.server.version
        for ack in acks:  # behind the models published before it, on each member's downlink
            name = ack.update.device
            answered = max(self.boards[m].message_end(self.devices[m].downlink.free_after(t))
                           for m in self._members(name))
            self.queue.at(answered, functools.partial(self._on_ack, name, ack, version))
        timeout = self.server.timeout(t)
        if timeout is not None and self.timer_at != t + timeout + TIMER_SLACK_S:
            self.timer_at = t + timeout + TIMER_SLACK_S
            self.queue.at(self.timer_at, self._on_timer)
        for name in list(self.waiting):
            if self.devices[name].downlink.when(self.devices[name].wanted) is not None:
                self.waiting.discard(name)
                self._start(name, t)
        if len(self.server.versions) > VERSIONS_KEPT:
            self.server.forget_before(min((d.downlink.held for d in self.devices.values()
                                           if d.me is not None and not d.left), default=version))

    def _on_timer(self, t: float) -> None:
        if self.timer_at != t:
            return  # a deadline since moved
        self.timer_at = None
        self._turn(lambda: self.server.take([], t), t)

    # ------------------------------------------------------------------ evaluation and the result
    def _evaluate(self, t: float) -> None:
        version = self.server.version
        if self.curve and self.curve[-1][1] == version:
            return
        loss, accuracy = self.model.evaluate(version, self.server.versions[version], self.test)
        self.curve.append((t, version, accuracy, loss))
        since = len(self.server.published)
        if self.server.evaluated(version, loss, accuracy, t):  # rolled back: the best model goes out whole
            self._turn(list, t, since)

    def _reached(self) -> float | None:
        return next((t for t, _, a, _ in self.curve if a >= self.settings.target), None)

    def _result(self, wall_s: float) -> SimRun:
        s, counts, curve = self.settings, self.server.counts, self.curve
        last = [a for _, _, a, _ in curve[-FINAL_EVALUATIONS:]]
        best = max(a for _, _, a, _ in curve)
        _, _, final_acc, final_loss = curve[-1]
        diverged = not math.isfinite(final_loss) or final_acc < best - self.cfg.ps.guard.accuracy_drop
        first = self.planner.first
        return SimRun(
            policy=s.policy, parallelism=self.cfg.planner.parallelism, seed=s.seed, time_to_target_s=self._reached(),
            final_accuracy=round(statistics.fmean(last), 4), best_accuracy=round(best, 4),
            versions=self.server.version, updates=counts.accepted, discarded=dict(sorted(counts.discarded.items())),
            steps_refused=counts.steps_refused, diverged=diverged, curve=curve, gradients=self.gradients,
            elapsed_s=self.queue.now, wall_s=wall_s, plans=self.plans,
            details={"lr": self.cfg.training.lr, "rollbacks": self.server.guard.rollbacks,
                     "final_lr": self.server.lr,
                     "mean_delay": round(statistics.fmean(counts.delays), 3) if counts.delays else None,
                     "updates_by_device": dict(sorted(counts.by_device.items())),
                     "batch_sizes": {d.device: d.batch_size for d in first.devices} if first else {},
                     "round_time_s": round(first.round_time_s, 4) if first else None,
                     "bytes_up": counts.bytes_in, "bytes_down": counts.bytes_out})


def _seed(*parts: int) -> int:
    """A seed for one draw of one device (``hash`` of a string is not stable across processes)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def simulate(settings: SimSettings) -> SimRun:
    """One run of ``settings`` on the virtual clock (ConfigError for an unknown profile, scenario, policy or codec,
    or a bad setting)."""
    return Simulation(settings).run()
