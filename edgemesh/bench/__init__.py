"""Benchmarks behind ``edgemesh bench ...``: each writes a JSON report and a PNG plot (docs/benchmarks.md).

Reports default to ``bench/reports/`` of the working directory. Benchmarks compare ratios
measured in one run (this class of machine is noisy); tests never assert their speed. Each
benchmark module registers its own arguments. Besides ``edgemesh bench``, ``edgemesh simulate`` imports the
fleet's settings from here and ``edgemesh demo`` the report writer; no service does.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "codecs": ("edgemesh.bench.codecs", "gradient codecs: ratio, error, speed, accuracy"),
    "ddp": ("edgemesh.bench.ddp", "EdgeMesh sync beside torch DDP on the same job: time per step, final held-out loss"),
    "fleet": ("edgemesh.bench.fleet", "an emulated fleet under every sync policy: time to accuracy, delays, bytes"),
    "ideal": ("edgemesh.bench.ideal", "ideal data parallel in one process on bench models' data: what sync and async "
                                      "themselves cost per sample, with no system in the way"),
    "jobs": ("edgemesh.bench.jobs", "users' jobs (image folders, CSV; layer list, entry point) on one running fleet: "
                                    "time to target, bytes"),
    "mesh": ("edgemesh.bench.mesh", "single device, data parallelism and Edge Mesh: iteration delay, memory, "
                                    "accuracy, load balance"),
    "models": ("edgemesh.bench.models", "your model on the fleet beside one plain PyTorch process on the pooled data: "
                                        "exported accuracy per model x sync policy, the same samples seen"),
    "policies": ("edgemesh.bench.policies", "every sync policy and FedBuff (a peer's reference) on the simulator over "
                                            "seeds: time to target, divergence, share of the headroom over sync"),
    "robust": ("edgemesh.bench.robust", "a fleet with faulty devices under each robust aggregation rule: "
                                        "accuracy against a clean run"),
    "scale": ("edgemesh.bench.scale", "many light load-generating devices on one broker for minutes: updates/s, "
                                      "publish-to-ack, CPU and RSS per service, the PS's queue"),
    "soak": ("edgemesh.bench.soak", "a cluster whose workers are killed and restarted for N minutes: memory growth, "
                                    "queues, updates lost or applied twice"),
    "transport": ("edgemesh.bench.transport", "the broker alone beside the parameter server's ingest of the same "
                                              "gradients: MB/s, publish-to-ack p50/p99"),
}
"""Benchmark -> (module with ``register(parser)``, one-line help)."""


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh bench NAME``: one subcommand per benchmark, each with the benchmark's own arguments."""
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for name, (module, text) in BENCHMARKS.items():
        importlib.import_module(module).register(sub.add_parser(name, help=text, description=text))
