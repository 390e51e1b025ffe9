"""Measure the inputs of the scale model (:mod:`bench.scale_model`) on this machine; write them as JSON.

    python -m bench.scale_inputs [--out bench/scale_inputs.json] [--mib 256] [--steps 4] [--repeats 3]

What is measured (medians of ``--repeats`` runs unless stated):

* **per byte**, the best of ``--repeats`` runs (the machine is shared: the
  fastest run has the least interference), one thread
  (``torch.set_num_threads(1)``, a per-core figure):
  ``copy_`` into a pre-allocated tensor (the memcpy bound), xxh3-128 over a
  buffer, the host tier's ``put`` (snapshot + seal + publish + index) and
  ``get(out=...)`` (verify + copy), of ``--mib`` MiB in 8 tensors;
* **per message**, on loopback TCP: a ``PING`` round trip; a vote that does
  not decide the step (its client latency) on a single server (no replica
  acknowledgement), on a primary with one replica (``WAIT 1`` after it) and
  on a 3+3 Redis Cluster (``WAIT 1``); the deciding vote of a 1024-voter step
  (it assembles the manifest), that manifest's size and the server CPU to
  serve it once (a restoring rank reads it); a round of 1024 votes sent at once by 8 client
  threads, first vote to commit, and the server's CPU per vote in it (what
  the primary serializes), without and with acknowledgements;
* **index operations per step**: a real :class:`~tierstore.store.TierStore`
  saves steps of R ranks x L objects (tiny tensors: only the index matters)
  with migration to a local durable directory, on a single server and on a
  primary with a replica (acks on). One pass counts the commands the
  client sends (the messages: a script's own commands are not messages),
  a second pass the server's main-thread CPU seconds
  (``INFO cpu``: commands, I/O and replication together). Four (R, L)
  shapes fit ``x = a * objects + b * ranks + c`` (least squares) for both;
* **failover**: a 3+3 cluster with ``cluster-node-timeout`` 1000 ms; the
  primary serving a model is SIGKILLed; the seconds until its replica is
  primary, minus the node timeout, is the election overhead.

Peer-tier efficiency (the fraction of raw UCX throughput a peer put/get
reaches) is not re-measured here: it is taken from ``python bench/bench_peer.py``
(README, "Other figures"), overridable with ``--peer-put`` / ``--peer-get``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import redis
import torch
import xxhash

__all__ = ["main"]

MiB = 1 << 20


def _best(fn: Callable[[], float], repeats: int) -> float:
    """The fastest of ``repeats`` runs: this machine's cost with the least interference from other load."""
    return min(fn() for _ in range(repeats))


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


