"""``edgemesh simulate``: policies x seeds of a simulated fleet, a JSON report and a short table (docs/simulation.md).

    edgemesh simulate [--fleet pi3,pi3,pi4,...] [--scenario steady|dynamic|harsh] [--policy sync|...|all]
                      [--parallelism data,mesh|all] [--seeds N] [--lr X] [--target A] [--budget-s S]
                      [--report PATH] [--set KEY=VALUE ...] [--job JOB.toml [--data-dir DIR]]
                      [--live JOB --broker URL [--wait S]]

With ``--job``, the fleet trains the user's own job (its model, settings, data and target: ``simulate/job.py``);
a fleet of the user's own boards is a profiles file (``--set worker.emulation_profiles=FILE``) and ``--fleet``
naming its profiles, or ``--live``: the devices a running job has, as they measured themselves (``simulate/live.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import cast

from edgemesh import cli
from edgemesh.bench.fleet import DEFAULT_BUDGET_S, DEFAULT_FLEET, DEFAULT_TARGET, EVAL_INTERVAL_S
from edgemesh.bench.runs import names
from edgemesh.common.config import load_config
from edgemesh.common.emulation.profiles import DeviceProfile, load_profiles
from edgemesh.common.errors import ConfigError
from edgemesh.common.vocabulary import SYNC_POLICIES, CodecName
from edgemesh.simulate import job as simulated_job
from edgemesh.simulate.engine import PARALLELISMS, POLICIES, Parallelism, Policy, SimSettings
from edgemesh.simulate.report import compare, table


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh simulate``."""
    parser.add_argument("--fleet", default=",".join(DEFAULT_FLEET), help="device profiles, comma-separated")
    parser.add_argument("--scenario", default="steady", help="emulation scenario: steady, dynamic, harsh "
                        "(--set worker.emulation_scenarios=FILE for your own)")
    parser.add_argument("--policy", default="all", help=f"{', '.join(POLICIES)}, comma-separated, or all (the "
                        f"service's: {', '.join(SYNC_POLICIES)}); fedbuff is a peer's rule for comparison")
    parser.add_argument("--parallelism", help="data, mesh, comma-separated, or all: runs of each policy under each "
                        "(default: planner.parallelism of the configuration or the job)")
    parser.add_argument("--seeds", type=int, default=1, help="runs per policy, seeds --seed, --seed + 1, ...")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--lr", type=float, help="learning rate of every policy (default: training.lr)")
    parser.add_argument("--target", type=float, help=f"target held-out accuracy (default: the job's "
                        f"target_accuracy, else {DEFAULT_TARGET})")
    parser.add_argument("--job", help="a job file: simulate its model, settings and data (what job submit sends)")
    parser.add_argument("--data-dir", help="the folder the job's data.path and evaluation.path are relative to "
                        "(default: worker.data_dir)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="virtual seconds per run")
    parser.add_argument("--eval-interval-s", type=float, default=EVAL_INTERVAL_S,
                        help="evaluate the model every this many virtual seconds")
    parser.add_argument("--codec", help="every device's gradient codec (default: compressor.default_codec)")
    parser.add_argument("--detect-s", type=float, help="seconds from a drop-out or a return to the new plan "
                        "(default: planner.replan_debounce_s)")
    parser.add_argument("--live", metavar="JOB", help="the fleet of the running job JOB: its devices as they measured "
                        "themselves (their hellos and stats on --broker), instead of --fleet")
    parser.add_argument("--broker", help="with --live: the broker's URL (default: broker.url)")
    parser.add_argument("--wait", type=float, default=3.0, help="with --live: seconds to listen for the devices' "
                        "stats (their hellos are retained)")
    parser.add_argument("--report", help="JSON report path (default: bench/reports/simulate-SCENARIO.json)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a board trains on its own)")
    parser.add_argument("--ps-update-s", type=float, default=0.0,
                        help="virtual seconds the parameter server spends on each update, one after another "
                             "(default 0: none; docs/simulation.md gives what bench fleet measured)")
    parser.add_argument("--ps-broadcast-s", type=float, default=0.0,
                        help="virtual seconds the parameter server spends on each model it publishes, before its next "
                             "update and its acks (default 0: none; docs/simulation.md gives what bench fleet showed)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any setting by its dotted key, e.g. --set ps.round_scaling=none")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")
    parser.set_defaults(func=main)


def policies_of(text: str) -> list[Policy]:
    """``--policy``: the policies named, or every service policy for ``all``; ConfigError for an unknown one."""
    return [cast(Policy, p) for p in _chosen(text, POLICIES, SYNC_POLICIES, "policy")]


def parallelisms_of(text: str | None) -> list[Parallelism | None]:
    """``--parallelism``: the parallelisms named, every one for ``all``, the configuration's for None."""
    if text is None:
        return [None]
    return [cast(Parallelism, p) for p in _chosen(text, PARALLELISMS, PARALLELISMS, "parallelism")]


def _chosen(text: str, known: Sequence[str], every: Sequence[str], what: str) -> list[str]:
    """The names of a comma-separated option: ``every`` for ``all``; ConfigError naming an unknown one."""
    chosen = names(text)
    if chosen == ["all"]:
        return list(every)
    unknown = [p for p in chosen if p not in known]
    if unknown or not chosen:
        raise ConfigError(f"unknown {what} {', '.join(unknown) or repr(text)}; known: {', '.join(known)}, or all")
    return chosen


def measured_fleet(args: argparse.Namespace) -> dict[str, DeviceProfile]:
    """``--live``: the running job's devices as boards."""
    import asyncio

    from edgemesh.simulate.live import boards, listen

    extra = {"job": args.live, **({"broker.url": args.broker} if args.broker else {})}
    overrides = cli.overrides(argparse.Namespace(set=args.set, config_keys={}))
    config = load_config(overrides={**overrides, **extra})
    return boards(asyncio.run(listen(config, args.wait)), load_profiles(
        overrides.get("worker.emulation_profiles") or None))


def main(args: argparse.Namespace) -> int:
    cli.setup_logging(args.log_level or "WARNING")
    if args.seeds < 1 or args.threads < 1:
        raise ConfigError("--seeds and --threads must be >= 1")
    import torch

    torch.set_num_threads(args.threads)
    target = args.target
    if target is None:
        target = (simulated_job.read(args.job).target_accuracy if args.job else 0.0) or DEFAULT_TARGET
    fleet, boards = tuple(names(args.fleet)), {}
    if args.live:
        devices = measured_fleet(args)
        fleet = tuple(b.name for b in devices.values())  # an emulated board by its profile, as --fleet names it
        boards = {b.name: b for b in devices.values()}
        shown = (f"{name} ({b.train_gflops:.2f} GFLOP/s, up {b.uplink_bps * 8e-6:.1f} Mbit/s)"
                 for name, b in devices.items())
        print(f"the fleet of job {args.live!r}: {', '.join(shown)}", file=sys.stderr)
    base = SimSettings(fleet=fleet, boards=boards, scenario=args.scenario, lr=args.lr, target=target,
                       job_file=args.job or "", data_dir=args.data_dir or "",
                       budget_s=args.budget_s, eval_interval_s=args.eval_interval_s,
                       codec=cast(CodecName | None, args.codec), detect_s=args.detect_s, ps_update_s=args.ps_update_s,
                       ps_broadcast_s=args.ps_broadcast_s,
                       overrides=cli.overrides(argparse.Namespace(set=args.set, config_keys={})))
    policies = policies_of(args.policy)
    report = compare(base, policies, range(args.seed, args.seed + args.seeds),
                     progress=lambda line: print(line, file=sys.stderr, flush=True),
                     parallelisms=parallelisms_of(args.parallelism))
    default = f"simulate-{Path(args.job).stem}-{args.scenario}.json" if args.job else f"simulate-{args.scenario}.json"
    path = Path(args.report or Path("bench/reports") / default)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"report written to {path}")
    return 0
