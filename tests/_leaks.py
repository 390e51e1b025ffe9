"""What a test session leaves behind: host tiers in shared memory and processes it started, found and named.

``tests/conftest.py`` takes a :class:`Baseline` before the first test (:func:`start`) and checks it after
the last (:func:`leftovers`). Only what this session made counts, never what other sessions or the user
keep on the same machine:

- **host tiers**: the session gives every store a private ``TIERSTORE_SHM_DIR`` (tests get their own, one
  per test, below it in time), so anything still in the session's directory at the end was left by a test;
  and a ``tierstore-<hash>`` directory that appeared in ``/dev/shm`` since the start counts when its hash is
  that of a home under this session's directories (a process that dropped the variable);
- **processes**: every process the session starts inherits ``TIERSTORE_TEST_SESSION=<token>`` (ranks,
  agents, servers of the fixtures); one still alive at the end is a leftover. An embedded index server
  rewrites its environment (its process title), so it counts when it serves a home under this session's
  directories and was not running before the session.

:func:`clean` then removes what was found, so a failed check does not leave the machine dirty either.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
MARK = "TIERSTORE_TEST_SESSION"
_HASHED = re.compile(r"tierstore-[0-9a-f]{12}")
_PRUNE = {".git", ".venv", "venv", "site-packages", "node_modules", "__pycache__", "appendonlydir"}


@dataclass(frozen=True)
class Baseline:
    """What the machine held when the session started, and the session's own markers."""

    token: str
    shm_dir: Path
    shm_entries: frozenset[str]
    pids: frozenset[int]


@dataclass(frozen=True)
class Leftover:
    """One thing the session left: a host tier (``path``) or a process (``pid``)."""

    what: str
    path: Path | None = None
    pid: int | None = None

    def __str__(self) -> str:
        return self.what


def start() -> Baseline:
    """Record ``/dev/shm``'s tierstore entries and make the session's private host-tier directory."""
    token = uuid.uuid4().hex
    entries = frozenset(n for n in os.listdir(SHM) if n.startswith("tierstore-"))
    shm_dir = SHM / f"tierstore-test-session-{os.getpid()}-{token[:8]}"
    shm_dir.mkdir()
    return Baseline(token, shm_dir, entries, frozenset(_pids()))


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _human(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} B"


def _size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def _homes_by_digest(roots: list[Path], wanted: set[str]) -> dict[str, Path]:
    """The directories under ``roots`` whose derived host tier is ``tierstore-<digest>`` (see StoreConfig)."""
    found: dict[str, Path] = {}
    for root in roots:
        for dirpath, dirs, _files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in _PRUNE]
            name = "tierstore-" + hashlib.sha256(str(Path(dirpath).resolve()).encode()).hexdigest()[:12]
            if name in wanted:
                found[name] = Path(dirpath)
            if len(found) == len(wanted):
                return found
    return found


def host_tiers(b: Baseline, roots: list[Path]) -> list[Leftover]:
    """Host tiers the session left: in its own directory, or new in ``/dev/shm`` with a home under ``roots``."""
    inside = sorted(b.shm_dir.iterdir()) if b.shm_dir.is_dir() else []
    new = {n for n in os.listdir(SHM) if n.startswith("tierstore-")} - b.shm_entries - {b.shm_dir.name}
    mine = {n for n in new if n.startswith((f"tierstore-test-shm-{os.getpid()}-", f"tierstore-test-{os.getpid()}-"))}
    hashed = {n for n in new if _HASHED.fullmatch(n)}
    homes = _homes_by_digest(roots, hashed | {p.name for p in inside if _HASHED.fullmatch(p.name)})
    out = []
    for p in [*inside, *(SHM / n for n in sorted(mine)), *(SHM / n for n in sorted(hashed) if n in homes)]:
        home = homes.get(p.name)
        whose = f"the host tier of home {home}" if home else "a test's host tier"
        out.append(Leftover(f"{p} ({_human(_size(p))}): {whose}", path=p))
    return out


def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _session_pids(b: Baseline, roots: list[Path]) -> list[int]:
    from tierstore.embedded import find_servers

    needle = f"{MARK}={b.token}".encode()
    me = os.getpid()
    marked = {p for p in _pids() if p != me and _environ_has(p, needle)}
    servers = {s.pid for s in find_servers() if s.pid not in b.pids and any(s.home.is_relative_to(r) for r in roots)}
    return sorted(p for p in marked | servers if _alive(p))


def processes(b: Baseline, roots: list[Path], grace_s: float = 5.0) -> list[Leftover]:
    """Processes the session started that still run (after ``grace_s`` for those on their way out)."""
    deadline = time.monotonic() + grace_s
    while True:
        left = _session_pids(b, roots)
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    out = []
    for pid in sorted(left):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        out.append(Leftover(f"pid {pid}: {cmd[:200]}", pid=pid))
    return out


def leftovers(b: Baseline, roots: list[Path], grace_s: float = 5.0) -> list[Leftover]:
    """Everything :func:`processes` and :func:`host_tiers` find."""
    return [*processes(b, roots, grace_s), *host_tiers(b, roots)]


def clean(found: list[Leftover], b: Baseline) -> None:
    """Stop the processes (SIGTERM, then SIGKILL) and remove the directories; then the session's own."""
    pids = [x.pid for x in found if x.pid is not None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
    for x in found:
        if x.path is not None:
            shutil.rmtree(x.path, ignore_errors=True)
    shutil.rmtree(b.shm_dir, ignore_errors=True)


def purge_homes(*homes: Path) -> None:
    """Remove what a module fixture's embedded homes hold, as ``tierstore server stop --purge`` does: the index
    server, the index, the durable tier and the host tier (with its pool)."""
    from tierstore.home import purge

    for home in homes:
        purge(home)
