"""The simulated fleet's boards, links and planner: what a device's step and transfers take on the virtual clock,
and the plans the planner would publish for it.

* :class:`Board`: a profile's training rate and links, slowed and held by its scenario's seeded timeline (the
  functions of :mod:`edgemesh.common.emulation.dynamics` the emulated boards themselves follow).
* :class:`Downlink`: the models a device receives, in publication order, one after the other over its downlink,
  and the acks after the models published before them (an ack waits behind them on the link, as on the emulated
  link, where one relay carries the broker's messages to the device in order). Worked out lazily (only when the
  device asks what it holds, or is answered), so a broadcast to 1,000 devices costs nothing until each of them
  starts a step.
* :class:`Planner`: the planner's data-parallel plan of the devices present (``layout.plan_data_parallel``) with
  batches from ``batching`` (balanced to the speeds a device's stats would report, or uniform), re-planned when a
  device leaves or comes back and, like the planner's re-balance, when measured speeds move a batch enough; under
  ``planner.parallelism = "mesh"`` the planner's training grid (``stability.Rule.lay_out``, as the service lays it
  out) of those devices, laid out again when one leaves or comes back.
* :class:`Crew`: a model-parallel cluster of the plan as one unit of work: its members compute their filters of
  every layer, each on its own board, and meet at every layer's exchange over their own links (the cost model's
  all-gather and reduce-scatter, ``member_cost.layer_coefficients``); each pushes its rows of the update.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from edgemesh.common import costs
from edgemesh.common.codecs import bytes_per_value
from edgemesh.common.config import Config
from edgemesh.common.costs import LayerCost
from edgemesh.common.emulation.dynamics import Episode, Timeline
from edgemesh.common.emulation.profiles import DeviceProfile
from edgemesh.common.messages import Plan, PlanCluster
from edgemesh.common.vocabulary import Batching, CodecName
from edgemesh.services.planner import batching, stability
from edgemesh.services.planner.layout import batch_sizes, plan_data_parallel, plan_mesh
from edgemesh.services.planner.mesh import DeviceInfo, wire_for
from edgemesh.services.planner.mesh.member_cost import Wire, layer_coefficients
from edgemesh.services.planner.planning import batching_in_force, mesh_refusal


@dataclass(frozen=True, slots=True)
class Board:
    """One device: its profile and its scenario's timeline (board seconds since the run's start)."""

    name: str
    profile: DeviceProfile
    timeline: Timeline
    samples_per_s: float
    """Training samples per second at full speed: the step's FLOPs over the board's training rate
    (``train_gflops x TRAIN_EFFICIENCY``, as ``bench headroom`` replays it)."""

    @classmethod
    def of(cls, name: str, profile: DeviceProfile, timeline: Timeline, model_spec: str, *,
           scale: float = 1.0) -> Board:
        """``scale``: a factor on the profile's training rate (a board the profiles do not list)."""
        rate = profile.train_gflops * 1e9 * costs.TRAIN_EFFICIENCY / costs.cost(model_spec).train_flops_per_sample
        return cls(name, profile, timeline, rate * scale)

    def step_end(self, start: float, samples: float) -> float:
        """When a step of ``samples`` begun at ``start`` ends, throttled spells slowing it."""
        return self.timeline.work_end(start, samples / self.samples_per_s)

    def upload_end(self, start: float, nbytes: int) -> float:
        """When ``nbytes`` handed to the uplink at ``start`` have arrived (stalls and drop-outs hold them)."""
        return self.timeline.transfer_end(start, nbytes / self.profile.uplink_bps) + self.profile.latency_s

    def download_end(self, start: float, nbytes: int) -> tuple[float, float]:
        """(when the downlink is free again, when the device holds the bytes) for ``nbytes`` sent from ``start``."""
        sent = self.timeline.transfer_end(start, nbytes / self.profile.downlink_bps)
        return sent, sent + self.profile.latency_s

    def message_end(self, start: float) -> float:
        """When a small message (an ack, a plan) sent at ``start`` arrives: after any stall, one latency."""
        return self.timeline.blocked_until(start) + self.profile.latency_s

    def out_at(self, t: float) -> Episode | None:
        """The drop-out under way at ``t``, if any."""
        return self.timeline.drop_between(t, t)

    def drops(self, until: float) -> list[Episode]:
        """The drop-outs that begin before ``until``."""
        return self.timeline.until(until, ("drop",))


