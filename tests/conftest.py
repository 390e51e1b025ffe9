"""Shared fixtures: a real Redis-protocol server and moto's S3 server, both on loopback; and the check that
the session leaves nothing behind (host tiers in shared memory, processes it started: ``tests/_leaks.py``)."""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections import Counter
from pathlib import Path

import pytest

from tests import _leaks
from tests.redis_cluster import cluster_url, redis_cluster  # noqa: F401
from tests.redis_server import redis_proc, redis_url  # noqa: F401
from tests.s3_server import *  # noqa: F403

# The long cases (205 tests, about a quarter of the run's time in one process): ``scripts/test --fast`` deselects them (``-m "not slow"``);
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
    # a reboot after a save on two processes (three launches of two ranks each); the one-process cases stay fast
    "tests/test_lightning_reboot.py::test_reboot_right_after_a_save_on_two_processes",
    "tests/test_huggingface_reboot.py::test_reboot_right_after_a_save_on_two_processes",
    "tests/test_bench_sweep.py::test_a_small_sweep_end_to_end",  # six bench sub-runs
    # end-to-end runs of a minute or less each, kept out of --fast so that it stays under 10 minutes on 2 cores
    # (each has faster cases of the same code in --fast; CI runs them all):
    "tests/test_docs.py::test_python_block_runs_as_a_script_and_pasted_into_the_repl",  # every docs snippet, twice
    "tests/test_docs.py::test_a_broken_page_fails_the_build",  # a whole site build
    "tests/test_readme.py::test_the_install_line_gives_a_working_command_outside_the_checkout",  # pip into a venv
    "tests/test_faults_matrix.py::test_fault_matrix_more_seeds",  # the matrix again, other seeds
    "tests/test_testbed.py::test_testbed_netns_nodes_cross_real_interfaces",
    "tests/test_netns.py::test_partition_during_a_vote",
    "tests/test_netns.py::test_partition_during_migration",
    "tests/test_consistency_kill.py::test_restore_after_a_rank_is_killed",
    "tests/test_cluster_kill.py::test_restore_after_a_rank_is_killed_on_a_cluster",
    "tests/test_bench_interrupt.py",  # real bench runs, interrupted
    "tests/test_host_pool_limits.py::test_differential_run_under_256_fds",
    "tests/test_reshard_dist.py::test_two_rank_fsdp2_checkpoint_restores_on_four_ranks_and_on_one",
    "tests/test_trainer_ddp.py::test_ddp_trainer_resumes_bitwise_after_sigkill",
)


REPO = Path(__file__).resolve().parents[1]
_REPO_BASELINE = pytest.StashKey[_leaks.Baseline]()

_SHARED_SCOPES = ("class", "module", "package")
# module fixtures that cost about a second: a file using them is spread over the workers anyway, each setting
# its own up (moto's S3 server; the state machines' services, the session's Redis server and a directory)
_CHEAP_SHARED = {"s3_server", "_services"}


def _shares_a_fixture(item) -> bool:
    """Whether ``item`` uses a fixture that outlives one test but not the session (a module's agents, a venv,
    a testbed, a saved checkpoint): its file's tests then run on one xdist worker, which sets it up once."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    # pytest wraps each unittest class's setUpClass in a class fixture of its own (the state machines' TestCases
    # have none worth sharing): not counted
    return any(defs and defs[-1].scope in _SHARED_SCOPES and name not in _CHEAP_SHARED
               and not name.startswith("_unittest_")
               for name in item.fixturenames if (defs := info.name2fixturedefs.get(name)))


# The files that take longest (seconds of one worker, summed over their tests, from `scripts/test --durations=0`
# on a fresh clone, 2 workers on 2 cores), run first: xdist hands out work in this order (`scripts/test` passes
# --no-loadscope-reorder), so a long file is not the last one running while the other worker idles. Only the order
# changes; a file not listed keeps its place after these. Refresh the figures when the slowest tests change.
LONGEST_FIRST = {
    "tests/test_readme.py": 515, "tests/test_faults_matrix.py": 309, "tests/test_testbed.py": 150,
    "tests/test_soak.py": 140, "tests/test_trainer_ddp.py": 120, "tests/test_netns.py": 114,
    "tests/test_training_run.py": 111, "tests/test_protocol_statemachine.py": 112,
    "tests/test_dcp_writers.py": 97, "tests/test_dcp_dist.py": 94, "tests/test_lightning_reboot.py": 87,
    "tests/test_agent_security.py": 84, "tests/test_huggingface_reboot.py": 76, "tests/test_bench_sweep.py": 74,
    "tests/test_lightning.py": 74, "tests/test_reshard_dist.py": 73, "tests/test_bench_quick.py": 69,
    "tests/test_demo.py": 66, "tests/test_dcp_lease.py": 63,
}


def _order_key(item) -> int:
    return -LONGEST_FIRST.get(item.nodeid.split("::")[0], 0)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks the slow tests (``SLOW``); for ``pytest -n N --dist loadgroup`` (``scripts/test``), puts the tests of
    a file that share a module or class fixture in one xdist group (one worker), while the tests of the other
    files are spread one by one; and runs the longest files first (``LONGEST_FIRST``; a stable sort: each file's
    tests keep their order)."""
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
        if _shares_a_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    items.sort(key=_order_key)


