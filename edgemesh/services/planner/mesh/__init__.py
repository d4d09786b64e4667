"""Edge Mesh planning (docs/mesh.md): the filter division inside a cluster and the hybrid training grid.

Pure functions, no I/O and no torch: the planner service wires them to the bus, tests and
``bench/`` call them directly. Four modules, each documenting its part:

* ``devices``: ``DeviceInfo`` (what the planner knows of a device), ``cluster_name`` and the
  benchmark fleet (``sample_fleet``);
* ``cost_model``: a member's predicted step time and memory, and a cluster's iteration;
* ``division``: ``divide_filters`` splits every divisible layer of a model among the members of
  one cluster;
* ``grid``: ``training_grid`` chooses the clusters of a whole fleet, ``needs_replan`` and
  ``links_moved`` whether a grid should give way to a new one.

The names below are the package's interface. Each module imports only those listed before it,
and none imports the planner's ``layout`` (which makes plans of grids).
"""

from __future__ import annotations

from edgemesh.services.planner.mesh.cost_model import (
    DEFAULT_LINK_BPS,
    FLOAT32_WIRE,
    StepTime,
    Wire,
    cluster_iteration_s,
    layer_seconds,
    member_memory,
    member_step,
    member_time,
    wire_for,
)
from edgemesh.services.planner.mesh.devices import FLEET_CLASSES, DeviceInfo, cluster_name, sample_fleet
from edgemesh.services.planner.mesh.division import Division, divide_filters
from edgemesh.services.planner.mesh.grid import (
    DEFAULT_MAX_CLUSTER_SIZE,
    REPLAN_THRESHOLD,
    Grid,
    GridCluster,
    grid_iteration_s,
    links_moved,
    needs_replan,
    time_layout,
    training_grid,
)

__all__ = [
    "DEFAULT_LINK_BPS",
    "DEFAULT_MAX_CLUSTER_SIZE",
    "FLEET_CLASSES",
    "FLOAT32_WIRE",
    "REPLAN_THRESHOLD",
    "DeviceInfo",
    "Division",
    "Grid",
    "GridCluster",
    "StepTime",
    "Wire",
    "cluster_iteration_s",
    "cluster_name",
    "divide_filters",
    "grid_iteration_s",
    "layer_seconds",
    "links_moved",
    "member_memory",
    "member_step",
    "member_time",
    "needs_replan",
    "sample_fleet",
    "time_layout",
    "training_grid",
    "wire_for",
]
