"""``edgemesh bench codecs``: every gradient codec on real and synthetic gradients.

For each codec, at its default policy:

* ``compression_ratio``: fp32 bytes / wire bytes of a whole digits-CNN gradient (mean over
  gradients captured while training), and ``bytes_per_step`` (wire bytes of one update);
* ``relative_error``: ||decode(encode(g)) - g|| / ||g|| on those gradients, without error feedback;
* ``encode_gbps`` / ``decode_gbps``: GB/s of fp32 input on a synthetic 10-million-element
  tensor, one thread, best of several runs; ``memcpy_gbps`` (a plain copy) is the ceiling;
* ``final_accuracy``: held-out accuracy after a fixed synchronous training run of 4 simulated
  workers whose gradients go through the codec with error feedback, same seeds for every codec.

``same_density`` compares ``grid`` and ``threshold`` at one kept density (the grid-clustering paper
reports grid at about half the bytes of threshold at equal accuracy).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgemesh import cli
from edgemesh.bench.reporting import pyplot, save, write_report
from edgemesh.common.codecs import ErrorFeedback, available_codecs, get_codec
from edgemesh.common.messages import CodecPolicy
from edgemesh.common.vocabulary import SPARSE_CODECS, CodecName

logger = logging.getLogger(__name__)

SYNTHETIC_ELEMENTS = 10_000_000
TIMING_RUNS = 5
WORKERS = 4
DEFAULT_ROUNDS = 300
CAPTURE_EVERY = 10
SAME_DENSITY = 0.01
DEFAULT_DENSITY = 0.01
"""Kept share for sparsifying codecs when the benchmark uses their default policy."""


@dataclass(frozen=True, slots=True)
class Settings:
    rounds: int = DEFAULT_ROUNDS
    density: float = DEFAULT_DENSITY
    same_density: float = SAME_DENSITY
    elements: int = SYNTHETIC_ELEMENTS
    batch_size: int = 32
    lr: float = 0.1
    momentum: float = 0.9
    seed: int = 0


def default_policy(codec: CodecName, density: float) -> CodecPolicy:
    return CodecPolicy(device="bench", codec=codec, density=density if codec in SPARSE_CODECS else 1.0)


def _best_seconds(fn: Callable[[], Any], runs: int = TIMING_RUNS) -> float:
    best = math.inf
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def memcpy_gbps(elements: int) -> float:
    src = np.random.default_rng(1).standard_normal(elements, dtype=np.float32)
    dst = np.empty_like(src)
    return src.nbytes / _best_seconds(lambda: np.copyto(dst, src)) / 1e9


def _train(codec_name: CodecName, s: Settings, capture: list[dict[str, np.ndarray]] | None) -> float:
    """Synchronous training of WORKERS simulated devices through ``codec_name`` with error feedback.

    Returns the final held-out accuracy; appends raw per-parameter gradients to ``capture``.
    """
    import torch

    from edgemesh.common import models
    from edgemesh.common.data import BatchIterator, load_dataset, shard
    from edgemesh.services.parameter_server.optimizer import ModelState, ShardGrad

    torch.set_num_threads(1)
    train, test = load_dataset("digits", seed=s.seed)
    model = models.build_model("digits-cnn", seed=s.seed)
    state = ModelState(models.get_params(model))
    codec = get_codec(codec_name)
    policy = default_policy(codec_name, s.density)
    batches = [BatchIterator(shard(train, i, WORKERS, seed=s.seed), s.batch_size, seed=s.seed + i)
               for i in range(WORKERS)]
    feedback = [ErrorFeedback() for _ in range(WORKERS)]
    for step in range(s.rounds):
        models.set_params(model, state.params)
        contributions = []
        for w in range(WORKERS):
            x, y = next(batches[w])
            _, grads = models.compute_gradients(model, x, y)
            if capture is not None and w == 0 and step % CAPTURE_EVERY == 0:
                capture.append(grads)
            shards = []
            for name, g in grads.items():
                data = feedback[w].encode(name, g, codec, policy)
                shards.append(ShardGrad(name, 0, g.shape[0], codec.decode(data, g.size).reshape(g.shape)))
            contributions.append((1.0 / WORKERS, shards))
        state.step(contributions, lr=s.lr, momentum=s.momentum)
    models.set_params(model, state.params)
    return float(models.evaluate(model, test)[1])


def _on_gradients(codec_name: CodecName, grads: list[dict[str, np.ndarray]], density: float) -> dict[str, float]:
    codec = get_codec(codec_name)
    policy = default_policy(codec_name, density)
    raw = wire = 0
    errors = []
    for g in grads:
        sq_err = sq_norm = 0.0
        for arr in g.values():
            flat = arr.reshape(-1)
            data = codec.encode(flat, policy)
            back = codec.decode(data, flat.size)
            raw += flat.nbytes
            wire += len(data)
            sq_err += float(np.sum((back.astype(np.float64) - flat) ** 2))
            sq_norm += float(np.sum(flat.astype(np.float64) ** 2))
        errors.append(math.sqrt(sq_err / sq_norm) if sq_norm else 0.0)
    return {"compression_ratio": raw / wire, "bytes_per_step": wire / len(grads),
            "relative_error": float(np.mean(errors))}


def _speed(codec_name: CodecName, tensor: np.ndarray, density: float) -> dict[str, float]:
    codec = get_codec(codec_name)
    policy = default_policy(codec_name, density)
    data = codec.encode(tensor, policy)
    enc = _best_seconds(lambda: codec.encode(tensor, policy))
    dec = _best_seconds(lambda: codec.decode(data, tensor.size))
    return {"encode_gbps": tensor.nbytes / enc / 1e9, "decode_gbps": tensor.nbytes / dec / 1e9,
            "synthetic_compression_ratio": tensor.nbytes / len(data)}


def run(report: Path, s: Settings, *, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark; write ``report`` (JSON) and a PNG beside it; return the report."""
    import torch

    torch.set_num_threads(1)
    codecs = [c for c in ("none", "fp16", "topk", "threshold", "qsgd", "grid") if c in available_codecs()]
    progress(f"codecs: {', '.join(codecs)}; {s.rounds} training rounds each, {s.elements:,}-element tensor")
    tensor = np.random.default_rng(s.seed).standard_normal(s.elements, dtype=np.float32)
    result: dict[str, Any] = {"memcpy_gbps": round(memcpy_gbps(s.elements), 3), "codecs": {},
                              "settings": {"rounds": s.rounds, "workers": WORKERS, "density": s.density,
                                           "batch_size": s.batch_size, "lr": s.lr, "elements": s.elements}}
    captured: list[dict[str, np.ndarray]] = []
    started = time.perf_counter()
    for i, name in enumerate(codecs):
        accuracy = _train(name, s, captured if name == "none" else None)
        entry = {**_on_gradients(name, captured, s.density), **_speed(name, tensor, s.density),
                 "final_accuracy": accuracy}
        result["codecs"][name] = {k: round(v, 6) if isinstance(v, float) else v for k, v in entry.items()}
        progress(f"[{i + 1}/{len(codecs)}] {name:<9} ratio {entry['compression_ratio']:8.1f}  "
                 f"accuracy {accuracy:.4f}  encode {entry['encode_gbps']:.2f} GB/s  "
                 f"({time.perf_counter() - started:.0f}s)")
    if {"grid", "threshold"} <= set(codecs):
        grid = _on_gradients("grid", captured, s.same_density)
        thr = _on_gradients("threshold", captured, s.same_density)
        g_syn = len(get_codec("grid").encode(tensor, default_policy("grid", s.same_density)))
        t_syn = len(get_codec("threshold").encode(tensor, default_policy("threshold", s.same_density)))
        result["same_density"] = {
            "density": s.same_density,
            "grid_bytes": int(grid["bytes_per_step"]), "threshold_bytes": int(thr["bytes_per_step"]),
            "ratio": round(grid["bytes_per_step"] / thr["bytes_per_step"], 4),
            "synthetic_grid_bytes": g_syn, "synthetic_threshold_bytes": t_syn,
            "synthetic_ratio": round(g_syn / t_syn, 4),
        }
    write_report(report, result, _plot, progress)
    return result


