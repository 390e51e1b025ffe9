"""``scripts/test`` itself: ``--help`` prints its usage and runs nothing; system packages are installed only when
CI asks (``CI=true``) or the user opts in; pytest runs in parallel. Every program it could start is a stand-in
here that records its arguments (the interpreter, apt-get), on a PATH with nothing else."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

FAKE_PY = """#!/bin/bash
echo "python $*" >> "$LOG"
case "$*" in
  *sys.prefix*) echo 1 ;;        # a virtual environment's interpreter
  *sched_getaffinity*) echo 2 ;;  # 2 cores
esac
exit 0
"""
FAKE_APT = '#!/bin/bash\necho "apt-get $*" >> "$LOG"\nexit 0\n'


def _run(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    bindir = tmp_path / "bin"
    if not bindir.exists():
        bindir.mkdir()
        for tool in ("dirname", "cat"):  # what the script needs besides the stand-ins
            os.symlink(shutil.which(tool), bindir / tool)
        for name, text in (("python3", FAKE_PY), ("apt-get", FAKE_APT)):
            (bindir / name).write_text(text)
            (bindir / name).chmod(0o755)
    log = tmp_path / "log"
    log.write_text("")
    full = {"PATH": str(bindir), "LOG": str(log), "HOME": str(tmp_path), **env}
    p = subprocess.run([shutil.which("bash"), str(REPO / "scripts" / "test"), *args], env=full, capture_output=True,
                       text=True, timeout=60, check=False)
    return p, log.read_text().splitlines()


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["--fast", "--help"], ["-k", "store", "--help"]])
def test_help_prints_the_usage_and_runs_nothing(tmp_path, args):
    p, ran = _run(tmp_path, *args, CI="true", TIERSTORE_TEST_INSTALL_SYSTEM="1")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: scripts/test [--fast]") and "TIERSTORE_TEST_WORKERS" in p.stdout, p.stdout
    assert ran == [], ran  # no pip, no apt-get, no ruff, mypy or pytest


def test_a_developer_run_installs_no_system_package_and_runs_pytest_in_parallel(tmp_path):
    p, ran = _run(tmp_path, "-x")
    assert p.returncode == 0, p.stderr
    assert not any(r.startswith("apt-get") for r in ran), ran
    assert "docker-compose is not installed" in p.stderr and "TIERSTORE_TEST_INSTALL_SYSTEM=1" in p.stderr, p.stderr
    assert any("-m pip install" in r for r in ran), ran  # into the virtual environment
    pytest_line = next(r for r in ran if " -m pytest " in r)
    workers = max(2, len(os.sched_getaffinity(0)))  # one per core, at least 2
    assert f"-n {workers} --dist loadgroup" in pytest_line and "--durations=15" in pytest_line, pytest_line
    assert pytest_line.endswith(" -x"), pytest_line  # the caller's arguments last: they override the script's


def test_ci_installs_the_system_packages_and_an_opt_out_wins(tmp_path):
    p, ran = _run(tmp_path, CI="true")
    assert p.returncode == 0, p.stderr
    installs = [r for r in ran if r.startswith("apt-get install")]
    assert any("docker-compose" in r for r in installs) and any("iproute2" in r for r in installs), ran
    p, ran = _run(tmp_path, CI="true", TIERSTORE_TEST_INSTALL_SYSTEM="0")
    assert p.returncode == 0 and not any(r.startswith("apt-get") for r in ran), ran
    p, ran = _run(tmp_path, "--fast", TIERSTORE_TEST_WORKERS="0")
    pytest_line = next(r for r in ran if " -m pytest " in r)
    assert " -n " not in pytest_line and "-m not slow" in pytest_line, pytest_line


GROUPED = """
import os
import pytest

@pytest.mark.xdist_group("one")
@pytest.mark.parametrize("i", range(4))
def test_grouped(i):
    print("worker", os.environ.get("PYTEST_XDIST_WORKER"))

@pytest.mark.parametrize("i", range(4))
def test_free(i):
    pass
"""


def test_xdist_groups_hold_with_the_installed_pytest(tmp_path):
    """``scripts/test`` runs ``--dist loadgroup``: a file whose tests share an expensive module fixture (a fresh
    venv, the training runs) is one group, so one worker builds it once. With pytest 9.2 and pytest-xdist 3.8 the
    grouping silently stopped (pytest-dev/pytest-xdist#1386: the fixture was built on every worker); this runs the
    installed pair on two groups' worth of tests and checks that every test of the group ran on one worker."""
    pytest.importorskip("xdist")
    for name in ("test_a.py", "test_b.py"):
        (tmp_path / name).write_text(GROUPED)
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                        "-v", "-s", "-p", "no:randomly", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, check=False)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    ran = [line.split()[0] for line in p.stdout.splitlines() if "PASSED" in line and "test_grouped" in line]
    assert len(ran) == 8, p.stdout[-3000:]
    assert len(set(ran)) == 1, f"the group's tests ran on {sorted(set(ran))}:\n{p.stdout[-3000:]}"
