"""Edge Mesh planning (docs/mesh.md): the filter division inside a cluster and the hybrid training grid.

Pure functions, no I/O and no torch: the planner service wires them to the bus, tests and
``bench/`` call them directly. Four modules, each documenting its part:

* ``devices``: ``DeviceInfo`` (what the planner knows of a device), ``cluster_name`` and the
  benchmark fleet (``sample_fleet``);
* ``member_cost``: a member's predicted step time and memory, and a cluster's iteration;
* ``division``: ``divide_filters`` splits every divisible layer of a model among the members of
  one cluster;
* ``grid``: ``training_grid`` chooses the clusters of a whole fleet, ``grid_iteration_s`` predicts a grid's
  iteration on given figures (whether a grid gives way to a new one is the planner's ``stability``).

The names below are the package's interface. Each module imports only those listed before it,
and none imports the planner's ``layout`` (which makes plans of grids).
"""

from __future__ import annotations

from edgemesh.services.planner.mesh.devices import FLEET_CLASSES, DeviceInfo, cluster_name, sample_fleet
from edgemesh.services.planner.mesh.division import Division, divide_filters
from edgemesh.services.planner.mesh.grid import (
    DEFAULT_MAX_CLUSTER_SIZE,
    Grid,
    GridCluster,
    grid_iteration_s,
    time_layout,
    training_grid,
)
from edgemesh.services.planner.mesh.member_cost import (
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

__all__ = [
    "DEFAULT_LINK_BPS",
    "DEFAULT_MAX_CLUSTER_SIZE",
    "FLEET_CLASSES",
    "FLOAT32_WIRE",
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
    "member_memory",
    "member_step",
    "member_time",
    "sample_fleet",
    "time_layout",
    "training_grid",
    "wire_for",
]
