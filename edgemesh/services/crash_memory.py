"""Crash memory: a host that dies with a job does not die with it again at every restart (docs/reliability.md).

A process killed outright (``os.abort`` in a model's code, SIGKILL, the kernel's out-of-memory killer) runs no
``except`` and no ``finally``. systemd restarts it, it reads the retained job again, and it would serve the job that
killed it again, until systemd gives up on the unit. So before a host starts serving a job it writes a marker in
its state folder naming the run (the job, its file's sha256 and its submission time) and the phase:

* ``starting``: building the model, reading the data, starting the job's service;
* ``running``: the service is up and serving (training, applying, evaluating).

It removes the marker when it stops serving the job in any orderly way: the job ended, its service failed (that
error is reported like any other), or the host was told to stop. A marker found at start-up therefore means the
previous process died with that run. If the run is still active:

* died while ``starting``: the host gives the run up at once, with the reason (the parameter server's host fails
  the job; a worker leaves it): whatever killed it will again;
* died while ``running``: the host resumes, as after a power cut, unless that was the ``RUNNING_DEATHS``-th
  death in a row that came within ``CRASH_LOOP_S`` of the run (re)starting: then it gives the run up.

A run given up stays given up across restarts (the marker says so, with the reason) until the run is no longer
active. The marker is written atomically: a temporary file, fsync, rename, fsync of the folder.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, Literal

logger = logging.getLogger(__name__)

Phase = Literal["starting", "running", "given_up"]
PHASES: Final[tuple[Phase, ...]] = ("starting", "running", "given_up")
RUNNING_DEATHS: Final = 3
"""Deaths in a row while running a run (each within ``CRASH_LOOP_S`` of its start) after which a host gives it up:
a step that kills the process every time. One death (a power cut, a ``kill -9``) is resumed from."""
CRASH_LOOP_S: Final = 600.0
"""A death while running counts toward ``RUNNING_DEATHS`` when the host restarts less than this after the run
(re)started running (systemd restarts a unit within seconds); a later restart starts the count again."""
FORMAT_VERSION: Final = 1


@dataclass(frozen=True, slots=True)
class Run:
    """One run of a job: a submission of a job file."""

    job: str
    sha256: str
    submitted_at: float


@dataclass(frozen=True, slots=True)
class Marker:
    """What the marker file says."""

    run: Run
    phase: Phase
    pid: int
    since: float
    """Wall-clock time the phase began."""
    deaths: int = 0
    """Deaths of earlier processes while running this run, in a row."""
    reason: str = ""
    """Why the run was given up (phase ``given_up``)."""

    def to_json(self) -> str:
        return json.dumps({"version": FORMAT_VERSION, **asdict(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Marker:
        """ValueError (or KeyError, TypeError) for anything but a marker of this version."""
        data: Any = json.loads(text)
        if data.get("version") != FORMAT_VERSION or data.get("phase") not in PHASES:
            raise ValueError(f"not a marker of version {FORMAT_VERSION}")
        run = data["run"]
        return cls(run=Run(job=str(run["job"]), sha256=str(run["sha256"]), submitted_at=float(run["submitted_at"])),
                   phase=data["phase"], pid=int(data["pid"]), since=float(data["since"]),
                   deaths=int(data["deaths"]), reason=str(data["reason"]))


class CrashMemory:
    """The marker of one host (``path``), read once at start-up (``load``), then written as the host serves."""

    def __init__(self, path: Path | None, who: str) -> None:
        self.path = path
        """None: no state folder, no memory (said once at start-up)."""
        self.who = who
        """The host, as a reason names it: ``the parameter server``, ``device w1``."""
        self.found: Marker | None = None
        """The marker the previous process left (a run it died with), until the host decided about it."""
        self._deaths = 0
        """Deaths of earlier processes in a row while running the current run."""
        self._written: Marker | None = None

    def load(self) -> None:
        """Read the marker a previous process left (blocking)."""
        if self.path is None:
            logger.info("%s keeps no crash memory (no state folder): a job that kills it is tried again at every "
                        "restart", self.who)
            return
        try:
            self.found = Marker.from_json(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("%s: ignoring an unreadable crash marker %s (%s)", self.who, self.path, exc)
            return
        if self.found.phase != "given_up":
            logger.warning("%s died while %s job %s (process %d); deciding whether to serve it again", self.who,
                           self.found.phase, self.found.run.job, self.found.pid)

    def recall(self, run: Run, now: float | None = None) -> str:
        """Why ``run`` must not be served again (a previous process died with it), or '' to serve it."""
        found, self._deaths = self.found, 0
        if found is None or found.run != run:
            return ""
        now = time.time() if now is None else now
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(found.since))
        how = (f"process {found.pid}, in that phase since {when}; killed by a signal, an abort or the kernel's "
               "out-of-memory killer: the host's log or journal says which")
        match found.phase:
            case "given_up":
                return found.reason
            case "starting":
                return f"{self.who} died while starting it ({how}); it is not tried again here"
        quick = 0 <= now - found.since < CRASH_LOOP_S
        self._deaths = found.deaths + 1 if quick else 1
        if self._deaths < RUNNING_DEATHS:
            logger.warning("%s died while running job %s (%s): resuming it (death %d in a row of at most %d)",
                           self.who, run.job, how, self._deaths, RUNNING_DEATHS - 1)
            return ""
        return (f"{self.who} died while running it, {self._deaths} times in a row, each within {CRASH_LOOP_S:.0f} s "
                f"of its (re)start (the last: {how}); it is not tried again here")

    def starting(self, run: Run) -> None:
        """The host starts serving ``run`` (blocking)."""
        self._write(Marker(run=run, phase="starting", pid=os.getpid(), since=time.time(), deaths=self._deaths))

    def running(self, run: Run) -> None:
        """The run's service is up (blocking)."""
        self._write(Marker(run=run, phase="running", pid=os.getpid(), since=time.time(), deaths=self._deaths))

    def give_up(self, run: Run, reason: str) -> None:
        """The host gives ``run`` up after dying with it: kept so that later restarts do not try it either."""
        self._write(Marker(run=run, phase="given_up", pid=os.getpid(), since=time.time(), reason=reason))

    @property
    def given_up(self) -> bool:
        """Whether the marker this process wrote last gives its run up."""
        return self._written is not None and self._written.phase == "given_up"

    def clear(self) -> None:
        """The host stopped serving its run in an orderly way: no marker (a quick unlink, safe in the event loop).
        A marker another process wrote since (a misconfigured shared folder) is left alone."""
        if self.path is None or self._written is None:
            return
        try:
            if Marker.from_json(self.path.read_text()).pid == os.getpid():
                self.path.unlink()
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("%s: cannot remove the crash marker %s: %s", self.who, self.path, exc)
        self._written = None

    def _write(self, marker: Marker) -> None:
        """Write ``marker`` atomically (temporary file, fsync, rename, fsync of the folder); a failure is logged:
        the host serves on without the memory."""
        self.found = None  # decided
        if self.path is None:
            return
        partial = self.path.with_name(self.path.name + ".partial")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(partial, "w") as fh:
                fh.write(marker.to_json() + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(partial, self.path)
            _fsync_folder(self.path.parent)
        except OSError as exc:
            logger.error("%s: cannot write the crash marker %s (%s): a job that kills this host would be tried "
                         "again at its restart", self.who, self.path, exc)
            return
        self._written = marker


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (where the platform lets a folder be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
