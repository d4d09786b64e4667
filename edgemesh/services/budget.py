"""A host's memory budget for the jobs it serves (docs/jobs.md#memory-budget).

Before the parameter server's host or a worker's builds a job's model, it measures the model itself, on the
meta device (``models.meta_costs``: parameters counted, one sample's forward pass watched, nothing allocated), and
estimates what training it takes here (``models.derived_costs``: the parameters in their copies, the activations of a
batch). A model over the host's budget (``ps.memory_limit_mb``, ``worker.memory_limit_mb``; 0 = a share of the
host's RAM) is refused, naming the budget and the estimate: the host is not the one to find out by running out of
memory. The cost figures a submission carries are the submitter's word; a host that builds the model registers
its own in their place.

The planner and the compressor never build a job's model and have no budget.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from edgemesh.common import costs
from edgemesh.common.config import Config, ModelsConfig
from edgemesh.common.errors import EdgeMeshError, ModelError
from edgemesh.common.jobs import JobSpec, host_model_spec

if TYPE_CHECKING:
    from edgemesh.common.costs import LayerCost, ModelCost
    from edgemesh.common.models.derived_costs import MemoryNeed

logger = logging.getLogger(__name__)

DEFAULT_MEMORY_SHARE: Final = 0.8
"""The budget of a host whose ``memory_limit_mb`` is 0: this share of its RAM (``MemTotal``)."""


def host_memory_bytes() -> int:
    """This host's RAM."""
    import psutil

    return int(psutil.virtual_memory().total)


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """The most memory a host's service may need for a job's model, and how it estimates that need."""

    setting: str
    """The setting that gives it (``ps.memory_limit_mb``), named in a refusal."""
    limit_bytes: int
    derived: bool
    """Whether it is the default share of the host's RAM (the setting is 0)."""
    estimate: Callable[[ModelCost, Config], MemoryNeed]
    """The need of a model of that cost under a job's configuration, as this host's service holds it."""

    @classmethod
    def of(cls, role: str, config: Config, *, ram_bytes: int | None = None) -> MemoryBudget | None:
        """The budget of a host of ``role`` (None for a host that never builds a job's model)."""
        def server(cost: ModelCost, cfg: Config) -> MemoryNeed:
            from edgemesh.common.models.derived_costs import server_memory  # torch: only the hosts that build models

            return server_memory(cost, cfg.ps.shards)

        def worker(cost: ModelCost, cfg: Config) -> MemoryNeed:
            from edgemesh.common.models.derived_costs import worker_memory

            return worker_memory(cost, cfg.training.batch_size)

        match role:
            case "ps":
                setting, limit_mb, estimate = "ps.memory_limit_mb", config.ps.memory_limit_mb, server
            case "worker":
                setting, limit_mb, estimate = "worker.memory_limit_mb", config.worker.memory_limit_mb, worker
            case _:
                return None
        if limit_mb:
            return cls(setting, limit_mb * 2**20, False, estimate)
        ram = host_memory_bytes() if ram_bytes is None else ram_bytes
        return cls(setting, int(ram * DEFAULT_MEMORY_SHARE), True, estimate)

    def describe(self) -> str:
        mib = self.limit_bytes // 2**20
        if self.derived:
            return f"{mib} MiB ({self.setting} = 0: {DEFAULT_MEMORY_SHARE:.0%} of this host's RAM)"
        return f"{mib} MiB ({self.setting})"

    def check(self, job: JobSpec, config: Config) -> MemoryNeed:
        """Measure ``job``'s model without allocating it and check it against the budget (blocking: in a thread);
        its figures are then registered as this host's (not the submission's). ModelError naming the budget and
        the estimate when it is over, or naming the model when it does not build."""
        cost, layers, why = job_costs(job, config.models)
        need = self.estimate(cost, config)
        if need.total_bytes > self.limit_bytes:
            raise ModelError(f"the model is over this host's memory budget: training it here needs an estimated "
                             f"{need.describe()}, the budget is {self.describe()}")
        costs.register(job.model_key, cost, layers, why=why)
        return need


def job_costs(job: JobSpec, trust: ModelsConfig) -> tuple[ModelCost, tuple[LayerCost, ...] | None, str]:
    """The figures of ``job``'s model as this host measures it, built on the meta device: (cost, layer figures or
    None, why there are none). An entry point is imported (only from a module ``trust`` allows) and called there
    too; one whose model cannot be built on the meta device is built for real, as serving the job would."""
    import torch

    from edgemesh.common.models.derived_costs import built_costs, meta_costs

    entry = job.model.entry_point
    if not entry:
        return meta_costs(host_model_spec(job, trust))  # a layer list is checked on the meta device already
    _import_first(entry, trust)
    try:
        with torch.device("meta"):
            return meta_costs(host_model_spec(job, trust))
    except EdgeMeshError as exc:
        logger.warning("job %s: entry point %s does not build on the meta device (%s); measuring it built for real",
                       job.name, entry, exc)
    return built_costs(host_model_spec(job, trust))  # ModelError naming the entry point when it fails for real too


def _import_first(entry_point: str, trust: ModelsConfig) -> None:
    """Import the entry point's module, if ``trust`` allows it, outside the meta device: the tensors it makes when
    it is imported (constants, tables) are real ones then, as the model built for training needs them. Any failure
    is left for the spec to report, naming the entry point."""
    from edgemesh.common.models.entry_point import check_allowed

    check_allowed(entry_point, trust.allowed)
    added = [p for p in trust.path if p not in sys.path]
    sys.path[:0] = added
    try:
        importlib.import_module(entry_point.partition(":")[0])
    except Exception as exc:  # noqa: BLE001 - whatever the module raises: the spec says it, naming the entry point
        logger.debug("importing %s failed: %s", entry_point, exc)
    finally:
        for entry in added:
            if entry in sys.path:
                sys.path.remove(entry)
