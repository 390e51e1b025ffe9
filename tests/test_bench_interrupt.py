"""``tierstore bench`` reports as it goes and cleans up when it is stopped.

The benchmark runs as a real subprocess (``python -m tierstore.cli bench``, 2 gloo ranks, tiny state,
tierstore's host-tier system, so an embedded index server runs in the ranks' home). The test follows
its progress lines on stderr, SIGTERMs it once rounds are running (the parent alone, as ``kill PID``
does, or its whole process group, as ``timeout`` and Ctrl-C do) and checks that no rank and no index
server is left and that its scratch directories (one in ``/dev/shm``) are gone (the leak checks of
``tests/_leaks.py`` look for the same things at the end of the session).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tierstore.embedded import find_servers

ROOT = Path(__file__).resolve().parent.parent
_SCRATCH = re.compile(r"scratch (\S+) and (\S+); results in")


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (ranks, multiprocessing's helpers), from ``/proc``."""
    parent: dict[int, int] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                parent[int(p)] = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out: set[int] = set()
    todo = [pid]
    while todo:
        me = todo.pop()
        kids = [c for c, pp in parent.items() if pp == me and c not in out]
        out.update(kids)
        todo.extend(kids)
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _start(pid: int) -> str | None:
    """The process's start time (``/proc/PID/stat`` field 22), so a reused pid is not taken for it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _left_after(procs: dict[int, str | None], within_s: float) -> list[str]:
    """The processes of ``procs`` (pid to start time) still alive after ``within_s`` seconds, by command line.

    multiprocessing's resource tracker ignores SIGTERM and exits when the last of its writers has closed the
    pipe, so it ends a moment after the bench itself: it gets that moment (bounded), a process left behind
    does not end at all."""
    deadline = time.monotonic() + within_s
    while True:
        left = [p for p, t in procs.items() if _alive(p) and _start(p) == t]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    out = []
    for p in left:
        try:
            out.append(f"{p}: " + Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
        except OSError:
            out.append(str(p))
    return out


def _servers_under(root: Path) -> list[int]:
    return [s.pid for s in find_servers() if s.home.is_relative_to(root.resolve())]


@pytest.mark.parametrize("target", ["parent", "group"])
def test_sigterm_during_bench_leaves_no_server_rank_or_scratch(tmp_path: Path, target: str) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierstore.cli", "bench", "--quick", "--size-gib", "0.005", "--tensors", "8",
         "--repeats", "500", "--systems", "copy,tierstore_host", "--out", str(tmp_path / "out"),
         "--disk-dir", str(disk)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while not any("round 1/500 tierstore_host" in line for line in seen):
            left = deadline - time.monotonic()
            assert left > 0, "no progress line for round 1 of tierstore_host:\n" + "".join(seen)[-3000:]
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                continue
            assert line is not None, f"bench ended (rc {proc.wait()}) before its rounds:\n" + "".join(seen)[-3000:]
            seen.append(line)
        m = _SCRATCH.search("".join(seen))
        assert m, "the first line names the scratch directories:\n" + "".join(seen)
        shm_dir, disk_dir = Path(m.group(1)), Path(m.group(2))
        assert shm_dir.is_dir() and disk_dir.is_dir() and disk_dir.is_relative_to(disk)
        assert _servers_under(disk), "the tierstore system's index server should be running now"
        ranks = {p: _start(p) for p in _descendants(proc.pid)}
        assert ranks, "the ranks should be running now"

        if target == "parent":
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    while (line := lines.get(timeout=10)) is not None:
        seen.append(line)
    assert rc == 128 + signal.SIGTERM, "".join(seen)[-3000:]
    assert _servers_under(tmp_path) == []
    assert _left_after(ranks, within_s=30.0) == []
    assert not shm_dir.exists() and not disk_dir.exists()
    assert "interrupted by SIGTERM" in "".join(seen)
