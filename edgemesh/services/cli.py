"""``edgemesh``: one command for every service, the broker, the demo and the operator tools.

    edgemesh broker [--host H] [--port P]
    edgemesh planner|ps|compressor|worker [--config F] [--broker URL] [--job J] [--set key=value ...]
    edgemesh demo [--workers N] [--report PATH] [--broker URL] ...
    edgemesh devices [--broker URL] [--job J]
    edgemesh ctl COMMAND [--target ps] [--value V] [--device D] [--broker URL] [--job J]
    edgemesh bench codecs [--report PATH]           (benchmarks: JSON report + PNG)
    edgemesh config [--config F] [--set ...]       (print the effective configuration)

Configuration precedence: defaults < TOML (--config or EDGEMESH_CONFIG) < EDGEMESH_* < flags.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from edgemesh.common.config import Config, describe, load_config
from edgemesh.common.errors import EdgeMeshError

logger = logging.getLogger("edgemesh")

SERVICES = {
    "planner": "edgemesh.services.planner.service",
    "ps": "edgemesh.services.parameter_server.service",
    "compressor": "edgemesh.services.compressor.service",
    "worker": "edgemesh.services.worker.service",
}


def _common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML configuration file (also EDGEMESH_CONFIG)")
    parser.add_argument("--broker", help="broker URL, mqtt://host:port")
    parser.add_argument("--job", help="job name (topic namespace)")
    parser.add_argument("--metrics", help="host:port of /metrics (port 0 = any free port, '' = off)")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any setting by its dotted key, e.g. --set training.lr=0.1")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise EdgeMeshError(f"--set expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value
    for flag, key in (("broker", "broker.url"), ("job", "job"), ("metrics", "metrics.address"),
                      ("log_level", "log_level"), ("device", "worker.device"), ("state_dir", "ps.state_dir"),
                      ("workers", "demo.workers"), ("target_accuracy", "demo.target_accuracy"),
                      ("max_versions", "demo.max_versions"), ("timeout", "demo.timeout_s"),
                      ("policy", "training.sync_policy"), ("link_rate", "demo.link_rate_bps"),
                      ("emulate", "worker.emulate"), ("keep_logs", "demo.keep_logs")):
        value = getattr(args, flag, None)
        if value is not None:
            out[key] = str(value)
    return out


def _load(args: argparse.Namespace) -> Config:
    return load_config(args.config, overrides=_overrides(args))


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("amqtt", "transitions", "aiomqtt"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _run_service(name: str) -> Callable[[argparse.Namespace], int]:
    def command(args: argparse.Namespace) -> int:
        config = _load(args)
        _setup_logging(config.log_level)
        module = importlib.import_module(SERVICES[name])
        run: Callable[[Config], Coroutine[Any, Any, None]] = module.run
        asyncio.run(run(config))
        return 0

    return command


def _broker(args: argparse.Namespace) -> int:
    from edgemesh.common.broker import main as broker_main

    return broker_main(["--host", args.host, "--port", str(args.port), "--log-level", args.log_level or "INFO"])


def _demo(args: argparse.Namespace) -> int:
    from edgemesh.services.demo import run_demo

    config = _load(args)
    _setup_logging(args.log_level or "WARNING")
    return run_demo(config, report=args.report, external_broker=args.broker is not None,
                    quiet=args.quiet, embedded_broker=args.embedded_broker)


def _devices(args: argparse.Namespace) -> int:
    from edgemesh.services.operator import list_devices

    config = _load(args)
    _setup_logging(config.log_level if args.log_level else "WARNING")
    return asyncio.run(list_devices(config, wait_s=args.wait))


def _ctl(args: argparse.Namespace) -> int:
    from edgemesh.services.operator import send_command

    config = _load(args)
    _setup_logging(config.log_level if args.log_level else "WARNING")
    return asyncio.run(send_command(config, target=args.target, command=args.command, value=args.value,
                                    device=args.device_name or "", timeout_s=args.timeout_s))


def _bench_codecs(args: argparse.Namespace) -> int:
    from edgemesh.bench.codecs import main as bench_main

    _setup_logging(args.log_level or "WARNING")
    return bench_main(args.report, rounds=args.rounds, density=args.density, elements=args.elements)


def _bench_fleet(args: argparse.Namespace) -> int:
    from edgemesh.bench.fleet import main as bench_main

    _setup_logging(args.log_level or "WARNING")
    if args.budget_s <= 0 or not 0 < args.target <= 1:
        raise EdgeMeshError("--budget-s must be > 0 and --target in (0, 1]")
    overrides = _overrides(args)
    return bench_main(args.report, fleet=args.fleet, policies=args.policies, target=args.target,
                      budget_s=args.budget_s, seed=args.seed, overrides=overrides, keep_logs=args.keep_logs)


def _bench_mesh(args: argparse.Namespace) -> int:
    from edgemesh.bench.mesh import main as bench_main

    _setup_logging(args.log_level or "WARNING")
    return bench_main(args.report, fleet=args.fleet, modes=args.modes, batch=args.batch, dilation=args.dilation,
                      iterations=args.iterations, accuracy_iterations=args.accuracy_iterations, seed=args.seed,
                      overrides=_overrides(args), keep_logs=args.keep_logs)


def _config(args: argparse.Namespace) -> int:
    config = _load(args)
    for key, value, _ in describe(config):
        print(f"{key} = {value!r}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgemesh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("broker", help="run the embedded MQTT broker (amqtt, MQTT 3.1.1)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=1883)
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_broker)

    for name, text in (("planner", "device registry, mesh layout, plan"),
                       ("ps", "parameter server: global model, versions, checkpoints"),
                       ("compressor", "codec policy per device"),
                       ("worker", "one device: trains its shard")):
        p = sub.add_parser(name, help=text)
        _common_flags(p)
        if name == "worker":
            p.add_argument("--device", help="device name (default: host name)")
            p.add_argument("--emulate", metavar="PROFILE",
                           help="emulate a device profile (pi3, pi4, pi5, jetson-nano, laptop): its speed, memory "
                                "and link; off by default")
        if name == "ps":
            p.add_argument("--state-dir", help="directory of checkpoint and write-ahead log")
            p.add_argument("--policy", help="sync, async, ssp or adaptive")
        p.set_defaults(func=_run_service(name))

    p = sub.add_parser("demo", help="a whole local cluster: broker, planner, PS, compressor, N workers")
    _common_flags(p)
    p.add_argument("--workers", type=int, help="number of worker processes (default 4)")
    p.add_argument("--report", help="write a JSON report to this path")
    p.add_argument("--target-accuracy", type=float, help="stop at this held-out accuracy (default 0.95)")
    p.add_argument("--max-versions", type=int, help="stop after this many model versions")
    p.add_argument("--timeout", type=float, help="give up after this many seconds")
    p.add_argument("--policy", help="sync, async, ssp or adaptive")
    p.add_argument("--link-rate", type=float, dest="link_rate",
                   help="uplink bytes/s each worker declares (default 1e6; 0 = measure loopback)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--keep-logs", action="store_true", default=None,
                   help="keep the children's logs after a successful run too (demo.keep_logs)")
    p.add_argument("--embedded-broker", action="store_true",
                   help="use the embedded amqtt broker even if mosquitto is installed")
    p.set_defaults(func=_demo)

    p = sub.add_parser("devices", help="list the devices of a job and their state")
    _common_flags(p)
    p.add_argument("--wait", type=float, default=1.0, help="seconds to collect retained messages")
    p.set_defaults(func=_devices)

    p = sub.add_parser("ctl", help="send a control command and print the reply")
    _common_flags(p)
    p.add_argument("command", help="e.g. status, pause, resume, set-sync-policy, set-bound, set-lr, snapshot, stop")
    p.add_argument("--target", default="ps", help="planner | ps | compressor | all | device/ID")
    p.add_argument("--value", help="command argument (numbers are sent as numbers)")
    p.add_argument("--device", dest="device_name", help="device the command is about")
    p.add_argument("--timeout-s", type=float, default=5.0, help="how long to wait for the reply")
    p.set_defaults(func=_ctl)

    p = sub.add_parser("bench", help="benchmarks that write JSON reports and PNG plots")
    bench = p.add_subparsers(dest="bench", required=True)
    b = bench.add_parser("codecs", help="gradient codecs: ratio, error, speed, accuracy")
    b.add_argument("--report", default="bench/reports/codecs.json", help="JSON report path (PNG beside it)")
    b.add_argument("--rounds", type=int, default=300, help="training rounds per codec")
    b.add_argument("--density", type=float, default=0.01, help="kept share of sparsifying codecs")
    b.add_argument("--elements", type=int, default=10_000_000, help="size of the synthetic tensor")
    b.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")
    b.set_defaults(func=_bench_codecs)
    from edgemesh.bench.fleet import DEFAULT_BUDGET_S, DEFAULT_FLEET, DEFAULT_TARGET, POLICIES

    b = bench.add_parser("fleet", help="an emulated fleet under every sync policy: time to accuracy, delays, bytes")
    b.add_argument("--report", default="bench/reports/fleet.json", help="JSON report path (PNG beside it)")
    b.add_argument("--fleet", default=",".join(DEFAULT_FLEET), help="device profiles, comma-separated")
    b.add_argument("--policies", default=",".join(POLICIES), help="runs, comma-separated")
    b.add_argument("--target", type=float, default=DEFAULT_TARGET, help="target held-out accuracy")
    b.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="seconds of training per run")
    b.add_argument("--seed", type=int, default=0, help="seed of the emulated links' disconnects")
    b.add_argument("--keep-logs", action="store_true", help="keep every process's log (failed runs always do)")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any setting")
    b.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")
    b.set_defaults(func=_bench_fleet)
    from edgemesh.bench import mesh as mesh_bench

    b = bench.add_parser("mesh", help="single device, data parallelism and Edge Mesh: iteration delay, memory, "
                                      "accuracy, load balance")
    b.add_argument("--report", default="bench/reports/mesh.json", help="JSON report path (PNG beside it)")
    b.add_argument("--fleet", default=",".join(mesh_bench.DEFAULT_FLEET), help="device profiles, comma-separated")
    b.add_argument("--modes", default=",".join(mesh_bench.MODES), help="runs, comma-separated")
    b.add_argument("--batch", type=int, default=mesh_bench.DEFAULT_BATCH,
                   help="samples per iteration in every mode (a multiple of the fleet size)")
    b.add_argument("--dilation", type=float, default=mesh_bench.DEFAULT_DILATION,
                   help="emulated boards run this many times slower (compute and links), so the host keeps up")
    b.add_argument("--iterations", type=int, default=mesh_bench.DEFAULT_ITERATIONS,
                   help="timed model versions per mode (after a warm-up)")
    b.add_argument("--accuracy-iterations", type=int, default=mesh_bench.DEFAULT_ACCURACY_ITERATIONS,
                   help="model versions of each digits accuracy run (0 = skip accuracy)")
    b.add_argument("--seed", type=int, default=0, help="seed of the emulated links and the 1,000-device fleet")
    b.add_argument("--keep-logs", action="store_true", help="keep every process's log (failed runs always do)")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any setting")
    b.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")
    b.set_defaults(func=_bench_mesh)

    p = sub.add_parser("config", help="print the effective configuration")
    _common_flags(p)
    p.set_defaults(func=_config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except EdgeMeshError as exc:
        print(f"edgemesh: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