# -- servers -------------------------------------------------------------------------------------
def _server(workdir: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    from tierstore.embedded import server_binary
    from tierstore.ports import free_port

    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
                             "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
                             "--repl-diskless-sync-delay", "0", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(500):
        try:
            redis.Redis(port=port).ping()
            return proc, port
        except redis.exceptions.ConnectionError:
            time.sleep(0.02)
    raise RuntimeError("bench server did not start")


def _replicated_pair(workdir: Path) -> tuple[list[subprocess.Popen], int]:
    p, pport = _server(workdir / "primary")
    r, rport = _server(workdir / "replica", "--replicaof", "127.0.0.1", str(pport))
    for _ in range(1000):
        if redis.Redis(port=rport).info("replication").get("master_link_status") == "up":
            return [p, r], pport
        time.sleep(0.02)
    raise RuntimeError("replica did not sync")


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        p.terminate()
        p.wait(10)


# -- per byte ------------------------------------------------------------------------------------
def per_byte(mib: int, repeats: int, work: Path) -> dict[str, float]:
    import tierstore
    from tierstore import ShardKey

    torch.set_num_threads(1)
    n = mib * MiB // 4 // 8
    src = {f"t{i}": torch.randn(n) for i in range(8)}
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    nbytes = sum(t.numel() * 4 for t in src.values())

    def copy() -> float:
        t0 = time.perf_counter()
        for k, v in src.items():
            dst[k].copy_(v)
        return time.perf_counter() - t0

    flat = torch.cat(list(src.values())).numpy().view("uint8")

    def hash_() -> float:
        t0 = time.perf_counter()
        xxhash.xxh3_128(memoryview(flat)).digest()
        return time.perf_counter() - t0

    proc, port = _server(work / "bytes-redis")
    store = tierstore.open(work / "bytes-home", redis=f"redis://127.0.0.1:{port}/0", durable="none",
                           host_root=str(Path("/dev/shm") / f"ts-scale-{port}"), node_id="bench", migrate=False)
    step = [0]

    def put() -> float:
        step[0] += 1
        key = ShardKey("scale", "layer", step[0], 0)
        t0 = time.perf_counter()
        store.put(key, src)
        dt = time.perf_counter() - t0
        if step[0] > 1:
            store.delete(ShardKey("scale", "layer", step[0] - 1, 0))  # its segment is reused by the next put,
            time.sleep(store.host.recycle_grace_s + 0.1)  # once the host tier's recycle grace has passed
        return dt

    def get() -> float:
        t0 = time.perf_counter()
        store.get(ShardKey("scale", "layer", step[0], 0), out=dst)
        return time.perf_counter() - t0

    try:
        copy(), hash_(), put(), get()  # warm: pages faulted in, the segment pool filled
        out = {
            "copy_GBps": nbytes / _best(copy, repeats) / 1e9,
            "xxh3_GBps": nbytes / _best(hash_, repeats) / 1e9,
            "host_put_GBps": nbytes / _best(put, repeats) / 1e9,
            "host_get_GBps": nbytes / _best(get, repeats) / 1e9,
            "bytes": nbytes,
        }
    finally:
        store.close()
        shutil.rmtree(Path("/dev/shm") / f"ts-scale-{port}", ignore_errors=True)
        _stop(proc)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    return out


# -- per message ---------------------------------------------------------------------------------
def _objects(model: str, rank: int, step: int, n: int = 13) -> list[dict]:
    return [{"key": f"{model}/layer{i}/{step}/{rank}", "kind": "full", "size": 1 << 24,
             "checksum": "0123456789abcdef0123456789abcdef", "base": None, "target": None, "tiers": ["host"]}
            for i in range(n)]


def _vote_latency(url: str, votes: int) -> float:
    """p50 client latency (s) of votes that do not decide their step (the world is larger than the votes)."""
    from consistency.index import Index
    from consistency.twophase import StepProtocol

    sp = StepProtocol(Index(url))
    model = f"lat{time.monotonic_ns()}"
    sp.begin(model, 1, 1 << 20)
    lat = []
    for rank in range(votes):
        t0 = time.perf_counter()
        assert sp.vote(model, 1, rank, _objects(model, rank, 1), extra={"rank": rank}) == "preparing"
        lat.append(time.perf_counter() - t0)
    sp.index.close()
    return _pct(lat[10:], 50)


def _deciding_vote(url: str, voters: int, rounds: int) -> dict[str, float]:
    """The vote that decides a step of ``voters`` (it writes the manifest): its p50 latency; then the
    manifest a restoring rank reads: its size and the server CPU per read (every rank reads it)."""
    from consistency.index import Index
    from consistency.twophase import StepProtocol

    sp = StepProtocol(Index(url))
    model = f"dec{time.monotonic_ns()}"
    lat = []
    for step in range(rounds):
        sp.begin(model, step, voters)
        for rank in range(voters - 1):
            sp.vote(model, step, rank, _objects(model, rank, step), extra={"rank": rank})
        t0 = time.perf_counter()
        assert sp.vote(model, step, voters - 1, _objects(model, voters - 1, step), extra={}) == "committed"
        lat.append(time.perf_counter() - t0)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    reads = 20
    size = len(json.dumps(sp.manifest(model, rounds - 1), separators=(",", ":")))
    c0 = _main_cpu(port)
    for _ in range(reads):  # one GET each on the server
        sp.manifest(model, rounds - 1)
    cpu = (_main_cpu(port) - c0) / reads
    sp.index.close()
    return {"deciding_vote_s": statistics.median(lat), "manifest_bytes": size,
            "manifest_objects": voters * len(_objects(model, 0, 0)), "manifest_read_cpu_s": cpu}


def _vote_round(url: str, voters: int, rounds: int, clients: int = 8) -> tuple[float, float]:
    """Medians of: seconds from the first of ``voters`` votes, sent at once by ``clients`` threads, to the
    commit; and the server's main-thread CPU seconds per vote in that round (what it serializes)."""
    from consistency.index import Index
    from consistency.twophase import StepProtocol

    protos = [StepProtocol(Index(url)) for _ in range(clients)]
    model = f"round{time.monotonic_ns()}"
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    out, cpu = [], []
    for step in range(rounds):
        protos[0].begin(model, step, voters)
        barrier = threading.Barrier(clients + 1)

        def send(c: int, step: int = step, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            for rank in range(c, voters, clients):
                protos[c].vote(model, step, rank, _objects(model, rank, step), extra={"rank": rank})

        threads = [threading.Thread(target=send, args=(c,)) for c in range(clients)]
        for t in threads:
            t.start()
        c0 = _main_cpu(port)
        barrier.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        out.append(time.perf_counter() - t0)
        cpu.append((_main_cpu(port) - c0) / voters)
        assert protos[0].state(model, step) == "committed"
    for sp in protos:
        sp.index.close()
    return statistics.median(out), statistics.median(cpu)


def _ping(port: int, n: int = 2000) -> float:
    c = redis.Redis(port=port)
    c.ping()
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        c.ping()
        lat.append(time.perf_counter() - t0)
    return _pct(lat, 50)


# -- index operations per step -------------------------------------------------------------------
class _Counter:
    """Counts the commands this process sends to any Redis server, by name (the messages; the commands a
    script runs inside the server are not messages). Patches redis-py's senders while active."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._orig: tuple[Any, Any] | None = None

    def _add(self, args: tuple) -> None:
        name = args[0].decode() if isinstance(args[0], bytes) else str(args[0])
        name = name.split()[0].lower()
        self.counts[name] = self.counts.get(name, 0) + 1

    def __enter__(self) -> Self:
        from redis.connection import AbstractConnection

        one, many = AbstractConnection.send_command, AbstractConnection.pack_commands
        self._orig = (one, many)
        counter = self

        def send_command(conn: Any, *args: Any, **kw: Any) -> Any:
            counter._add(args)
            return one(conn, *args, **kw)

        def pack_commands(conn: Any, commands: Any) -> Any:
            commands = list(commands)
            for c in commands:
                counter._add(tuple(c))
            return many(conn, commands)

        AbstractConnection.send_command = send_command  # type: ignore[method-assign]
        AbstractConnection.pack_commands = pack_commands  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        from redis.connection import AbstractConnection

        assert self._orig is not None
        AbstractConnection.send_command, AbstractConnection.pack_commands = self._orig  # type: ignore[method-assign]


def _main_cpu(port: int) -> float:
    info = redis.Redis(port=port).info("cpu")
    return float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"])


def _step_workload(port: int, work: Path, ranks: int, layers: int, steps: int) -> dict[str, Any]:
    """Per step: the commands sent, by name (one pass, counted in the client), and the server's main-thread
    CPU seconds (a second pass), for ``ranks`` x ``layers`` objects."""
    import tierstore
    from tierstore import ShardKey

    tag = f"w{ranks}x{layers}x{port}"
    shm = Path("/dev/shm") / f"ts-scale-{tag}"
    store = tierstore.open(work / tag, redis=f"redis://127.0.0.1:{port}/0", durable=f"file://{work / tag / 'd'}",
                           host_root=str(shm), node_id="bench")
    model = f"m{tag}"
    tensors = {"w": torch.ones(16)}
    try:
        epoch = store.open_epoch(model)

        def one(step: int) -> None:
            store.begin_step(model, step, ranks, layout={"layers": layers}, epoch=epoch)
            for r in range(ranks):
                infos = [store.put(ShardKey(model, f"l{i}", step, r), tensors, epoch=epoch) for i in range(layers)]
                store.vote(model, step, r, infos, extra={"rank": r}, epoch=epoch)
            for _ in range(ranks):
                store.wait_step(model, step, timeout=30)
            store.flush()
            assert store.wait_step(model, step, timeout=30) == "durable"

        one(1)  # warm: scripts loaded, model registered, subscriptions open
        with _Counter() as counter:
            for step in range(2, steps + 2):
                one(step)
        store.wait_step(model, steps + 1, timeout=30)
        counts = counter.counts
        cpu0 = _main_cpu(port)
        for step in range(steps + 2, 2 * steps + 2):
            one(step)
        cpu = _main_cpu(port) - cpu0
    finally:
        store.close()
        shutil.rmtree(shm, ignore_errors=True)
    return {"commands": {k: v / steps for k, v in sorted(counts.items())},
            "calls": sum(counts.values()) / steps, "cpu_s": cpu / steps}


def _fit(shapes: list[tuple[int, int]], ys: list[float]) -> dict[str, float]:
    """Least squares ``y = a * (R*L) + b * R + c`` over the (R, L) shapes."""
    import numpy as np

    a = np.array([[r * layer, r, 1.0] for r, layer in shapes])
    coef = np.linalg.lstsq(a, np.array(ys), rcond=None)[0]
    return {"per_object": float(coef[0]), "per_rank": float(coef[1]), "per_step": float(coef[2])}


def index_ops(work: Path, steps: int) -> dict[str, Any]:
    shapes = [(4, 4), (4, 16), (16, 4), (8, 8)]
    out: dict[str, Any] = {"shapes": shapes}
    for name, acks in (("single", False), ("replicated", True)):
        procs: list[subprocess.Popen]
        if acks:
            procs, port = _replicated_pair(work / f"ops-{name}")
        else:
            proc, port = _server(work / f"ops-{name}")
            procs = [proc]
        try:
            rows = [_step_workload(port, work / f"ops-{name}", r, layer, steps) for r, layer in shapes]
        finally:
            _stop(*procs)
        out[name] = {
            "calls": _fit(shapes, [r["calls"] for r in rows]),
            "server_cpu_s": _fit(shapes, [r["cpu_s"] for r in rows]),
            "commands_at": {"ranks": shapes[1][0], "layers": shapes[1][1], "per_step": rows[1]["commands"]},
            "rows": [{"ranks": r, "layers": layer, "calls": row["calls"], "cpu_s": row["cpu_s"]}
                     for (r, layer), row in zip(shapes, rows)],
        }
    return out


# -- failover ------------------------------------------------------------------------------------
def failover(work: Path) -> dict[str, float]:
    from tierstore.testing.rediscluster import LocalCluster

    node_timeout_ms = 1000
    with LocalCluster(work / "failover", node_timeout_ms=node_timeout_ms) as cl:
        primary = cl.primary_of("ts:{scale}:x")
        replica = cl.replica_of(primary)
        t0 = time.monotonic()
        cl.kill(primary)
        while replica.client(1).info("replication")["role"] != "master":
            time.sleep(0.01)
        promoted = time.monotonic() - t0
    return {"node_timeout_s": node_timeout_ms / 1000, "promoted_after_s": promoted,
            "election_overhead_s": promoted - node_timeout_ms / 1000}


def cluster_vote(work: Path, votes: int) -> float:
    from tierstore.testing.rediscluster import LocalCluster

    with LocalCluster(work / "cluster") as cl:
        return _vote_latency(cl.url, votes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).with_name("scale_inputs.json")))
    ap.add_argument("--mib", type=int, default=256, help="bytes per per-byte measurement")
    ap.add_argument("--steps", type=int, default=4, help="steps per index workload shape")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--votes", type=int, default=400, help="votes per latency measurement")
    ap.add_argument("--voters", type=int, default=1024, help="world of the deciding-vote measurement")
    ap.add_argument("--peer-put", type=float, default=0.58, help="peer put / raw ucxx (bench_peer.py)")
    ap.add_argument("--peer-get", type=float, default=0.64, help="peer get / raw ucxx (bench_peer.py)")
    a = ap.parse_args(argv)
    result: dict[str, Any] = {
        "measured_on": {"machine": platform.node(), "cpus": len(os.sched_getaffinity(0)),
                        "python": platform.python_version(), "torch": torch.__version__,
                        "date": time.strftime("%Y-%m-%d"),
                        "command": "python -m bench.scale_inputs " + " ".join(argv or [])},
    }
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        result["per_byte"] = per_byte(a.mib, a.repeats, work)
        print("per byte:", json.dumps(result["per_byte"]), flush=True)
        proc, port = _server(work / "lat-single")
        try:
            url = f"redis://127.0.0.1:{port}/0"
            msg = {"ping_s": _ping(port), "vote_s": _vote_latency(url, a.votes), "deciding_voters": a.voters,
                   **_deciding_vote(url, a.voters, a.repeats)}
            msg["round_s"], msg["vote_server_cpu_s"] = _vote_round(url, a.voters, a.repeats)
        finally:
            _stop(proc)
        procs, pport = _replicated_pair(work / "lat-pair")
        try:
            msg["vote_acked_s"] = _vote_latency(f"redis://127.0.0.1:{pport}/0", a.votes)
            msg["round_acked_s"], msg["vote_server_cpu_acked_s"] = _vote_round(f"redis://127.0.0.1:{pport}/0",
                                                                                 a.voters, a.repeats)
        finally:
            _stop(*procs)
        msg["vote_cluster_acked_s"] = cluster_vote(work, a.votes)
        result["per_message"] = msg
        print("per message:", json.dumps(msg), flush=True)
        result["index_ops"] = index_ops(work, a.steps)
        print("index ops:", json.dumps({k: v for k, v in result["index_ops"].items() if k != "shapes"})[:400],
              flush=True)
        result["failover"] = failover(work)
        print("failover:", json.dumps(result["failover"]), flush=True)
    result["peer"] = {"put_vs_raw": a.peer_put, "get_vs_raw": a.peer_get,
                      "source": "README 'Other figures': python bench/bench_peer.py (loopback TCP)"}
    Path(a.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
