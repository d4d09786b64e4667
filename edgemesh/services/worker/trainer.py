"""The thread side of a worker: the model, this device's data shard, one training step and its encoding.

Everything here runs in a worker thread (``asyncio.to_thread``), one call per step, so the event
loop never waits on torch. The shard a plan gives the device is loaded once per plan that changes
it (``shard``, also what a model-parallel member draws its batches from); a gradient leaves as
shards ``(param, start, stop)`` encoded with the device's codec and error feedback (``encode``,
for whole tensors and for a member's rows alike), with the change the step made to the model's buffers
(batch norm's running statistics) as float32 shards of their own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgemesh.common import costs, models
from edgemesh.common.codecs import ErrorFeedback, codec_for
from edgemesh.common.config import Config
from edgemesh.common.data import BatchIterator, Dataset, load_dataset, shard
from edgemesh.common.errors import ModelError
from edgemesh.common.messages import CodecPolicy, Plan, PlanDevice, ShardUpdate
from edgemesh.common.shards import Span
from edgemesh.common.vocabulary import CodecName
from edgemesh.services.worker.attack import attack_rng, falsify
from edgemesh.services.worker.board import Board

logger = logging.getLogger(__name__)

FP32_BYTES = 4
"""Bytes of one float32 gradient value (``DeviceStats.gradient_bytes`` counts these)."""
Layout = dict[str, tuple[tuple[int, ...], str]]
"""A model's parameters: name -> (shape, dtype)."""
Rows = Mapping[str, tuple[int, int, np.ndarray]]
"""A gradient by shard: param -> (start, stop, gradient of rows [start, stop))."""


def codec_of(policy: CodecPolicy | None, can_encode: bool) -> CodecName:
    """The codec a device encodes with: its policy's, or ``none`` when there is no policy yet, when
    the policy routes it through the compressor gateway, or when the device cannot encode."""
    if policy is None or policy.gateway or not can_encode:
        return "none"
    return policy.codec


def shard_weights(plan: Plan) -> tuple[int, ...] | None:
    """Each data shard's samples per iteration, when they differ (balanced batches, a training grid):
    shards then hold data in proportion, so every sample is drawn about as often; None when even."""
    batches: dict[int, int] = {d.shard_index: d.batch_size for d in plan.devices}
    count = plan.devices[0].shard_count if plan.devices else 0
    if len(batches) != count or len(set(batches.values())) <= 1:
        return None
    return tuple(batches[i] for i in range(count))


@dataclass(frozen=True, slots=True)
class Computed:
    """One step of a device: its encoded gradient, the change it made to the model's buffers, the samples and loss
    of its batch, the seconds it computed and its training FLOPs (None for a model without cost figures)."""

    shards: list[ShardUpdate]
    buffers: list[ShardUpdate]
    samples: int
    loss: float
    seconds: float
    flops: float | None


def _exact(rows: Iterable[tuple[str, int, int, np.ndarray]]) -> list[ShardUpdate]:
    """The buffers' changes as float32 shards: running statistics are a few values per channel, which a lossy
    codec and its error feedback would bias."""
    return [ShardUpdate(param=param, start=start, stop=stop, codec="none",
                        data=np.ascontiguousarray(change, dtype=np.float32).tobytes())
            for param, start, stop, change in rows]


def _rows(tensors: Mapping[str, np.ndarray], spans: Sequence[Span] | None) -> list[tuple[str, int, int, np.ndarray]]:
    """``tensors`` as ``(name, start, stop, rows)``: whole, or cut at the rows each parameter server shard owns
    (``spans``; a name ``tensors`` lacks is skipped)."""
    if spans is None:
        return [(name, 0, int(t.shape[0]), t) for name, t in tensors.items()]
    return [(s.param, s.start, s.stop, tensors[s.param][s.start:s.stop]) for s in spans if s.param in tensors]


