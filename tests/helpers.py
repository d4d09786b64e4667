"""Helpers shared by more than one test module, grouped under a comment header per topic; a test module
never imports another one.

Fixtures belong in ``conftest.py``; this module holds ordinary functions and classes (``from helpers import ...``):
configurations, running services, test clients of the broker that wait for messages, and builders of
test data. Each has a one-line docstring.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import time
import typing
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import numpy as np
import pytest
import torch
from torch import nn

from edgemesh.common import costs, models
from edgemesh.common.bus import Bus
from edgemesh.common.codecs import get_codec
from edgemesh.common.config import Config, load_config
from edgemesh.common.messages import (
    ControlReply,
    DeviceHello,
    DeviceStats,
    DeviceStatus,
    Event,
    GradientUpdate,
    LayerDivision,
    ModelSnapshot,
    Plan,
    PlanCluster,
    PlanDevice,
    ShardUpdate,
    UpdateAck,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.models.masks import apply_mask, dropout_mask
from edgemesh.common.tasks import cancel_all
from edgemesh.common.topics import Filter, TopicMatch, Topics
from edgemesh.common.vocabulary import CodecName
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.parameter_server.optimizer import ShardGrad
from edgemesh.services.parameter_server.scheduler import Candidate
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.planner.mesh import DeviceInfo, Division, cluster_iteration_s, member_memory, member_time
from edgemesh.services.worker.mesh.exchange import LocalHub
from edgemesh.services.worker.mesh.member import MeshMember, MeshStep

T = TypeVar("T")

# --- data sets ------------------------------------------------------------------


def label_distribution(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """The fraction of ``labels`` in each of ``num_classes`` classes."""
    return np.bincount(labels, minlength=num_classes) / labels.shape[0]


# --- configs, services and waiting ------------------------------------------------

WAIT_S = 20.0
"""How long a test waits for an event before it fails."""
POLL_S = 0.05
"""How often a wait re-checks a condition on a service's own state (between messages, which wake it at once)."""


def make_config(broker: BrokerProcess, *, job: str, **settings: object) -> Config:
    """The configuration of a test's services: its own broker and job, metrics on a free port, quick
    reconnects, evaluations as often as a job's stop rule needs on a loaded host (``ps.eval_budget`` 0.5; the
    budget itself is tested in test_evaluation.py), then ``settings`` (dotted keys)."""
    return load_config(env={}, overrides={
        "broker.url": broker.url, "job": job, "metrics.address": "127.0.0.1:0", "broker.backoff_initial_s": "0.05",
        "broker.backoff_max_s": "0.5", "ps.eval_budget": "0.5", **{key: str(value) for key, value in settings.items()}})


@contextlib.asynccontextmanager
async def running(*services: Any) -> AsyncIterator[None]:
    """``services`` running (each ``run()`` a task; those with a ``ready`` event are waited for), stopped on
    exit; an error any of them ended with fails the test."""
    tasks = [asyncio.create_task(s.run()) for s in services]
    try:
        async with asyncio.timeout(WAIT_S):
            for s, task in zip(services, tasks, strict=True):
                ready = getattr(s, "ready", None)
                if isinstance(ready, asyncio.Event):
                    waiter = asyncio.ensure_future(ready.wait())
                    await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    if task.done():
                        task.result()
        yield
    finally:
        for s in services:
            s.stop.set()
        _, stuck = await asyncio.wait(tasks, timeout=WAIT_S)
        await cancel_all(stuck)  # not left behind to hang the next test: a stop that hangs fails this one
        hung = [type(s).__name__ for s, t in zip(services, tasks, strict=True) if t in stuck]
        assert not hung, f"did not stop within {WAIT_S:g}s: {hung}"
        errors = [t.exception() for t in tasks if not t.cancelled() and t.exception() is not None]
        assert not errors, errors


