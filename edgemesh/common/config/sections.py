"""The configuration's sections: nested dataclasses, one docstring per field, validated in ``__post_init__``.

A section is the settings of what it configures, declared once: ``[ps.adaptive]`` is the adaptive
rule's ``AdaptiveConfig``, ``[compressor]`` the compressor policy's settings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlparse

from edgemesh.common.errors import ConfigError
from edgemesh.common.vocabulary import (
    AggregationRule,
    AttackKind,
    CodecName,
    DeltaCodecName,
    RoundScaling,
    SparseCodecName,
    StalenessRule,
    SyncPolicy,
    valid_name,
    valid_topic,
)


def _require(ok: bool, key: str, message: str) -> None:
    """Refuse the setting ``key`` with ``message`` (a ``ConfigError`` naming it) unless ``ok``: what every
    section's ``__post_init__`` checks with."""
    if not ok:
        raise ConfigError(f"{key}: {message}")


@dataclass(slots=True)
class BrokerConfig:
    """How to reach the MQTT broker."""

    url: str = "mqtt://127.0.0.1:1883"
    """Broker URL, ``mqtt://host:port`` (``mqtts://`` for TLS)."""
    protocol: Literal["auto", "5", "3.1.1"] = "auto"
    """MQTT version; ``auto`` tries 5 and falls back to 3.1.1."""
    username: str = ""
    """User name for brokers with password authentication."""
    password: str = ""
    """Password for brokers with password authentication."""
    ca_file: str = ""
    """CA certificate(s) to verify an ``mqtts://`` broker; empty = the system store."""
    cert_file: str = ""
    """Client certificate for brokers that authenticate devices by certificate."""
    key_file: str = ""
    """Private key of ``cert_file``."""
    keepalive_s: int = 30
    """MQTT keepalive interval."""
    connect_timeout_s: float = 10.0
    """Timeout of one connection attempt."""
    operation_timeout_s: float = 10.0
    """How long a subscribe or a QoS 1 publish of a connected client may wait for the broker's answer. On a
    slow link it queues behind the retained model the broker sends first: raise it when a device's downlink
    needs longer than this for the model (2.5 MB of cifar-cnn takes 10 s at 2 Mbit/s). A lost connection ends
    the wait at once: the publish goes out again on the next connection."""
    backoff_initial_s: float = 0.2
    """First reconnect delay; doubles up to ``backoff_max_s``, with jitter."""
    backoff_max_s: float = 10.0
    """Largest reconnect delay. After a reconnect the planner waits this long for the devices to announce
    themselves again before it plans (a stopping broker sends every device's will)."""
    chunk_bytes: int = 256 * 1024
    """Payloads larger than this are split into chunks of this size, or larger ones on a fast link to a broker
    that says its packet limit (``chunk_max_bytes``)."""
    chunk_max_bytes: int = 16 * 1024 * 1024
    """The most a chunk of a message that is not retained grows to: what this connection's measured upload rate
    carries in ``chunk_seconds``, within the largest packet the broker says it takes (MQTT 5's Maximum Packet
    Size, less 64 KiB for the envelope and topic; Mosquitto says it when ``max_packet_size`` is set). A broker
    that says nothing (MQTT 3.1.1, or no limit set) keeps chunks at ``chunk_bytes``, as does this at
    ``chunk_bytes``."""
    chunk_seconds: float = 0.05
    """How long one chunk may hold the connection at its measured upload rate: on Wi-Fi chunks stay at
    ``chunk_bytes``, with other messages and a downlink measurement between them; on a LAN a gradient goes in
    as few packets as the broker allows."""
    chunk_window: int = 8
    """Chunks of one message published at once (each QoS 1 publish waits for its PUBACK: one at a time, a 2.5 MB
    model would wait out ten round trips to the broker)."""
    max_message_bytes: int = 64 * 1024 * 1024
    """Largest message (after reassembly) a service accepts."""
    reassembly_timeout_s: float = 30.0
    """A chunked message not complete within this time is dropped."""
    reassembly_budget_bytes: int = 256 * 1024 * 1024
    """Bytes of partial chunked messages held at most."""
    publish_timeout_s: float = 30.0
    """How long a publish waits for a connection before failing."""
    topic_prefix: str = ""
    """Put before every topic published or subscribed to, and taken off every topic received: on a cloud broker,
    the cloud-side services and operators of a bridged site's jobs set that site's ``sites/{site}/``
    (deploy/mosquitto/bridge.conf). Empty: topics as they are."""

    def __post_init__(self) -> None:
        _require(not self.topic_prefix or (valid_topic(self.topic_prefix) and self.topic_prefix.endswith("/")
                                           and self.topic_prefix[0] not in "/$"), "broker.topic_prefix",
                 f"{self.topic_prefix!r} is not levels ending in /, without wildcards, not starting with / or $")
        parsed = urlparse(self.url)
        _require(parsed.scheme in ("mqtt", "mqtts", "tcp"), "broker.url", f"{self.url!r} is not mqtt://host:port")
        _require(bool(parsed.hostname), "broker.url", f"{self.url!r} has no host")
        _require(self.keepalive_s >= 1, "broker.keepalive_s", "must be >= 1")
        _require(bool(self.cert_file) == bool(self.key_file), "broker.cert_file",
                 "cert_file and key_file go together")
        for key in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, key)
            _require(not path or os.path.isfile(path), f"broker.{key}", f"{path!r} is not a readable file")
        _require(self.connect_timeout_s > 0, "broker.connect_timeout_s", "must be > 0")
        _require(self.operation_timeout_s > 0, "broker.operation_timeout_s", "must be > 0")
        _require(0 < self.backoff_initial_s <= self.backoff_max_s, "broker.backoff_initial_s",
                 "must be > 0 and <= backoff_max_s")
        _require(1024 <= self.chunk_bytes <= 16 << 20, "broker.chunk_bytes", "must be in [1 KiB, 16 MiB]")
        _require(self.chunk_bytes <= self.chunk_max_bytes <= 16 << 20, "broker.chunk_max_bytes",
                 "must be in [chunk_bytes, 16 MiB]")
        _require(self.chunk_seconds > 0, "broker.chunk_seconds", "must be > 0")
        _require(self.chunk_window >= 1, "broker.chunk_window", "must be >= 1")
        _require(self.max_message_bytes >= self.chunk_bytes, "broker.max_message_bytes", "must be >= chunk_bytes")
        _require(self.reassembly_timeout_s > 0, "broker.reassembly_timeout_s", "must be > 0")
        _require(self.reassembly_budget_bytes >= self.max_message_bytes, "broker.reassembly_budget_bytes",
                 "must be >= max_message_bytes")

    @property
    def host(self) -> str:
        return urlparse(self.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        parsed = urlparse(self.url)
        return parsed.port or (8883 if parsed.scheme == "mqtts" else 1883)

    @property
    def tls(self) -> bool:
        return urlparse(self.url).scheme == "mqtts"


@dataclass(slots=True)
class MetricsConfig:
    """Prometheus ``/metrics`` endpoint."""

    address: str = "0.0.0.0:0"  # noqa: S104 - metrics are meant to be scraped from the network
    """``host:port`` to serve on; port 0 picks a free port (logged); empty disables."""
    port_file: str = ""
    """If set, the bound port is written to this file (for supervisors when port is 0)."""
    health_interval_s: float = 5.0
    """How often the host's CPU temperature and throttling flags are read (``edgemesh_device_*``)."""
    thermal_dir: str = "/sys/class/thermal"
    """Where the kernel's thermal zones are read: the hottest of type cpu or soc is the CPU temperature."""
    vcgencmd: str = "vcgencmd"
    """The Raspberry Pi firmware tool read for throttling and under-voltage (and for the temperature where no
    thermal zone gives it): a name looked up on PATH, or a path; empty = not read."""

    def __post_init__(self) -> None:
        _require(self.health_interval_s > 0, "metrics.health_interval_s", "must be > 0")
        if self.address:
            host, sep, port = self.address.rpartition(":")
            _require(bool(sep) and port.isdigit() and 0 <= int(port) < 65536, "metrics.address",
                     f"{self.address!r} is not host:port")


@dataclass(slots=True)
class TrainingConfig:
    """What is trained, shared by planner, PS and workers."""

    model_spec: str = "digits-cnn"
    """Named model spec (see ``edgemesh.common.models``)."""
    dataset: str = "digits"
    """digits | mnist-idx | cifar10 | synthetic-cifar; under a submitted job, the job's data format."""
    dataset_path: str = ""
    """Directory of the data set files (not needed for digits); under a job, the data's path on each device."""
    partition: Literal["iid", "dirichlet"] = "iid"
    """How the training split is divided among devices."""
    partition_alpha: float = 0.5
    """Dirichlet concentration for non-IID partitions (smaller = more skewed)."""
    seed: int = 0
    """Seed of the model initialisation, the test split and the partition."""
    batch_size: int = 32
    """Per-device mini-batch size the planner assigns."""
    sync_policy: SyncPolicy = "sync"
    """Parameter server synchronization policy (switchable at run time)."""
    staleness_bound: int = 4
    """Largest delay of an update that is still applied, in rounds of the fleet: under ``sync`` and ``adaptive`` a
    version is a round; under ``async`` and ``ssp``, where a version is one cluster's update, ``(bound + 1) x
    clusters - 1`` versions (``scheduler.rounds_bound``)."""
    lr: float = 0.05
    """SGD learning rate. With momentum 0.9, 0.1 trained the digits CNN to 97 % on four devices' 128 samples a
    version and then held it, but collapsed it to chance after 200-400 versions of 32 samples (one device, or a
    model-parallel fleet, whose iteration is ``training.batch_size`` in all); 0.05 held both at 97-98 %."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float = 0.0
    """L2 weight decay."""

    def __post_init__(self) -> None:
        _require(self.batch_size >= 1, "training.batch_size", "must be >= 1")
        _require(self.staleness_bound >= 0, "training.staleness_bound", "must be >= 0")
        _require(self.lr > 0, "training.lr", "must be > 0")
        _require(0 <= self.momentum < 1, "training.momentum", "must be in [0, 1)")
        _require(self.weight_decay >= 0, "training.weight_decay", "must be >= 0")
        _require(self.partition_alpha > 0, "training.partition_alpha", "must be > 0")


@dataclass(slots=True)
class PlannerConfig:
    """Planner service."""

    replan_debounce_s: float = 0.3
    """Joins and leaves within this window produce one re-plan."""
    min_devices: int = 1
    """No plan is published before this many devices are online (the job's first plan only: once a plan has
    named devices, plans follow whoever is live, so training goes on after a broker restart with fewer)."""
    batching: Literal["auto", "uniform", "balanced"] = "auto"
    """Batch sizes: uniform (training.batch_size for all), balanced (sized to each device's speed so
    all finish an iteration together), or auto (balanced under the adaptive policy, else uniform)."""
    round_samples: int = 0
    """Samples per iteration over all devices. Balanced batching: 0 = devices x training.batch_size.
    Mesh parallelism (the iteration's batch, split among the clusters): 0 = training.batch_size."""
    min_batch: int = 4
    """Balanced batching: smallest batch a device is given, however slow. Mesh: smallest batch of a
    cluster (the grid makes no more clusters than the iteration's samples over this)."""
    max_batch: int = 128
    """Balanced batching: largest batch a device is given, however fast (memory caps it too). Mesh:
    largest batch of a cluster."""
    rebalance_threshold: float = 0.25
    """Balanced batching: publish new batch sizes only when one moves by more than this share."""
    rebalance_interval_s: float = 2.0
    """Balanced batching: at most one re-plan for new batch sizes per this many seconds."""
    parallelism: Literal["data", "mesh"] = "data"
    """data: every device is its own cluster (data parallelism); mesh: the hybrid training grid of Edge
    Mesh, clusters of devices that divide the model's filters among them (docs/mesh.md)."""
    mesh_fallback: bool = False
    """Mesh, a model the grid cannot divide (a layer it has no division for): true trains it data parallel, every
    device its own cluster, said in a ``mesh_fallback`` event; false refuses it (at submit, or the planner fails)."""
    max_cluster_size: int = 8
    """Mesh: most devices in one model-parallel cluster."""
    replan_threshold: float = 0.25
    """Mesh, the margin: re-plan for measurements only when the current layout's predicted iteration, on the
    devices' smoothed measurements, is this share above the best new layout's on the same figures."""
    replan_band: float = 0.5
    """Mesh: a measurement re-plan is considered only once a device's smoothed speed, uplink, downlink or
    latency is above (1 + band) times, or below 1 / (1 + band) of, the figure the current plan was laid out with
    (or last weighed against: docs/mesh.md#re-planning)."""
    replan_min_interval_s: float = 60.0
    """Mesh: at least this many seconds between re-plans for measurements (joins, leaves, drains and an
    operator's replan are never held back)."""
    smoothing_window: int = 9
    """Mesh: the planner plans each device's speed and link figures as the median of its last this many
    measurements."""
    grid_slack: float = 0.0
    """Mesh: share of the fastest layout's predicted iteration the grid may give up for fewer clusters,
    each a replica of the model: less memory per device and fewer gradients into the PS per round
    (0 = the fastest layout)."""

    def __post_init__(self) -> None:
        _require(self.replan_debounce_s >= 0, "planner.replan_debounce_s", "must be >= 0")
        _require(self.min_devices >= 1, "planner.min_devices", "must be >= 1")
        _require(self.round_samples >= 0, "planner.round_samples", "must be >= 0 (0 = devices x batch_size)")
        _require(self.min_batch >= 1, "planner.min_batch", "must be >= 1")
        _require(self.max_batch >= self.min_batch, "planner.max_batch", "must be >= planner.min_batch")
        _require(0 <= self.rebalance_threshold < 10, "planner.rebalance_threshold", "must be in [0, 10)")
        _require(self.rebalance_interval_s >= 0, "planner.rebalance_interval_s", "must be >= 0")
        _require(self.max_cluster_size >= 1, "planner.max_cluster_size", "must be >= 1")
        _require(self.replan_threshold > 0, "planner.replan_threshold", "must be > 0")
        _require(self.replan_band > 0, "planner.replan_band", "must be > 0")
        _require(self.replan_min_interval_s >= 0, "planner.replan_min_interval_s", "must be >= 0")
        _require(self.smoothing_window >= 1, "planner.smoothing_window", "must be >= 1")
        _require(0 <= self.grid_slack <= 1, "planner.grid_slack", "must be in [0, 1]")


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
    delta_codec: DeltaCodecName = "auto"
    """Codec of the model deltas; what it leaves out is sent with the next delta. ``auto``: ``fp16`` under the
    round policies (``sync``, ``adaptive``), whose rounds move the model by several batches at once and reach each
    device once, ``grid`` under ``async`` and ``ssp``, where every device hears of every other's update
    (docs/compression.md)."""
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
    round_scaling: RoundScaling = "linear"
    """Under sync and adaptive, how a round's step grows with the batches (of the plan's mean size per cluster) it
    averages: ``linear`` (k batches, k times the step: per sample, training.lr means what it means in one process
    at one batch), ``sqrt`` (the square root of k), ``none`` (one step of training.lr whatever the round holds:
    the rate is per round), or ``adascale`` (AdaScale's gain, between 1 and k, measured from how much the round's
    gradients disagree: k where they are noisy, near 1 where they agree, as on a fleet that holds the whole data set
    in one round; ``round_warmup`` does not apply; the rule for fleets past a dozen devices, where ``linear`` steps too
    far). Measured in docs/synchronization.md."""
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


@dataclass(slots=True)
class CompressorConfig:
    """Compressor service."""

    default_codec: CodecName = "fp16"
    """Codec assigned to devices without an override."""
    overrides: dict[str, CodecName] = field(default_factory=dict)
    """Per-device codec, e.g. ``{"pi-07" = "none"}``."""
    mode: Literal["static", "adaptive"] = "adaptive"
    """static: codecs from config alone; adaptive: codec and density follow each device's link and step time."""
    adaptive_codec: SparseCodecName = "grid"
    """Sparsifying codec the adaptive mode switches a device to when its link is too slow for a dense one."""
    comm_share: float = 0.5
    """Adaptive target: estimated communication time of one update at most this share of its step time."""
    min_density: float = 0.001
    """Smallest share of gradient entries the adaptive mode keeps, however slow the link."""
    max_density: float = 0.25
    """Largest share of gradient entries the adaptive mode keeps with a sparsifying codec."""
    density_hysteresis: float = 0.25
    """Relative change below which a new density or codec is not published (keeps noisy stats from flapping)."""
    delay_pressure: float = 0.1
    """Budget shrink per version of delay index above the fleet median: budget / (1 + pressure * excess)."""
    static_density: float = 0.01
    """Density of a sparsifying codec chosen from config alone (static mode, or a link not measured yet)."""

    def __post_init__(self) -> None:
        for device in self.overrides:
            _require(valid_name(device), "compressor.overrides", f"invalid device name {device!r}")
        _require(0 < self.comm_share <= 100, "compressor.comm_share", "must be in (0, 100]")
        _require(0 < self.min_density <= 1, "compressor.min_density", "must be in (0, 1]")
        _require(self.min_density <= self.max_density <= 1, "compressor.max_density",
                 "must be in [min_density, 1]")
        _require(0 <= self.density_hysteresis < 1, "compressor.density_hysteresis", "must be in [0, 1)")
        _require(self.delay_pressure >= 0, "compressor.delay_pressure", "must be >= 0")
        _require(0 < self.static_density <= 1, "compressor.static_density", "must be in (0, 1]")


@dataclass(slots=True)
class WorkerConfig:
    """Worker service (one device)."""

    device: str = ""
    """Device name; empty = the host name."""
    memory_bytes: int = 0
    """Memory offered to training; 0 = measured."""
    threads: int = 1
    """torch intra-op threads."""
    lean_allocator: bool = True
    """Hold glibc's mmap threshold at 128 KiB and its heaps at two (``edgemesh.common.allocator``): a freed tensor
    goes back to the kernel, so resident memory is what training holds, not what it held at its peak in each
    thread's heap (docs/jobs.md#memory-budget)."""
    ack_timeout_s: float = 10.0
    """The shortest wait for an update's ack before it is sent again: the wait grows to the acks' measured time
    (its smoothed value plus four times its variation) when they take longer, doubles after each timeout, up to
    60 s (docs/reliability.md)."""
    stats_interval_s: float = 2.0
    """How often stats are published."""
    profile_seconds: float = 0.2
    """Duration of the start-up FLOPS benchmark."""
    max_steps: int = 0
    """Stop after this many accepted updates (0 = run until stopped)."""
    state_dir: str = ""
    """Where the worker keeps its last incarnation, so a device whose clock went back (a Pi has no real-time
    clock) still restarts with a larger one; empty: systemd's ``$STATE_DIRECTORY`` if set, else the clock alone.
    Its host's crash memory (a marker naming the job it serves: docs/reliability.md#crash-memory) is kept here too;
    empty: ``$STATE_DIRECTORY``, else ``edgemesh-state/worker-{device}`` under the working directory."""
    memory_limit_mb: int = 0
    """This host's memory budget for a job's model (MiB): a job whose model, measured here on the meta device,
    needs more to train at ``training.batch_size`` (parameters in 4 copies, every layer's output and its gradient)
    is left before it is built (docs/jobs.md#memory-budget). 0 = 80 % of the host's RAM."""
    ack_log: str = ""
    """A file the worker appends ``incarnation seq status version`` to for every update acked applied (an audit
    against the parameter server's ledger, ``{ps.state_dir}/ledger.log``); empty: none."""
    codec_wait_s: float = 2.0
    """How long to wait for a codec policy before using ``none``."""
    mesh_timeout_s: float = 10.0
    """Model-parallel clusters: how long a member waits for another member's slice before it abandons the step."""
    mesh_dtype: Literal["float32", "float16"] = "float32"
    """Model-parallel clusters: the type activation and gradient slices travel in (float16 halves the traffic)."""
    link_rate_bps: float = 0.0
    """Uplink rate to report, bytes/s; 0 = measure it from gradient publishes (time to the broker's PUBACK)."""
    can_encode: bool = True
    """False: send raw float32 gradients on ``grad-raw`` and let the compressor gateway encode them."""
    data_dir: str = ""
    """Directory a submitted job's ``data.path`` is read from on this device: the path is relative to it and
    nothing outside it is read, links followed (docs/jobs.md); empty = the working directory."""
    emulate: str = ""
    """Emulate this device profile (``edgemesh.common.emulation``: pi3, pi4, ...): its speed, memory and
    link; empty = a real device (the default)."""
    emulation_profiles: str = ""
    """TOML file of device profiles to emulate from; empty = the built-in ``profiles.toml``."""
    emulation_seed: int = 0
    """Seed of the emulated link's disconnects (with the device name, so devices differ)."""
    emulation_host_gflops: float = 0.0
    """Emulation: this host's float32 GFLOP/s on one thread, the reference the profile's speed is scaled
    from; 0 = measure it at start."""
    emulation_max_outage_s: float = 0.0
    """Emulation: cap on the length of one spontaneous disconnect, seconds (0 = no cap)."""
    emulation_dilation: float = 1.0
    """Emulation: time dilation, >= 1. The board runs this many times slower in every respect (compute,
    link rates, latency), so a host slower than the fleet it emulates keeps up; durations are then this
    many times the board's (benchmarks report the factor)."""
    emulation_scenario: str = ""
    """Emulation: how the board misbehaves over time (``scenarios.toml``: steady, dynamic, harsh): thermal
    throttling, link stalls, drop-outs and a varying link rate, seeded by ``emulation_seed`` and the device
    name; the timeline starts with the first plan naming the device. Empty = none (the profile's own
    disconnects only)."""
    emulation_scenarios: str = ""
    """TOML file of emulation scenarios; empty = the built-in ``scenarios.toml``."""
    emulation_attack: AttackKind = ""
    """Emulation of a faulty or malicious device (``edgemesh bench robust``): ``sign-flip`` sends its gradient
    negated and scaled by ``emulation_attack_scale``; ``noise`` sends Gaussian noise whose standard deviation
    is ``emulation_attack_scale`` times its gradient's RMS, per tensor; empty = an honest device."""
    emulation_attack_scale: float = 10.0
    """Emulation: the factor of ``emulation_attack``."""
    emulation_cgroup_root: str = "/sys/fs/cgroup"
    """Emulation: where the cgroup v1 controllers are mounted. An emulated worker runs in cgroups of its own there,
    under its board's memory and CPU share (docs/emulation.md#two-modes); where they are missing or not writable,
    with stretched compute alone. Empty = never: stretched compute alone."""
    emulation_cpu_quota: bool = True
    """Emulation under cgroups: cap the process at its board's share of this host's CPU too (the cpu controller's
    quota); false = its memory alone."""

    def __post_init__(self) -> None:
        _require(not self.device or valid_name(self.device), "worker.device",
                 f"{self.device!r}: use 1-64 characters of A-Z a-z 0-9 _ . -")
        _require(self.memory_bytes >= 0, "worker.memory_bytes", "must be >= 0")
        _require(self.memory_limit_mb >= 0, "worker.memory_limit_mb", "must be >= 0 (0 = a share of the host's RAM)")
        _require(self.threads >= 1, "worker.threads", "must be >= 1")
        _require(self.ack_timeout_s > 0, "worker.ack_timeout_s", "must be > 0")
        _require(self.mesh_timeout_s > 0, "worker.mesh_timeout_s", "must be > 0")
        _require(self.stats_interval_s > 0, "worker.stats_interval_s", "must be > 0")
        _require(self.profile_seconds > 0, "worker.profile_seconds", "must be > 0")
        _require(self.max_steps >= 0, "worker.max_steps", "must be >= 0")
        _require(self.link_rate_bps >= 0, "worker.link_rate_bps", "must be >= 0 (0 = measure)")
        _require(self.emulation_host_gflops >= 0, "worker.emulation_host_gflops", "must be >= 0 (0 = measure)")
        _require(self.emulation_max_outage_s >= 0, "worker.emulation_max_outage_s", "must be >= 0")
        _require(self.emulation_dilation >= 1, "worker.emulation_dilation", "must be >= 1 (1 = real time)")
        _require(self.emulation_attack_scale > 0, "worker.emulation_attack_scale", "must be > 0")


@dataclass(slots=True)
class DemoConfig:
    """``edgemesh demo``: a whole local cluster."""

    workers: int = 4
    """Number of worker processes."""
    target_accuracy: float = 0.95
    """Stop once the held-out accuracy reaches this."""
    max_versions: int = 3000
    """Stop after this many model versions if the target is not reached."""
    timeout_s: float = 300.0
    """Give up after this long."""
    link_rate_bps: float = 1_000_000.0
    """Uplink every demo worker declares (bytes/s; 1 MB/s is a Pi on busy Wi-Fi), so the
    compressor picks codecs as it would at the edge; 0 = measure the loopback link."""
    keep_logs: bool = False
    """Keep the children's logs after a successful run too (a failed run always keeps them)."""

    def __post_init__(self) -> None:
        _require(1 <= self.workers <= 64, "demo.workers", "must be in [1, 64]")
        _require(0 < self.target_accuracy <= 1, "demo.target_accuracy", "must be in (0, 1]")
        _require(self.max_versions >= 1, "demo.max_versions", "must be >= 1")
        _require(self.timeout_s > 0, "demo.timeout_s", "must be > 0")
        _require(self.link_rate_bps >= 0, "demo.link_rate_bps", "must be >= 0")


@dataclass(slots=True)
class ModelsConfig:
    """Whose code a job's entry-point model may run on this machine (docs/jobs.md#whose-code-runs). A job never
    sets it: a host imports only what its own configuration allows, from the directories it names."""

    allowed: tuple[str, ...] = ()
    """Module-name prefixes an entry point may be imported from, on whole dotted components: ``"acme_models"``
    allows ``acme_models`` and ``acme_models.cnn``, not ``acme_models2``. Empty (the default) = none: jobs bring
    layer lists only."""
    path: tuple[str, ...] = ()
    """Absolute directories searched first for those modules (then the installed packages). A job's
    ``model.module_path`` is never added: a host refuses a job whose module_path is not one of these."""

    def __post_init__(self) -> None:
        for prefix in self.allowed:
            _require(bool(prefix) and all(part.isidentifier() for part in prefix.split(".")), "models.allowed",
                     f"{prefix!r} is not a module name (package.module)")
        for directory in self.path:
            _require(os.path.isabs(directory), "models.path", f"{directory!r} is not an absolute directory")


@dataclass(slots=True)
class Config:
    """Everything a service needs."""

    job: str = ""
    """Job name: the topic namespace, so several trainings can share a broker. A service started without
    one serves the jobs operators submit (``edgemesh job submit``), one after another; the operator tools
    need it to know which job they speak to."""
    log_level: str = "INFO"
    """Python logging level."""
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    ps: ParameterServerConfig = field(default_factory=ParameterServerConfig)
    compressor: CompressorConfig = field(default_factory=CompressorConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)
    models: ModelsConfig = field(default_factory=ModelsConfig)

    def __post_init__(self) -> None:
        _require(not self.job or valid_name(self.job), "job",
                 f"{self.job!r}: use 1-64 characters of A-Z a-z 0-9 _ . -")
        _require(self.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"), "log_level",
                 "one of DEBUG INFO WARNING ERROR")
