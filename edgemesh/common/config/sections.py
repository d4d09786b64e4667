"""The configuration's sections: nested dataclasses, one docstring per field, validated in ``__post_init__``.

A section is the settings of what it configures, declared once: ``[ps.adaptive]`` is the adaptive
rule's ``AdaptiveConfig``, ``[compressor]`` the compressor policy's settings. The parameter server's two are in
``parameter_server``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlparse

from edgemesh.common.config.checks import require as _require
from edgemesh.common.config.parameter_server import ParameterServerConfig
from edgemesh.common.vocabulary import AttackKind, CodecName, SparseCodecName, SyncPolicy, valid_name, valid_topic


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
    """Largest delay (PS versions) of an update that is still applied."""
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
    max_cluster_size: int = 8
    """Mesh: most devices in one model-parallel cluster."""
    replan_threshold: float = 0.25
    """Mesh: re-plan when the current layout's predicted time per sample, under the devices' measured
    speeds, is this share above the best new layout's (a device slowed down)."""
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
        _require(0 <= self.grid_slack <= 1, "planner.grid_slack", "must be in [0, 1]")


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
    ack_timeout_s: float = 10.0
    """Resend an update not acked within this time."""
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
