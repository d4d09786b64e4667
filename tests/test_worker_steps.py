"""A device's training steps (services/worker/step.py): one step alone on the held model, what it counts and what
its update carries, and a model-parallel member that a plan leaves alone leaving its cluster first."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Mapping

import numpy as np
import pytest
from helpers import SPLIT, inbox, make_config, mesh_plan, plan_for, until

from edgemesh.common import models
from edgemesh.common.broadcast import ModelView
from edgemesh.common.bus import Bus
from edgemesh.common.codecs import get_codec
from edgemesh.common.config import Config, load_config
from edgemesh.common.data import BatchIterator
from edgemesh.common.messages import (
    GradientUpdate,
    ModelDelta,
    ModelSnapshot,
    Plan,
    PlanDevice,
    ShardUpdate,
    SnapshotRequest,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.common.wire.tensors import Tensor
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.worker.board import Board
from edgemesh.services.worker.mesh.session import MeshSession
from edgemesh.services.worker.source import WholeModel
from edgemesh.services.worker.stats import Recent
from edgemesh.services.worker.step import Steps
from edgemesh.services.worker.trainer import Trainer

DEVICE = "pi-7"
OTHER = "pi-8"
INCARNATION = 2
SPEC = "digits-cnn"
BN_SPEC = "steps-digits-bn"
"""A small model of digits with batch norm: its steps move buffers."""
BN_LAYERS = [{"conv2d": 4, "kernel": 3}, "batchnorm", "relu", "flatten", {"linear": 10}]


class Worker:
    """A worker's step machinery, wired as the worker wires it (services/worker/service.py), without its loop."""

    def __init__(self, config: Config, *, spec: str = SPEC, incarnation: int = INCARNATION,
                 plan: Callable[[], Plan | None] = lambda: None) -> None:
        topics = Topics(config.job)
        self.metrics = metrics = ServiceMetrics("worker")
        self.recent = Recent(config.worker, topics, metrics)
        board = Board(config.worker, DEVICE, self.recent.link, metrics)
        self.trainer = Trainer(config, DEVICE, board)
        self.source = WholeModel(ModelView(), topics=topics, device=DEVICE, trainer=self.trainer,
                                 seed=config.training.seed, spec=lambda: spec, changed=self._changed)
        self.mesh = MeshSession(topics=topics, device=DEVICE, config=config.worker, view=self.source.view, board=board,
                                trainer=self.trainer, metrics=metrics, current_plan=plan, wait=self._wait,
                                on_delta=self.source.on_delta, ask_for_model=self.source.ask)
        self.steps = Steps(device=DEVICE, incarnation=incarnation, trainer=self.trainer, board=board,
                           source=self.source, mesh=self.mesh, recent=self.recent, metrics=metrics)
        self.job = config.job

    async def _changed(self) -> None:
        """Nothing waits on the model here: the test steps when it has loaded one."""

    async def _wait(self, what: str, predicate: Callable[[], bool]) -> None:
        await until(what, predicate)

    async def load(self, params: Mapping[str, np.ndarray], version: int, spec: str = SPEC) -> None:
        """The parameter server's snapshot of ``params`` at ``version``, as the worker's route hands it over."""
        await self.source.on_snapshot(snapshot(params, version, spec), TopicMatch(job=self.job, kind="model"))

    async def delta(self, change: float, version: int, base: int) -> None:
        """A delta adding ``change`` to every tensor, from ``base`` to ``version``."""
        view = self.source.view
        assert view.params is not None
        shards = tuple(ShardUpdate(param=name, start=0, stop=p.shape[0], codec="none",
                                   data=np.full(p.shape, change, np.float32).tobytes())
                       for name, p in view.params.items())
        await self.source.on_delta(ModelDelta(version=version, base_version=base, model_spec=SPEC, shards=shards),
                                   TopicMatch(job=self.job, kind="delta"))

    def value(self, name: str) -> float:
        return self.metrics.value(f"edgemesh_worker_{name}")


def worker_config(**settings: object) -> Config:
    return load_config(env={}, overrides={"job": f"steps-{uuid.uuid4().hex[:6]}", **{
        key: str(value) for key, value in settings.items()}})


def snapshot(params: Mapping[str, np.ndarray], version: int, spec: str = SPEC) -> ModelSnapshot:
    return ModelSnapshot(version=version, model_spec=spec,
                         tensors={name: Tensor.from_numpy(np.ascontiguousarray(p)) for name, p in params.items()})


def initial(seed: int, spec: str = SPEC) -> dict[str, np.ndarray]:
    """A freshly built model's state: parameters and buffers, as a parameter server's snapshot holds them."""
    return models.get_params(models.build_model(spec, seed=seed))


