"""CI runs what the README tells a developer to run, under ``CI=true``, after installing the programs the tests run
that a fresh Debian runner lacks (``PROGRAMS`` in tests/helpers.py). ``.ci/run`` is run for real, with ``apt-get``,
``pip`` and ``python`` replaced by programs that write down how they were called."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from helpers import PROGRAMS

ROOT = Path(__file__).resolve().parents[1]
CI = ROOT / ".ci" / "run"


def readme_commands() -> list[str]:
    """The commands of the README's first code block."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```\n") + len("```\n")
    return text[start:text.index("```", start)].strip().splitlines()


def run_ci(tmp_path: Path, *, installed: tuple[str, ...]) -> list[str]:
    """``.ci/run`` with a PATH of recording stand-ins, the programs ``installed`` among them; what they were called
    with, in order (``python`` with the value of ``CI`` it saw)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    dirname = shutil.which("dirname")  # the one tool the script needs of the real system
    assert dirname is not None
    (bin_dir / "dirname").symlink_to(dirname)
    for name in ("apt-get", "pip", "python", *installed):
        stand_in = bin_dir / name
        seen = " CI=$CI" if name == "python" else ""
        stand_in.write_text(f'#!/bin/sh\necho "{name} $*{seen}" >> {calls}\n')
        stand_in.chmod(0o755)
    bash = shutil.which("bash")
    assert bash is not None
    done = subprocess.run([bash, str(CI)], env={"PATH": str(bin_dir)}, capture_output=True, text=True, timeout=30,
                          check=False)
    assert done.returncode == 0, done.stderr
    return calls.read_text().splitlines() if calls.exists() else []


def test_ci_runs_the_readme_test_command() -> None:
    test_command = readme_commands()[1]
    assert "python -m pytest" in test_command
    assert CI.read_text().strip().splitlines()[-1] == test_command


INSTALL = "apt-get install -y -qq --no-install-recommends "
TEST_COMMANDS = ["pip install torch==2.13.0", "pip install -e .[test]", "python -m pytest CI=true"]


def test_ci_installs_quietly_the_packages_of_every_program_the_tests_run_that_is_missing(tmp_path: Path) -> None:
    calls = run_ci(tmp_path, installed=())
    assert calls[0] == "apt-get update -qq" and calls[1].startswith(INSTALL)
    assert sorted(calls[1].removeprefix(INSTALL).split()) == sorted(set(PROGRAMS.values()))
    assert calls[2:] == TEST_COMMANDS


def test_ci_installs_only_what_is_missing(tmp_path: Path) -> None:
    calls = run_ci(tmp_path, installed=tuple(name for name in PROGRAMS if name != "prometheus"))
    assert calls == ["apt-get update -qq", INSTALL + "prometheus", *TEST_COMMANDS]


def test_ci_skips_the_install_when_every_program_is_there(tmp_path: Path) -> None:
    assert run_ci(tmp_path, installed=tuple(PROGRAMS)) == TEST_COMMANDS
