"""``edgemesh bench ideal``: what data parallel itself costs, with no system in the way.

``bench models`` compares the fleet with one PyTorch process at the same samples seen; a gap there is the
algorithm's (k batches averaged into one step, stale updates, devices holding different data) or the system's
(a lossy model broadcast, compressed gradients, a race). This benchmark takes the system out: in one process, on
the same glyph folders (:mod:`edgemesh.bench.glyphs`, one per device, non-IID) and the same models
(:mod:`edgemesh.bench.model_jobs`), it trains

* ``reference``: one process on the pooled data (``bench models``' reference);
* ``sync``: every step the exact sum of one batch per device, each computed on the exact current model, scaled
  as ``ps.round_scaling`` (``none``, ``sqrt``, ``linear``; warm-up left out) would;
* ``async``: the devices in turn, each update computed on the model ``devices - 1`` versions old (what four
  devices updating in turn see) and damped as ``ps.staleness_rule`` would (``inverse``, ``sqrt``, or ``whole``:
  not at all), with the job's momentum or ``compensated`` (``ps.async_momentum``).

A ``-clip`` variant combines each step's device gradients as the parameter server does by default
(``ps.aggregation = "clip"``: its own :class:`~edgemesh.services.parameter_server.robust.Aggregator`, each norm cut
to ``ps.clip_factor`` times the median of the recent ones); an ``-iid`` variant deals the pooled images out to the
devices at random, as many to each as its own folder holds, so that what devices holding different data cost can
be told from what the round costs. A ``-grid`` variant has the devices compute on the model as the parameter
server's broadcast leaves it with them (its own :class:`~edgemesh.common.broadcast.Broadcaster`, ``ps.broadcast =
"delta"`` with the ``grid`` codec at ``ps.delta_density`` and a whole snapshot every ``ps.snapshot_every`` steps:
the defaults under ``async``, where ``sync`` sends ``fp16`` deltas) instead of the exact model, so that what the
lossy broadcast costs can be told too; ``-grid-0.6`` keeps twice the share of each delta, ``-fp16`` sends every
delta whole in half precision. A ``-cameras`` variant takes each device's images (and the held-out ones, at random)
through a camera of its own, a gain and an offset (``CAMERAS``): devices whose inputs differ, not only their
classes; ``-fixbn`` normalizes by the running statistics, frozen, from half the samples on (FixBN's remedy for batch
norm on such devices).

Batch-norm statistics move as on the fleet: each device's change, sample-weighted, the running variance's as the
mixture's (``models.mixture_variance_change``; ``-bn-own``: as batch norm's own change, the rule before it).
Every variant is evaluated on the held-out folder every ``--every`` samples; the report gives each one's curve, its
best and its last. Set beside ``bench models``, it says how much of the fleet's gap is the algorithm's: the fleet
matching its ideal within the spread of single runs leaves nothing to the system.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgemesh import cli
from edgemesh.bench import model_jobs
from edgemesh.bench.glyphs import GLYPHS, device_mixes, draw_glyphs
from edgemesh.bench.reporting import finish, pyplot, save
from edgemesh.bench.runs import names
from edgemesh.common.broadcast import Broadcaster
from edgemesh.common.config import ParameterServerConfig
from edgemesh.common.data import BatchIterator, Dataset, load_local
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.services.parameter_server.adaptive import compensated_momentum, staleness_weight
from edgemesh.services.parameter_server.optimizer import ShardGrad
from edgemesh.services.parameter_server.robust import Aggregator

if TYPE_CHECKING:
    import torch

    Part = tuple[list[torch.Tensor], dict[str, torch.Tensor], int]
    """One device's batch: its gradient, its buffers' change and its samples."""

VARIANTS: dict[str, dict[str, Any]] = {
    "reference": {"mode": "reference"},
    "sync-none": {"mode": "sync", "scaling": "none"},
    "sync-sqrt": {"mode": "sync", "scaling": "sqrt"},
    "sync-linear": {"mode": "sync", "scaling": "linear"},
    "async-inverse": {"mode": "async", "damping": "inverse"},
    "async-sqrt": {"mode": "async", "damping": "sqrt"},
    "async-whole": {"mode": "async", "damping": "whole"},
    "async-whole-compensated": {"mode": "async", "damping": "whole", "compensated": True},
    "async-inverse-compensated": {"mode": "async", "damping": "inverse", "compensated": True},
    "sync-linear-clip": {"mode": "sync", "scaling": "linear", "clip": True},
    "sync-linear-clip-iid": {"mode": "sync", "scaling": "linear", "clip": True, "iid": True},
    "async-inverse-clip": {"mode": "async", "damping": "inverse", "clip": True},
    "sync-linear-clip-grid": {"mode": "sync", "scaling": "linear", "clip": True, "broadcast": {"delta_codec": "grid"}},
    "async-inverse-clip-grid": {"mode": "async", "damping": "inverse", "clip": True,
                                "broadcast": {"delta_codec": "grid"}},
    "sync-linear-clip-grid-0.6": {"mode": "sync", "scaling": "linear", "clip": True,
                                  "broadcast": {"delta_codec": "grid", "delta_density": 0.6}},
    "sync-linear-clip-fp16": {"mode": "sync", "scaling": "linear", "clip": True, "broadcast": {"delta_codec": "fp16"}},
    "reference-cameras": {"mode": "reference", "cameras": True},
    "sync-linear-clip-cameras": {"mode": "sync", "scaling": "linear", "clip": True, "cameras": True},
    "sync-linear-clip-cameras-bn-own": {"mode": "sync", "scaling": "linear", "clip": True, "cameras": True,
                                        "bn_own": True},
    "async-inverse-clip-cameras": {"mode": "async", "damping": "inverse", "clip": True, "cameras": True},
    "async-inverse-clip-cameras-bn-own": {"mode": "async", "damping": "inverse", "clip": True, "cameras": True,
                                          "bn_own": True},
    "sync-linear-clip-cameras-fixbn": {"mode": "sync", "scaling": "linear", "clip": True, "cameras": True,
                                       "fix_bn": 0.5},
    "async-inverse-clip-cameras-fixbn": {"mode": "async", "damping": "inverse", "clip": True, "cameras": True,
                                         "fix_bn": 0.5},
}
"""Every way of training the benchmark knows, by name."""


@dataclass(frozen=True, slots=True)
class Shards:
    """The devices' training sets, their pooled set and the held-out one."""

    devices: list[Dataset]
    pooled: Dataset
    held_out: Dataset