async def until(what: str, predicate: Callable[[], T | None | bool], timeout_s: float = WAIT_S,
                *, changed: asyncio.Condition | None = None) -> T:
    """Wait until ``predicate()`` holds, woken by ``changed`` (a test client's messages) and re-checked
    every ``POLL_S`` for a service's own state; returns its value. Fails the test after ``timeout_s``."""
    changed = changed or asyncio.Condition()
    try:
        async with asyncio.timeout(timeout_s), changed:
            while not (result := predicate()):
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(POLL_S):
                        await changed.wait()
            return typing.cast(T, result)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


class Inbox:
    """A test client of the broker: its routes' messages, kept in arrival order, with ways to wait for them."""

    def __init__(self, bus: Bus, topics: Topics) -> None:
        self.bus, self.topics = bus, topics
        self.received: list[tuple[TopicMatch, Any]] = []
        self.changed = asyncio.Condition()
        self._taken: set[int] = set()

    async def keep(self, msg: Any, match: TopicMatch) -> None:
        """The route handler: keep ``msg``, wake every waiter."""
        self.received.append((match, msg))
        async with self.changed:
            self.changed.notify_all()

    def of(self, kind: type[T], where: Callable[[TopicMatch], bool] = lambda _: True) -> list[T]:
        """Every message of ``kind`` received so far on topics ``where`` accepts."""
        return [m for t, m in self.received if isinstance(m, kind) and where(t)]

    async def next(self, kind: type[T], predicate: Callable[[T], bool] = lambda _: True,
                   timeout_s: float = WAIT_S) -> T:
        """The oldest message of ``kind`` satisfying ``predicate`` not taken yet; it is taken."""
        def first() -> tuple[int, T] | None:
            for i, (_, m) in enumerate(self.received):
                if i not in self._taken and isinstance(m, kind) and predicate(m):
                    return i, m
            return None

        try:
            i, msg = await self.until(f"a {kind.__name__}", first, timeout_s)
        except AssertionError as e:  # what did arrive says why the awaited one did not
            seen = self.of(kind)
            last = str(seen[-1])[:800] if seen else None
            raise AssertionError(f"{e}; {len(seen)} received, the last: {last}") from None
        self._taken.add(i)
        return msg

    async def until(self, what: str, predicate: Callable[[], T | None | bool], timeout_s: float = WAIT_S) -> T:
        return await until(what, predicate, timeout_s, changed=self.changed)

    async def publish(self, topic: str, msg: object, *, retain: bool = False) -> None:
        await self.bus.publish(topic, msg, retain=retain)


@contextlib.asynccontextmanager
async def inbox(config: Config, *routes: tuple[Filter, type | tuple[type, ...]],
                name: str = "test") -> AsyncIterator[Inbox]:
    """An :class:`Inbox` on ``config``'s broker, connected, taking each ``(filter, message type)``."""
    bus = Bus(config.broker, client_id=f"{name}-{uuid.uuid4().hex[:8]}", metrics=ServiceMetrics(name))
    box = Inbox(bus, Topics(config.job))
    for filter_, kind in routes:
        bus.route(filter_, kind, box.keep)
    async with bus:
        yield box


def control_json(command: str, **fields: object) -> bytes:
    """A control command as an operator types it for ``mosquitto_pub``."""
    return json.dumps({"command": command, **fields}).encode()


# --- parameter server and its devices ----------------------------------------------

DIGITS_LAYOUT = models.param_layout(models.build_model("digits-cnn"))
"""Names and shapes of the model state of ``digits-cnn``: its parameters, then its buffers (the standardization's
constants)."""
DIGITS_PARAMS = models.gradient_layout(models.build_model("digits-cnn"))
"""The parameters of ``digits-cnn`` alone: what a gradient covers."""


def plan_for(devices: list[str], *, version: int = 1, batch: int = 8) -> Plan:
    """A data-parallel plan of ``digits-cnn``: every device its own cluster ``c-{device}``."""
    return Plan(version=version, created=time.time(), model_spec="digits-cnn", dataset="digits",
                devices=tuple(PlanDevice(device=d, cluster=f"c-{d}", shard_index=i, shard_count=len(devices),
                                         batch_size=batch) for i, d in enumerate(devices)),
                clusters=tuple(PlanCluster(cluster=f"c-{d}", members=(d,)) for d in devices))


