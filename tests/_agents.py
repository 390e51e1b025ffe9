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


def _limit_fds(n: int):
    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    return apply


class AgentProc:
    def __init__(self, node_id: str, root: Path, secret_file: Path, extra: list[str], *,
                 nofile: int | None = None, log: Path | None = None, repo: Path = REPO) -> None:
        self.node_id = node_id
        self.root = root
        self.log = log
        env = dict(os.environ, UCXX_LOG_LEVEL=os.environ.get("UCXX_LOG_LEVEL", "FATAL"))
        if repo != REPO:  # another checkout's agent (a benchmark's baseline)
            env["PYTHONPATH"] = str(repo)
        stderr = open(log, "wb") if log is not None else None  # the child writes its own copy
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tierstore.cli.agent", "--node-id", node_id, "--host-root", str(root),
                 "--secret-file", str(secret_file), *extra],
                cwd=repo, stdout=subprocess.PIPE, stderr=stderr, env=env,
                preexec_fn=_limit_fds(nofile) if nofile else None)
        finally:
            if stderr is not None:
                stderr.close()
        self.port = self._wait_ready(30.0)

    def log_text(self) -> str:
        """What the agent logged so far (only for an agent started with ``log``)."""
        return self.log.read_text(errors="replace") if self.log is not None else ""

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

    def rss_bytes(self, field: str = "VmRSS") -> int:
        """The agent process's resident memory (``/proc/<pid>/status``: ``VmRSS``, or ``RssAnon``, ``RssShmem``)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no {field}")

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

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

    def __init__(self, n: int, *, extra: list[str] | None = None, secret: bytes = SECRET,
                 nofile: int | None = None, logs: bool = False, repo: Path = REPO) -> None:
        self.base = Path("/dev/shm") / f"ts-test-{uuid.uuid4().hex[:12]}"
        self.base.mkdir(parents=True)
        self.secret = secret
        self.secret_file = self.base / "secret"
        self.secret_file.write_bytes(secret + b"\n")
        self.agents: list[AgentProc] = []
        try:
            for i in range(n):
                self.agents.append(AgentProc(f"node{i}", self.base / f"node{i}", self.secret_file, extra or [],
                                             nofile=nofile, log=self.base / f"node{i}.log" if logs else None,
                                             repo=repo))
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
    """Speaks raw frames to one agent from the process's ucxx event-loop thread (for the security tests).

    On connect it reads the agent's challenge (``challenge``) and keeps a
    :class:`~backends.agent_protocol.ClientSession`: :meth:`request` signs the
    next frame for this connection; :meth:`send` and :meth:`reply` use the
    session's tags (``slot`` 0: frames, ``i + 1``: payload chunk ``i``).
    """

    def __init__(self, port: int, *, host: str = "127.0.0.1", secret: bytes = SECRET) -> None:
        from backends import agent_protocol as P
        from backends.ucx_util import ucx_loop

        self.ucxx = require_ucxx()
        self.loop = ucx_loop()
        self.ep = self.run(self.ucxx.create_endpoint(host, port))
        frame = bytearray(P.CHALLENGE_FRAME_SIZE)
        self.run(self.ep.recv(frame))
        self.challenge = P.unpack_challenge(frame)
        self.session = P.ClientSession(secret, self.challenge)
        self.base = self.challenge.tag_base
        self._reply_size = P.REPLY_FRAME_SIZE

    def run(self, coro, timeout: float = 20.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def request(self, op: int, key: str, **kw) -> bytearray:
        """The next signed request frame of this connection (keywords as ``pack_request``)."""
        return self.session.request(op, key, **kw)[1]

    def send(self, frame, slot: int = 0) -> None:
        from backends import agent_protocol as P

        self.run(self.ep.send(bytearray(frame), tag=P.tag(self.base, slot), force_tag=True))

    def send_tag(self, data, tag: int) -> None:
        """Send ``data`` under an arbitrary tag (flooding the agent's unexpected queue)."""
        self.run(self.ep.send(bytearray(data), tag=tag, force_tag=True))

    def recv(self, buf, slot: int = 0, timeout: float = 20.0):
        from backends import agent_protocol as P

        return self.run(self.ep.recv(buf, tag=P.tag(self.base, slot, to_client=True), force_tag=True), timeout)

    def reply(self, timeout: float = 20.0):
        from backends import agent_protocol as P

        buf = bytearray(P.REPLY_FRAME_SIZE)
        self.recv(buf, 0, timeout)
        return P.unpack_reply(buf)

    def closed_by_agent(self, timeout: float) -> bool:
        """Whether a receive fails (the agent aborted its end) within ``timeout`` seconds."""
        try:
            self.recv(bytearray(self._reply_size), slot=0, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - any transport error means closed
            return not isinstance(e, TimeoutError)
        return False

    def close(self) -> None:
        async def _abort():
            self.ep.abort()

        self.run(_abort())