def prepare(workdir: Path, devices: int, per_class: int, held_out_per_class: int) -> tuple[Shards, dict[str, Any]]:
    """The glyph folders ``bench models`` draws, loaded; and what each device holds."""
    names_ = [f"w{i}" for i in range(devices)]
    mixes = device_mixes(names_, per_class)
    for i, device in enumerate(names_):
        draw_glyphs(workdir / device, mixes[device], seed=i)
    draw_glyphs(workdir / "held-out", dict.fromkeys(GLYPHS, held_out_per_class), seed=1000)

    def load(path: Path) -> Dataset:
        return load_local("image-folder", path, input_shape=(3, 32, 32), classes=GLYPHS).train

    parts = [load(workdir / d) for d in names_]
    pooled = Dataset("pooled", np.concatenate([p.x for p in parts]), np.concatenate([p.y for p in parts]),
                     len(GLYPHS))
    return Shards(parts, pooled, load(workdir / "held-out")), mixes


CAMERAS = ((1.0, 0.0), (1.3, 0.4), (0.8, -0.3), (1.15, 0.15))
"""``-cameras``: each device's pixels (in [0, 1]) times a gain plus an offset, as by a camera of its own, in turn."""


def through_cameras(shards: Shards, seed: int) -> Shards:
    """``shards`` as the devices' cameras would have taken them (``CAMERAS``, device i the i-th in turn); the pooled
    set is every device's so taken, and each held-out image is taken by one of the cameras at random."""
    def taken(x: np.ndarray, camera: int) -> np.ndarray:
        gain, offset = CAMERAS[camera % len(CAMERAS)]
        return (x * gain + offset).astype(np.float32)

    devices = [Dataset(f"{d.name}-camera", taken(d.x, i), d.y, d.num_classes) for i, d in enumerate(shards.devices)]
    pooled = Dataset("pooled-cameras", np.concatenate([d.x for d in devices]), shards.pooled.y,
                     shards.pooled.num_classes)
    held = shards.held_out
    cameras = np.random.default_rng(seed).integers(0, len(shards.devices), len(held.y))
    held_x = np.stack([taken(x, int(c)) for x, c in zip(held.x, cameras, strict=True)])
    return Shards(devices, pooled, Dataset("held-out-cameras", held_x, held.y, held.num_classes))


