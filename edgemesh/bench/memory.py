"""What each device of a layout holds during one training step, measured on real tensors (``bench mesh``).

Every cluster of a plan runs one step of its batch in this process; saved-tensor hooks count the
activations autograd keeps for the backward pass, and the rows of the model a member trains count
four times over: its model view, its parameters, their gradients and the error-feedback residual.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from edgemesh.common import costs, models
from edgemesh.common.messages import Plan
from edgemesh.services.worker.mesh.exchange import LocalHub
from edgemesh.services.worker.mesh.member import MeshMember


def held_bytes(spec: str, batch: int, plan: Plan | None) -> dict[str, Any]:
    """Bytes of parameters, optimizer-like state and activations per device, measured on real
    tensors: every cluster of ``plan`` runs one step of its batch (at most ``batch``) in this process
    (saved-tensor hooks). ``mean`` over the devices (the Edge Mesh paper reports average memory), ``max``, and
    the parts of the largest holder."""
    shape = models.get_spec(spec).input_shape
    rng = np.random.default_rng(0)
    x = rng.random((batch, *shape), dtype=np.float32)
    y = rng.integers(0, 10, batch)
    params = models.get_params(models.build_model(spec))
    full: dict[str, tuple[int, ...]] = {layer.name: (layer.units,) for layer in costs.layers(spec)}
    batches = {d.cluster: d.batch_size for d in plan.devices} if plan else {}
    clusters = [(c.counts if len(c.members) > 1 else full, batches.get(c.cluster, batch))
                for c in (plan.clusters if plan else ())] or [(full, batch)]
    out: list[dict[str, int]] = []
    measured: dict[tuple[Any, int], list[dict[str, int]]] = {}
    for counts, b in clusters:
        key = (tuple(sorted(counts.items())), b)
        if key not in measured:
            measured[key] = _cluster_bytes(spec, counts, params, x[:b], y[:b])
        out += measured[key]
    totals = [sum(d.values()) for d in out]
    largest = out[totals.index(max(totals))]
    return {"mean": round(statistics.fmean(totals)), "max": max(totals), "devices": len(out), "largest": largest}


def _cluster_bytes(spec: str, counts: dict[str, tuple[int, ...]], params: dict[str, Any], x: Any,
                   y: Any) -> list[dict[str, int]]:
    """What every member of a cluster dividing ``spec`` by ``counts`` holds during one step."""
    k = len(next(iter(counts.values())))
    members = [MeshMember(spec, counts, i) for i in range(k)]
    for m in members:
        m.load(params, 0)
    saved: list[dict[int, int]] = [{} for _ in range(k)]
    # autograd also saves the weights for the input gradient: they are counted as parameters already
    weights = [{t.untyped_storage().data_ptr() for layer in m.layers.values() for t in (layer.weight, layer.bias)
                if t is not None} for m in members]

    def runner(i: int) -> Callable[..., Any]:
        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights[i]:
                saved[i][storage.data_ptr()] = storage.nbytes()
            return t

        async def run(fn: Callable[..., Any], *args: Any, flops: float = 0.0) -> Any:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                result = fn(*args)
            for layer in members[i].layers.values():  # outputs kept for the backward pass
                if layer.saved is not None and (kept := layer.saved[1]) is not None:
                    storage = kept.untyped_storage()
                    saved[i].setdefault(storage.data_ptr(), storage.nbytes())
            return result
        return run

    hub = LocalHub(k)

    async def step() -> None:
        await asyncio.gather(*(m.step(1, x, y, hub.member(i), run=runner(i)) for i, m in enumerate(members)))

    asyncio.run(step())
    out = []
    for i, m in enumerate(members):  # the model view keeps exactly the rows a member trains
        trained = m.param_count * costs.FLOAT32_BYTES
        out.append({"view": trained, "parameters": trained, "gradients": trained, "residual": trained,
                    "activations": sum(saved[i].values())})
    return out
