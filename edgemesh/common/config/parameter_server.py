"""The parameter server's sections: ``[ps]`` (``ParameterServerConfig``) and its adaptive rule's ``[ps.adaptive]``
(``AdaptiveConfig``). The others are in ``sections``; the same habits: one docstring per field, validated in
``__post_init__``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from edgemesh.common.config.checks import require as _require
from edgemesh.common.vocabulary import AggregationRule, CodecName, RoundScaling, StalenessRule


@dataclass(slots=True)
class AdaptiveConfig:
    """The adaptive bounded-delay rule (``[ps.adaptive]``; docs/synchronization.md)."""

    alpha: float = 0.3
    """Weight of the newest delay in each device's delay index (an exponential moving average)."""
    quantile: float = 0.9
    """Quantile of the delay indices (the bound)."""
    deadline_quantile: float = 0.5
    """Quantile of the clusters' median cycles (the deadline): at 0.5 a round waits for the typical cluster (times
    ``slack``), not for the stragglers, whose updates land in the next round, damped; at 0.9 it waits for nearly
    every cluster, as sync does."""
    slack: float = 1.5
    """Factor on that quantile before clamping the deadline and the bound."""
    min_deadline_s: float = 0.02
    """Shortest round deadline, seconds."""
    max_deadline_s: float = 30.0
    """Longest round deadline, seconds (also the deadline before any arrival is seen)."""
    min_bound: int = 1
    """Smallest delay bound; the largest is training.staleness_bound (``set-bound``)."""
    slow_factor: float = 2.0
    """A device is slow when its delay index exceeds the fleet median by this factor (and by ``slow_margin``)."""
    slow_margin: float = 0.5
    """A device is slow when its delay index exceeds the fleet median by this many versions (and by
    ``slow_factor``): 0.5 flags a device one round late in two consecutive rounds (an index of 0.3, then 0.51)."""
    window: int = 32
    """Arrival times remembered per cluster."""

    def __post_init__(self) -> None:
        _require(0 < self.alpha <= 1, "ps.adaptive.alpha", "must be in (0, 1]")
        _require(0 <= self.quantile <= 1, "ps.adaptive.quantile", "must be in [0, 1]")
        _require(0 <= self.deadline_quantile <= 1, "ps.adaptive.deadline_quantile", "must be in [0, 1]")
        _require(self.slow_margin >= 0, "ps.adaptive.slow_margin", "must be >= 0")
        _require(self.slack >= 1, "ps.adaptive.slack", "must be >= 1")
        _require(self.min_deadline_s > 0, "ps.adaptive.min_deadline_s", "must be > 0")
        _require(self.max_deadline_s >= self.min_deadline_s, "ps.adaptive.max_deadline_s",
                 "must be >= ps.adaptive.min_deadline_s")
        _require(self.min_bound >= 0, "ps.adaptive.min_bound", "must be >= 0")
        _require(self.slow_factor >= 1, "ps.adaptive.slow_factor", "must be >= 1")
        _require(self.window >= 1, "ps.adaptive.window", "must be >= 1")


@dataclass(slots=True)
class GuardConfig:
    """The divergence guard (``[ps.guard]``; docs/synchronization.md#the-divergence-guard): an evaluation whose
    loss is not finite or explodes, or whose accuracy falls far below the best, rolls the model back to the best
    evaluated version and lowers the learning rate."""

    enabled: bool = True
    """Watch every held-out evaluation of the model (the parameter server's own; not a sharded server's)."""
    loss_factor: float = 4.0
    """An evaluation loss above this many times the best evaluated model's loss is exploding."""
    accuracy_drop: float = 0.25
    """An accuracy more than this below the best evaluated model's is far below it."""
    patience: int = 3
    """Consecutive evaluations that explode or fall far below before a rollback (a loss that is not finite, or a
    model that is not, rolls back at once)."""
    lr_factor: float = 0.5
    """The learning rate after a rollback: the one before, times this."""
    max_rollbacks: int = 8
    """Rollbacks in one run at most; past them the guard only reports (the job's state says it diverges)."""

    def __post_init__(self) -> None:
        _require(self.loss_factor > 1, "ps.guard.loss_factor", "must be > 1")
        _require(0 < self.accuracy_drop <= 1, "ps.guard.accuracy_drop", "must be in (0, 1]")
        _require(self.patience >= 1, "ps.guard.patience", "must be >= 1")
        _require(0 < self.lr_factor < 1, "ps.guard.lr_factor", "must be in (0, 1)")
        _require(self.max_rollbacks >= 0, "ps.guard.max_rollbacks", "must be >= 0")


