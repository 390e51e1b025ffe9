"""Commit latency of the two-phase commit: vote to committed, p50/p99, beside a bare Redis round trip.

Every figure has its floor measured in the same run, against the same server, by the same harness
doing a bare round trip (``PING``) instead of the commit; the table gives both and their ratio.

* ``ranks``: R real ranks (threads with their own clients, or forked processes), each with its own
  :class:`StepProtocol`, vote for every step at once (released by a barrier); a rank's latency runs
  from its vote call to the moment it knows the step committed (its own vote's reply if it was the
  last, else :meth:`StepProtocol.wait`). The step's latency is the slowest rank's. The bare row: the
  same ranks, released the same way, each doing one ``PING``: the slowest rank's time.
* ``voters``: N simulated voters against one server, sent by 8 client threads, either one vote each
  or one :meth:`StepProtocol.vote_many` per node of 8 ranks (a node-local aggregator); reported: the
  last vote's latency (the script that counts the world and writes the manifest), the round (first
  vote sent to committed), and the index's own time per round (the server's ``EVALSHA`` time from
  ``INFO commandstats``: what the round costs the index, whatever the clients' speed).

Every vote carries 4 object entries (key, kind, size, checksum, tiers) and a
small ``extra``, as a trainer's would. The server is a private
Redis-compatible server on loopback TCP (append-only file on, fsync every
second: the embedded default's durability).

Run: ``python -m bench.bench_commit [--steps 200] [--voters 64,256,1024] [--node 8]``
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import threading
import time

import redis

from consistency.index import Index
from consistency.twophase import StepProtocol, Vote
from tierstore.embedded import server_binary
from tierstore.ports import free_port

__all__ = ["main"]


def _objects(rank: int, step: int) -> list[dict]:
    return [{"key": f"bench/layer{i}/{step}/{rank}", "kind": "full", "size": 1 << 24,
             "checksum": "0123456789abcdef0123456789abcdef", "base": None, "target": None, "tiers": ["host"]}
            for i in range(4)]


def _server(workdir: str) -> tuple[subprocess.Popen, str]:

    port = free_port()
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


def _ping_lat(url: str, n: int = 500) -> list[float]:
    """One client's bare round trips (``PING``), seconds."""
    r = redis.Redis.from_url(url)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r.ping()
        out.append(time.perf_counter() - t0)
    r.close()
    return out[50:]


def bench_ranks(url: str, ranks: int, steps: int, *, bare: bool = False) -> list[float]:
    """Per step: the slowest rank's vote-to-committed time (seconds); ``bare``: its ``PING`` instead."""
    protos = [StepProtocol(Index(url)) for _ in range(ranks)]
    model = f"r{ranks}"
    barrier = threading.Barrier(ranks)
    lat: dict[int, list[float]] = {s: [] for s in range(steps)}

    def run(rank: int) -> None:
        sp = protos[rank]
        for step in range(steps):
            if rank == 0 and not bare:
                sp.begin(model, step, ranks)
            barrier.wait()
            t0 = time.perf_counter()
            if bare:
                sp.index.ping()
                state = "committed"
            else:
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
        sp.close()
        sp.index.close()
    return [max(v) for v in lat.values()][1:]  # the first step warms the script cache


def _rank_proc(url: str, ranks: int, rank: int, steps: int, barrier, out, bare: bool) -> None:
    sp = StepProtocol(Index(url))
    model = f"p{ranks}"
    lat = []
    for step in range(steps):
        if rank == 0 and not bare:
            sp.begin(model, step, ranks)
        barrier.wait()
        t0 = time.perf_counter()
        if bare:
            sp.index.ping()
            state = "committed"
        else:
            state = sp.vote(model, step, rank, _objects(rank, step), extra={"rank": rank}, world_size=ranks)
            if state != "committed":
                state = sp.wait(model, step, timeout=30)
        lat.append(time.perf_counter() - t0)
        assert state == "committed", state
        barrier.wait()
    out.put((rank, lat))


