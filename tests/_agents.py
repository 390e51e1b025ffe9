"""Test helpers: node agents as real subprocesses on loopback, and a raw protocol client.

Each agent stands in for one node: its own process, port and host root under
``/dev/shm/<unique>``. :class:`AgentCluster` starts them, and its ``close``
(called by fixture finalizers) kills every process and removes the directories.
"""

from __future__ import annotations

import asyncio
import os
import select
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SECRET = b"test-shared-secret-0123456789"


def require_ucxx():
    from backends.ucx_util import import_ucxx
    from tierstore.errors import MissingDependencyError

    try:
        return import_ucxx()
    except MissingDependencyError as e:
        pytest.skip(f"needs ucxx: {e}")


class AgentProc:
    def __init__(self, node_id: str, root: Path, secret_file: Path, extra: list[str]) -> None:
        self.node_id = node_id
        self.root = root
        env = dict(os.environ, UCXX_LOG_LEVEL=os.environ.get("UCXX_LOG_LEVEL", "FATAL"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierstore.cli.agent", "--node-id", node_id, "--host-root", str(root),
             "--secret-file", str(secret_file), *extra],
            cwd=REPO, stdout=subprocess.PIPE, env=env)
        self.port = self._wait_ready(30.0)

    def _wait_ready(self, timeout: float) -> int:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline().decode() if ready else ""
        if "ready" not in line:
            self.proc.kill()
            raise RuntimeError(f"agent {self.node_id} did not start (rc={self.proc.poll()}, line={line!r})")
        return int(line.rsplit("port=", 1)[1])

    @property
    def address(self):
        from backends.peer import PeerAddress

        return PeerAddress(self.node_id, "127.0.0.1", self.port)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(15)


class AgentCluster:
    """``n`` agents, ``node0..node{n-1}``, each with its own host root below one /dev/shm dir."""

    def __init__(self, n: int, *, extra: list[str] | None = None, secret: bytes = SECRET) -> None:
        self.base = Path("/dev/shm") / f"ts-test-{uuid.uuid4().hex[:12]}"
        self.base.mkdir(parents=True)
        self.secret = secret
        self.secret_file = self.base / "secret"
        self.secret_file.write_bytes(secret + b"\n")
        self.agents: list[AgentProc] = []
        try:
            for i in range(n):
                self.agents.append(AgentProc(f"node{i}", self.base / f"node{i}", self.secret_file, extra or []))
        except BaseException:
            self.close()
            raise

    @property
    def addresses(self):
        return [a.address for a in self.agents]

    def close(self) -> None:
        for a in self.agents:
            try:
                a.kill()
            except Exception:
                pass
        shutil.rmtree(self.base, ignore_errors=True)


class RawClient:
    """Speaks raw frames to one agent from a private event-loop thread (for the security tests)."""

    def __init__(self, port: int) -> None:
        from backends.ucx_util import ucx_loop

        self.ucxx = require_ucxx()
        self.loop = ucx_loop()
        self.ep = self.run(self.ucxx.create_endpoint("127.0.0.1", port))

    def run(self, coro, timeout: float = 20.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def send(self, frame, tag=None) -> None:
        self.run(self.ep.send(bytearray(frame)) if tag is None else self.ep.send(bytearray(frame), tag=tag))

    def reply(self):
        from backends import agent_protocol as P

        buf = bytearray(P.REPLY_FRAME_SIZE)
        self.run(self.ep.recv(buf))
        return P.unpack_reply(buf)

    def close(self) -> None:
        async def _abort():
            self.ep.abort()

        self.run(_abort())