def gradient(device: str, seq: int, base: int, *, incarnation: int = 1, scale: float = 0.01,
             codec: CodecName = "none", cluster: str = "", spans: list[Any] | None = None) -> GradientUpdate:
    """A whole ``digits-cnn`` gradient of ``scale`` everywhere, computed on version ``base`` (only the rows of
    ``spans``, ``(param, start, stop)`` each, if given)."""
    enc = get_codec(codec)
    # a gradient is of the parameters: a span of a buffer (a shard's rows of the standardization) has none
    rows = [r for r in spans if r[0] in DIGITS_PARAMS] if spans else \
        [(name, 0, shape[0]) for name, (shape, _) in DIGITS_PARAMS.items()]
    shards = tuple(ShardUpdate(param=name, start=start, stop=stop, codec=codec, data=enc.encode(
        np.full((stop - start) * int(np.prod(DIGITS_LAYOUT[name][0][1:])), scale, np.float32), None))
        for name, start, stop in rows)
    return GradientUpdate(device=device, cluster=cluster or f"c-{device}", incarnation=incarnation, seq=seq,
                          base_version=base, samples=8, shards=shards)


class Devices(Inbox):
    """A test client playing devices and an operator of one parameter server: it publishes plans and
    updates and sees acks, snapshots and control replies."""

    @property
    def acks(self) -> list[UpdateAck]:
        return self.of(UpdateAck)

    @property
    def snapshots(self) -> list[ModelSnapshot]:
        return self.of(ModelSnapshot)

    @property
    def replies(self) -> list[ControlReply]:
        return self.of(ControlReply)

    def forget(self) -> None:
        """Drop what was received so far (a resend's ack is told from the first's)."""
        self.received.clear()
        self._taken.clear()

    async def ack_for(self, device: str, seq: int, incarnation: int = 1) -> UpdateAck:
        return await self.until(f"ack {device}/{seq}", lambda: next(
            (a for a in reversed(self.acks) if (a.device, a.seq, a.incarnation) == (device, seq, incarnation)),
            None))

    async def version_at_least(self, version: int) -> ModelSnapshot:
        return await self.until(f"model version {version}", lambda: next(
            (s for s in reversed(self.snapshots) if s.version >= version), None))

    async def reply(self, request_id: str) -> ControlReply:
        return await self.until(f"reply {request_id}", lambda: next(
            (r for r in self.replies if r.request_id == request_id), None))

    async def push(self, update: GradientUpdate) -> UpdateAck:
        """Publish ``update`` and wait for its ack."""
        await self.bus.publish(self.topics.grad(update.cluster, update.device), update)
        return await self.ack_for(update.device, update.seq, update.incarnation)

    async def publish_plan(self, devices: list[str], **kwargs: Any) -> Plan:
        plan = plan_for(devices, **kwargs)
        await self.bus.publish(self.topics.plan(), plan, retain=True)
        return plan


@contextlib.asynccontextmanager
async def devices(config: Config, names: list[str], requester: str = "tester") -> AsyncIterator[Devices]:
    """A :class:`Devices` client, connected, seeing the model, the acks of ``names`` and ``requester``'s replies."""
    topics = Topics(config.job)
    bus = Bus(config.broker, client_id=f"devices-{uuid.uuid4().hex[:8]}", metrics=ServiceMetrics("tester"))
    box = Devices(bus, topics)
    bus.route(topics.model_filter(), ModelSnapshot, box.keep)
    bus.route(topics.reply_filter(requester), ControlReply, box.keep)
    for name in names:
        bus.route(topics.ack_filter(name), UpdateAck, box.keep)
    async with bus:
        yield box


@contextlib.asynccontextmanager
async def serving_ps(config: Config, names: list[str]) -> AsyncIterator[tuple[Devices, ParameterServer]]:
    """A parameter server, and a :class:`Devices` client playing ``names`` that has published their plan
    ("ghost" aside: a device outside it) and seen the first model."""
    ps = ParameterServer(config)
    async with devices(config, names) as c, running(ps):
        await c.publish_plan([n for n in names if n != "ghost"])
        await c.version_at_least(0)
        await c.until("the plan", lambda: ps.plan is not None)
        yield c, ps


