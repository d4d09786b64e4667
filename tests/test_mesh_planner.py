"""Model-parallel plans: what a plan's cluster must hold to be valid, the wire sizes the planner's
cost model charges, and the planner laying out a training grid on a real broker (``planner.parallelism
= "mesh"``)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from helpers import SPLIT, Inbox, make_config, mesh_plan, planner_devices, running, share_memory

from edgemesh.common import costs, models
from edgemesh.common.codecs import bytes_per_value
from edgemesh.common.config import load_config
from edgemesh.common.errors import ConfigError
from edgemesh.common.messages import (
    DeviceHello,
    DeviceStats,
    DeviceStatus,
    Event,
    LayerDivision,
    Plan,
    PlanCluster,
    PlanDevice,
    SyncState,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.planner import mesh
from edgemesh.services.planner.mesh import DeviceInfo, wire_for
from edgemesh.services.planner.planning import MeshParallel
from edgemesh.services.planner.registry import Registry
from edgemesh.services.planner.service import Planner

PLAN_WAIT_S = 30.0
"""How long the planner may take to lay out a grid."""

# --------------------------------------------------------------------------- plans and wire sizes (pure)


def test_plans_refuse_a_model_parallel_cluster_without_a_sound_division() -> None:
    with pytest.raises(ValueError, match="no filter division"):
        PlanCluster(cluster="m-a", members=("a", "b")).validate()
    with pytest.raises(ValueError, match="3 counts for 2 members"):
        PlanCluster(cluster="m-a", members=("a", "b"),
                    division=(LayerDivision(layer="conv1", counts=(1, 2, 13)),)).validate()
    with pytest.raises(ValueError, match="appears twice"):
        PlanCluster(cluster="m-a", members=("a", "a"),
                    division=(LayerDivision(layer="conv1", counts=(8, 8)),)).validate()
    plan = mesh_plan(["a", "b"], SPLIT)
    with pytest.raises(ValueError, match="not a member"):
        replace(plan, devices=(*plan.devices, PlanDevice(device="c", cluster="m-a", shard_index=0, shard_count=1,
                                                         batch_size=8))).validate()


def test_codec_sizes_the_cost_model_charges_are_measured_from_the_codecs() -> None:
    assert bytes_per_value("none") == 4.0 and bytes_per_value("fp16") == 2.0
    assert bytes_per_value("grid", 0.3) < bytes_per_value("grid", 0.9) < 4.0
    wire = wire_for(load_config(env={}, overrides={"worker.mesh_dtype": "float16", "ps.delta_codec": "fp16"}))
    assert (wire.activation, wire.gradient, wire.model) == (2.0, 2.0, 2.0)
    assert wire_for(load_config(env={}, overrides={"ps.broadcast": "snapshot"})).model == 4.0
    # the deltas' codec by default follows the job's policy: a round's whole in fp16, an async update's grid-coded
    assert wire_for(load_config(env={}, overrides={"training.sync_policy": "sync"})).model == 2.0
    assert wire_for(load_config(env={}, overrides={"training.sync_policy": "async"})).model == bytes_per_value(
        "grid", 0.3)


# --------------------------------------------------------------------------- the planner lays out a mesh

# gigabit boards, two of which cannot hold the model alone
BOARDS = {"big-0": (60e9, 7 << 30), "big-1": (60e9, 7 << 30), "small-0": (20e9, 268 << 20),
          "small-1": (20e9, 268 << 20), "small-2": (20e9, 268 << 20)}


def board_hello(name: str) -> DeviceHello:
    flops, memory = BOARDS[name]
    return DeviceHello(device=name, incarnation=1, flops=flops, memory_bytes=memory, link_rate_bps=117e6,
                       latency_s=0.0002)


@contextlib.asynccontextmanager
async def mesh_planner(broker: BrokerProcess, job: str,
                       overrides: dict[str, str] | None = None) -> AsyncIterator[tuple[Planner, Inbox]]:
    """A mesh planner for the 64-sample iterations of cifar-cnn, BOARDS announced to it and online,
    and a client that sees its plans."""
    cfg = make_config(broker, job=job, **{
        "planner.parallelism": "mesh", "planner.round_samples": "64", "planner.replan_debounce_s": "0.05",
        "training.model_spec": "cifar-cnn", "training.dataset": "synthetic-cifar", **(overrides or {})})
    planner = Planner(cfg)
    async with running(planner), planner_devices(cfg) as box:
        for name in BOARDS:
            await box.publish(box.topics.hello(name), board_hello(name), retain=True)
            await box.publish(box.topics.status(name), DeviceStatus(device=name, state="online", incarnation=1),
                              retain=True)
        yield planner, box


async def test_the_planner_lays_out_a_training_grid_and_re_plans_when_a_member_leaves(
        mosquitto_broker: BrokerProcess) -> None:
    async with mesh_planner(mosquitto_broker, "meshplan") as (planner, box):

        def every_board(p: Plan) -> bool:
            """``p`` is the planner's grid, and it plans or leaves idle all five boards."""
            grid = planner.parallelism.grid
            return grid is not None and {d.device for d in p.devices} == {
                m for c in grid.clusters for m in c.members} and len(p.devices) + len(grid.idle) == 5

        first = await box.next(Plan, every_board, PLAN_WAIT_S)
        await box.publish(box.topics.status("small-1"), DeviceStatus(device="small-1", state="offline",
                                                                     incarnation=1), retain=True)
        second = await box.next(Plan, lambda p: p.device("small-1") is None and p.version > first.version,
                                PLAN_WAIT_S)
    for plan in (first, second):
        batches = {d.cluster: d.batch_size for d in plan.devices}
        assert sum(batches.values()) == 64  # the iteration's samples, split among the clusters
        for c in plan.clusters:
            assert [d.cluster for d in plan.devices if d.device in c.members] == [c.cluster] * len(c.members)
            assert c.predicted_iteration_s > 0
            if len(c.members) > 1:
                assert {d.layer for d in c.division} == {la.name for la in costs.layers("cifar-cnn")}
        # the small boards are never alone: they cannot hold the model
        assert all(len(c.members) > 1 for c in plan.clusters if any(m.startswith("small") for m in c.members))
        assert plan.round_time_s == max(c.predicted_iteration_s for c in plan.clusters)
    assert any(len(c.members) > 1 for c in first.clusters)
    assert second.reason == "leave"


