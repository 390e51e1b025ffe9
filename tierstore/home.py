"""Where the embedded default keeps its state, who is using it, and how to remove it.

A home (``--home``, ``$TIERSTORE_HOME``, default ``./.tierstore``) holds:

==============================  =====================================================
``HOME/index/``                 the index server's append-only file, log, pid and lock
                                (and its socket, unless the path is too long: then
                                ``/tmp/tierstore-<hash>.sock``)
``HOME/durable/``               the durable tier (``file://``), unless ``durable=`` says otherwise
``/dev/shm/tierstore-<hash>/``  the host tier, one directory per node, each with its
                                reuse pool ``.pool/`` (``$TIERSTORE_SHM_DIR`` instead of
                                ``/dev/shm``; ``HOME/shm/`` where there is no ``/dev/shm``)
a detached process              the index server (``tierstore server status``)
==============================  =====================================================

Users: every store opened on a host tier holds a shared ``flock`` on a lock
file beside it (``.<node>.lock``; :class:`HostUsers`), released by
``close()`` or by the kernel when the process dies, however it dies. The
store that opens a host tier no one else holds frees the pool's segments
(nobody maps them), and so does the last one to close it. :func:`users` also
counts the connections to the index server, so ``tierstore server stop
--purge`` refuses while a trainer, an agent or an admin command holds the home.

Protocol of :func:`purge`: :func:`describe` what is there, check
:func:`users` (empty), stop the server (:func:`~tierstore.embedded.stop_server`,
by socket or by pid), then remove the host tier directory and the home's
``index`` and ``durable`` directories; the home directory itself only if it
is left empty (a home pointed at ``~`` keeps everything else).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

from tierstore.config import StoreConfig
from tierstore.embedded import SOCKET_NAME, ServerProcess, client_count, find_servers, socket_path, stop_server

__all__ = ["HomeState", "HostUsers", "Users", "describe", "host_dir", "host_lock_path", "is_index_dir", "purge",
           "users"]


def host_lock_path(host_root: str | os.PathLike) -> Path:
    """The lock file of a host tier: beside its directory, so the tier never lists it as an object."""
    root = Path(host_root).resolve()
    return root.parent / f".{root.name}.lock"


class HostUsers:
    """A shared hold on a host tier directory, for as long as a store has it open.

    :meth:`acquire` takes the hold and says whether no one else held it;
    :meth:`release` drops it and says whether this was the last hold. The
    answers are exact for stores opened through :func:`tierstore.open` (each
    holds one); the lock is advisory, so a process that maps the tier without
    a store (a node agent) is not counted.
    """

    def __init__(self, host_root: str | os.PathLike) -> None:
        self.path = host_lock_path(host_root)
        self._fd: int | None = None

    def acquire(self) -> bool:
        """Hold the tier; return whether this is its only holder now. No lock file possible: ``False``."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            return False
        alone = _try_lock(fd, fcntl.LOCK_EX)
        fcntl.flock(fd, fcntl.LOCK_SH)  # from exclusive (alone) or waiting out another's brief exclusive hold
        self._fd = fd
        return alone

    def release(self) -> bool:
        """Drop the hold; return whether it was the last one (no other holder now)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return False
        try:
            return _try_lock(fd, fcntl.LOCK_EX)
        finally:
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


def _lock_holders(path: Path) -> list[int]:
    """Pids holding a ``flock`` on ``path`` (from ``/proc/locks``); empty where that is unavailable."""
    try:
        st = path.stat()
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in lines:
        parts = line.split()
        if "->" in parts:  # a waiter, not a holder
            continue
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == want:
            pids.append(int(parts[4]))
    return sorted(set(pids))


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def host_dir(home: str | os.PathLike) -> Path:
    """The directory holding every node's derived host tier of ``home`` (``.../tierstore-<hash>``)."""
    cfg = replace(StoreConfig.from_env(home=str(home)), host_root=None).resolved()
    assert cfg.host_root is not None  # resolved() derives one
    return Path(cfg.host_root).parent


