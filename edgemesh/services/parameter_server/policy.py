"""Synchronization rules of the parameter server as pure functions (DESIGN.md §5).

The PS keeps a version clock ``v``; an update computed on version ``b`` has delay ``d = v - b``.

* ``sync``  (BSP): one update per live cluster per round, all computed on the current version;
  anything older is stale.
* ``async`` (ASP): apply every update on arrival while ``d <= bound``.
* ``ssp``: like ``async``, and a cluster whose clock (accepted updates) runs more than
  ``bound`` ahead of the slowest live cluster waits (its update is held, not acked).
* ``adaptive``: rounds like ``sync`` that close at a deadline; delay index, deadline and an
  adapted bound are in :mod:`edgemesh.services.parameter_server.adaptive`.

An update with ``d > bound`` is discarded and its sender told to resync.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

Policy = Literal["sync", "async", "ssp", "adaptive"]
POLICIES: tuple[str, ...] = ("sync", "async", "ssp", "adaptive")
"""Policies this parameter server implements."""


@dataclass(frozen=True, slots=True)
class Verdict:
    accept: bool
    delay: int
    reason: str = ""


def judge(policy: Policy, version: int, base_version: int, bound: int) -> Verdict:
    """Accept or discard an update computed on ``base_version`` when the PS is at ``version``."""
    delay = version - base_version
    if delay < 0:
        return Verdict(False, delay, "future")
    limit = 0 if policy == "sync" else bound
    if delay > limit:
        return Verdict(False, delay, "stale")
    return Verdict(True, delay)


def staleness_weight(delay: int) -> float:
    """Scale of an update applied ``delay`` versions late: ``1 / (1 + delay)``.

    A stale gradient points where the model was, not where it is; damping it by its delay
    keeps asynchronous SGD with momentum stable (Zhang et al., "Staleness-aware Async-SGD", 2016).
    """
    return 1.0 / (1.0 + max(0, delay))


def must_wait(policy: Policy, cluster: str, clocks: Mapping[str, int], live: Iterable[str], bound: int) -> bool:
    """SSP gate: True when ``cluster`` is more than ``bound`` accepted updates ahead of the slowest live one."""
    if policy != "ssp":
        return False
    others = [clocks.get(c, 0) for c in live if c != cluster]
    if not others:
        return False
    return clocks.get(cluster, 0) - min(others) > bound


def round_complete(contributed: Iterable[str], live: Iterable[str]) -> bool:
    """BSP: every live cluster has contributed to the current round (and there is at least one)."""
    got = set(contributed)
    need = set(live)
    return bool(got) and need <= got
