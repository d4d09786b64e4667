"""``edgemesh ps``: its flags, and which server runs: the job of the configuration, or, with no job named, the
job board that serves the jobs operators submit; either as one process, or as shard i of n (``--shard i/n``)."""

from __future__ import annotations

import argparse

from edgemesh import cli
from edgemesh.common.config import Config
from edgemesh.services.parameter_server.service import ParameterServer


class _Shard(argparse.Action):
    """``--shard i/n``: ``ps.shard`` and ``ps.shards``, as ``--set`` would give them; ``--shard i`` alone takes n
    from ``ps.shards`` of the configuration (which the workers read too: the systemd template's way)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        index, sep, count = str(values).partition("/")
        if not (index.isdigit() and (count.isdigit() or not sep)):
            parser.error(f"--shard expects INDEX/COUNT such as 0/2, or INDEX (COUNT from ps.shards), got {values!r}")
        namespace.set = [*namespace.set, f"ps.shard={index}", *([f"ps.shards={count}"] if sep else [])]


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh ps``: the configuration flags and its own."""
    parser.add_argument("--state-dir", help="directory of checkpoint and write-ahead log")
    parser.add_argument("--policy", help="sync, async, ssp or adaptive")
    parser.add_argument("--shard", action=_Shard, metavar="I/N", help="run shard I of a parameter server split "
                        "into N processes (workers need ps.shards = N too); I alone takes N from ps.shards; "
                        "default: one process")
    cli.service_command(parser, run, {"state_dir": "ps.state_dir", "policy": "training.sync_policy"})


async def run(config: Config) -> None:
    """Run the parameter server until stopped (SIGINT, SIGTERM or a ``stop`` command): the job of the
    configuration, or without one the jobs operators submit, their states kept by the job board (``jobs``; with
    shards, shard 0's keeps them and the others serve what it starts)."""
    if config.job:
        await ParameterServer(config).run(signals=True)
        return
    from edgemesh.services.parameter_server.jobs import serve_jobs

    await serve_jobs(config)
