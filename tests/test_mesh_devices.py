"""Edge Mesh planning, the devices (planner/mesh/devices.py): cluster names and the benchmark fleet."""

from __future__ import annotations

import pytest

from edgemesh.common.topics import valid_name
from edgemesh.services.planner.mesh.devices import FLEET_CLASSES, MAX_NAME, cluster_name, sample_fleet


def test_cluster_names() -> None:
    assert cluster_name(("pi-1",)) == "c-pi-1"
    assert cluster_name(("pi-1", "pi-2")) == "m-pi-1"
    long = "x" * 70
    name = cluster_name((long, "y"))
    assert len(name) == 64 and valid_name(name) and name.startswith("m-x")
    assert name != cluster_name(("x" * 69 + "z", "y"))
    with pytest.raises(ValueError):
        cluster_name(())


def test_one_function_names_single_device_clusters_and_meshes() -> None:
    assert cluster_name(["x"]) == "c-x"
    assert cluster_name(["a", "b", "c"]) == "m-a"
    # over 64 characters both kinds are shortened, stay valid, and stay unique per first member
    long_a, long_b = "a" * 63 + "x", "a" * 63 + "y"
    names = [cluster_name([long_a]), cluster_name([long_b]), cluster_name([long_a, "b"]), cluster_name([long_b, "b"])]
    assert len(set(names)) == 4
    assert all(len(n) == MAX_NAME and valid_name(n) for n in names)
    assert names[0].startswith("c-a") and names[2].startswith("m-a")
    assert cluster_name([long_a]) == cluster_name((long_a,))  # any sequence of names, the same name
    # a bare name is not a list of one member (a string is a sequence of one-letter names)
    with pytest.raises(TypeError):
        cluster_name("pi-1")


def test_the_benchmark_fleet_is_a_pure_function_of_its_seed() -> None:
    fleet = sample_fleet(40, seed=2)
    assert fleet == sample_fleet(40, seed=2) and fleet != sample_fleet(40, seed=3)
    assert len({d.device for d in fleet}) == 40
    classes = {c[0]: c for c in FLEET_CLASSES}
    for d in fleet:
        _, _, flops, memory, _ = classes[d.device.rsplit("-", 1)[0]]
        assert 0.8 * flops <= d.flops <= 1.2 * flops and d.memory_bytes == int(memory)
        assert 0.001 <= d.latency_s <= 0.010