@dataclass(frozen=True, slots=True)
class Crew:
    """A model-parallel cluster of the plan (module docstring): its members' boards, in the plan's member order, and
    the units of every layer each holds (the plan's filter division). A step of the whole cluster's batch lasts, layer
    by layer, as long as its slowest member's share of the layer's compute and exchange there."""

    members: tuple[Board, ...]
    infos: tuple[DeviceInfo, ...]
    """What the planner planned the members with (their links set the exchanges' times)."""
    held: tuple[tuple[int, ...], ...]
    """Units of every layer (forward order) each member holds."""
    work: tuple[tuple[float, ...], ...]
    """Each member's share of a whole step's compute on every layer (its units' multiply-adds over the model's)."""
    pushed: tuple[float, ...]
    """Each member's share of the update's values (its rows)."""
    layers: tuple[LayerCost, ...]
    wire: Wire

    @classmethod
    def of(cls, cluster: PlanCluster, boards: Mapping[str, Board], infos: Mapping[str, DeviceInfo], spec: str,
           wire: Wire) -> Crew:
        layers = costs.layers(spec)
        counts = cluster.counts
        held = tuple(tuple(counts[layer.name][i] if layer.name in counts else layer.units for layer in layers)
                     for i in range(len(cluster.members)))
        macs = sum(layer.units * layer.macs_per_unit for layer in layers) or 1
        params = sum(layer.units * layer.params_per_unit for layer in layers) or 1
        work = tuple(tuple(n * layer.macs_per_unit / macs for n, layer in zip(h, layers, strict=True)) for h in held)
        pushed = tuple(sum(n * layer.params_per_unit for n, layer in zip(h, layers, strict=True)) / params
                       for h in held)
        return cls(tuple(boards[m] for m in cluster.members), tuple(infos[m] for m in cluster.members), held, work,
                   pushed, tuple(layers), wire)

    def step_end(self, start: float, samples: float) -> float:
        """When the cluster's step of ``samples`` begun at ``start`` ends: each layer begins when the last member is
        through the one before; a member computes its units' share of a whole step's work on its board (throttled
        spells slowing it), then its exchange there takes its link (stalls holding it)."""
        k = len(self.members)
        exchanges = [layer_coefficients(self.layers, replace(info, flops=math.inf), max(1, round(samples)), k,
                                        self.wire) for info in self.infos]  # no compute: the links' seconds only
        members = list(zip(self.members, self.held, self.work, exchanges, strict=True))
        t = start
        for li in range(len(self.layers)):
            ends = []
            for board, held, work, (const, weights, _) in members:
                computed = board.step_end(t, samples * work[li])
                ends.append(board.timeline.transfer_end(computed, const[li] + weights[li] * held[li]))
            t = max(ends)
        return t

    def upload_end(self, start: float, nbytes: int) -> float:
        """When every member's rows of an update of ``nbytes`` handed over at ``start`` have arrived."""
        return max(board.upload_end(start, round(nbytes * share))
                   for board, share in zip(self.members, self.pushed, strict=True))


def check_mesh(config: Config) -> bool:
    """Whether ``config`` plans a training grid (``planner.parallelism = "mesh"``); ConfigError, as the planner
    service says it, when the model has a layer the grid cannot divide (unless ``planner.mesh_fallback``: then,
    as the planner does, data parallel)."""
    return config.planner.parallelism == "mesh" and not mesh_refusal(config)


STRAGGLER_PROFILE = "laptop"
"""The board a straggler fleet spreads: its links are the fastest, so compute alone sets the spread."""