@pytest.mark.parametrize(("overrides", "clusters", "samples"), [
    ({}, 2, 64),
    ({"planner.grid_slack": "1.0"}, 1, 64),  # one replica is within the slack of the fastest layout
    ({"planner.grid_slack": "1.0", "planner.max_batch": "40"}, 2, 64),  # ... but trains more than 40
    ({"planner.max_batch": "20"}, 2, 40),  # the small boards cannot form a third cluster: 40 samples
])
async def test_the_planners_grid_follows_the_slack_and_batch_bounds_it_is_configured_with(
        mosquitto_broker: BrokerProcess, overrides: dict[str, str], clusters: int, samples: int) -> None:
    async with mesh_planner(mosquitto_broker, f"meshbounds{len(overrides)}{clusters}", overrides) as (planner, box):
        plan = await box.next(Plan, lambda p: len(p.devices) == 5, PLAN_WAIT_S)
    batches = {d.cluster: d.batch_size for d in plan.devices}
    assert len(plan.clusters) == clusters
    assert sum(batches.values()) == samples
    low, high = int(overrides.get("planner.min_batch", "4")), int(overrides.get("planner.max_batch", "128"))
    assert all(low <= b <= high for b in batches.values()), batches
    grid = mesh.training_grid("cifar-cnn", [DeviceInfo.from_hello(board_hello(n)) for n in BOARDS], batch=64,
                              slack=float(overrides.get("planner.grid_slack", "0")), min_batch=low, max_batch=high,
                              wire=wire_for(planner.cfg))
    assert sorted(c.members for c in plan.clusters) == sorted(c.members for c in grid.clusters)


async def test_under_adaptive_the_grid_gives_a_cluster_of_slow_members_a_smaller_batch(
        mosquitto_broker: BrokerProcess) -> None:
    overrides = {"training.sync_policy": "adaptive"}
    async with mesh_planner(mosquitto_broker, "meshslow", overrides) as (planner, box):
        first = await box.next(Plan, lambda p: len(p.devices) == 5, PLAN_WAIT_S)
        cluster = first.device("big-1").cluster  # type: ignore[union-attr]
        members = next(c.members for c in first.clusters if c.cluster == cluster)
        before = first.device("big-1").batch_size  # type: ignore[union-attr]
        # the PS finds the cluster's members three versions behind: they train as if 4x slower
        await box.publish(box.topics.sync(), SyncState(policy="adaptive", version=9, bound=2, slow=members,
                                                       delay_indices=dict.fromkeys(members, 3.0)), retain=True)
        second = await box.next(Plan, lambda p: p.version > first.version, PLAN_WAIT_S)
    after = {d.device: d.batch_size for d in second.devices}
    assert all(after[m] < before for m in members if m in after), (before, after)  # members may go idle too