def bench_rank_procs(url: str, ranks: int, steps: int, *, bare: bool = False) -> list[float]:
    """As :func:`bench_ranks`, with one process per rank (forked)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=_rank_proc, args=(url, ranks, r, steps, barrier, out, bare)) for r in range(ranks)]
    for p in procs:
        p.start()
    per_rank = dict(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join()
    return [max(per_rank[r][s] for r in range(ranks)) for s in range(1, steps)]


def _evalsha_usec(r: redis.Redis) -> float:
    return float(r.info("commandstats").get("cmdstat_evalsha", {}).get("usec", 0))


def bench_voters(url: str, voters: int, rounds: int, clients: int = 8,
                 node: int = 1) -> tuple[list[float], list[float], list[float]]:
    """Per round: (last vote's latency, first vote sent to committed, the server's EVALSHA time), seconds.

    ``node`` > 1: the voters are grouped in nodes of ``node`` ranks, each node one :meth:`vote_many`.
    """
    protos = [StepProtocol(Index(url)) for _ in range(clients)]
    model = f"v{voters}n{node}"
    raw = redis.Redis.from_url(url)
    groups = [list(range(i, min(i + node, voters))) for i in range(0, voters, node)]
    last, round_t, server = [], [], []
    for step in range(rounds + 1):
        protos[0].begin(model, step, voters)
        barrier = threading.Barrier(clients + 1)
        t_first = [0.0]

        def send(c: int, step: int = step, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            for g in groups[c:len(groups) - 1:clients]:
                protos[c].vote_many(model, step, [Vote(r, _objects(r, step), extra={"rank": r}) for r in g],
                                    world_size=voters)

        threads = [threading.Thread(target=send, args=(c,)) for c in range(clients)]
        for t in threads:
            t.start()
        u0 = _evalsha_usec(raw)
        t_first[0] = time.perf_counter()
        barrier.wait()
        for t in threads:
            t.join()
        t0 = time.perf_counter()
        state = protos[0].vote_many(model, step, [Vote(r, _objects(r, step), extra={"rank": r}) for r in groups[-1]],
                                    world_size=voters)
        t1 = time.perf_counter()
        u1 = _evalsha_usec(raw)
        assert state == "committed", state
        if step:
            last.append(t1 - t0)
            round_t.append(t1 - t_first[0])
            server.append((u1 - u0) / 1e6)
    for sp in protos:
        sp.close()
        sp.index.close()
    raw.close()
    return last, round_t, server


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="steps measured for the rank runs")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--voters", default="64,256,1024")
    ap.add_argument("--node", type=int, default=8, help="ranks per node for the aggregated voter rows (0: none)")
    ap.add_argument("--rounds", type=int, default=30, help="rounds per simulated voter count")
    a = ap.parse_args(argv)
    ms = 1e3
    with tempfile.TemporaryDirectory() as d:
        proc, url = _server(d)
        try:
            ping = _ping_lat(url)
            rows = []  # (workload, samples, latencies, bare latencies or None, round, server)
            for name, fn in ((f"{a.ranks} ranks (threads, own clients)", bench_ranks),
                             (f"{a.ranks} ranks (processes)", bench_rank_procs)):
                bare = fn(url, a.ranks, a.steps + 1, bare=True)
                lat = fn(url, a.ranks, a.steps + 1)
                rows.append((name, len(lat), lat, bare, None, None))
            for n in [int(x) for x in a.voters.split(",") if x]:
                for node in sorted({1, a.node} - {0}):
                    last, rnd, srv = bench_voters(url, n, a.rounds, node=node)
                    what = f"{n} simulated voters" + (f", one vote per node of {node}" if node > 1 else "")
                    rows.append((what, len(last), last, None, rnd, srv))
        finally:
            proc.terminate()
            proc.wait(10)
    p50 = _pct(ping, 50)
    print(f"bare round trip (one client, PING): p50 {p50 * ms:.3f} ms, p99 {_pct(ping, 99) * ms:.3f} ms")
    print()
    print("| workload | samples | vote→committed p50 | p99 | same ranks, bare PING p50 | ratio | "
          "round (first vote→committed) p50 | p99 | index EVALSHA time per round p50 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, n, lat, bare, rnd, srv in rows:
        b = f"{_pct(bare, 50) * ms:.2f} ms | {_pct(lat, 50) / _pct(bare, 50):.1f}x" if bare else \
            f"{p50 * ms:.3f} ms (one client) | {_pct(lat, 50) / p50:.0f}x"
        r = f"{_pct(rnd, 50) * ms:.2f} ms | {_pct(rnd, 99) * ms:.2f} ms | {_pct(srv, 50) * ms:.2f} ms" if rnd \
            else "— | — | —"
        print(f"| {name} | {n} | {_pct(lat, 50) * ms:.2f} ms | {_pct(lat, 99) * ms:.2f} ms | {b} | {r} |")


if __name__ == "__main__":
    main()
