"""What training jobs exchange: the submitted job, its state, a device's local evaluation (docs/jobs.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

from edgemesh.common.costs import LayerCost
from edgemesh.common.messages.checks import MAX_DEVICES, check_name, nonneg
from edgemesh.common.wire import message

JobPhase = Literal["queued", "running", "paused", "finished", "stopped", "failed"]
"""A job's life: queued until the fleet is free, running (or paused by an operator), then ended at its stop
rule (finished), by an operator (stopped), or by an error (failed)."""
ENDED: Final[tuple[JobPhase, ...]] = ("finished", "stopped", "failed")
ACTIVE: Final[tuple[JobPhase, ...]] = ("running", "paused")
EVALUATIONS_KEPT: Final = 20
"""Most evaluations a job's state carries: the latest (``edgemesh job status`` shows them)."""
MAX_REASON_CHARS: Final = 2000
"""Longest reason a job's state gives for a device that left it (a worker's ``left`` status is cut there too)."""


@message("job")
@dataclass(frozen=True, slots=True, kw_only=True)
class JobSubmission:
    """A job file an operator submitted, retained on ``job``; every service parses ``source`` itself."""

    name: str
    source: bytes
    """The job file (UTF-8 TOML), as written."""
    sha256: str
    """Hash of ``source``: this submission's identity."""
    submitted_at: float
    requester: str = "operator"
    params: int = 0
    """The model's cost, derived from the module at submission (the planner plans with it, without torch)."""
    macs_per_sample: int = 0
    activations_per_sample: int = 0
    layers: tuple[LayerCost, ...] = ()
    """Its divisible layers' figures, for model parallelism; empty when the model cannot be divided."""
    refusal: str = ""
    """Why model parallelism cannot divide the model ('' when it can)."""

    def validate(self) -> None:
        check_name("job", self.name)
        if len(self.sha256) != 64:
            raise ValueError("sha256 must be 64 hex digits")
        nonneg("submitted_at", self.submitted_at)
        for value in (self.params, self.macs_per_sample, self.activations_per_sample):
            nonneg("cost", value)
        for layer in self.layers:
            if layer.units < 1 or min(layer.macs_per_unit, layer.params_per_unit, layer.out_per_unit,
                                      layer.gathered_per_unit, layer.in_values) < 0:
                raise ValueError(f"layer figures of {layer.name!r} out of range")
            if layer.group < 1 or layer.units % layer.group:
                raise ValueError(f"layer figures of {layer.name!r}: groups of {layer.group} do not divide its "
                                 f"{layer.units} units")


@dataclass(frozen=True, slots=True, kw_only=True)
class JobEvaluation:
    """One evaluation of a job's model: the version evaluated, its accuracy and loss (None if not finite), when."""

    version: int
    accuracy: float
    loss: float | None = None
    time: float = 0.0

    def validate(self) -> None:
        nonneg("version", self.version)
        nonneg("time", self.time)
        if not 0.0 <= self.accuracy <= 1.0:
            raise ValueError(f"accuracy {self.accuracy} is outside [0, 1]")


@message("job_state")
@dataclass(frozen=True, slots=True, kw_only=True)
class JobState:
    """A job's state and progress, retained on ``job/state`` by the parameter server's host."""

    name: str
    state: JobPhase
    sha256: str = ""
    """The submission this state is about."""
    submitted_at: float = 0.0
    started_at: float = 0.0
    ended_at: float = 0.0
    updated_at: float = 0.0
    version: int = 0
    accuracy: float | None = None
    loss: float | None = None
    devices: tuple[str, ...] = ()
    """Devices in the current plan."""
    bytes_received: int = 0
    """Encoded gradient bytes the parameter server received for this job."""
    target_accuracy: float = 0.0
    max_versions: int = 0
    max_minutes: float = 0.0
    reason: str = ""
    """Why it ended or failed, or the last operator action."""
    device_errors: dict[str, str] = field(default_factory=dict)
    """Devices out of the job while it runs, and why: they left it (their data is broken or missing, the model
    does not build there) or refused their share of the plan (it does not fit their memory); at most
    ``MAX_REASON_CHARS`` each."""
    evaluations: tuple[JobEvaluation, ...] = ()
    """The latest evaluations of the job's model, oldest first: at most ``EVALUATIONS_KEPT``."""
    model_version: int = 0
    """The version of the model ``accuracy`` and ``loss`` are of: while the job runs, the latest evaluated; once it
    ended, the one kept on ``job/model``, which ``edgemesh job export`` writes (the best evaluated, or the last)."""
    rollbacks: int = 0
    """Times the divergence guard rolled the model back to its best evaluated version."""
    warning: str = ""
    """What looks wrong while the job runs ('' when nothing does): the model diverges where the guard could not roll
    it back, or its accuracy stays at chance; at most ``MAX_REASON_CHARS``."""

    def validate(self) -> None:
        check_name("job", self.name)
        nonneg("version", self.version)
        if len(self.devices) > MAX_DEVICES or len(self.device_errors) > MAX_DEVICES:
            raise ValueError("too many devices")
        for name in (*self.devices, *self.device_errors):
            check_name("device", name)
        if any(len(reason) > MAX_REASON_CHARS for reason in self.device_errors.values()):
            raise ValueError(f"a device's reason is longer than {MAX_REASON_CHARS} characters")
        nonneg("model_version", self.model_version)
        nonneg("rollbacks", self.rollbacks)
        if len(self.warning) > MAX_REASON_CHARS:
            raise ValueError(f"a warning is longer than {MAX_REASON_CHARS} characters")
        if len(self.evaluations) > EVALUATIONS_KEPT:
            raise ValueError(f"more than {EVALUATIONS_KEPT} evaluations")
        for evaluation in self.evaluations:
            evaluation.validate()

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    @property
    def ended(self) -> bool:
        return self.state in ENDED


@message("local_evaluation")
@dataclass(frozen=True, slots=True, kw_only=True)
class LocalEvaluation:
    """A device's evaluation of the model on its own validation share, on ``device/{id}/evaluation``;
    the parameter server combines them by sample count."""

    device: str
    version: int
    samples: int
    correct: int
    loss_sum: float

    def validate(self) -> None:
        check_name("device", self.device)
        for name in ("version", "samples", "correct", "loss_sum"):
            nonneg(name, getattr(self, name))
        if self.correct > self.samples:
            raise ValueError("correct exceeds samples")
