"""``tierstore testbed``: the docker-compose topology as local processes, end to end.

Topology (``docker/docker-compose.yml`` runs the same with containers):

* a Redis-protocol server on a loopback TCP port (the index);
* moto's S3 server on a loopback port (the durable tier), one bucket;
* two "nodes", ``node0`` and ``node1``: each a host tier directory in
  ``/dev/shm``, a node agent (``python -m tierstore.cli.agent``) serving it to
  peers over UCX and registered in the index, and ``--ranks-per-node``
  trainer ranks (the demo's rank program, gloo over loopback).

Scenario:

1. Phase 0: every rank trains the small GPT and checkpoints every step
   (replicas to the peer node when the peer tier is available, bases to S3).
   After step ``--kill-at`` the ranks pause, and the launcher kills
   ``node1`` whole: its agent and its ranks (SIGKILL), and its shared
   memory is wiped (a lost node loses its memory). The survivors are
   stopped, as a launcher does when a rank dies.
2. Phase 1: a replacement ``node1`` starts (a fresh agent, an empty host
   tier); every rank restarts and restores. Ranks of ``node0`` read their
   host tier; ranks of ``node1`` must read the peer tier (the replicas on
   ``node0``) or the durable tier. Training continues to ``--steps``.
3. Prints, per rank, the restored step, the restore time and the tiers read,
   and checks every rank restored the same step; exit 0 on success.

``--no-peer`` runs without the peer tier (restore of the lost node from S3).
The peer tier is used only when this tierstore's :class:`StoreConfig` has
``peer_replicas`` and ``ucxx`` imports.

``--netns`` runs each node (its agent and its ranks) in its own Linux
network namespace on a private bridge (:class:`tierstore.cli.netns.Fabric`;
root and iproute2): the index and the S3 server bind the bridge's address,
every node has its own address, UCX and gloo use the node's interface, so
replication, restore and the collectives cross real interfaces. Without
root or ``ip`` it exits with the reason.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from consistency.index import Index
from consistency.nodes import NodeRegistry
from tierstore.cli.common import HelpFormatter
from tierstore.cli.demo import _read_events, _tail
from tierstore.cli.netns import Fabric, netns_supported
from tierstore.config import StoreConfig
from tierstore.embedded import server_binary
from tierstore.errors import TierUnavailableError
from tierstore.ports import free_port

__all__ = ["Testbed", "main", "netns_supported", "peer_supported"]

_FAKE_S3_ENV = {"AWS_ACCESS_KEY_ID": "testbed", "AWS_SECRET_ACCESS_KEY": "testbed", "AWS_DEFAULT_REGION": "us-east-1"}


def peer_supported() -> tuple[bool, str]:
    """Whether ranks can use the peer tier here, and why not."""

    if "peer_replicas" not in StoreConfig.__dataclass_fields__:
        return False, "TierStore has no peer tier option (peer_replicas) yet"
    if not _ucxx_ok():
        return False, "ucxx is not usable here: pip install 'tierstore[ucx]'"
    return True, ""


def _ucxx_ok() -> bool:
    try:
        from backends.ucx_util import import_ucxx  # lazy: the testbed runs without ucxx (--no-peer)

        import_ucxx()
        return True
    except Exception:  # noqa: BLE001
        return False


def _missing_dependency() -> str | None:
    """What the testbed needs and lacks here, with the ``pip install`` that brings it; ``None`` if nothing."""
    missing = [m for m in ("moto", "flask", "flask_cors") if importlib.util.find_spec(m) is None]
    if missing:
        return (f"the testbed's S3 server is moto's, which is not installed here (missing: {', '.join(missing)}): "
                "pip install 'tierstore[testbed]'")
    return None


def _wait(cond, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            tail = f"; the end of its log ({log}):\n{_tail(log)}" if log is not None else ""
            raise RuntimeError(f"{what}: the process exited with {proc.returncode}{tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not ready after {timeout}s")
        time.sleep(0.05)


class Testbed:
    """Starts and stops the services and processes of the topology; see the module docstring."""

    def __init__(self, work: Path, *, nodes: int = 2, ranks_per_node: int = 2, peer: bool = True,
                 policy: str = "exact", steps: int = 10, kill_at: int = 4, netns: bool = False) -> None:
        self.work = work
        self.nodes = [f"node{i}" for i in range(nodes)]
        self.fabric = Fabric(self.nodes) if netns else None
        self.service_host = self.fabric.gateway if self.fabric is not None else "127.0.0.1"
        self.ranks_per_node = ranks_per_node
        self.world = nodes * ranks_per_node
        self.peer = peer
        self.agents = _ucxx_ok()
        self.shm = Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()) / \
            f"tierstore-testbed-{uuid.uuid4().hex[:10]}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ, OMP_NUM_THREADS="1", UCXX_LOG_LEVEL=os.environ.get("UCXX_LOG_LEVEL", "FATAL"),
                        **_FAKE_S3_ENV)
        root = str(Path(__file__).resolve().parents[2])  # the folder holding the tierstore package
        self.env["PYTHONPATH"] = root + (os.pathsep + self.env["PYTHONPATH"] if self.env.get("PYTHONPATH") else "")
        self.secret_file = self.work / "secret"
        self.redis_url = ""
        self.s3_endpoint = ""
        self.bucket = "tierstore-testbed"
        self.base_cfg: dict[str, Any] = {"steps": steps, "world": self.world, "policy": policy, "seed": 0,
                                         "batch_size": 8, "model": "testbed", "hold_after": kill_at}

    def spawn(self, name: str, args: list[str], *, node: str | None = None, env: dict[str, str] | None = None,
              stdin: Any = None) -> subprocess.Popen:
        """Start a process (inside ``node``'s namespace with ``--netns``), logging to ``<name>.log``."""
        full = dict(self.env, **(env or {}))
        if node is not None and self.fabric is not None:
            args = self.fabric.command(node, args)
            full.update(self.fabric.env(node))
        log = open(self.work / f"{name}.log", "a")
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=full, cwd=str(self.work), stdin=stdin)
        log.close()
        self.procs[name] = p
        return p

    def node_host(self, node: str) -> str:
        """The address ``node``'s agent advertises (its namespace's address with ``--netns``)."""
        return self.fabric.ip[node] if self.fabric is not None else "127.0.0.1"

    # -- services ------------------------------------------------------------------------
    def start_services(self) -> None:
        import boto3  # lazy: boto3 is slow to import and only the testbed's own S3 set-up needs it

        self.work.mkdir(parents=True, exist_ok=True)
        self.shm.mkdir(parents=True)
        self.secret_file.write_text(uuid.uuid4().hex + "\n")
        if self.fabric is not None:
            self.fabric.up()
        host = self.service_host
        port = free_port()
        p = self.spawn("redis", [server_binary(), "--port", str(port), "--bind", host, "--save", "",
                                 "--appendonly", "no", "--dir", str(self.work), "--protected-mode", "no"])
        self.redis_url = f"redis://{host}:{port}/0"

        def redis_up() -> bool:
            index = Index(self.redis_url, socket_timeout=1)
            try:
                index.ping()
                return True
            except TierUnavailableError:
                return False
            finally:
                index.close()

        _wait(redis_up, 30, "redis", p, self.work / "redis.log")
        port = free_port()
        p = self.spawn("s3", [sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)])
        self.s3_endpoint = f"http://{host}:{port}"
        client = boto3.client("s3", endpoint_url=self.s3_endpoint, region_name="us-east-1",
                              aws_access_key_id="testbed", aws_secret_access_key="testbed")

        def s3_up() -> bool:
            try:
                client.list_buckets()
                return True
            except Exception:  # noqa: BLE001 - not listening yet
                return False

        _wait(s3_up, 60, "S3 server", p, self.work / "s3.log")
        client.create_bucket(Bucket=self.bucket)
        self.base_cfg.update(home=str(self.work / "home"), redis=self.redis_url, durable=f"s3://{self.bucket}/ckpt",
                             s3_endpoint=self.s3_endpoint)

    def start_agent(self, node: str, extra: Sequence[str] = ()) -> None:
        (self.shm / node).mkdir(parents=True, exist_ok=True)
        p = self.spawn(f"agent-{node}", [sys.executable, "-m", "tierstore.cli.agent", "--node-id", node,
                                         "--host-root", str(self.shm / node), "--secret-file", str(self.secret_file),
                                         "--redis", self.redis_url, "--ttl", "5", "--log-level", "INFO",
                                         "--host", self.node_host(node), *extra], node=node)
        registry = NodeRegistry(Index(self.redis_url))
        _wait(lambda: registry.is_registered(node), 60, f"agent {node}", p)

    def kill_node(self, node: str) -> None:
        """SIGKILL the node's agent and ranks, wipe its shared memory, drop its registration."""
        for name, p in self.procs.items():
            if (name == f"agent-{node}" or name.startswith(f"{node}-rank")) and p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(30)
        shutil.rmtree(self.shm / node, ignore_errors=True)
        NodeRegistry(Index(self.redis_url)).remove(node)  # what its TTL would do a few seconds later

    # -- ranks ---------------------------------------------------------------------------
    def start_ranks(self, phase: int) -> dict[int, subprocess.Popen]:
        port = free_port()
        ranks = {}
        # with --netns, gloo meets at rank 0's node address (env://), not on the launcher's loopback
        rendezvous = {"MASTER_ADDR": self.node_host(self.nodes[0]), "MASTER_PORT": str(port)}
        for r in range(self.world):
            node = self.nodes[r // self.ranks_per_node]
            cfg = dict(self.base_cfg, rank=r, phase=phase, port=None if self.fabric else port, node_id=node,
                       host_root=str(self.shm / node), events=str(self.work / f"rank{r}.phase{phase}.jsonl"))
            if self.peer:
                cfg.update(peer_replicas=1, peer_secret_file=str(self.secret_file))
            ranks[r] = self.spawn(f"{node}-rank{r}-phase{phase}",
                                  [sys.executable, "-m", "tierstore.cli.demo", "--worker", json.dumps(cfg)],
                                  node=node, env=rendezvous if self.fabric else None)
        return ranks

    def events(self, rank: int, phase: int) -> list[dict[str, Any]]:
        return _read_events(self.work / f"rank{rank}.phase{phase}.jsonl")

    def close(self) -> None:
        procs = list(reversed(self.procs.values()))  # ranks, agents, then the services they use
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        shutil.rmtree(self.shm, ignore_errors=True)
        if self.fabric is not None:
            self.fabric.down()


def _log_tail(tb: Testbed, name: str) -> str:
    return f"--- {name}.log ---\n{_tail(tb.work / f'{name}.log')}"


def run(tb: Testbed, kill_at: int, say=print, timeout: float = 300.0) -> dict[str, Any]:
    """The scenario of the module docstring; returns the report (raises RuntimeError on failure)."""
    deadline = time.monotonic() + timeout
    tb.start_services()
    say(f"index {tb.redis_url}, S3 {tb.s3_endpoint}, host tiers under {tb.shm}, peer tier {'on' if tb.peer else 'off'}")
    if tb.fabric is not None:
        say(f"nodes in network namespaces on bridge {tb.fabric.bridge}: "
            + ", ".join(f"{n} {tb.fabric.ip[n]}" for n in tb.nodes))
    if tb.agents:
        for node in tb.nodes:
            tb.start_agent(node)
        say(f"agents up: {', '.join(tb.nodes)}")
    else:
        say("no node agents: ucxx is not usable here")
    ranks = tb.start_ranks(0)
    victim = tb.nodes[-1]

    def all_held() -> bool:
        for r, p in ranks.items():
            if p.poll() is not None:
                raise RuntimeError(f"rank {r} exited with {p.returncode} in phase 0\n"
                                   + _log_tail(tb, f"{tb.nodes[r // tb.ranks_per_node]}-rank{r}-phase0"))
        return all(any(e["event"] == "step" and e["step"] == kill_at for e in tb.events(r, 0)) for r in ranks)

    _wait(all_held, max(1.0, deadline - time.monotonic()), "phase 0 ranks reaching the kill step")
    time.sleep(0.5)  # let background commits of the last step run
    tb.kill_node(victim)
    for p in ranks.values():
        if p.poll() is None:
            p.kill()
            p.wait(30)
    say(f"killed {victim} (agent, ranks, shared memory) after step {kill_at}; stopped the survivors")
    if tb.agents:
        tb.start_agent(victim)
    say(f"replacement {victim} up; restarting {tb.world} ranks")
    ranks = tb.start_ranks(1)
    for r, p in ranks.items():
        try:
            rc = p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None
        if rc != 0:
            raise RuntimeError(f"rank {r} failed in phase 1 (exit {rc})\n"
                               + _log_tail(tb, f"{tb.nodes[r // tb.ranks_per_node]}-rank{r}-phase1"))
    report: dict[str, Any] = {"killed": victim, "kill_at": kill_at, "peer": tb.peer, "ranks": {},
                              "netns": None if tb.fabric is None else dict(tb.fabric.ip)}
    for r in range(tb.world):
        ev = tb.events(r, 1)
        restore = next(e for e in ev if e["event"] == "restore")
        steps = [e["step"] for e in ev if e["event"] == "step"]
        done = next((e for e in ev if e["event"] == "done"), {})
        report["ranks"][r] = {"node": tb.nodes[r // tb.ranks_per_node], "restored_step": restore["step"],
                              "seconds": restore["seconds"], "phases": restore.get("phases") or {},
                              "tiers": restore["tiers"],
                              "last_step": steps[-1] if steps else None, "final_state": done.get("state")}
    if tb.fabric is not None:
        report["links"] = {n: tb.fabric.counters(n) for n in tb.nodes}
    restored = {v["restored_step"] for v in report["ranks"].values()}
    if len(restored) != 1 or None in restored:
        raise RuntimeError(f"ranks restored different steps: {report['ranks']}")
    report["restored_step"] = restored.pop()
    return report


def _print_report(rep: dict[str, Any]) -> None:
    t = Table(title=f"testbed: {rep['killed']} lost after step {rep['kill_at']}; restored step {rep['restored_step']}",
              title_justify="left")
    for c in ("rank", "node", "restored step", "restore time", "of which", "tiers read", "trained to", "last save"):
        t.add_column(c)
    for r, v in sorted(rep["ranks"].items()):
        parts = ", ".join(f"{k} {s * 1e3:.0f}" for k, s in (v.get("phases") or {}).items()) or "-"
        t.add_row(str(r), v["node"], str(v["restored_step"]), f"{v['seconds'] * 1e3:.0f} ms", parts,
                  ", ".join(f"{k} {n}" for k, n in sorted(v["tiers"].items())) or "-", str(v["last_step"]),
                  str(v["final_state"]))
    Console(width=None if sys.stdout.isatty() else 140).print(t)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tierstore testbed", description=__doc__.split("\n\n")[0].split(": ", 1)[-1],
                                formatter_class=HelpFormatter,
                                epilog="Needs tierstore[testbed] (moto's S3 server); the peer tier needs tierstore[ucx].")
    p.add_argument("--steps", type=int, default=10, help="training steps in all")
    p.add_argument("--kill-at", type=int, default=4, help="the step after which node1 is lost")
    p.add_argument("--ranks-per-node", type=int, default=2, help="trainer ranks on each of the two nodes")
    p.add_argument("--policy", default="exact",
                   help="exact | layerwise | differential | dedup, or a '+'-joined mix (as the demo's)")
    p.add_argument("--no-peer", action="store_true",
                   help="no peer tier: the lost node restores from S3 (default: the peer tier where ucxx works)")
    p.add_argument("--workdir", default=None, help="logs and state (default: a temporary directory, removed)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds the whole scenario may take")
    p.add_argument("--json", action="store_true", help="print the report as JSON (default: a table)")
    p.add_argument("--netns", action="store_true",
                   help="each node in its own network namespace on a private bridge (root, iproute2)")
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    missing = _missing_dependency()
    if missing:
        print(f"tierstore testbed: {missing}", file=sys.stderr)
        return 1
    if a.netns:
        ok, why_not = netns_supported()
        if not ok:
            print(f"tierstore testbed: --netns is not possible here: {why_not}", file=sys.stderr)
            return 3
    if not 0 < a.kill_at < a.steps - 1:
        print(f"tierstore testbed: --kill-at must be in 1..{a.steps - 2}", file=sys.stderr)
        return 2
    peer, why = (False, "--no-peer") if a.no_peer else peer_supported()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="tierstore-testbed-")).resolve()
    tb = Testbed(work, ranks_per_node=a.ranks_per_node, peer=peer, policy=a.policy, steps=a.steps, kill_at=a.kill_at,
                 netns=a.netns)
    say = (lambda m: print(m, file=sys.stderr)) if a.json else print
    if not peer:
        say(f"peer tier off ({why}): the lost node restores from the durable tier")
    try:
        rep = run(tb, a.kill_at, say=say, timeout=a.timeout)
        rep["peer_off_reason"] = None if peer else why
    except RuntimeError as e:
        print(f"tierstore testbed: {e}\nlogs in {work}", file=sys.stderr)
        return 1
    finally:
        tb.close()
        if a.workdir is None and "rep" in locals():
            shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps(rep, indent=2, default=str))
    else:
        _print_report(rep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
