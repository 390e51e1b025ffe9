"""Shared fixtures: a real Redis-protocol server and moto's S3 server, both on loopback."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

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


@pytest.fixture(autouse=True)
def _private_shared_memory(monkeypatch):
    """Stores opened without an explicit host_root put their host tier in a per-test dir, removed after."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    d = base / f"tierstore-test-shm-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    monkeypatch.setenv("TIERSTORE_SHM_DIR", str(d))
    yield d
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
