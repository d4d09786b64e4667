"""``edgemesh``: the one command for the services, the local tools, the operator tools and the benchmarks.

    edgemesh planner|ps|compressor|worker [--config F] [--broker URL] [--job J] [--set key=value ...]
    edgemesh broker [--host H] [--port P]            the embedded MQTT broker
    edgemesh demo [--workers N] [--report PATH] ...  a whole local cluster on one machine
    edgemesh job submit|list|status|pause|resume|stop|export   training jobs on the running services
    edgemesh devices | ctl COMMAND ...              operator tools
    edgemesh bench codecs|fleet|mesh|jobs|robust|soak [--report PATH]   benchmarks: JSON report + PNG
    edgemesh config [--config F] [--set ...]         print the effective configuration

Configuration precedence: defaults < TOML (--config or EDGEMESH_CONFIG) < EDGEMESH_* < flags.

Every subcommand lives in its own module and registers its own arguments (``register(parser)``);
a module is imported only when its subcommand runs, so ``edgemesh worker`` on a Pi loads neither
the benchmarks nor the embedded broker.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

from edgemesh.common.config import Config, describe, load_config
from edgemesh.common.errors import EdgeMeshError

COMMANDS: Mapping[str, tuple[str, str]] = {
    "planner": ("edgemesh.services.planner.command", "device registry, mesh layout, plan"),
    "ps": ("edgemesh.services.parameter_server.command", "parameter server: global model, versions, checkpoints"),
    "compressor": ("edgemesh.services.compressor.command", "codec policy per device, and the gateway"),
    "worker": ("edgemesh.services.worker.command", "one device: trains its share of the model"),
    "broker": ("edgemesh.local.embedded", "run the embedded MQTT broker (amqtt, MQTT 3.1.1)"),
    "demo": ("edgemesh.local.demo", "a whole local cluster: broker, planner, PS, compressor, N workers"),
    "devices": ("edgemesh.operator.devices", "list the devices of a job and their state"),
    "ctl": ("edgemesh.operator.ctl", "send a control command and print the replies"),
    "job": ("edgemesh.operator.job", "submit a training job to the running services, follow, steer, export it"),
    "predict": ("edgemesh.operator.predict", "classify images with an exported model (ONNX runs without torch)"),
    "bench": ("edgemesh.bench", "benchmarks that write JSON reports and PNG plots"),
    "simulate": ("edgemesh.simulate.command", "a fleet under each sync policy on a virtual clock: time to accuracy"),
}
"""Subcommand -> (module with ``register(parser)``, one-line help)."""
COMMON_KEYS = {"broker": "broker.url", "job": "job", "metrics": "metrics.address", "log_level": "log_level"}
"""Common flags and the setting each overrides."""
NOISY_LOGGERS = ("amqtt", "transitions", "aiomqtt")


def config_flags(parser: argparse.ArgumentParser, keys: Mapping[str, str] | None = None) -> None:
    """The configuration flags every command that loads a config has; ``keys`` maps the command's
    own flags (argparse dest) to the settings they override."""
    parser.add_argument("--config", help="TOML configuration file (also EDGEMESH_CONFIG)")
    parser.add_argument("--broker", help="broker URL, mqtt://host:port")
    parser.add_argument("--job", help="job name (topic namespace)")
    parser.add_argument("--metrics", help="host:port of /metrics (port 0 = any free port, '' = off)")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any setting by its dotted key, e.g. --set training.lr=0.1")
    parser.set_defaults(config_keys={**COMMON_KEYS, **(keys or {})})


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the flags of ``args`` override, as dotted keys."""
    out: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise EdgeMeshError(f"--set expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value
    for flag, key in getattr(args, "config_keys", COMMON_KEYS).items():
        value = getattr(args, flag, None)
        if value is not None:
            out[key] = str(value)
    return out


def load(args: argparse.Namespace) -> Config:
    return load_config(args.config, overrides=overrides(args))


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str) -> None:
    """Logging to stderr at ``level``; the MQTT libraries and amqtt at WARNING."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format=LOG_FORMAT)
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)


def service_command(parser: argparse.ArgumentParser, run: Callable[[Config], Coroutine[Any, Any, None]],
                    keys: Mapping[str, str] | None = None) -> None:
    """Make ``parser`` run a service: load the configuration, set up logging, ``asyncio.run(run(config))``."""
    config_flags(parser, keys)

    def command(args: argparse.Namespace) -> int:
        config = load(args)
        setup_logging(config.log_level)
        asyncio.run(run(config))
        return 0

    parser.set_defaults(func=command)


def _print_config(args: argparse.Namespace) -> int:
    for key, value, _ in describe(load(args)):
        print(f"{key} = {value!r}")
    return 0


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser; only the subcommand named in ``argv`` is imported to register its arguments."""
    parser = argparse.ArgumentParser(prog="edgemesh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, text) in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text)
        if name == chosen:
            importlib.import_module(module).register(p)
    p = sub.add_parser("config", help="print the effective configuration")
    config_flags(p)
    p.set_defaults(func=_print_config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args))
    except EdgeMeshError as exc:
        print(f"edgemesh: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