class Trainer:
    """The model and the data of one device."""

    def __init__(self, config: Config, device: str, board: Board, *, local: Dataset | None = None) -> None:
        self.cfg = config
        self.device = device
        self.board = board
        self.local = local
        """A submitted job's data on this device: trained whole, whatever shard the plan names."""
        self.layout: Layout = {}
        """The model's parameters, to check snapshots against (empty until a plan named the model)."""
        self.model_version = -1
        """Version of the weights loaded into the model."""
        self._stamp = -1
        """What the weights loaded were told apart by (``step``'s ``stamp``)."""
        self.gradient_bytes = 0
        """float32 size of the last gradient encoded (the compressor sizes codecs from it)."""
        self._model: Any = None
        self._data: Dataset | None = None
        self._data_key: tuple[Any, ...] | None = None
        self._batches: BatchIterator | None = None
        self._feedback = ErrorFeedback()
        self._attack_rng = attack_rng(config.worker.emulation_seed, device)
        if config.worker.emulation_attack:
            logger.warning("%s: emulating a faulty device: its gradients are sent %s (scale %g)", device,
                           config.worker.emulation_attack, config.worker.emulation_attack_scale)

    def shard(self, plan: Plan, me: PlanDevice) -> Dataset:
        """This device's shard of the plan's data set (loaded again only when the plan changes it)."""
        if self.local is not None:
            if self._data is not self.local:
                self._data, self._batches = self.local, None
                logger.info("%s: %d local samples, batch %d", self.device, len(self.local), me.batch_size)
            return self.local
        weights = shard_weights(plan)
        key = (plan.dataset, plan.partition, plan.partition_alpha, plan.seed, me.shard_index, me.shard_count, weights)
        if key != self._data_key or self._data is None:
            train, _ = load_dataset(plan.dataset, self.cfg.training.dataset_path or None, seed=plan.seed)
            self._data = shard(train, me.shard_index, me.shard_count, scheme=plan.partition,
                               alpha=plan.partition_alpha, seed=plan.seed, weights=weights)
            self._data_key = key
            self._batches = None
            logger.info("%s: shard %d/%d of %s, %d samples, batch %d", self.device, me.shard_index, me.shard_count,
                        plan.dataset, len(self._data), me.batch_size)
        return self._data

    def know_model(self, model_spec: str, seed: int) -> None:
        """The model's parameter layout (a model-parallel member builds the model for this alone)."""
        if not self.layout:
            self.layout = models.param_layout(models.build_model(model_spec, seed=seed))

    def step(self, plan: Plan, me: PlanDevice, params: Mapping[str, np.ndarray], version: int,
             policy: CodecPolicy | None, *, spans: Sequence[Span] | None = None,
             stamp: int | None = None) -> Computed:
        """Follow the plan, load the model if newer, take a batch, compute and encode the gradient and the
        buffers' change.

        ``spans``: the rows each parameter server shard owns, each encoded alone (default: whole tensors);
        ``stamp``: what tells one model from another when ``version`` does not (a sharded model's)."""
        self._prepare(plan, me)
        assert self._batches is not None
        stamp = version if stamp is None else stamp
        if stamp != self._stamp:
            models.set_params(self._model, params)
            self.model_version, self._stamp = version, stamp
        started = time.perf_counter()
        x, y = next(self._batches)
        update = models.compute_update(self._model, x, y)
        elapsed = time.perf_counter() - started
        w = self.cfg.worker
        grads = update.grads
        if w.emulation_attack:  # an emulated attacker (bench robust)
            grads = falsify(grads, w.emulation_attack, w.emulation_attack_scale, self._attack_rng)
        moved = {name: change for name, change in update.buffers.items() if change.any()}  # constants stay home
        if moved:  # the model no longer holds the version's buffers: the next step or evaluation loads it again
            self._stamp = -1
        return Computed(self.encode(_rows(grads, spans), policy), _exact(_rows(moved, spans)), len(y), update.loss,
                        elapsed, self._flops(plan.model_spec, len(y)))

    def evaluate(self, data: Dataset, params: Mapping[str, np.ndarray], version: int, *,
                 stamp: int | None = None) -> tuple[float, float]:
        """(mean loss, accuracy) of the model at ``version`` (told apart by ``stamp``, as in ``step``) on ``data``
        (the training thread's model, between steps)."""
        if self._model is None:
            self._model = models.build_model(self.cfg.training.model_spec, seed=self.cfg.training.seed)
            self.layout = models.param_layout(self._model)
        stamp = version if stamp is None else stamp
        if stamp != self._stamp:
            models.set_params(self._model, params)
            self.model_version, self._stamp = version, stamp
        return models.evaluate(self._model, data)

    def encode(self, grads: Rows | Iterable[tuple[str, int, int, np.ndarray]],
               policy: CodecPolicy | None) -> list[ShardUpdate]:
        """Shards of ``grads`` (``param -> (start, stop, rows)``, or ``(param, start, stop, rows)`` items)
        with the device's codec and error feedback (per parameter rows)."""
        items = [(k, *v) for k, v in grads.items()] if isinstance(grads, Mapping) else list(grads)
        name = codec_of(policy, self.cfg.worker.can_encode)
        self.gradient_bytes = sum(int(g.size) for _, _, _, g in items) * FP32_BYTES
        shards = []
        for param, start, stop, g in items:
            codec = codec_for(name, g.size)
            data = self._feedback.encode(f"{param}[{start}:{stop}]", g, codec, policy)
            shards.append(ShardUpdate(param=param, start=start, stop=stop, codec=codec.name, data=data))
        return shards

    def _prepare(self, plan: Plan, me: PlanDevice) -> None:
        """The model and this device's batches for ``plan``."""
        if self._model is None:
            self._model = models.build_model(plan.model_spec, seed=plan.seed)
            self.layout = models.param_layout(self._model)
            if self._flops(plan.model_spec, 1) is None:
                self.board.calibrate(self._timed_step(plan.model_spec))  # no cost figures: emulate from host steps
        data = self.shard(plan, me)
        if self._batches is None:
            self._batches = BatchIterator(data, me.batch_size, seed=plan.seed + me.shard_index)
        if self._batches.batch_size != me.batch_size:
            logger.info("%s: batch %d -> %d (plan version %d)", self.device, self._batches.batch_size,
                        me.batch_size, plan.version)
            self._batches.batch_size = me.batch_size

    def _timed_step(self, model_spec: str) -> Any:
        """``step(batch) -> seconds``: one real step of the model on random inputs."""
        spec = models.get_spec(model_spec)
        rng = np.random.default_rng(0)

        def step(batch: int) -> float:
            x = rng.random((batch, *spec.input_shape), dtype=np.float32)
            y = rng.integers(0, spec.num_classes, size=batch)
            started = time.perf_counter()
            models.compute_gradients(self._model, x, y)
            return time.perf_counter() - started

        return step

    @staticmethod
    def _flops(model_spec: str, samples: int) -> float | None:
        """Training FLOPs of ``samples`` of the whole model (None: a model without cost figures)."""
        try:
            return costs.cost(model_spec).train_flops_per_sample * samples
        except ModelError:
            return None
