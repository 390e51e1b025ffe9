"""The session's leak check (tests/_leaks.py, run by tests/conftest.py) finds what a session leaves, and only that.

Each case makes its own baseline, as the session does, and leaves real things behind: a store's host tier
(opened the way a module fixture opens one, and one whose process lost ``TIERSTORE_SHM_DIR``), a rank-like
process, an embedded index server; beside them what another session or the user keeps, which must be
neither named nor touched.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import torch

import tierstore
from tests import _leaks
from tierstore.keys import ShardKey


def _digest_dir(home: Path) -> str:
    return "tierstore-" + hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:12]


def test_names_a_left_host_tier_and_process_and_nothing_of_others(tmp_path, monkeypatch):
    b = _leaks.start()
    procs: list[subprocess.Popen] = []
    others = [_leaks.SHM / f"tierstore-{uuid.uuid4().hex[:12]}", _leaks.SHM / f"tierstore-test-shm-1-{uuid.uuid4().hex[:8]}"]
    try:
        for d in others:  # another session's host tier, another pid's test dir: appeared, but not ours
            d.mkdir()
        # a store opened as a module fixture opens one: under the session's TIERSTORE_SHM_DIR, never closed
        monkeypatch.setenv("TIERSTORE_SHM_DIR", str(b.shm_dir))
        monkeypatch.setenv(_leaks.MARK, b.token)  # what the session sets for every process it starts
        home = tmp_path / "home"
        store = tierstore.open(home)
        store.put(ShardKey("m", "l", 0, 0), {"w": torch.ones(1024)})
        store.close()
        # a process that dropped the variable: its host tier lands in /dev/shm itself
        lost = tmp_path / "lost"
        (lost / "index").mkdir(parents=True)
        (_leaks.SHM / _digest_dir(lost)).mkdir()
        # a rank-like process the session started, still running
        env = {**os.environ, _leaks.MARK: b.token}
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env))
        # another session's process: not ours
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                      env={**os.environ, _leaks.MARK: "another-session"}))

        found = _leaks.leftovers(b, [tmp_path], grace_s=0)
        text = "\n".join(map(str, found))
        assert f"pid {procs[0].pid}:" in text and f"pid {procs[1].pid}" not in text, text
        assert f"the host tier of home {home}" in text and str(b.shm_dir / _digest_dir(home)) in text, text
        assert f"the host tier of home {lost}" in text, text
        assert f"pid {_embedded_pid(home)}:" in text, text  # its index server, by its home
        assert not any(str(d) in text for d in others), text
        assert len(found) == 4, text  # the rank, the index server, two host tiers
        _leaks.clean(found, b)
        assert procs[0].wait(10) is not None and procs[1].poll() is None  # the other session's keeps running
        assert not b.shm_dir.exists() and not (_leaks.SHM / _digest_dir(lost)).exists()
        assert all(d.is_dir() for d in others)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for d in [*others, b.shm_dir, _leaks.SHM / _digest_dir(tmp_path / "lost")]:
            shutil.rmtree(d, ignore_errors=True)


def _embedded_pid(home: Path) -> int:
    from tierstore.embedded import find_servers

    (server,) = find_servers(home)
    return server.pid


def test_what_existed_before_the_session_is_not_counted(tmp_path):
    before = _leaks.SHM / _digest_dir(tmp_path / "home")
    before.mkdir()  # the user's own state, there before the session started
    try:
        b = _leaks.start()
        assert _leaks.leftovers(b, [tmp_path], grace_s=0) == []
        _leaks.clean([], b)
        assert before.is_dir() and not b.shm_dir.exists()
    finally:
        shutil.rmtree(before, ignore_errors=True)
