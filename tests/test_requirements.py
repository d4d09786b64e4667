"""Programs outside Python that tests run (``requires_binary``, ``requires_root``: tests/conftest.py and
tests/helpers.py): a missing one skips its test with the reason and the package to install, fails it under
``CI=true``, and is installed by the test run itself where it runs as root with ``apt-get``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import INSTALL_SWITCH, PROGRAMS, install_programs, require_binary, require_root

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
MISSING = "edgemesh-no-such-program"
"""A program no machine has."""

INNER_TESTS = f'''
import pytest

@pytest.fixture
def started():
    raise AssertionError("a fixture of a test lacking its program was started")

@pytest.mark.requires_binary("sh", "{MISSING}")
def test_needs_a_missing_program(started):
    pass

@pytest.mark.requires_binary("sh")
def test_needs_a_program_that_is_there():
    pass
'''


def run_inner(tmp_path: Path, *, ci: bool) -> subprocess.CompletedProcess[str]:
    """A pytest run of ``INNER_TESTS`` with tests/conftest.py as its plugin, ``CI=true`` or not set."""
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]), INSTALL_SWITCH: "0"} | ({"CI": "true"} if ci else {})
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-ra",
                           "-o", "asyncio_default_fixture_loop_scope=function", "test_inner.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_a_test_lacking_its_program_is_reported_skipped_with_the_package_to_install(tmp_path: Path) -> None:
    done = run_inner(tmp_path, ci=False)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "1 passed, 1 skipped" in done.stdout
    assert f": {MISSING} not installed: apt-get install {MISSING}\n" in done.stdout  # the reason, in the summary
    assert "fixture of a test lacking" not in done.stdout  # skipped before its fixtures start


def test_under_ci_a_test_lacking_its_program_fails(tmp_path: Path) -> None:
    done = run_inner(tmp_path, ci=True)
    assert done.returncode == 1, done.stdout[-3000:]
    assert "1 passed, 1 error" in done.stdout  # an error in its set-up: the run fails
    assert f"ERROR test_inner.py::test_needs_a_missing_program - Failed: {MISSING} not installed" in done.stdout


def test_the_reason_names_the_package_and_ci_turns_the_skip_into_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(PROGRAMS, MISSING, "edgemesh-tools")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=f"^{MISSING} not installed: apt-get install edgemesh-tools$"):
        require_binary(MISSING)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=f"^{MISSING} not installed: apt-get install edgemesh-tools"):
        require_binary(MISSING)


def test_a_program_is_found_on_path_or_in_sbin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    program = tmp_path / MISSING
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert require_binary(MISSING) == str(program)
    # Debian's mosquitto lives in /usr/sbin, off a user's PATH
    assert require_binary("mosquitto") in ("/usr/local/sbin/mosquitto", "/usr/sbin/mosquitto", "/sbin/mosquitto")


def test_root_is_required_by_skipping_or_under_ci_failing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.skip.Exception, match="^a network namespace needs root$"):
        require_root("a network namespace")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="^a network namespace needs root"):
        require_root("a network namespace")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    require_root("a network namespace")


# --------------------------------------------------------------------------- the install


def fake_apt(tmp_path: Path, *, fails_before_update: bool = False) -> tuple[Path, Path]:
    """A PATH directory with an ``apt-get`` that writes down its calls and installs package ``P`` as program
    ``P`` (failing ``install`` until ``update`` ran, if asked); the directory and the file of calls."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    gate = f'[ -e {tmp_path}/updated ] || exit 100' if fails_before_update else ""
    (bin_dir / "apt-get").write_text(f'''#!/bin/sh
echo "$*" >> {calls}
case "$1" in
  update) : > {tmp_path}/updated ;;
  install) {gate}
           for arg in "$@"; do case "$arg" in edgemesh-*) printf '#!/bin/sh\\n' > {bin_dir}/$arg
                                                          /bin/chmod +x {bin_dir}/$arg ;; esac; done ;;
esac
''')
    (bin_dir / "apt-get").chmod(0o755)
    return bin_dir, calls


@pytest.fixture
def fake_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PROGRAMS`` is two programs no machine has, each its own package; the run is root's, without CI."""
    monkeypatch.setattr("helpers.PROGRAMS", {"edgemesh-a": "edgemesh-a", "edgemesh-b": "edgemesh-b"})
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.delenv(INSTALL_SWITCH, raising=False)


INSTALL = "install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=120 edgemesh-a edgemesh-b"


@pytest.mark.usefixtures("fake_programs")
def test_root_installs_the_missing_packages_once_from_the_lists_there(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir, calls = fake_apt(tmp_path)
    monkeypatch.setenv("PATH", str(bin_dir))
    log: list[str] = []
    assert install_programs(log.append) == []
    assert calls.read_text().splitlines() == [INSTALL]
    assert log[0].startswith("installing edgemesh-a edgemesh-b with apt-get") and "TESTS_INSTALL=0" in log[0]
    assert log[1:] == ["installed edgemesh-a edgemesh-b"]
    assert install_programs(log.append) == [] and len(calls.read_text().splitlines()) == 1  # nothing left to do


@pytest.mark.usefixtures("fake_programs")
def test_stale_package_lists_are_updated_and_the_install_tried_again(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir, calls = fake_apt(tmp_path, fails_before_update=True)
    monkeypatch.setenv("PATH", str(bin_dir))
    log: list[str] = []
    assert install_programs(log.append) == []
    assert calls.read_text().splitlines() == [INSTALL, "update -qq -o DPkg::Lock::Timeout=120", INSTALL]
    assert log[-1] == "installed edgemesh-a edgemesh-b"


@pytest.mark.usefixtures("fake_programs")
def test_a_failed_install_says_why_and_leaves_the_programs_missing(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir, calls = fake_apt(tmp_path)
    (bin_dir / "apt-get").write_text(f'#!/bin/sh\necho "$*" >> {calls}\necho "E: Unable to locate package" >&2\n'
                                     "exit 100\n")
    monkeypatch.setenv("PATH", str(bin_dir))
    for ci, outcome in (("", "are skipped"), ("true", "fail (CI=true)")):
        monkeypatch.setenv("CI", ci)
        log: list[str] = []
        assert install_programs(log.append) == ["edgemesh-a", "edgemesh-b"]
        assert log[-1] == ("installed nothing; apt-get update failed (exit code 100): E: Unable to locate package; "
                           f"still missing edgemesh-a edgemesh-b: the tests that need them {outcome}")


@pytest.mark.usefixtures("fake_programs")
def test_nothing_is_installed_when_opted_out_or_not_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir, calls = fake_apt(tmp_path)
    monkeypatch.setenv("PATH", str(bin_dir))
    log: list[str] = []
    monkeypatch.setenv(INSTALL_SWITCH, "0")
    assert install_programs(log.append) == ["edgemesh-a", "edgemesh-b"]
    monkeypatch.delenv(INSTALL_SWITCH)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert install_programs(log.append) == ["edgemesh-a", "edgemesh-b"]
    assert not calls.exists() and log == []
