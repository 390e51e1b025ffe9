"""Shared fixtures: a real Redis-protocol server and moto's S3 server, both on loopback; and the check that
the session leaves nothing behind (host tiers in shared memory, processes it started: ``tests/_leaks.py``)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from tests import _leaks
from tests.redis_cluster import cluster_url, redis_cluster  # noqa: F401
from tests.redis_server import redis_proc, redis_url  # noqa: F401
from tests.s3_server import *  # noqa: F403

# The long cases (about two thirds of the run): ``scripts/test --fast`` deselects them (``-m "not slow"``);
# ``scripts/test`` with no arguments, which CI runs, runs everything. Listed here rather than marked in each
# file, so the list of what a quick run skips is one list.
SLOW = (
    "tests/test_soak.py",  # 2 minutes by design
    "tests/test_training_run.py",  # trains, kills and restarts real runs
    "tests/test_testbed.py::test_testbed_node_loss_and_restore",
    "tests/test_demo.py",
    "tests/test_readme.py::test_the_demo_as_written",
    "tests/test_readme.py::test_scripts_test_runs_in_a_fresh_venv",  # installs the test extras into a fresh venv
    "tests/test_readme.py::test_the_readme_counts_of_the_test_suite_are_true",  # collects the whole suite
    "tests/test_replay.py::test_two_ranks_kill_restart_replay_is_bitwise",
    "tests/test_bench_quick.py",
    "tests/test_faults_matrix.py::test_kill_at_point",
    # two 2-rank jobs in turn; the fast cases are test_attempts.py and test_dcp_writers.py's own
    "tests/test_dcp_writers.py::test_restarted_job_saves_a_step_whose_attempt_timed_out",
    # two launches of two Lightning ranks (SIGKILL, resume, reference, FSDP2); the resume itself is covered on one
    # process by test_lightning.py, the rank-0-only save without a collective by test_values.py
    "tests/test_lightning.py::test_ddp_rank0_saves_sigkill_resume_bitwise_and_fsdp2",
    # two ranks of the HF Trainer, four trainings; the same flow on one process is test_huggingface.py's other case
    "tests/test_huggingface.py::test_trainer_resumes_bitwise_on_two_processes",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)


def pytest_sessionfinish(session, exitstatus):
    """Stop the embedded index servers that tests started (they are detached by design)."""
    from tierstore.embedded import find_servers

    base = Path(str(session.config._tmp_path_factory.getbasetemp()))
    for server in find_servers():  # by process: also those whose home a test deleted, or with a /tmp socket
        if server.home.is_relative_to(base):
            try:
                os.kill(server.pid, 15)
            except OSError:
                pass


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_behind(tmp_path_factory):
    """Fails the session, naming each one, if the tests leave a host tier in shared memory or a process running.

    Before the first test: ``/dev/shm``'s entries are recorded, every store of the session (module fixtures
    and their rank processes included) gets a private ``TIERSTORE_SHM_DIR``, and every process the session
    starts inherits a token. After the last: what is left in that directory, new host tiers of this session's
    homes in ``/dev/shm``, and live processes carrying the token are named, removed, and fail the run.
    What other sessions and the user keep on the machine is never counted or touched.
    """
    baseline = _leaks.start()
    saved = {k: os.environ.get(k) for k in (_leaks.MARK, "TIERSTORE_SHM_DIR")}
    os.environ[_leaks.MARK] = baseline.token
    os.environ["TIERSTORE_SHM_DIR"] = str(baseline.shm_dir)
    yield baseline
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    # this process's own multiprocessing helpers (the kill tests' forkserver, its resource tracker) would
    # exit with the interpreter: stopped here, they are not counted
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker
    for helper in (multiprocessing.forkserver._forkserver, multiprocessing.resource_tracker._resource_tracker):
        try:
            helper._stop()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001, S110 - best effort; a helper still running is then named below
            pass
    found = _leaks.leftovers(baseline, [Path(str(tmp_path_factory.getbasetemp())), REPO])
    _leaks.clean(found, baseline)
    if found:
        pytest.fail("the tests left behind (now removed):\n  " + "\n  ".join(map(str, found)), pytrace=False)


def _stop_servers_under(root: Path, timeout_s: float = 10.0) -> None:
    """Stop the embedded index servers of homes below ``root`` (detached by design: they outlive their store):
    SIGTERM to all of them at once (the server's own clean shutdown), SIGKILL to any still there after
    ``timeout_s``."""
    import signal
    import time

    from tierstore.embedded import find_servers

    pids = [s.pid for s in find_servers() if s.home.is_relative_to(root)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        while (pids := [p for p in pids if _leaks._alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.02)
        if not pids:
            return


@pytest.fixture(autouse=True)
def _private_shared_memory(monkeypatch, request):
    """Stores opened without an explicit host_root put their host tier in a per-test dir, removed after;
    the index servers of homes in the test's ``tmp_path`` are stopped after it."""
    tmp = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    d = base / f"tierstore-test-shm-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    monkeypatch.setenv("TIERSTORE_SHM_DIR", str(d))
    yield d
    if tmp is not None:
        _stop_servers_under(Path(tmp))
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def shm_root() -> Path:
    """A private directory in /dev/shm, removed afterwards."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    root = base / f"tierstore-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def store(tmp_path, redis_url, shm_root):  # noqa: F811
    """A TierStore on the test Redis server, a private host tier and a local durable directory."""
    import tierstore

    s = tierstore.open(tmp_path / "home", redis=redis_url, durable=f"file://{tmp_path / 'durable'}",
                       host_root=str(shm_root / "node0"), node_id="node0")
    yield s
    s.close()
