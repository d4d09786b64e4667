"""What an operator sets on the parameter server, and what a checkpoint keeps of it (docs/operations.md).

``pause``, ``resume`` and the ``set-...`` commands (``SETTING_COMMANDS``) set the policy, the staleness bound, the
learning rate, the pause and the aggregation rule. A command's value is checked as a checkpoint's is
(:class:`OperatorSettings`): one it refuses is its reply, and one a checkpoint holds that is not valid is left as
it was. Every command that changes a setting writes a checkpoint at once (``SETTINGS_COMMANDS``), so a crash keeps
it. A checkpoint also keeps what the server learned that a restart would otherwise lose: the adaptive rule's delay
indices and the clusters' cycles its deadline is learned from, and the norms ``clip`` compares with.
:class:`Settings` holds the settings in force, on their gauges.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from edgemesh.common.config import TrainingConfig
from edgemesh.common.messages import Scalar
from edgemesh.common.messages.operations import SERVICE_COMMANDS
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.vocabulary import AGGREGATION_RULES, SYNC_POLICIES, AggregationRule, SyncPolicy

LR_LIMIT = 10.0
"""Learning rates ``set-lr`` (and a checkpoint) may set lie in (0, LR_LIMIT)."""
SETTING_COMMANDS: dict[str, tuple[str, str]] = {
    "set-sync-policy": ("policy", f"policy must be one of {', '.join(SYNC_POLICIES)}"),
    "set-bound": ("bound", "bound must be an integer >= 0"),
    "set-lr": ("lr", f"lr must be a number in (0, {LR_LIMIT:g})"),
    "set-aggregation": ("aggregation", f"aggregation must be one of {', '.join(AGGREGATION_RULES)}"),
}
"""Operator commands that set one setting: command -> (the setting, the reply to a value it refuses)."""
SETTINGS_COMMANDS = ("pause", "resume", *SETTING_COMMANDS)
"""Commands that change what the checkpoint keeps: a checkpoint is written at once, so a crash keeps them."""
COMMANDS = ", ".join(SERVICE_COMMANDS["ps"])


@dataclass(frozen=True, slots=True)
class OperatorSettings:
    """What an operator set that a checkpoint keeps, read back and checked (None: not kept, or not valid)."""

    policy: SyncPolicy | None = None
    bound: int | None = None
    lr: float | None = None
    paused: bool | None = None
    aggregation: AggregationRule | None = None
    delay_indices: dict[str, float] = field(default_factory=dict)
    cycles: dict[str, list[float]] = field(default_factory=dict)
    """``adaptive``: each cluster's last cycles (what the round deadline is learned from)."""
    norms: list[float] = field(default_factory=list)
    """Norms of the last contributions applied (what ``clip`` compares with)."""

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> OperatorSettings:
        bound, lr, paused, indices, norms = (settings.get(k) for k in ("bound", "lr", "paused", "delay_indices",
                                                                        "norms"))
        return cls(
            policy=next((p for p in SYNC_POLICIES if p == settings.get("policy")), None),
            bound=bound if isinstance(bound, int) and not isinstance(bound, bool) and bound >= 0 else None,
            lr=float(lr) if isinstance(lr, float | int) and not isinstance(lr, bool) and 0 < lr < LR_LIMIT else None,
            paused=paused if isinstance(paused, bool) else None,
            aggregation=next((r for r in AGGREGATION_RULES if r == settings.get("aggregation")), None),
            delay_indices={str(k): float(v) for k, v in indices.items()} if isinstance(indices, dict) else {},
            cycles=_cycles(settings.get("cycles")),
            norms=[float(v) for v in norms if isinstance(v, float | int)] if isinstance(norms, list) else [])

    def kept(self) -> dict[str, Any]:
        """What a checkpoint keeps of these (``of`` reads it back); a None setting is not kept."""
        kept: dict[str, Any] = {"policy": self.policy, "bound": self.bound, "lr": self.lr, "paused": self.paused,
                                "aggregation": self.aggregation}
        return {k: v for k, v in kept.items() if v is not None} | {
            "delay_indices": dict(self.delay_indices), "cycles": {c: list(a) for c, a in self.cycles.items()},
            "norms": list(self.norms)}

    @classmethod
    def command(cls, command: str, value: Scalar) -> OperatorSettings | str:
        """The setting ``pause``, ``resume`` or a ``set-...`` command (``SETTING_COMMANDS``) asks for, checked as
        a checkpoint's is; or the reply to a value it refuses."""
        if command in ("pause", "resume"):
            return cls(paused=command == "pause")
        key, refusal = SETTING_COMMANDS[command]
        wanted = cls.of({key: value})
        return wanted if getattr(wanted, key) is not None else refusal


class Settings:
    """The policy, bound, learning rate and pause in force: the configuration's, then a checkpoint's and the
    operator's commands'; the policy and the pause on their gauges."""

    def __init__(self, training: TrainingConfig, metrics: ServiceMetrics) -> None:
        self.policy: SyncPolicy = training.sync_policy
        self.bound = training.staleness_bound
        self.lr = training.lr
        self.paused = False
        self.m_policy = metrics.gauge("sync_policy_info", "1 for the active synchronization policy", ["policy"])
        self.m_paused = metrics.gauge("paused", "1 while paused by an operator")
        self.take(OperatorSettings())

    def take(self, kept: OperatorSettings) -> bool:
        """What ``kept`` sets (a None setting stays as it is); whether the policy changed."""
        changed = kept.policy is not None and kept.policy != self.policy
        self.policy = kept.policy or self.policy
        self.bound = kept.bound if kept.bound is not None else self.bound
        self.lr = kept.lr if kept.lr is not None else self.lr
        self.paused = kept.paused if kept.paused is not None else self.paused
        for p in SYNC_POLICIES:
            self.m_policy.labels(policy=p).set(1 if p == self.policy else 0)
        self.m_paused.set(1 if self.paused else 0)
        return changed


def _cycles(kept: Any) -> dict[str, list[float]]:
    """A checkpoint's cycles per cluster, each a finite, non-negative number of seconds (others are dropped)."""
    if not isinstance(kept, dict):
        return {}
    return {str(c): [float(v) for v in seconds
                     if isinstance(v, float | int) and not isinstance(v, bool) and math.isfinite(v) and v >= 0]
            for c, seconds in kept.items() if isinstance(seconds, list)}