# -- counts a test reports (rule runs of the state machines, faults the matrix tried) ----------------------------
# A test appends ("tierstore-counts: LABEL", {what: n}) to its user_properties (the state machines' and the
# fault matrix's module fixtures do); they travel with the report from an xdist worker, are summed here, and
# are printed at the end of the run, after pytest's summary. They are a report, not a test.
_COUNTS_PREFIX = "tierstore-counts: "
_COUNTS: dict[str, Counter] = {}


def pytest_runtest_logreport(report):
    if report.when != "teardown":
        return
    for name, value in getattr(report, "user_properties", ()):
        if isinstance(name, str) and name.startswith(_COUNTS_PREFIX) and isinstance(value, dict):
            _COUNTS.setdefault(name.removeprefix(_COUNTS_PREFIX), Counter()).update(value)


def pytest_terminal_summary(terminalreporter):
    if not _COUNTS:
        return
    terminalreporter.section("what the property and fault tests exercised")
    for label, counts in sorted(_COUNTS.items()):
        terminalreporter.write_line(f"{label}: {len(counts)} kinds, {sum(counts.values())} in all "
                                    f"({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))})")


@pytest.fixture
def report_counts(request):
    """``report_counts(label, counts)``: reports ``counts`` (a Counter of what this test exercised) under
    ``label`` in the run's summary (see above)."""
    def report(label: str, counts: Counter) -> None:
        if counts:
            request.node.user_properties.append((_COUNTS_PREFIX + label,
                                                 {str(k): int(v) for k, v in counts.items()}))

    return report


# -- parallel runs (pytest-xdist) ------------------------------------------------------------------------------
# Each worker is a session of its own: its own Redis-protocol server, S3 server and cluster (free ports), its own
# basetemp (``.../popen-gwN``), its own TIERSTORE_SHM_DIR and token for the leak check, names with its pid. What
# no worker can tell apart is what lands in the checkout itself (a home under REPO): the controller checks that,
# once, after every worker finished.


def _distributing(config) -> bool:
    """Whether this process is the controller of an xdist run (its workers run the tests)."""
    return config.pluginmanager.has_plugin("dsession")


def _xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_sessionstart(session):
    if _distributing(session.config):
        session.config.stash[_REPO_BASELINE] = _leaks.start()


def pytest_sessionfinish(session, exitstatus):
    """Stop the embedded index servers that tests started (they are detached by design); on an xdist
    controller, fail the run if the workers left a host tier or an index server of a home in the checkout."""
    from tierstore.embedded import find_servers

    baseline = session.config.stash.get(_REPO_BASELINE, None)
    if baseline is not None:
        found = _leaks.leftovers(baseline, [REPO])
        _leaks.clean(found, baseline)
        if found:
            session.config.get_terminal_writer().line(
                "the tests left behind in the checkout (now removed):\n  " + "\n  ".join(map(str, found)), red=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    base = Path(str(session.config._tmp_path_factory.getbasetemp()))
    for server in find_servers():  # by process: also those whose home a test deleted, or with a /tmp socket
        if server.home.is_relative_to(base):
            try:
                os.kill(server.pid, 15)
            except OSError:
                pass


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_behind(tmp_path_factory, request):
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

    from tests import _warm
    _warm.shutdown()  # the warm interpreters the rank jobs were forked from (tests/_warm.py)
    for helper in (multiprocessing.forkserver._forkserver, multiprocessing.resource_tracker._resource_tracker):
        try:
            helper._stop()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001, S110 - best effort; a helper still running is then named below
            pass
    # an xdist worker checks its own basetemp only: a home in the checkout may be another worker's (see above)
    roots = [Path(str(tmp_path_factory.getbasetemp())), *([] if _xdist_worker(request.config) else [REPO])]
    found = _leaks.leftovers(baseline, roots)
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
    remove_host_root(root)


def remove_host_root(root: Path) -> None:
    """Remove a test's host tier directory and its lock file beside it (``tierstore.home.host_lock_path``)."""
    from tierstore.home import host_lock_path

    shutil.rmtree(root, ignore_errors=True)
    host_lock_path(root).unlink(missing_ok=True)


@pytest.fixture
def one_node(tmp_path, redis_url, shm_root):  # noqa: F811
    """``open_store()``: a new store on one index, one node's host tier and one durable directory (each call a
    new process's view of the same node); every store opened is closed afterwards."""
    import tierstore

    opened = []

    def open_store():
        s = tierstore.open(tmp_path / "home", redis=redis_url, durable=f"file://{tmp_path / 'durable'}",
                           host_root=str(shm_root / "node0"), node_id="node0")
        opened.append(s)
        return s

    yield open_store
    for s in opened:
        try:
            s.close()
        except Exception as e:  # noqa: BLE001 - a store the test left with failed migrations
            logging.getLogger(__name__).debug("closing a test store: %r", e)


@pytest.fixture
def store(tmp_path, redis_url, shm_root):  # noqa: F811
    """A TierStore on the test Redis server, a private host tier and a local durable directory."""
    import tierstore

    s = tierstore.open(tmp_path / "home", redis=redis_url, durable=f"file://{tmp_path / 'durable'}",
                       host_root=str(shm_root / "node0"), node_id="node0")
    yield s
    s.close()