def straggler_fleet(devices: int = 8, spread: float = 10.0,
                    profile: str = STRAGGLER_PROFILE) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """A straggler-heavy fleet, as asynchronous federated learning studies it (FedBuff, FedAsync: client speeds
    over an order of magnitude): ``devices`` boards of one ``profile`` whose training rates fall geometrically from
    the profile's to ``1 / spread`` of it. (profiles, ``SimSettings.compute_scale``)."""
    if devices < 1 or spread < 1:
        raise ValueError("a straggler fleet needs >= 1 device and a spread >= 1")
    steps = max(1, devices - 1)
    return (profile,) * devices, tuple(spread ** (-i / steps) for i in range(devices))


@dataclass(frozen=True, slots=True)
class Published:
    """One model message the parameter server published: its version, when, its encoded size, and whether it is a
    snapshot (a device that joins starts from the latest one)."""

    version: int
    at: float
    nbytes: int
    snapshot: bool


class Downlink:
    """The model messages one device receives, in order, each sent once its link is free (module docstring)."""

    def __init__(self, board: Board, published: Sequence[Published]) -> None:
        self.board = board
        self.published = published
        self.held = -1
        """The newest version delivered so far (as far as worked out)."""
        self._next = len(published)
        self._free = 0.0
        self._free_before = 0.0
        """When the downlink was free before message ``_next``, once its delivery is worked out."""
        self._due: float | None = None
        """When message ``_next`` is delivered, once worked out."""

    def join(self, index: int, held: int = -1) -> None:
        """Receive from message ``index`` on (a snapshot: what a device that joins asks for), holding ``held``."""
        self._next, self._due, self.held = index, None, held

    def _delivery(self) -> float | None:
        if self._due is None and self._next < len(self.published):
            message = self.published[self._next]
            self._free_before = self._free
            self._free, self._due = self.board.download_end(max(message.at, self._free), message.nbytes)
        return self._due

    def _take(self) -> None:
        self.held = max(self.held, self.published[self._next].version)
        self._next, self._due = self._next + 1, None

    def holds(self, t: float) -> int:
        """The newest version delivered by ``t``."""
        while (due := self._delivery()) is not None and due <= t:
            self._take()
        return self.held

    def free_after(self, t: float) -> float:
        """When the downlink is through with every message published by ``t``: what a small message sent at ``t``
        (an ack) waits behind, since one link carries them in the order the broker sends them."""
        self.holds(t)
        free, i = self._free, self._next
        if self._due is not None:  # message _next is worked out: after it, unless it was published after t
            if self.published[i].at > t:
                return max(self._free_before, t)
            i += 1
        while i < len(self.published) and self.published[i].at <= t:
            free, _ = self.board.download_end(max(self.published[i].at, free), self.published[i].nbytes)
            i += 1
        return max(free, t)

    def when(self, version: int) -> float | None:
        """When the device holds ``version`` or a newer one; None if none is published yet."""
        while self.held < version:
            due = self._delivery()
            if due is None:
                return None
            if self.published[self._next].version >= version:
                return due
            self._take()
        return -math.inf