_INDEX_MARKERS = ("server.lock", "appendonlydir", "server.pid", "server.log", SOCKET_NAME)


def is_index_dir(path: Path) -> bool:
    """Whether ``path`` is an embedded index server's directory (it holds the server's files)."""
    return path.is_dir() and any((path / m).exists() for m in _INDEX_MARKERS)


@dataclass(frozen=True)
class HomeState:
    """What a home holds on this machine (see the module docstring)."""

    home: Path
    socket: Path
    exists: bool
    paths: list[tuple[str, Path, int]]
    servers: list[ServerProcess]
    kept: list[tuple[Path, str]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.paths and not self.servers


@dataclass(frozen=True)
class Users:
    """Who holds a home now: connections to its index server and processes holding its host tiers."""

    connections: int = 0
    host_holders: dict[str, list[int]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.connections or any(self.host_holders.values()))

    def describe(self) -> str:
        parts = []
        if self.connections:
            parts.append(f"{self.connections} connection(s) to its index server")
        for node, pids in sorted(self.host_holders.items()):
            if pids:
                who = ", ".join("an unnamed process" if p < 0 else str(p) for p in pids)
                parts.append(f"host tier {node} held by pid {who}")
        return "; ".join(parts)


def describe(home: str | os.PathLike) -> HomeState:
    """The state of ``home``: its directories (with sizes) and running servers. Creates nothing.

    ``paths`` is what :func:`purge` removes; ``kept`` what it leaves, and why.
    """
    home = Path(home).resolve()
    is_home = is_index_dir(home / "index")
    paths: list[tuple[str, Path, int]] = []
    kept: list[tuple[Path, str]] = []
    candidates = [("host tier (every node)", host_dir(home)), ("index", home / "index"),
                  ("durable tier", home / "durable"), ("host tier (no /dev/shm)", home / "shm")]
    for what, p in candidates:
        if not p.exists() or any(p.is_relative_to(q) for _w, q, _n in paths):
            continue
        if p.parent == home and not is_home:
            kept.append((p, f"{home / 'index'} is not a tierstore index: {p} is not removed"))
            continue
        paths.append((what, p, _size(p)))
    sock = socket_path(home)
    if sock.parent != home / "index" and sock.exists():
        paths.append(("index socket", sock, 0))
    env_root = os.environ.get("TIERSTORE_HOST_ROOT")
    if env_root:
        kept.append((Path(env_root), "TIERSTORE_HOST_ROOT names a host tier of its own: it is not removed"))
    return HomeState(home, sock, is_home, paths, find_servers(home), kept)


def users(home: str | os.PathLike) -> Users:
    """Connections to the home's index server (other than this query) and holders of its host tiers."""
    home = Path(home).resolve()
    conns = client_count(socket_path(home)) or 0
    holders: dict[str, list[int]] = {}
    hdir = host_dir(home)
    if hdir.is_dir():
        for entry in sorted(hdir.iterdir()):
            if entry.is_dir():
                lock = host_lock_path(entry)
                if lock.exists():
                    holders[entry.name] = _holders_of(lock)
    return Users(conns, holders)


def _holders_of(lock: Path) -> list[int]:
    pids = _lock_holders(lock)
    if pids:
        return pids
    try:  # no /proc/locks: ask the lock itself
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        if _try_lock(fd, fcntl.LOCK_EX):
            return []
        return [-1]  # held, by a process that cannot be named here
    finally:
        os.close(fd)


def purge(home: str | os.PathLike) -> list[Path]:
    """Stop the home's server and remove what :func:`describe` lists in ``paths``; return what was removed.

    The caller checks :func:`users` first (``tierstore server stop --purge`` does). Never removes the
    home directory wholesale: only its ``index``, ``durable`` and ``shm`` directories (and those only
    when ``index`` is a tierstore index), then the home itself if that left it empty.
    """
    home = Path(home).resolve()
    stop_server(home)
    removed = []
    for _what, p, _size_ in describe(home).paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    try:
        home.rmdir()  # only if nothing else is in it
        removed.append(home)
    except OSError:
        pass
    return removed
