"""``edgemesh simulate``: a discrete-event simulation of a fleet training on a virtual clock (docs/simulation.md).

The services' own code decides everything that is not hardware: the parameter server's scheduler, aggregation and
optimizer, the planner's batches and plans, the worker's gradient and its encoding. The hardware is the emulation's
device profiles and seeded scenario timelines, replayed on the virtual clock instead of slept through, so a run
takes about the wall time of its gradients. As a library: :func:`simulate` (one run) and :func:`compare` (policies x
seeds, summarized), for benchmarks and the planner to call.
"""

from __future__ import annotations

from edgemesh.simulate.engine import POLICIES, Policy, SimRun, SimSettings, simulate
from edgemesh.simulate.fleet import straggler_fleet
from edgemesh.simulate.report import compare, summarize, table

__all__ = ["POLICIES", "Policy", "SimRun", "SimSettings", "compare", "simulate", "straggler_fleet", "summarize",
           "table"]