# --- compressor: device stats ------------------------------------------------------

STEP_S = 0.1
"""Step time, seconds, of the devices of the compressor tests."""
GRADIENT_BYTES = 4_000_000
"""Float32 size of one gradient of the compressor tests' devices: a one-million-value model."""


def device_stats(rate: float, *, step: float = STEP_S, gradient_bytes: int = GRADIENT_BYTES, delay: float = 0.0,
                 device: str = "pi-1") -> DeviceStats:
    """The stats of ``device``: an uplink of ``rate`` bytes/s, ``step``-second steps, its gradient size and delay."""
    return DeviceStats(device=device, link_rate_bps=rate, step_time_s=step, gradient_bytes=gradient_bytes,
                       delay_index=delay)


def rate_for(nbytes: float, step: float = STEP_S, comm_share: float = 0.5) -> float:
    """The link rate at which ``nbytes`` per update take exactly ``comm_share`` (the default's) of the step."""
    return nbytes / (comm_share * step)


# --- mesh planning ---------------------------------------------------------------

MIB = 2**20
"""Bytes in a mebibyte."""
GIB = 2**30
"""Bytes in a gibibyte."""
GIGABIT = 117e6
"""Gigabit ethernet, bytes/s."""
CLASSES = {
    # matmul FLOP/s, memory, uplink bytes/s
    "pi3": (9.2e9, 566 * MIB, 6.25e6),
    "pi4": (23.8e9, int(3.3 * GIB), 4.8e6),
    "pi5": (60.5e9, 7 * GIB, 14e6),
    "laptop": (115e9, 8 * GIB, 25e6),
}
"""The board classes of ``dev``, by kind."""


def dev(name: str, kind: str, *, link: float | None = None, memory: int | None = None, flops: float | None = None,
        latency: float = 0.001) -> DeviceInfo:
    """A ``kind`` board of ``CLASSES`` named ``name``, any of its figures overridden."""
    f, m, up = CLASSES[kind]
    return DeviceInfo(device=name, flops=flops or f, memory_bytes=memory or m, link_rate_bps=link or up,
                      latency_s=latency)


def full(spec: str) -> list[int]:
    """Every unit of every layer of ``spec``: the whole model."""
    return [la.units for la in costs.layers(spec)]


def share_memory(spec: str, fraction: float, batch: int) -> int:
    """Memory that holds ``fraction`` of the model (and nothing more) at ``batch``."""
    empty = member_memory(spec, [0] * len(full(spec)), batch=batch)
    return int(empty + fraction * (member_memory(spec, full(spec), batch=batch) - empty))


def held(division: Division, spec: str, i: int) -> list[int]:
    """Member ``i``'s units of every layer of ``spec`` in ``division``, in forward order."""
    return [division.counts[la.name][i] for la in costs.layers(spec)]


def check_division(division: Division, spec: str, members: list[DeviceInfo], batch: int) -> None:
    """Assert that ``division`` of ``members`` is whole and agrees with the cost model and memory."""
    assert division.members == tuple(d.device for d in members)
    for layer in costs.layers(spec):
        counts = division.counts[layer.name]
        assert len(counts) == len(members) and sum(counts) == layer.units
        assert all(isinstance(n, int) and n >= 0 for n in counts)
    for i, d in enumerate(members):
        assert division.member_seconds[i] == pytest.approx(
            member_time(spec, d, held(division, spec, i), batch=batch, cluster_size=len(members)))
        assert division.member_memory_bytes[i] == member_memory(spec, held(division, spec, i), batch=batch)
    assert division.predicted_s >= max(division.member_seconds) * (1 - 1e-9)  # members meet at every layer
    assert division.predicted_s == pytest.approx(cluster_iteration_s(spec, members, division.counts, batch=batch))
    assert division.fits == all(m <= d.memory_bytes for m, d in zip(division.member_memory_bytes, members,
                                                                     strict=True))


# --- the planner and its devices -------------------------------------------------