def me_in(plan: Plan) -> PlanDevice:
    me = plan.device(DEVICE)
    assert me is not None
    return me


def first_batch(worker: Worker, plan: Plan, me: PlanDevice) -> tuple[np.ndarray, np.ndarray]:
    """The first batch the device draws from its shard under ``plan``."""
    return next(BatchIterator(worker.trainer.shard(plan, me), me.batch_size, seed=plan.seed + me.shard_index))


def decoded(shards: tuple[ShardUpdate, ...], layout: Mapping[str, tuple[tuple[int, ...], str]]) -> dict[
        str, np.ndarray]:
    """Whole tensors of ``shards`` (one per name, rows 0 to the end), decoded as the parameter server does."""
    out = {}
    for s in shards:
        shape = layout[s.param][0]
        assert (s.start, s.stop) == (0, shape[0]), s.param
        out[s.param] = get_codec(s.codec).decode(s.data, int(np.prod(shape))).reshape(shape)
    return out


def registered_bn_spec() -> str:
    """``BN_SPEC``, registered in this process (again: the same spec)."""
    models.register_spec(models.layer_list_spec(BN_SPEC, BN_LAYERS, (1, 8, 8), 10))
    return BN_SPEC


# --------------------------------------------------------------------------- alone: one step on the held model


async def test_a_step_alone_is_the_gradient_of_the_next_batch_on_the_held_model() -> None:
    worker = Worker(worker_config())
    params = initial(seed=5)
    await worker.load(params, 4)
    plan = plan_for([DEVICE, OTHER], version=3, batch=8)
    me = me_in(plan)

    update = await worker.steps.next(plan, me, None)

    assert isinstance(update, GradientUpdate)
    x, y = first_batch(worker, plan, me)
    reference = models.build_model(SPEC)
    models.set_params(reference, params)
    loss, grads = models.compute_gradients(reference, x, y)
    assert update.loss == pytest.approx(loss, rel=1e-5)
    sent = decoded(update.shards, models.gradient_layout(reference))
    assert set(sent) == set(grads)  # every parameter, whole: no policy yet, so no codec
    for name, g in grads.items():
        np.testing.assert_allclose(sent[name], g, rtol=1e-5, atol=1e-7)
    assert (update.device, update.cluster, update.incarnation, update.seq) == (DEVICE, f"c-{DEVICE}", INCARNATION, 1)
    assert (update.base_version, update.need_snapshot, update.plan_version, update.samples) == (4, False, 3, 8)
    assert update.buffers == ()  # digits-cnn's only buffers are its standardization's constants: they stay home
    assert update.mesh_step == 0 and update.step_time_s >= 0


async def test_steps_are_numbered_per_incarnation_and_counted() -> None:
    worker = Worker(worker_config())
    await worker.load(initial(seed=1), 4)
    plan = plan_for([DEVICE, OTHER], version=3, batch=8)
    updates = [await worker.steps.next(plan, me_in(plan), None)]
    await worker.delta(0.001, 5, 4)  # the parameter server moved on
    updates.append(await worker.steps.next(plan, me_in(plan), None))
    bigger = plan_for([DEVICE, OTHER], version=4, batch=16)  # a re-plan: a bigger batch
    updates.append(await worker.steps.next(bigger, me_in(bigger), None))

    made = [u for u in updates if u is not None]
    assert [u.seq for u in made] == [1, 2, 3] and worker.steps.seq == 3
    assert {u.incarnation for u in made} == {INCARNATION}
    assert [u.base_version for u in made] == [4, 5, 5]
    assert [u.plan_version for u in made] == [3, 3, 4]
    assert [u.samples for u in made] == [8, 8, 16]
    assert worker.value("steps_total") == 3
    assert worker.value("step_seconds_count") == 3
    assert worker.value("step_seconds_sum") == pytest.approx(sum(u.step_time_s for u in made))
    assert worker.value("loss") == pytest.approx(made[-1].loss)
    assert worker.value("model_version") == 5
    # the stats: recent steps of the batch size in use, the last loss and the measured speed (digits-cnn has costs)
    assert list(worker.recent.step_times) == [made[-1].step_time_s] and worker.recent.batch_size == 16
    assert worker.recent.loss == made[-1].loss
    assert len(worker.recent.work) == 3 and worker.recent.compute_flops > 0

    restarted = Worker(worker_config(), incarnation=INCARNATION + 1)  # the device's next run
    await restarted.load(initial(seed=1), 5)
    again = await restarted.steps.next(plan, me_in(plan), None)
    assert again is not None and (again.incarnation, again.seq) == (INCARNATION + 1, 1)


