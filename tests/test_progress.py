"""Progress output read from a file or a pipe: ``edgemesh job status`` (following a job) and ``edgemesh demo`` print
a plain line per change at a bounded rate there, not a bar redrawn with carriage returns into the log."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import re
import shutil
import time

from helpers import WAIT_S, inbox, make_config, until

from edgemesh.common.config import load_config
from edgemesh.common.messages import JobState
from edgemesh.common.topics import Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.local.demo import Demo
from edgemesh.operator.job import status
from edgemesh.operator.progress import LINE_INTERVAL_S, ProgressLines

REDRAWS = re.compile(r"[\r\x1b]")
"""What a bar redrawn in place writes: carriage returns, terminal escapes."""


class Clock:
    """An emulated monotonic clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_progress_lines_print_each_change_at_most_once_per_interval_and_the_final_one() -> None:
    out, clock = io.StringIO(), Clock()
    lines = ProgressLines(out, interval_s=5.0, clock=clock)
    assert lines.show("version 1")
    for version in range(2, 50):  # changes within the interval wait; a later call carries the latest
        clock.now += 0.1
        assert not lines.show(f"version {version}")
    clock.now += 0.5  # 5.3 s since the first line
    assert lines.show("version 50", "version 50 (5.3 s)")
    clock.now += 60
    assert not lines.show("version 50", "version 50 (65.3 s)")  # no change, no line, however long
    assert lines.show("version 51")  # a change after the interval: at once
    clock.now += 0.1
    assert lines.show("finished", final=True)  # the last one whatever the time
    assert not lines.show("finished", final=True)
    assert out.getvalue().splitlines() == ["version 1", "version 50 (5.3 s)", "version 51", "finished"]


async def test_a_followed_job_status_into_a_file_prints_plain_lines(mosquitto_broker: BrokerProcess) -> None:
    config = make_config(mosquitto_broker, job="plain")
    topics = Topics("plain")
    state = JobState(name="plain", state="running", sha256="a" * 64, version=1, max_versions=50, started_at=1.0)
    out = io.StringIO()
    async with inbox(config, name="board") as board:
        await board.publish(topics.job_state(), state, retain=True)
        started = time.monotonic()
        follow = asyncio.create_task(status(config, "plain", once=False, timeout_s=WAIT_S, out=out))
        await until("the first line", lambda: "plain running" in out.getvalue())
        for version in range(2, 50):  # a job moving faster than a log wants to hear of
            await board.publish(topics.job_state(), dataclasses.replace(state, version=version), retain=True)
        await board.publish(topics.job_state(), dataclasses.replace(
            state, state="finished", version=50, reason="reached model version 50"), retain=True)
        assert await asyncio.wait_for(follow, WAIT_S) == 0
        took = time.monotonic() - started
    printed = out.getvalue()
    assert not REDRAWS.search(printed), repr(printed)
    progress = [line for line in printed.splitlines() if line.startswith("plain ")]
    assert "version 1 " in progress[0] and progress[0].startswith("plain running: ")
    assert progress[-1].startswith("plain finished: 100%") and "version 50 " in progress[-1]
    assert len(progress) <= 2 + took / LINE_INTERVAL_S  # one line per change, at most one per interval
    assert printed.splitlines()[-1].startswith("plain: finished, version 50")  # then where it stands


def test_the_demo_progress_into_a_file_is_a_plain_line_per_change_and_redrawn_on_a_terminal() -> None:
    config = load_config(env={}, overrides={"job": "progress", "demo.target_accuracy": "0.9"})
    clock = Clock()
    for out in (io.StringIO(), Terminal()):
        demo = Demo(config, external_broker=True, quiet=False, out=out, clock=clock)
        shutil.rmtree(demo.workdir, ignore_errors=True)
        started = clock.now
        for version in range(0, 100):  # every 0.25 s, the version moves: a line every interval, not every redraw
            demo.progress.version, demo.progress.accuracy = version, version / 200
            demo._render(started)
            clock.now += 0.25
        demo._render(started, final=True)
        printed = out.getvalue()
        if isinstance(out, Terminal):
            assert printed.count("\r") == 101 and printed.endswith("\n")
            continue
        assert not REDRAWS.search(printed), repr(printed)
        lines = printed.splitlines()
        assert len(lines) == 1 + 100 * 0.25 / LINE_INTERVAL_S  # the first, then one per interval; the final
        assert "version     0" in lines[0] and "version    99" in lines[-1] and "49.50%" in lines[-1]
