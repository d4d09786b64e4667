"""One torch module for the whole simulated fleet, and a device's step on it.

1,000 simulated devices are one module, not 1,000: a step loads the weights of the version it starts from (unless
the module holds them already) and computes a real gradient with the training code every worker runs
(``models.compute_update``). Its update is encoded as a worker encodes it (``codec_for`` per tensor, error feedback,
the buffers' changes as float32), so its size on the wire is the real one.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from edgemesh.common import models, wire
from edgemesh.common.codecs import ErrorFeedback, codec_for
from edgemesh.common.data import Dataset
from edgemesh.common.messages import CodecPolicy, GradientUpdate, Plan, PlanDevice, ShardUpdate
from edgemesh.common.vocabulary import CodecName


class SharedModel:
    """The module every simulated device and the evaluation compute on, and which version it holds."""

    def __init__(self, model_spec: str, seed: int) -> None:
        self.module = models.build_model(model_spec, seed=seed)
        self.buffers = models.buffer_kinds(self.module)
        self.momenta = models.buffer_momenta(self.module)
        self._loaded: tuple[str, int] | None = None
        """Which weights the module holds: a version as the devices hold it (``held``) or as the server does."""

    def initial(self) -> dict[str, np.ndarray]:
        """The model state every run starts from (what the parameter server builds with the same seed)."""
        return models.get_params(self.module)

    def load(self, key: tuple[str, int], params: Mapping[str, np.ndarray]) -> None:
        if key != self._loaded:
            models.set_params(self.module, params)
            self._loaded = key

    def update(self, version: int, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray,
               seed: int) -> models.Update:
        """One step on the model of ``version`` as a device holds it (``params``): its loss, gradients and buffers'
        change (``seed``: dropout's draws, so that a run replays exactly)."""
        self.load(("held", version), params)
        with torch.random.fork_rng(devices=[]):
            # the CPU generator alone (the draws are the same): ``torch.manual_seed`` also queues a seed for every
            # CUDA device and records a stack trace each time, a cost paid once per simulated step
            torch.default_generator.manual_seed(seed)
            update = models.compute_update(self.module, x, y)
        if any(change.any() for change in update.buffers.values()):
            self._loaded = None  # the step moved the module's buffers: it no longer holds the version
        return update

    def evaluate(self, version: int, params: Mapping[str, np.ndarray], data: Dataset) -> tuple[float, float]:
        """(mean loss, accuracy) of the server's model of ``version`` on ``data``."""
        self.load(("server", version), params)
        return models.evaluate(self.module, data)


class Encoder:
    """What one device's worker does to a step before it sends it: its codec and error feedback."""

    def __init__(self, device: str, codec: CodecName, density: float) -> None:
        self.policy = CodecPolicy(device=device, codec=codec, density=density)
        self.feedback = ErrorFeedback()

    def encode(self, update: models.Update, *, plan: Plan, me: PlanDevice, seq: int, base_version: int,
               samples: int) -> tuple[GradientUpdate, int]:
        """The update message (``Trainer.encode`` and ``Steps._update``: whole tensors) and its size on the wire."""
        shards = []
        for param, g in update.grads.items():
            codec = codec_for(self.policy.codec, g.size)
            data = self.feedback.encode(f"{param}[0:{g.shape[0]}]", g, codec, self.policy)
            shards.append(ShardUpdate(param=param, start=0, stop=int(g.shape[0]), codec=codec.name, data=data))
        moved = tuple(ShardUpdate(param=name, start=0, stop=int(change.shape[0]), codec="none",
                                  data=np.ascontiguousarray(change, dtype=np.float32).tobytes())
                      for name, change in update.buffers.items() if change.any())  # constants stay home
        message = GradientUpdate(device=me.device, cluster=me.cluster, incarnation=0, seq=seq,
                                 base_version=base_version, samples=samples, shards=tuple(shards),
                                 loss=update.loss, plan_version=plan.version, buffers=moved)
        return message, len(wire.encode(message))