def _plot(result: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    names = list(result["codecs"])
    ratios = [result["codecs"][n]["compression_ratio"] for n in names]
    accs = [result["codecs"][n]["final_accuracy"] for n in names]
    enc = [result["codecs"][n]["encode_gbps"] for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].bar(names, ratios, color="tab:blue")
    axes[0].set_yscale("log")
    axes[0].set_title("compression ratio (fp32 / wire bytes)")
    axes[1].bar(names, accs, color="tab:green")
    axes[1].set_ylim(min(accs) - 0.02, 1.0)
    axes[1].set_title("final accuracy (error feedback)")
    axes[2].bar(names, enc, color="tab:orange")
    axes[2].axhline(result["memcpy_gbps"], color="grey", linestyle="--", label="memcpy")
    axes[2].set_yscale("log")
    axes[2].set_title("encode GB/s (10 M elements, 1 thread)")
    axes[2].legend()
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    return save(fig, path)


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh bench codecs``."""
    parser.add_argument("--report", default="bench/reports/codecs.json", help="JSON report path (PNG beside it)")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="training rounds per codec")
    parser.add_argument("--density", type=float, default=DEFAULT_DENSITY, help="kept share of sparsifying codecs")
    parser.add_argument("--elements", type=int, default=SYNTHETIC_ELEMENTS, help="size of the synthetic tensor")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    cli.setup_logging(args.log_level or "WARNING")
    s = Settings(rounds=args.rounds, density=args.density, elements=args.elements)
    run(Path(args.report), s, progress=lambda line: print(line, file=sys.stderr, flush=True))
    return 0
