"""CI runs what the README tells a developer to run, after installing what the tests need that a fresh Debian
runner lacks (Prometheus). ``.ci/run`` is run for real, with ``apt-get``, ``pip`` and ``python`` replaced by
programs that write down how they were called."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CI = ROOT / ".ci" / "run"


def readme_commands() -> list[str]:
    """The commands of the README's first code block."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```\n") + len("```\n")
    return text[start:text.index("```", start)].strip().splitlines()


def run_ci(tmp_path: Path, *, has_prometheus: bool) -> list[str]:
    """``.ci/run`` with a PATH of recording stand-ins; what they were called with, in order."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    dirname = shutil.which("dirname")  # the one tool the script needs of the real system
    assert dirname is not None
    (bin_dir / "dirname").symlink_to(dirname)
    names = ["apt-get", "pip", "python"] + (["prometheus"] if has_prometheus else [])
    for name in names:
        stand_in = bin_dir / name
        stand_in.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n')
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


def test_ci_installs_prometheus_quietly_when_it_is_missing(tmp_path: Path) -> None:
    calls = run_ci(tmp_path, has_prometheus=False)
    assert calls[:2] == ["apt-get update -qq", "apt-get install -y -qq --no-install-recommends prometheus"]
    assert calls[2:] == ["pip install torch==2.13.0", "pip install -e .[test]", "python -m pytest"]


def test_ci_skips_the_install_when_prometheus_is_there(tmp_path: Path) -> None:
    assert run_ci(tmp_path, has_prometheus=True) == [
        "pip install torch==2.13.0", "pip install -e .[test]", "python -m pytest"]