async def test_an_update_on_a_model_that_missed_a_delta_asks_for_a_snapshot() -> None:
    worker = Worker(worker_config())
    params = initial(seed=2)
    await worker.load(params, 4)
    plan = plan_for([DEVICE], version=1)
    await worker.delta(0.001, 7, 6)  # deltas 5 and 6 never came
    assert worker.source.view.gap

    gapped = await worker.steps.next(plan, me_in(plan), None)
    assert gapped is not None and (gapped.base_version, gapped.need_snapshot) == (4, True)

    await worker.load(params, 7)  # the snapshot it asked for
    caught_up = await worker.steps.next(plan, me_in(plan), None)
    assert caught_up is not None and (caught_up.base_version, caught_up.need_snapshot) == (7, False)
    assert [gapped.seq, caught_up.seq] == [1, 2]


async def test_an_update_carries_the_change_the_step_made_to_the_model_s_buffers() -> None:
    """Batch norm's running statistics move in a step: the update carries the change as float32, beside the
    gradient, for the parameter server to apply as it is."""
    bn_spec = registered_bn_spec()
    worker = Worker(worker_config(**{"training.model_spec": bn_spec}), spec=bn_spec)
    params = initial(seed=3, spec=bn_spec)
    await worker.load(params, 0, bn_spec)
    plan = dataclasses.replace(plan_for([DEVICE], version=1, batch=8), model_spec=bn_spec)
    me = me_in(plan)

    update = await worker.steps.next(plan, me, None)

    assert update is not None
    x, y = first_batch(worker, plan, me)
    reference = models.build_model(bn_spec)
    models.set_params(reference, params)
    expected = {name: change for name, change in models.compute_update(reference, x, y).buffers.items()
                if change.any()}
    assert expected  # the running statistics moved
    assert all(b.codec == "none" for b in update.buffers)
    moved = decoded(update.buffers, {name: (change.shape, "float32") for name, change in expected.items()})
    assert set(moved) == set(expected)
    for name, change in expected.items():
        np.testing.assert_allclose(moved[name], change, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- a model-parallel member left alone


async def test_a_member_left_alone_by_a_plan_leaves_its_cluster_and_steps_on_the_whole_model_next(
        mosquitto_broker: BrokerProcess) -> None:
    """Its view held its rows only: it makes no update that time, asks the parameter server for the model, and
    steps on the whole model once the snapshot is back."""
    config = make_config(mosquitto_broker, job=f"steps-{uuid.uuid4().hex[:6]}")
    topics = Topics(config.job)
    current: list[Plan] = []
    worker = Worker(config, plan=lambda: current[-1] if current else None)
    bus = Bus(config.broker, client_id=f"{DEVICE}-{uuid.uuid4().hex[:6]}", metrics=worker.metrics)
    models_routes, delta_routes = worker.source.route(bus)
    worker.mesh.attach(bus, models_routes, delta_routes)
    async with inbox(config, (topics.snapshot_request_filter(), SnapshotRequest), name="ps") as ps, bus:
        await ps.publish(topics.model(), snapshot(initial(seed=4), 2), retain=True)
        await until("the model", lambda: worker.source.view.ready)
        together = mesh_plan([DEVICE, OTHER], SPLIT, version=1)
        cluster = together.cluster("m-a")
        assert cluster is not None
        current.append(together)
        await worker.mesh.join(together, me_in(together), cluster)  # what its first step under that plan does
        assert worker.mesh.member is not None and worker.source.view.rows is not None

        alone = plan_for([DEVICE, OTHER], version=2)
        current.append(alone)
        left = await worker.steps.next(alone, me_in(alone), None)

        assert left is None and worker.mesh.member is None
        assert worker.steps.seq == 0 and worker.value("steps_total") == 0
        request = await ps.next(SnapshotRequest, lambda r: r.device == DEVICE)
        assert request.version == -1  # it holds no model now: any snapshot will do
        await until("the whole model again", lambda: worker.source.view.ready)
        assert worker.source.view.rows is None

        update = await worker.steps.next(alone, me_in(alone), None)
        assert update is not None and (update.seq, update.base_version, update.plan_version) == (1, 2, 2)
        assert not update.need_snapshot
        assert update.cluster == f"c-{DEVICE}" and update.mesh_step == 0
        layout = models.gradient_layout(models.build_model(SPEC))
        assert set(decoded(update.shards, layout)) == set(layout)  # whole tensors, not the member's rows