def dealt(shards: Shards, seed: int) -> list[Dataset]:
    """The pooled images dealt out at random, as many to each device as its own folder holds (``-iid``)."""
    order = np.random.default_rng(seed).permutation(len(shards.pooled.y))
    cuts = np.cumsum([len(d.y) for d in shards.devices])[:-1]
    return [Dataset(f"iid-{i}", shards.pooled.x[part], shards.pooled.y[part], shards.pooled.num_classes)
            for i, part in enumerate(np.split(order, cuts))]


def build(entry: model_jobs.BenchModel, seed: int, module_path: Path) -> Any:
    """The cell's module, built through its job spec as the fleet builds it (the same initial weights)."""
    from edgemesh.common import models
    from edgemesh.common.jobs import model_spec, parse_job

    spec = parse_job(model_jobs.job_text(entry, policy="sync", seed=seed, target=0.0, max_minutes=1.0,
                                         max_versions=0, module_path=module_path))
    model_spec(spec, allowed=(model_jobs.ENTRY_POINT_MODULE,), search_path=[str(module_path)])
    return models.build_model(spec.model_key, seed=seed)


class Fleet:
    """The fleet in one process: one module computes every device's gradient on the model it is given, and one
    optimizer (the server's) steps on what they send. Each way of training is a step of its own (``one_process``,
    ``in_sync``, ``in_turn``) that returns the samples it trained."""

    def __init__(self, variant: dict[str, Any], module: Any, shards: Shards, *, lr: float, momentum: float,
                 batch_size: int, seed: int) -> None:
        import torch

        from edgemesh.common import models

        self.variant, self.module = variant, module
        self.buffers = list(models.buffer_kinds(module))
        self.running = [] if variant.get("bn_own") else models.running_pairs(models.buffer_momenta(module))
        """Batch norms whose running variance moves as the mixture's (``-bn-own``: as batch norm moves it)."""
        self.devices = len(shards.devices)
        if variant.get("compensated"):
            momentum = compensated_momentum(momentum, self.devices)
        self.optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum)
        self.aggregator = Aggregator(ParameterServerConfig(), ServiceMetrics("ideal")) if variant.get("clip") \
            else None
        devices = dealt(shards, seed) if variant.get("iid") else shards.devices
        self.own = [BatchIterator(d, batch_size, seed=seed + i) for i, d in enumerate(devices)]
        self.pooled = BatchIterator(shards.pooled, batch_size, seed=seed)
        self.history: deque[dict[str, torch.Tensor]] = deque(maxlen=self.devices)
        """The latest versions of the model as the devices hold them, oldest first: what ``in_turn``'s updates are
        computed on."""
        self.turns = itertools.cycle(self.own)
        self.broadcast = Broadcaster(replace(ParameterServerConfig(), **variant["broadcast"]), "ideal") \
            if "broadcast" in variant else None
        self.version = 0
        self.fixed = False
        """``-fixbn``: batch norms normalize by the running statistics, which no longer move."""

    def step_of(self, mode: str) -> Callable[[], int]:
        return {"reference": self.one_process, "sync": self.in_sync, "async": self.in_turn}[mode]

    def one_process(self) -> int:
        """One batch of the pooled data."""
        grads, moved, n = self.gradient(self.pooled, self.state())
        self.step(self.state(), grads, moved)
        return n

    def in_sync(self) -> int:
        """One batch per device on the current model, their sample-weighted mean, scaled."""
        import torch

        now = self.state()
        held = self.held(now)
        parts = self.clipped([self.gradient(batches, held) for batches in self.own])
        n = sum(part[2] for part in parts)
        scale = {"none": 1.0, "sqrt": self.devices ** 0.5, "linear": float(self.devices)}[self.variant["scaling"]]
        grads = [torch.stack([part[0][i] * part[2] for part in parts]).sum(0) / n * scale
                 for i in range(len(parts[0][0]))]
        self.step(now, grads, {b: torch.stack([part[1][b] * part[2] for part in parts]).sum(0) / n
                               for b in self.buffers})
        return n

    def in_turn(self) -> int:
        """The next device's batch on the model ``devices - 1`` versions old (fewer at the start), damped."""
        now = self.state()
        self.history.append(self.held(now))
        [(grads, moved, n)] = self.clipped([self.gradient(next(self.turns), self.history[0])])
        delay = len(self.history) - 1
        damping = self.variant["damping"]
        weight = 1.0 if damping == "whole" else staleness_weight(delay, damping)
        self.step(now, [g * weight for g in grads], moved)
        return n

    def clipped(self, parts: list[Part]) -> list[Part]:
        """The parts of one step, each gradient's norm cut as the parameter server's ``clip`` cuts it (the parts
        as they are without ``-clip``)."""
        import torch

        if self.aggregator is None:
            return parts
        combined = self.aggregator.combine([(float(n), [ShardGrad(f"p{i}", 0, len(g), g.numpy())
                                                        for i, g in enumerate(grads)]) for grads, _, n in parts],
                                           rule="clip")
        return [([torch.from_numpy(g.values) for g in shards], moved, n)
                for (_, shards), (_, moved, n) in zip(combined.contributions, parts, strict=True)]

    def held(self, now: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model ``now`` as the devices hold it: exact, or (``-grid``) as the broadcast of this version leaves
        it with them (the parameter server's view of the workers)."""
        import torch

        if self.broadcast is None:
            return now
        # as the parameter server holds the model: float32, a scalar buffer (batch norm's count) as one value
        self.broadcast.after_step({k: np.atleast_1d(v.numpy().astype(np.float32)) for k, v in now.items()},
                                  self.version, self.variant["mode"], None)
        self.version += 1
        view = self.broadcast.view
        assert view is not None
        return {k: torch.from_numpy(view[k].reshape(v.shape).copy()).to(v.dtype) for k, v in now.items()}

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def gradient(self, batches: Iterator[tuple[np.ndarray, np.ndarray]], at: dict[str, torch.Tensor]) -> Part:
        """One batch's gradient and buffer change, computed on the model ``at``."""
        import torch
        import torch.nn.functional as F

        from edgemesh.common import models
        from edgemesh.common.models.training import BATCH_NORMS

        module = self.module
        module.load_state_dict(at)
        x, y = next(batches)
        module.train()
        if self.fixed:
            for norm in module.modules():
                if isinstance(norm, BATCH_NORMS):
                    norm.eval()
        module.zero_grad(set_to_none=True)
        F.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        after = module.state_dict()
        moved = {b: after[b].double() - at[b].double() for b in self.buffers}
        for var, mean, momentum in self.running:  # as a worker's step reports it (``models.compute_update``)
            moved[var] = torch.from_numpy(models.mixture_variance_change(moved[var].numpy(), moved[mean].numpy(),
                                                                         momentum))
        return ([p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in module.parameters()],
                moved, len(y))

    def step(self, now: dict[str, torch.Tensor], grads: list[torch.Tensor], moved: dict[str, torch.Tensor]) -> None:
        """One optimizer step from ``now`` on ``grads``, the buffers moved by ``moved``."""
        import torch

        self.module.load_state_dict(now)
        for p, g in zip(self.module.parameters(), grads, strict=True):
            p.grad = g
        self.optimizer.step()
        with torch.no_grad():
            current = self.module.state_dict()
            for b in self.buffers:
                current[b].copy_((now[b].double() + moved[b]).to(current[b].dtype))


def train(variant: dict[str, Any], module: Any, shards: Shards, *, lr: float, momentum: float, batch_size: int,
          seed: int, samples: int, every: int) -> list[tuple[int, float]]:
    """Train ``module`` as ``variant`` says for ``samples`` samples; its held-out accuracy every ``every``."""
    import torch

    if variant.get("cameras"):
        shards = through_cameras(shards, seed)
    x_held, y_held = torch.tensor(shards.held_out.x), torch.tensor(shards.held_out.y)
    fleet = Fleet(variant, module, shards, lr=lr, momentum=momentum, batch_size=batch_size, seed=seed)
    advance = fleet.step_of(variant["mode"])
    curve: list[tuple[int, float]] = []
    seen, due = 0, every
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # dropout's draws
        while seen < samples:
            seen += advance()
            fleet.fixed = "fix_bn" in variant and seen >= samples * variant["fix_bn"]
            if seen >= due or seen >= samples:
                module.eval()
                with torch.no_grad():
                    curve.append((seen, round(float((module(x_held).argmax(dim=1) == y_held).float().mean()), 4)))
                due += every
    return curve


def plot(result: dict[str, Any], png: Path) -> bool:
    """Each variant's held-out accuracy against samples, one panel per model and seed."""
    plt = pyplot()
    runs = result.get("runs") or {}
    if plt is None or not runs:
        return False
    columns = min(len(runs), 5)
    rows = -(-len(runs) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 4 * rows), squeeze=False)
    order = list(dict.fromkeys(name for variants in runs.values() for name in variants))
    # a variant's colour and line in every panel: twenty colours, then the same again dashed
    styles = {name: (plt.get_cmap("tab20")(i % 20), "-" if i < 20 else "--") for i, name in enumerate(order)}
    for ax, (key, variants) in zip(axes.flat, runs.items(), strict=False):
        for name, run in variants.items():
            if run["curve"]:
                xs, ys = zip(*run["curve"], strict=True)
                colour, line = styles[name]
                ax.plot(xs, ys, label=name, color=colour, linestyle=line,
                        linewidth=2.5 if name.startswith("reference") else 1.2)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("samples seen")
        ax.set_ylabel("held-out accuracy")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=6)  # each panel names the variants it holds
    for ax in list(axes.flat)[len(runs):]:
        ax.set_visible(False)
    fig.suptitle("ideal data parallel in one process, beside one process on the pooled data", fontsize=10)
    return save(fig, png)