PLANNER_DEBOUNCE_S = 0.2
"""Re-plan debounce of the planners under test: joins within it give one plan."""


def planner_config(broker: BrokerProcess, *, job: str, **settings: object) -> Config:
    """A planner test's configuration: ``make_config`` with the re-plan debounce ``PLANNER_DEBOUNCE_S``."""
    return make_config(broker, job=job, **{"planner.replan_debounce_s": PLANNER_DEBOUNCE_S, **settings})


@contextlib.asynccontextmanager
async def planner_devices(config: Config) -> AsyncIterator[Inbox]:
    """An :class:`Inbox` playing devices and the operator of a planner: it sees plans, events and the
    operator's control replies."""
    topics = Topics(config.job)
    async with inbox(config, (topics.plan_filter(), Plan), (topics.events_filter(), Event),
                     (topics.reply_filter("operator"), ControlReply), name="devices") as box:
        yield box


def device_hello(name: str, *, incarnation: int = 1, flops: float = 1e9, memory: int = GIB) -> DeviceHello:
    """The hello of a test device of ``flops`` FLOP/s and ``memory`` bytes."""
    return DeviceHello(device=name, incarnation=incarnation, flops=flops, memory_bytes=memory)


async def join(box: Inbox, name: str, *, incarnation: int = 1, flops: float = 1e9, memory: int = GIB) -> None:
    """What a worker does on start: its retained hello and ``online`` status."""
    await box.publish(box.topics.hello(name), device_hello(name, incarnation=incarnation, flops=flops,
                                                           memory=memory), retain=True)
    await box.publish(box.topics.status(name), DeviceStatus(device=name, state="online", incarnation=incarnation),
                      retain=True)


def device_names(plan: Plan) -> list[str]:
    """The devices of ``plan``, in its order."""
    return [d.device for d in plan.devices]


# --- model-parallel clusters -----------------------------------------------------

UNEVEN = {
    "digits-cnn": {"conv1": (7, 5, 4), "conv2": (3, 20, 9), "fc1": (30, 4, 30), "fc2": (5, 0, 5)},
    "cifar-cnn": {"conv1": (20, 8, 4), "conv2": (10, 30, 24), "conv3": (64, 1, 63), "fc1": (100, 100, 56),
                  "fc2": (3, 3, 4)},
}
"""Filter divisions of three uneven members; member 1 has no unit of digits' last layer."""
SPLIT: dict[str, tuple[int, ...]] = {"conv1": (10, 6), "conv2": (12, 20), "fc1": (40, 24), "fc2": (4, 6)}
"""A filter division of ``digits-cnn`` between two members."""


def reference(spec: str, seed: int, batch: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, float,
                                                           np.ndarray, dict[str, np.ndarray]]:
    """Parameters, a batch, and what one process computes on it: loss, logits, gradients."""
    model = models.build_model(spec, seed=seed)
    params = models.get_params(model)
    shape, classes = models.get_spec(spec).input_shape, models.get_spec(spec).num_classes
    rng = np.random.default_rng(seed)
    x = rng.random((batch, *shape), dtype=np.float32)
    y = rng.integers(0, classes, batch)
    loss, grads = models.compute_gradients(model, x, y)
    with torch.no_grad():
        logits = model(torch.tensor(x)).numpy()
    return params, x, y, loss, logits, grads


MASK_STEP = 7
"""The cluster step of ``one_process`` and ``train_together``: the dropout masks are drawn from it."""


class SharedMaskDropout(nn.Module):
    """One process's dropout with the mask a model-parallel cluster draws (``models.masks``) for ``name`` at
    ``MASK_STEP``."""

    def __init__(self, p: float, name: str, seed: int) -> None:
        super().__init__()
        self.p, self.name, self.seed = p, name, seed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        return apply_mask(x, dropout_mask(x.shape, self.p, self.seed, MASK_STEP, self.name), self.p)


