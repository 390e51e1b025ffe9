"""Commit latency of the two-phase commit: vote to committed, p50/p99.

* ``ranks``: R real rank threads, each with its own Redis client, vote for
  every step at once (released by a barrier); a rank's latency runs from its
  vote call to the moment it knows the step committed (its own vote's reply
  if it was the last, else :meth:`StepProtocol.wait`). The step's latency is
  the slowest rank's.
* ``voters``: N simulated voters against one server, sent by 8 client threads;
  reported: the last vote's latency (the script that counts the world and
  writes the manifest) and the round (first vote sent to committed).

Every vote carries 4 object entries (key, kind, size, checksum, tiers) and a
small ``extra``, as a trainer's would. The server is a private
Redis-compatible server on loopback TCP (append-only file on, fsync every
second: the embedded default's durability).

Run: ``python -m bench.bench_commit [--steps 200] [--voters 64,256,1024]``
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import threading
import time

import redis

from consistency.index import Index
from consistency.twophase import StepProtocol
from tierstore.embedded import server_binary

__all__ = ["main"]


def _objects(rank: int, step: int) -> list[dict]:
    return [{"key": f"bench/layer{i}/{step}/{rank}", "kind": "full", "size": 1 << 24,
             "checksum": "0123456789abcdef0123456789abcdef", "base": None, "target": None, "tiers": ["host"]}
            for i in range(4)]


def _server(workdir: str) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir,
                             "--appendonly", "yes", "--appendfsync", "everysec", "--save", ""],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(300):
        try:
            redis.Redis.from_url(url).ping()
            return proc, url
        except redis.exceptions.ConnectionError:
            time.sleep(0.02)
    raise RuntimeError("bench redis server did not start")


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def bench_ranks(url: str, ranks: int, steps: int) -> list[float]:
    """Per step: the slowest rank's vote-to-committed time (seconds)."""
    protos = [StepProtocol(Index(url)) for _ in range(ranks)]
    model = f"r{ranks}"
    barrier = threading.Barrier(ranks)
    lat: dict[int, list[float]] = {s: [] for s in range(steps)}

    def run(rank: int) -> None:
        sp = protos[rank]
        for step in range(steps):
            if rank == 0:
                sp.begin(model, step, ranks)
            barrier.wait()
            t0 = time.perf_counter()
            state = sp.vote(model, step, rank, _objects(rank, step), extra={"rank": rank}, world_size=ranks)
            if state != "committed":
                state = sp.wait(model, step, timeout=30)
            lat[step].append(time.perf_counter() - t0)
            assert state == "committed", state
            barrier.wait()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for sp in protos:
        sp.index.close()
    return [max(v) for v in lat.values()][1:]  # the first step warms the script cache


def _rank_proc(url: str, ranks: int, rank: int, steps: int, barrier, out) -> None:
    sp = StepProtocol(Index(url))
    model = f"p{ranks}"
    lat = []
    for step in range(steps):
        if rank == 0:
            sp.begin(model, step, ranks)
        barrier.wait()
        t0 = time.perf_counter()
        state = sp.vote(model, step, rank, _objects(rank, step), extra={"rank": rank}, world_size=ranks)
        if state != "committed":
            state = sp.wait(model, step, timeout=30)
        lat.append(time.perf_counter() - t0)
        assert state == "committed", state
    out.put((rank, lat))


def bench_rank_procs(url: str, ranks: int, steps: int) -> list[float]:
    """As :func:`bench_ranks`, with one process per rank (forked)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=_rank_proc, args=(url, ranks, r, steps, barrier, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    per_rank = dict(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join()
    return [max(per_rank[r][s] for r in range(ranks)) for s in range(1, steps)]


def bench_voters(url: str, voters: int, rounds: int, clients: int = 8) -> tuple[list[float], list[float]]:
    """Per round: (last vote's latency, first vote sent to committed), seconds."""
    protos = [StepProtocol(Index(url)) for _ in range(clients)]
    model = f"v{voters}"
    last, round_t = [], []
    for step in range(rounds + 1):
        protos[0].begin(model, step, voters)
        barrier = threading.Barrier(clients + 1)
        t_first = [0.0]

        def send(c: int, step: int = step, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            for rank in range(c, voters - 1, clients):
                protos[c].vote(model, step, rank, _objects(rank, step), extra={"rank": rank}, world_size=voters)

        threads = [threading.Thread(target=send, args=(c,)) for c in range(clients)]
        for t in threads:
            t.start()
        t_first[0] = time.perf_counter()
        barrier.wait()
        for t in threads:
            t.join()
        t0 = time.perf_counter()
        state = protos[0].vote(model, step, voters - 1, _objects(voters - 1, step), extra={"rank": voters - 1},
                               world_size=voters)
        t1 = time.perf_counter()
        assert state == "committed", state
        if step:
            last.append(t1 - t0)
            round_t.append(t1 - t_first[0])
    for sp in protos:
        sp.index.close()
    return last, round_t


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="steps measured for the rank runs")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--voters", default="64,256,1024")
    ap.add_argument("--rounds", type=int, default=30, help="rounds per simulated voter count")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        proc, url = _server(d)
        try:
            rows = []
            lat = bench_ranks(url, a.ranks, a.steps + 1)
            rows.append((f"{a.ranks} ranks (threads, own clients)", len(lat), lat, None))
            lat = bench_rank_procs(url, a.ranks, a.steps + 1)
            rows.append((f"{a.ranks} ranks (processes)", len(lat), lat, None))
            for n in [int(x) for x in a.voters.split(",") if x]:
                last, rnd = bench_voters(url, n, a.rounds)
                rows.append((f"{n} simulated voters", len(last), last, rnd))
        finally:
            proc.terminate()
            proc.wait(10)
    print("| workload | samples | vote→committed p50 | p99 | round (first vote→committed) p50 | p99 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, n, lat, rnd in rows:
        r = f"{_pct(rnd, 50) * 1e3:.2f} ms | {_pct(rnd, 99) * 1e3:.2f} ms" if rnd else "— | —"
        print(f"| {name} | {n} | {_pct(lat, 50) * 1e3:.2f} ms | {_pct(lat, 99) * 1e3:.2f} ms | {r} |")


if __name__ == "__main__":
    main()
