"""The trials of ``bench transport`` and what several rounds of them measured together.

One trial of a side, on a host whose load drifts, has swung that side's MB/s by a factor of three from one run to
the next here. ``bench transport`` therefore runs each side ``--rounds`` times, in turn first and last (ABBA), and
pools every round's trials of a side (:class:`Pooled`): its figures are those of all its messages over all its
seconds, and its CPU over the same seconds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from edgemesh.local.processes import cpu_seconds

MB = 1_000_000


@dataclasses.dataclass(slots=True)
class Trial:
    """What one trial measured."""

    messages: int = 0
    payload_bytes: int = 0
    seconds: float = 0.0
    latencies: list[float] = dataclasses.field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)

        def pct(q: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3, 2) if lat else None
        return {"messages": self.messages, "seconds": round(self.seconds, 3),
                "mb_per_s": round(self.payload_bytes / MB / self.seconds, 1) if self.seconds else None,
                "messages_per_s": round(self.messages / self.seconds, 1) if self.seconds else None,
                "p50_ms": pct(0.5), "p99_ms": pct(0.99)}


def cpu_now(broker_pid: int | None, ps_pids: list[int]) -> dict[str, float]:
    """CPU seconds so far: the host's busy time (all cores), the broker's, this process's (the devices) and the
    parameter server's processes'."""
    import psutil

    host = psutil.cpu_times()
    me = psutil.Process().cpu_times()
    return {"host": host.user + host.nice + host.system + getattr(host, "irq", 0.0) + getattr(host, "softirq", 0.0),
            "broker": cpu_seconds(broker_pid), "devices": me.user + me.system,
            "ps": sum(cpu_seconds(pid) for pid in ps_pids)}


@dataclasses.dataclass(slots=True)
class Pooled:
    """One side's trials at one payload and number in flight, over every round."""

    trial: Trial = dataclasses.field(default_factory=Trial)
    cpu: dict[str, float] = dataclasses.field(default_factory=dict)
    """CPU seconds during the trials, by ``cpu_now``'s keys."""
    samples: dict[Any, float] = dataclasses.field(default_factory=dict)
    """How much the parameter server's metrics moved during the trials (its processes' summed)."""

    def add(self, trial: Trial, before: dict[str, float], after: dict[str, float],
            samples: dict[Any, float] | None = None) -> Trial:
        """Pool ``trial``, the ``cpu_now`` readings around it and its metrics' deltas; returns ``trial``."""
        self.trial.messages += trial.messages
        self.trial.payload_bytes += trial.payload_bytes
        self.trial.seconds += trial.seconds
        self.trial.latencies += trial.latencies
        for key, value in after.items():
            self.cpu[key] = self.cpu.get(key, 0.0) + value - before[key]
        for key, value in (samples or {}).items():
            self.samples[key] = self.samples.get(key, 0.0) + value
        return trial

    def cores(self) -> dict[str, float]:
        """Cores busy on average during the trials (the parameter server's only if it ran)."""
        seconds = self.trial.seconds
        return {k: round(v / seconds, 2) for k, v in self.cpu.items() if seconds > 0 and (k != "ps" or v)}

    def cpu_per_message(self) -> float | None:
        """The parameter server's CPU seconds per message (update) acked."""
        return round(self.cpu.get("ps", 0.0) / self.trial.messages, 4) if self.trial.messages else None

    def per_update(self) -> dict[str, Any]:
        """Per update acked, what the parameter server's metrics say its time went to (histogram sums)."""
        def moved(name: str) -> float:
            return sum(v for (n, _), v in self.samples.items() if n == name)
        updates = self.trial.messages
        if not updates:
            return {}
        return {"step_ms_per_update": round(moved("edgemesh_ps_step_seconds_sum") / updates * 1e3, 3),
                "handler_ms_per_update": round(moved("edgemesh_ps_handler_seconds_sum") / updates * 1e3, 3),
                "wal_bytes_per_update": round(moved("edgemesh_ps_wal_bytes_total") / updates)}