def one_process(spec: str, seed: int, batch: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray,
                                                          models.Update, np.ndarray]:
    """Parameters, a batch, and what one process drawing the cluster's dropout masks computes on it in training
    mode: its update (loss, gradients, the buffers' change) and its logits."""
    model = models.build_model(spec, seed=seed)
    for path, module in list(model.named_modules()):
        if isinstance(module, nn.Dropout):
            parent, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent), child, SharedMaskDropout(module.p, path, seed))
    params = models.get_params(model)
    shape, classes = models.get_spec(spec).input_shape, models.get_spec(spec).num_classes
    rng = np.random.default_rng(seed)
    x = rng.random((batch, *shape), dtype=np.float32)
    y = rng.integers(0, classes, batch)
    update = models.compute_update(model, x, y)
    with torch.no_grad():  # training mode: batch statistics and the same masks, as in the step
        logits = model(torch.tensor(x)).numpy()
    return params, x, y, update, logits


async def train_together(spec: str, division: dict[str, tuple[int, ...]], seed: int,
                         params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> list[MeshStep]:
    """Three members dividing ``spec`` by ``division`` take cluster step ``MASK_STEP`` on ``x``, ``y`` together
    (over a hub in this process)."""
    hub = LocalHub(3)
    members = [MeshMember(spec, division, i, seed=seed) for i in range(3)]
    for m in members:
        m.load(params, version=0)
    return list(await asyncio.gather(*(m.step(MASK_STEP, x, y, hub.member(i)) for i, m in enumerate(members))))


def assert_matches_one_process(results: list[Any], loss: float, logits: np.ndarray,
                               grads: dict[str, np.ndarray]) -> None:
    """Assert that the members' step results are one process's loss and logits, and that their
    gradient shards tile its gradients, each row computed once."""
    covered = {name: np.zeros(g.shape[0], bool) for name, g in grads.items()}
    for r in results:
        assert r.loss == pytest.approx(loss, abs=1e-5)
        np.testing.assert_allclose(r.logits, logits, rtol=1e-4, atol=1e-5)
        for name, (start, stop, g) in r.grads.items():
            assert not covered[name][start:stop].any(), f"{name}[{start}:{stop}] computed twice"
            covered[name][start:stop] = True
            np.testing.assert_allclose(g, grads[name][start:stop], rtol=1e-4, atol=1e-6)
    assert all(c.all() for c in covered.values()), "some gradient rows were computed by no member"


def mesh_plan(devices: list[str], counts: dict[str, tuple[int, ...]], *, cluster: str = "m-a", batch: int = 8,
              version: int = 1) -> Plan:
    """A sync plan of ``digits-cnn``: ``devices`` are one model-parallel cluster divided by ``counts``."""
    return Plan(version=version, created=time.time(), model_spec="digits-cnn", dataset="digits",
                sync_policy="sync", devices=tuple(PlanDevice(device=d, cluster=cluster, shard_index=0, shard_count=1,
                                                             batch_size=batch) for d in devices),
                clusters=(PlanCluster(cluster=cluster, members=tuple(devices), division=tuple(
                    LayerDivision(layer=k, counts=tuple(v)) for k, v in counts.items())),))


def member_update(device: str, index: int, seq: int, base: int, *, step: int = 1,
                  counts: dict[str, tuple[int, ...]] = SPLIT, cluster: str = "m-a") -> GradientUpdate:
    """Member ``index``'s shards (its rows under ``counts``) of a ``digits-cnn`` gradient of 0.01, for
    model-parallel step ``step`` of plan version 1."""
    enc = get_codec("none")
    shards = []
    for layer, c in counts.items():
        start, stop = costs.slices(c)[index]
        for part in ("weight", "bias"):
            shape = DIGITS_LAYOUT[f"{layer}.{part}"][0]
            n = (stop - start) * int(np.prod(shape[1:]))
            shards.append(ShardUpdate(param=f"{layer}.{part}", start=start, stop=stop, codec="none",
                                      data=enc.encode(np.full(n, 0.01, np.float32), None)))
    return GradientUpdate(device=device, cluster=cluster, incarnation=1, seq=seq, base_version=base, samples=8,
                          shards=tuple(shards), mesh_step=step, plan_version=1)



def assert_buffers_match(results: list[MeshStep], moved: dict[str, np.ndarray]) -> None:
    """The members' buffer rows tile every running statistic's change once, and the counters come once, from the
    first member."""
    covered = {name: np.zeros(change.shape[0], bool) for name, change in moved.items()}
    for index, r in enumerate(results):
        for name, (start, stop, change) in r.buffers.items():
            assert not covered[name][start:stop].any(), f"{name}[{start}:{stop}] sent twice"
            covered[name][start:stop] = True
            np.testing.assert_allclose(change, moved[name][start:stop], rtol=1e-4, atol=1e-6, err_msg=name)
            if name.endswith("num_batches_tracked"):
                assert index == 0
    assert all(c.all() for c in covered.values()), "some buffer rows were sent by no member"


def candidate(device: str, seq: int, base: int, *, samples: int = 8, plan_version: int = 1,
              cluster: str = "") -> Candidate:
    """A scheduler's candidate of ``device`` computed on ``base``, with one gradient of ones."""
    u = GradientUpdate(device=device, cluster=cluster or f"c-{device}", incarnation=1, seq=seq, base_version=base,
                       samples=samples, plan_version=plan_version,
                       shards=(ShardUpdate(param="w", start=0, stop=1, codec="none", data=b"\0" * 4),))
    return Candidate(u, [ShardGrad("w", 0, 1, np.ones(1, np.float32))], 0.0)


def member_part(device: str, step: MeshStep, samples: int, mesh_step: int) -> Candidate:
    """A member's update for model-parallel step ``mesh_step`` as the parameter server decodes it: its gradient rows
    and buffer rows."""
    def shard(name: str, start: int, stop: int, values: np.ndarray) -> ShardUpdate:
        return ShardUpdate(param=name, start=start, stop=stop, codec="none", data=values.astype(np.float32).tobytes())

    u = GradientUpdate(device=device, cluster="m-a", incarnation=1, seq=1, base_version=0, samples=samples,
                       shards=tuple(shard(n, *v) for n, v in step.grads.items()),
                       buffers=tuple(shard(n, *v) for n, v in step.buffers.items()), mesh_step=mesh_step,
                       plan_version=1)
    return Candidate(u, [ShardGrad(n, a, b, g) for n, (a, b, g) in step.grads.items()], 0.0,
                     buffers=[ShardGrad(n, a, b, g) for n, (a, b, g) in step.buffers.items()])

# --- device health ----------------------------------------------------------------

def write_thermal_zones(root: Path, zones: dict[str, float]) -> Path:
    """A kernel thermal directory under ``root``: one ``thermal_zoneN`` per ``{type: °C}``, in millidegrees."""
    for i, (kind, celsius) in enumerate(zones.items()):
        zone = root / f"thermal_zone{i}"
        zone.mkdir(parents=True)
        (zone / "type").write_text(f"{kind}\n")
        (zone / "temp").write_text(f"{round(celsius * 1000)}\n")
    return root


def write_vcgencmd(directory: Path, *, throttled: str = "0x50005", temp: str = "48.3", body: str = "") -> Path:
    """An executable ``vcgencmd`` in ``directory`` that answers ``get_throttled`` and ``measure_temp`` as the
    Raspberry Pi firmware tool does (``body``: shell lines run first, e.g. to fail or to wait)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "vcgencmd"
    path.write_text("#!/bin/sh\n" + body + "\n" + 'case "$1" in\n'
                    f'  get_throttled) echo "throttled={throttled}" ;;\n'
                    f"  measure_temp) echo \"temp={temp}'C\" ;;\n"
                    '  *) echo "unknown command" >&2; exit 255 ;;\n'
                    "esac\n")
    path.chmod(0o755)
    return path


# --- programs outside Python ---------------------------------------------------------

PROGRAMS = {
    "mosquitto": "mosquitto",
    "mosquitto_passwd": "mosquitto",
    "mosquitto_pub": "mosquitto-clients",
    "prometheus": "prometheus",
    "ip": "iproute2",
    "openssl": "openssl",
    "pgrep": "procps",
    "systemd-analyze": "systemd",
}
"""Every program outside Python a test runs, and the Debian/Ubuntu package that installs it (``.ci/run`` installs
the same packages; tests/test_ci.py checks it)."""
SBIN_PATH = "/usr/local/sbin:/usr/sbin:/sbin"
"""Where a program is looked for after PATH: Debian installs daemons (``mosquitto``) in sbin, off a user's PATH."""
INSTALL_SWITCH = "TESTS_INSTALL"
"""Set to ``0``, a test run as root installs nothing (``install_programs``)."""
APT_TIMEOUT_S = 900.0
"""Longest one ``apt-get`` call of ``install_programs`` may take."""


def in_ci() -> bool:
    """``CI=true`` (as CI services set it, and ``.ci/run``): a test that lacks a program fails instead of skipping."""
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def what_missing_does() -> str:
    """What happens to the tests whose program is missing: skipped, or failed under ``CI=true``."""
    return "the tests that need them " + ("fail (CI=true)" if in_ci() else "are skipped")


def find_binary(name: str) -> str | None:
    """The path of program ``name``: PATH first, then ``SBIN_PATH``."""
    return shutil.which(name) or shutil.which(name, path=SBIN_PATH)


def missing_requirement(reason: str) -> NoReturn:
    """Skip the running test for ``reason``; under ``CI=true`` fail it, as CI must run every test."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: every test must run)", pytrace=False)
    pytest.skip(reason)


def require_binary(name: str) -> str:
    """The path of program ``name``; without it the test is skipped, naming the package to install (failed under
    ``CI=true``). The marker ``@pytest.mark.requires_binary(name, ...)`` calls it before the test's fixtures."""
    found = find_binary(name)
    if found is None:
        missing_requirement(f"{name} not installed: apt-get install {PROGRAMS.get(name, name)}")
    return found


def require_root(what: str) -> None:
    """Skip the running test unless it runs as root (failed under ``CI=true``); ``what`` is what needs root. The
    marker ``@pytest.mark.requires_root(what)`` calls it before the test's fixtures."""
    if os.geteuid() != 0:
        missing_requirement(f"{what} needs root")


def missing_packages() -> list[str]:
    """The packages of the ``PROGRAMS`` not installed here, sorted."""
    return sorted({package for name, package in PROGRAMS.items() if find_binary(name) is None})


def install_programs(log: Callable[[str], None]) -> list[str]:
    """Install the packages of the missing ``PROGRAMS`` with ``apt-get``, as root only, unless ``TESTS_INSTALL=0``;
    ``log`` hears what is done and, if it failed, why. The packages still missing afterwards."""
    missing = missing_packages()
    apt = shutil.which("apt-get")
    if not missing or os.environ.get(INSTALL_SWITCH) == "0" or os.geteuid() != 0 or apt is None:
        return missing
    log(f"installing {' '.join(missing)} with apt-get for the tests that run them ({INSTALL_SWITCH}=0 skips this)")
    lock = ["-o", "DPkg::Lock::Timeout=120"]  # another apt-get (another test run) is waited for, not failed on
    install = [apt, "install", "-y", "-qq", "--no-install-recommends", *lock, *missing]
    error = _apt(install)
    if error is not None:  # the package lists are stale, or there are none: update them and try again
        error = _apt([apt, "update", "-qq", *lock]) or _apt(install)
    still = missing_packages()
    log(f"installed {' '.join(sorted(set(missing) - set(still))) or 'nothing'}"
        + (f"; {error}" if error else "")
        + (f"; still missing {' '.join(still)}: {what_missing_does()}" if still else ""))
    return still


def _apt(command: list[str]) -> str | None:
    """Run one ``apt-get`` command non-interactively; what went wrong, or None."""
    what = " ".join(["apt-get", *command[1:2]])
    try:
        done = subprocess.run(command, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, capture_output=True,
                              text=True, timeout=APT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return f"{what} did not finish within {APT_TIMEOUT_S:g} s"
    if done.returncode != 0:
        return f"{what} failed (exit code {done.returncode}): {(done.stderr.strip().splitlines() or [''])[-1]}"
    return None
