"""``edgemesh planner``: its flags, and which planner runs: the job of the configuration, or, with no job named, one
for every job operators submit (``host``)."""

from __future__ import annotations

import argparse

from edgemesh import cli
from edgemesh.common.config import Config
from edgemesh.services.planner.service import Planner


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh planner``: the configuration flags."""
    cli.service_command(parser, run)


async def run(config: Config) -> None:
    """Run the planner until stopped (SIGINT, SIGTERM or a ``stop`` command): the job of the configuration, or
    without one the jobs operators submit."""
    from edgemesh.services.host import serve_or_host

    await serve_or_host("planner", config, Planner)