class Planner:
    """The plans the planner service would publish for the devices present (module docstring)."""

    def __init__(self, config: Config, boards: Mapping[str, Board], codec: CodecName) -> None:
        self.cfg = config
        self.boards = boards
        self.version = 0
        self.current: Plan | None = None
        self.first: Plan | None = None
        """The run's first plan (its batches are what a steady fleet trains with)."""
        spec = config.training.model_spec
        self.update_bytes = costs.cost(spec).params * bytes_per_value(codec, config.compressor.static_density)
        """An update's size as the planner's cost model charges it: the model's values at the codec's bytes each."""
        self.lag_s = config.worker.stats_interval_s
        """How old the speeds the planner balances on are: a device's stats come every this many seconds."""
        self.wire = wire_for(config)
        self.mesh = check_mesh(config)
        self.rule = stability.Rule.of(config.planner, spec=spec, batch=config.planner.round_samples
                                      or config.training.batch_size, wire=self.wire)
        """How the planner lays out its training grid (``planner.parallelism = "mesh"``)."""

    def speed(self, name: str, now: float) -> batching.DeviceSpeed:
        """What the planner measures of ``name`` (``SpeedTracker.speed``): the seconds per sample of its last
        stats, the upload of one update as the fixed part, the batch its memory holds."""
        b = self.boards[name]
        slowed = b.timeline.speed_at(max(0.0, now - self.lag_s))
        return batching.DeviceSpeed(device=name, sample_s=1.0 / (b.samples_per_s * slowed),
                                    fixed_s=self.update_bytes / b.profile.uplink_bps + b.profile.latency_s,
                                    max_batch=max(1, costs.max_batch_for_memory(self.cfg.training.model_spec,
                                                                                b.profile.memory_bytes)))

    def plan(self, present: Iterable[str], now: float, reason: str) -> Plan:
        """A new plan of ``present`` (``DataParallel.plan``), batches as ``planner.batching`` says; under mesh
        parallelism, the training grid of ``present`` (``MeshParallel.plan``)."""
        names = sorted(present)
        if self.mesh:
            return self._grid(names, now, reason)
        mode = batching_in_force(None, self.cfg)
        speeds = [self.speed(n, now) for n in names]
        p, t = self.cfg.planner, self.cfg.training
        if mode == "balanced" and speeds:
            sizes = batching.balanced(speeds, total=p.round_samples or t.batch_size * len(speeds),
                                      min_batch=p.min_batch, max_batch=p.max_batch)
        else:
            mode, sizes = "uniform", batching.uniform(speeds, t.batch_size)
        return self._publish(names, sizes, mode, now, reason)

    def rebalance(self, now: float) -> Plan | None:
        """A plan with new batches when the speeds measured now move one by more than ``planner.rebalance_threshold``
        (``DataParallel._batches``); None to keep the current one."""
        current = self.current
        if self.mesh or current is None or current.batching != "balanced" or not current.devices:
            return None  # a grid is laid out again at a join or a leave only (docs/simulation.md)
        names = [d.device for d in current.devices]
        p, t = self.cfg.planner, self.cfg.training
        proposal = batching.balanced([self.speed(n, now) for n in names], total=p.round_samples
                                     or t.batch_size * len(names), min_batch=p.min_batch, max_batch=p.max_batch)
        if not batching.needs_rebalance(batch_sizes(current), proposal.sizes, p.rebalance_threshold):
            return None
        return self._publish(names, proposal, "balanced", now, "rebalance")

    def info(self, name: str, now: float | None = None) -> DeviceInfo:
        """What the planner knows of ``name``: its hello's figures; at ``now``, with the training rate its stats
        would report instead of the hello's (``stability.measured_info``: the rate it measured, over the cost
        model's efficiency, which is the board's training rate)."""
        b = self.boards[name]
        p = b.profile
        flops = p.gflops * 1e9 if now is None else \
            b.samples_per_s * costs.cost(self.cfg.training.model_spec).train_flops_per_sample \
            / costs.TRAIN_EFFICIENCY * b.timeline.speed_at(max(0.0, now - self.lag_s))
        return DeviceInfo(device=name, flops=flops, memory_bytes=p.memory_bytes, link_rate_bps=p.uplink_bps,
                          downlink_rate_bps=p.downlink_bps, latency_s=p.latency_s)

    def _grid(self, names: list[str], now: float, reason: str) -> Plan:
        self.version += 1
        grid = self.rule.lay_out([self.info(n, now) for n in names])
        self.current = plan_mesh(grid, version=self.version, training=self.cfg.training, reason=reason, created=now)
        self.first = self.first or self.current
        return self.current

    def _publish(self, names: list[str], sizes: batching.Batches, mode: Batching, now: float,
                 reason: str) -> Plan:
        self.version += 1
        infos = [self.info(n) for n in names]
        self.current = plan_data_parallel(infos, version=self.version, training=self.cfg.training, reason=reason,
                                          created=now, batches=sizes.sizes, batching=mode,
                                          round_time_s=sizes.round_time_s if mode == "balanced" else 0.0)
        self.first = self.first or self.current
        return self.current