@dataclass(slots=True)
class ParameterServerConfig:
    """Parameter server service."""

    state_dir: str = "edgemesh-state/ps"
    """Directory of the checkpoint and write-ahead log."""
    checkpoint_every: int = 200
    """Write a full checkpoint (and truncate the log) every this many versions."""
    eval_every: int = 5
    """Evaluate on the held-out split every this many versions (0 = never)."""
    max_batch: int = 64
    """Most queued updates handled in one step before publishing a snapshot."""
    mesh_assembly_timeout_s: float = 30.0
    """Model-parallel clusters: an update whose members' shards are not all in after this long is discarded."""
    fsync: bool = True
    """fsync the log before acking (turn off only for throwaway runs)."""
    broadcast: Literal["snapshot", "delta"] = "delta"
    """How the model reaches workers: a full snapshot per version, or encoded deltas on
    ``model/delta`` (with a float32 snapshot every ``snapshot_every`` versions and on request)."""
    delta_codec: CodecName = "grid"
    """Codec of the model deltas; what it leaves out is sent with the next delta."""
    delta_density: float = 0.3
    """Kept share of each delta for sparsifying codecs."""
    snapshot_every: int = 50
    """In delta mode, a full snapshot every this many versions (for late joiners)."""
    snapshot_dtype: Literal["float32", "float16"] = "float16"
    """Precision of the model snapshots sent to workers; the PS keeps float32 weights and momentum."""
    staleness_weighting: bool = True
    """Under async and ssp, damp an update applied d versions late by ``staleness_rule`` (adaptive always does)."""
    async_momentum: Literal["same", "compensated"] = "same"
    """Under async and ssp, the PS's momentum: ``same``, training.momentum; ``compensated``, less by what the
    asynchrony of the plan's clusters adds (``1 - (1 - momentum) x clusters``, at least 0; docs/synchronization.md)."""
    staleness_rule: StalenessRule = "inverse"
    """How: ``inverse`` scales it by 1/(1+d), ``sqrt`` by 1/(1+sqrt(d)) (FedBuff's); measured in
    docs/synchronization.md."""
    round_scaling: RoundScaling = "none"
    """Under sync and adaptive, how a round's step grows with the batches (of the plan's mean size per cluster) it
    averages: ``none`` (one step of training.lr whatever the round holds: the rate is per round), ``linear`` (k
    batches, k times the step: per sample, training.lr means what it means in one process at one batch) or
    ``sqrt`` (the square root of k). Measured in docs/synchronization.md: ``linear`` trains more per sample, but
    a rate tuned per round (the examples', the demo's) is k times too high under it."""
    round_warmup: int = 20
    """Versions over which that growth ramps up from none, a step per version (0: at once)."""
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    """The ``adaptive`` policy's rule (``[ps.adaptive]``)."""
    guard: GuardConfig = field(default_factory=GuardConfig)
    """The divergence guard (``[ps.guard]``)."""
    sync_state_interval_s: float = 2.0
    """Publish the retained sync state (policy, bound, deadline, delay indices) at most this often
    while only the indices move; a change of policy, bound or slow devices goes out at once."""
    eval_interval_s: float = 0.0
    """Also evaluate when this many seconds passed since the last evaluation and the model moved (0 = off)."""
    eval_budget: float = 0.1
    """Most share of one core held-out evaluation takes: after an evaluation of d seconds the next waits
    d x (1 / eval_budget - 1), whatever ``eval_every`` asks (1 = back to back)."""
    eval_threads: int = 1
    """torch threads of the evaluation (the PS's only torch work): the rest of the host's cores stay with
    ingest, the broker and the workers."""
    data_dir: str = ""
    """Directory a submitted job's relative ``evaluation.path`` is read from on this host; empty = the working
    directory."""
    aggregation: AggregationRule = "clip"
    """How a step's contributions combine: ``clip`` (the default: the weighted mean, each contribution's norm
    clipped to ``clip_factor`` times the median of the recent ones, so that one exploding or faulty gradient cannot
    throw the model), the plain weighted ``mean``, or a rule that compares a round's updates: ``median``,
    ``trimmed-mean``, ``krum`` (docs/reliability.md#robust-aggregation)."""
    clip_factor: float = 3.0
    """``clip``: a contribution's L2 norm is clipped to this times the median norm of recent contributions."""
    trim_fraction: float = 0.2
    """``trimmed-mean``: the share of a coordinate's largest and of its smallest values dropped."""
    krum_f: int = 1
    """``krum``: attackers assumed among a step's n contributions; the n - krum_f best scored are averaged."""
    norm_factor: float = 10.0
    """Every rule but ``clip``: an update whose L2 norm is more than this times the median norm of the recent updates
    applied is refused, left out of its step (0 = off; docs/synchronization.md#what-the-parameter-server-refuses)."""
    norm_warmup: int = 8
    """The norm filter judges once this many updates' norms are known."""
    shards: int = 1
    """Parameter server processes the model's tensors are divided among (``edgemesh ps --shard i/n``;
    docs/scale.md#a-sharded-parameter-server). Every service of the job must be given the same number:
    workers send each process its tensors' gradients."""
    shard: int = 0
    """Which of the ``shards`` processes this one is (0 = the first, which also runs the policy for all of them
    and evaluates the model)."""
    shard_wait_s: float = 30.0
    """A shard other than 0: how long a step of shard 0 waits for an update it took that has not reached this
    shard (its sender died between the two publishes); then it is taken without it."""
    memory_limit_mb: int = 0
    """This host's memory budget for a job's model (MiB): a job whose model, measured here on the meta device,
    needs more by the parameter server's estimate (its parameters in 6 copies, an evaluation batch) fails before
    it is built (docs/jobs.md#memory-budget). 0 = 80 % of the host's RAM. A job file may not set it."""

    def __post_init__(self) -> None:
        _require(self.shards >= 1, "ps.shards", "must be >= 1")
        _require(0 <= self.shard < self.shards, "ps.shard", f"must be in [0, ps.shards = {self.shards})")
        _require(self.mesh_assembly_timeout_s > 0, "ps.mesh_assembly_timeout_s", "must be > 0")
        _require(self.shard_wait_s > 0, "ps.shard_wait_s", "must be > 0")
        _require(self.round_warmup >= 0, "ps.round_warmup", "must be >= 0")
        _require(self.memory_limit_mb >= 0, "ps.memory_limit_mb", "must be >= 0 (0 = a share of the host's RAM)")
        _require(self.clip_factor > 0, "ps.clip_factor", "must be > 0")
        _require(0 <= self.trim_fraction < 0.5, "ps.trim_fraction", "must be in [0, 0.5)")
        _require(self.krum_f >= 0, "ps.krum_f", "must be >= 0")
        _require(self.norm_factor == 0 or self.norm_factor >= 1, "ps.norm_factor", "must be 0 (off) or >= 1")
        _require(self.norm_warmup >= 1, "ps.norm_warmup", "must be >= 1")
        _require(self.sync_state_interval_s >= 0, "ps.sync_state_interval_s", "must be >= 0")
        _require(self.eval_interval_s >= 0, "ps.eval_interval_s", "must be >= 0")
        _require(0 < self.eval_budget <= 1, "ps.eval_budget", "must be in (0, 1]")
        _require(self.eval_threads >= 1, "ps.eval_threads", "must be >= 1")
        _require(self.checkpoint_every >= 1, "ps.checkpoint_every", "must be >= 1")
        _require(self.eval_every >= 0, "ps.eval_every", "must be >= 0")
        _require(self.max_batch >= 1, "ps.max_batch", "must be >= 1")
        _require(0 < self.delta_density <= 1, "ps.delta_density", "must be in (0, 1]")
        _require(self.snapshot_every >= 1, "ps.snapshot_every", "must be >= 1")
