"""The node agent under floods of tag messages nobody receives: its memory and its service, against a baseline agent.

Run: ``python bench/bench_agent_flood.py [--baseline PATH] [--mib 64] [--reps 3] [--flood-mib 80]``

Agents: this checkout's, and with ``--baseline`` another checkout's (say
``main``), in the same run, alternating, each a fresh subprocess on
loopback. Per agent and round:

* steady-state put and get of ``--mib`` objects by a
  :class:`backends.peer.PeerBackend` over TCP (``shm=False``): medians, and
  the ratio to the baseline's throughput (``x base``: 1.00 = as fast);
* a flood of ``--flood-mib`` of 4 KiB tag messages under random tags by an
  authenticated peer, twice: the agent's RSS (``/proc/<pid>/status``) before,
  at its peak during, and 3 s after the flooder left; how long the flood
  took (what the agent absorbs); the median latency of a well-behaved
  peer's 64 KiB put and get during the flood.

On a shared 2-core machine the absolute figures move with the load; read
the ratios and the memory, measured side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MIB = 1 << 20
MESSAGE = 4096
BURST = 1000


def _median_ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:8.1f} ms" if xs else "       - ms"


def _throughput(cluster, nbytes: int, reps: int) -> tuple[list[float], list[float]]:
    from backends.peer import PeerBackend

    data = os.urandom(MIB) * (nbytes // MIB)
    peer = PeerBackend(cluster.addresses, secret=cluster.secret, shm=False, timeout_s=120)
    puts: list[float] = []
    gets: list[float] = []
    try:
        for i in range(reps + 1):  # the first round warms the connection and the agent's pool; dropped
            t0 = time.perf_counter()
            peer.put(f"bench/{i}", data)
            t1 = time.perf_counter()
            assert len(peer.get(f"bench/{i}")) == nbytes
            t2 = time.perf_counter()
            if i:
                puts.append(t1 - t0)
                gets.append(t2 - t1)
                peer.delete(f"bench/{i - 1}")
    finally:
        peer.close()
    return puts, gets


def _flood(cluster, flood_bytes: int, seed: int) -> dict[str, float]:
    from backends import agent_protocol as P
    from backends.peer import PeerBackend
    from backends.ucx_util import ucx_loop
    from tests._agents import RawClient

    proc = cluster.agents[0]
    good = PeerBackend(cluster.addresses, secret=cluster.secret, shm=False, timeout_s=60)
    small = os.urandom(64 << 10)
    good.put("good/x", small)
    time.sleep(1.0)
    before = proc.rss_bytes()
    flooder = RawClient(proc.port, secret=cluster.secret)
    flooder.send(flooder.request(P.Op.PING, ""))
    assert flooder.reply().status == P.Status.OK
    rng = random.Random(seed)
    msg = bytearray(MESSAGE)

    async def burst() -> None:
        await asyncio.gather(*(flooder.ep.send(msg, tag=rng.getrandbits(63), force_tag=True) for _ in range(BURST)))

    lat: list[float] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            good.put("good/x", small)
            assert bytes(good.get("good/x")) == small
            lat.append(time.perf_counter() - t0)
            time.sleep(0.02)

    th = threading.Thread(target=serve, daemon=True)
    peak = before
    t0 = time.perf_counter()
    th.start()
    try:
        for _ in range(flood_bytes // (MESSAGE * BURST)):
            asyncio.run_coroutine_threadsafe(burst(), ucx_loop()).result(300)
            peak = max(peak, proc.rss_bytes())
    finally:
        took = time.perf_counter() - t0
        stop.set()
        th.join(60)
        flooder.close()
        good.close()
    time.sleep(3.0)
    return {"before": before / MIB, "peak": (peak - before) / MIB, "after": (proc.rss_bytes() - before) / MIB,
            "took": took, "lat": statistics.median(lat) if lat else float("nan"), "served": len(lat)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout whose agent runs alongside")
    ap.add_argument("--mib", type=int, default=64, help="object size of the put/get rounds")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--flood-mib", type=int, default=80, help="MB of 4 KiB messages per flood (two floods a round)")
    args = ap.parse_args()
    os.environ.setdefault("UCXX_LOG_LEVEL", "FATAL")
    from tests._agents import AgentCluster

    agents = {"this": REPO}
    if args.baseline is not None:
        agents["baseline"] = args.baseline.resolve()
    tput: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in agents}
    floods: dict[str, list[dict[str, float]]] = {k: [] for k in agents}
    for rnd in range(2):
        for name, repo in (agents.items() if rnd % 2 == 0 else reversed(agents.items())):
            cluster = AgentCluster(1, repo=repo)
            try:
                puts, gets = _throughput(cluster, args.mib * MIB, args.reps)
                tput[name][0].extend(puts)
                tput[name][1].extend(gets)
                for k in range(2):
                    floods[name].append(_flood(cluster, args.flood_mib * 1_000_000, 2 * rnd + k))
            finally:
                cluster.close()
    nbytes = args.mib * MIB
    print(f"\n== put/get of {args.mib} MiB over TCP, {2 * args.reps} reps per agent ==")
    for name in agents:
        puts, gets = tput[name]
        line = (f"{name:9s} put {_median_ms(puts)} ({nbytes / statistics.median(puts) / 1e9:.2f} GB/s)  "
                f"get {_median_ms(gets)} ({nbytes / statistics.median(gets) / 1e9:.2f} GB/s)")
        if name != "baseline" and "baseline" in agents:
            bp, bg = tput["baseline"]
            line += (f"  x base: put {statistics.median(bp) / statistics.median(puts):.2f}, "
                     f"get {statistics.median(bg) / statistics.median(gets):.2f}")
        print(line)
    print(f"\n== floods of {args.flood_mib} MB of 4 KiB tag messages nobody receives (4 per agent) ==")
    print("agent     RSS before  peak growth  growth 3 s after  flood took  good peer put+get 64 KiB (served)")
    for name in agents:
        for f in floods[name]:
            print(f"{name:9s} {f['before']:7.1f} MiB  {f['peak']:+8.1f} MiB  {f['after']:+13.1f} MiB  "
                  f"{f['took']:8.1f} s  {f['lat'] * 1e3:8.1f} ms ({f['served']:.0f})")


if __name__ == "__main__":
    main()