def run(report: Path, args: argparse.Namespace, progress: Callable[[str], None]) -> int:
    catalogue = model_jobs.catalogue()
    chosen, variants = names(args.models), names(args.variants)
    unknown = [m for m in chosen if m not in catalogue] + [v for v in variants if v not in VARIANTS]
    if unknown or args.samples < 1 or args.every < 1 or args.seeds < 1 or args.first_seed < 0 or args.devices < 2:
        print(f"edgemesh bench ideal: unknown {', '.join(unknown)}; models: {', '.join(catalogue)}; variants: "
              f"{', '.join(VARIANTS)}" if unknown else "edgemesh bench ideal: --samples, --every, --seeds >= 1, "
              "--first-seed >= 0, --devices >= 2", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)  # the fleet's devices train on one thread each
    workdir = Path(tempfile.mkdtemp(prefix="edgemesh-bench-ideal-"))
    started = time.monotonic()
    shards, mixes = prepare(workdir, args.devices, args.per_class, args.held_out_per_class)
    module_path = model_jobs.write_entry_point(workdir / "models")
    result: dict[str, Any] = {
        "command": " ".join(["edgemesh", *sys.argv[1:]]),
        "settings": {"models": chosen, "variants": variants, "seeds": args.seeds, "first_seed": args.first_seed,
                     "devices": args.devices,
                     "samples": args.samples, "every": args.every, "per_class": args.per_class,
                     "held_out_per_class": args.held_out_per_class,
                     "async_delay": f"{args.devices - 1} versions (each update on the model devices - 1 steps old)"},
        "data": {"devices": mixes}, "runs": {}, "summary": {}}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for name in chosen:
            entry, key = catalogue[name], f"{name}/s{seed}"
            result["runs"][key] = {}
            for variant in variants:
                began = time.perf_counter()
                curve = train(VARIANTS[variant], build(entry, seed, module_path), shards, lr=entry.lr,
                              momentum=0.9, batch_size=entry.batch_size, seed=seed, samples=args.samples,
                              every=args.every)
                best, last = max(a for _, a in curve), curve[-1][1]
                result["runs"][key][variant] = {"best": best, "last": last, "curve": curve,
                                                "seconds": round(time.perf_counter() - began, 1)}
                result["summary"].setdefault(name, {}).setdefault(variant, []).append(best)
                progress(f"  {key} {variant}: best {best:.3f}, last {last:.3f}")
    result["wall_seconds"] = round(time.monotonic() - started, 1)
    finish(report, result, plot, progress, workdir, keep_logs=False)
    return 0


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh bench ideal``."""
    parser.add_argument("--report", default="bench/reports/ideal.json", help="JSON report path (PNG beside it)")
    parser.add_argument("--models", default="plain-cnn,bn-cnn",
                        help="comma-separated subset of " + ", ".join(model_jobs.catalogue()))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of "
                                                                        + ", ".join(VARIANTS))
    parser.add_argument("--seeds", type=int, default=1, help="seeds per model (default 1)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0): --first-seed 5 "
                        "--seeds 5 runs seeds 5-9")
    parser.add_argument("--devices", type=int, default=4, help="devices, each its own glyph folder (default 4)")
    parser.add_argument("--per-class", type=int, default=80, help="images of a device's two main classes")
    parser.add_argument("--held-out-per-class", type=int, default=60, help="held-out images per class")
    parser.add_argument("--samples", type=int, default=12000, help="samples each variant trains on (default 12,000)")
    parser.add_argument("--every", type=int, default=800, help="evaluate every this many samples (default 800)")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    cli.setup_logging(args.log_level or "WARNING")
    return run(Path(args.report), args, progress=lambda line: print(line, file=sys.stderr, flush=True))