async def test_the_grid_plans_with_the_links_devices_measure_where_their_hellos_declare_none(
        mosquitto_broker: BrokerProcess) -> None:
    """A real device's hello carries no links: the links in its stats replace the cost model's 100 Mbit/s, and a
    grid laid out for them that predicts an iteration shorter by the margin goes out (``links``). A declared figure
    wins over a measured one; a previous incarnation's stats count for nothing."""
    cfg = make_config(mosquitto_broker, job="meshmeasured", **{
        "planner.parallelism": "mesh", "planner.round_samples": "16", "planner.min_devices": "2",
        "planner.replan_debounce_s": "0.05", "planner.rebalance_interval_s": "0.1",
        "planner.replan_threshold": "0.02",  # two members that must share the model: a new division gains 4 %
        "ps.delta_codec": "grid"})  # (of an iteration whose model deltas are not fp16's, sync's default)
    memory = share_memory("digits-cnn", 0.7, 16)  # neither holds the model alone: one cluster of the two
    hellos = {"real": DeviceHello(device="real", incarnation=2, flops=20e9, memory_bytes=memory),
              "declared": DeviceHello(device="declared", incarnation=1, flops=20e9, memory_bytes=memory,
                                      link_rate_bps=50e6, downlink_rate_bps=60e6, latency_s=0.001)}
    planner = Planner(cfg)
    async with running(planner), planner_devices(cfg) as box:
        for name, hello in hellos.items():
            await box.publish(box.topics.hello(name), hello, retain=True)
            await box.publish(box.topics.status(name), DeviceStatus(device=name, state="online",
                                                                    incarnation=hello.incarnation), retain=True)
        first = await box.next(Plan, lambda p: len(p.devices) == 2, PLAN_WAIT_S)
        for name, incarnation in (("real", 1), ("real", 2), ("declared", 1)):  # real's first: an old incarnation's
            await box.publish(box.topics.stats(name), DeviceStats(
                device=name, incarnation=incarnation, link_rate_bps=200e3 * incarnation, downlink_rate_bps=800e3,
                latency_s=0.005))
        second = await box.next(Plan, lambda p: p.version > first.version, PLAN_WAIT_S)
    planned = {d.device: d for d in planner.parallelism.grid_devices}
    assert second.reason == "links"
    assert (planned["real"].link_rate_bps, planned["real"].downlink_rate_bps, planned["real"].latency_s) == (
        400e3, 800e3, 0.005)
    assert (planned["declared"].link_rate_bps, planned["declared"].downlink_rate_bps,
            planned["declared"].latency_s) == (50e6, 60e6, 0.001)
    assert second.round_time_s > 2 * first.round_time_s


@pytest.mark.parametrize(("dataset", "level"), [("csv", logging.WARNING), ("digits", logging.INFO)])
def test_a_device_the_grid_leaves_idle_is_a_warning_when_its_data_goes_untrained(
        dataset: str, level: int, caplog: pytest.LogCaptureFixture) -> None:
    """A job whose data lives on the devices (a CSV, an image folder, an npz on each): a device the grid leaves
    idle trains none of its own data, which the planner says as a warning; on data every device holds (digits),
    idle is only slower."""
    config = load_config(env={}, overrides={"planner.parallelism": "mesh", "training.dataset": dataset})
    parallelism = MeshParallel(config, Registry(), ServiceMetrics("planner").gauge("predicted_round_seconds", "-"))
    grid = mesh.Grid(clusters=(), excluded=(), idle=("pi3-1",), predicted_iteration_s=0.1, throughput_samples_s=1.0)
    with caplog.at_level(logging.INFO, logger="edgemesh.services.planner.planning"):
        parallelism._log_left_out(grid)
    [record] = [r for r in caplog.records if "idle" in r.getMessage()]
    assert record.levelno == level and "pi3-1" in record.getMessage()
    assert ("not trained on" in record.getMessage()) == (level == logging.WARNING)


async def test_a_model_the_grid_cannot_divide_trains_data_parallel_where_the_job_allows_it(
        mosquitto_broker: BrokerProcess) -> None:
    """Group norm's groups would span the members' channels: under ``parallelism = mesh`` the planner refuses the
    model, naming the way out; with ``planner.mesh_fallback`` it plans every device its own cluster and says why
    in a ``mesh_fallback`` event."""
    models.register_spec(models.layer_list_spec("test-fallback-groupnorm", [
        {"conv2d": 8, "kernel": 3, "padding": 1}, {"groupnorm": 2}, "relu", "globalavgpool", {"linear": 10}],
        (3, 32, 32), 10))
    settings = {"planner.parallelism": "mesh", "planner.replan_debounce_s": "0.05",
                "training.model_spec": "test-fallback-groupnorm", "training.dataset": "synthetic-cifar"}
    with pytest.raises(ConfigError, match=r"cannot divide module 'gn1'.*planner.mesh_fallback = true"):
        Planner(make_config(mosquitto_broker, job="fallback", **settings))
    cfg = make_config(mosquitto_broker, job="fallback", **settings, **{"planner.mesh_fallback": "true"})
    async with planner_devices(cfg) as box:
        async with running(Planner(cfg)):
            said = await box.next(Event, lambda e: e.kind == "mesh_fallback", PLAN_WAIT_S)
            for name in BOARDS:
                await box.publish(box.topics.hello(name), board_hello(name), retain=True)
                await box.publish(box.topics.status(name), DeviceStatus(device=name, state="online", incarnation=1),
                                  retain=True)
            plan = await box.next(Plan, lambda p: len(p.devices) == len(BOARDS), PLAN_WAIT_S)
    assert "cannot divide module 'gn1'" in said.message and "trained data parallel" in said.message
    assert all(len(c.members) == 1 for c in plan.clusters) and not any(c.division for c in plan.clusters)
