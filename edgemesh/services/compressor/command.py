"""``edgemesh compressor``: its flags, and which compressor runs: the job of the configuration, or, with no job
named, one for every job operators submit (``host``)."""

from __future__ import annotations

import argparse

from edgemesh import cli
from edgemesh.common.config import Config
from edgemesh.services.compressor.service import Compressor


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh compressor``: the configuration flags."""
    cli.service_command(parser, run)


async def run(config: Config) -> None:
    """Run the compressor until stopped (SIGINT, SIGTERM or a ``stop`` command): the job of the configuration, or
    without one the jobs operators submit."""
    from edgemesh.services.host import serve_or_host

    await serve_or_host("compressor", config, Compressor)
