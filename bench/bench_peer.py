"""Peer tier throughput against raw ucxx, and device-tier snapshot stall against a bare ``copy_``.

Run: ``python bench/bench_peer.py [--mib 256] [--reps 5] [--snap-mib 512]``

* peer put/get: :class:`backends.peer.PeerBackend` (replication 1) to one agent
  subprocess (host tier in /dev/shm), against a raw ucxx send/recv of the same
  bytes to a bare receiver subprocess (pre-allocated, pre-faulted buffer), both
  over the same listener/TCP transport, alternating, in the same run.
* device snapshot: :meth:`backends.device.DeviceBackend.snapshot` against a
  bare ``copy_`` into pre-allocated tensors of the same sizes (the bound).

Medians with min-max, and ratios to the bound.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from backends.ucx_util import import_ucxx, ucx_loop


def _raw_server(nbytes: int) -> None:
    """Receive ``nbytes`` and ack (op 1), or send ``nbytes`` (op 2), forever."""
    ucxx = import_ucxx()

    async def main() -> None:
        buf = bytearray(nbytes)
        buf[:] = os.urandom(1024) * (nbytes // 1024)

        async def handle(ep):
            op = bytearray(1)
            try:
                while True:
                    await ep.recv(op)
                    if op[0] == 1:
                        await ep.recv(buf)
                        await ep.send(bytearray(1))
                    else:
                        await ep.send(buf)
            except Exception:
                pass

        lst = ucxx.create_listener(handle, port=0)
        print(f"port={lst.port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def _stats(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1e3:8.1f} ms (min {min(xs) * 1e3:.1f}, max {max(xs) * 1e3:.1f})"


def _gbps(nbytes: int, xs: list[float]) -> float:
    return nbytes / statistics.median(xs) / 1e9


def bench_peer(mib: int, reps: int) -> None:
    from backends.peer import PeerBackend
    from tests._agents import AgentCluster

    nbytes = mib << 20
    data = bytearray(os.urandom(1 << 20) * mib)
    ucxx = import_ucxx()
    loop = ucx_loop()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(600)

    raw_proc = subprocess.Popen([sys.executable, __file__, "--raw-server", str(nbytes)], stdout=subprocess.PIPE)
    cluster = AgentCluster(1)
    try:
        port = int(raw_proc.stdout.readline().decode().split("=")[1])
        ep = run(ucxx.create_endpoint("127.0.0.1", port))
        sink = bytearray(nbytes)

        async def raw_put():
            await ep.send(bytearray(b"\x01"))
            await ep.send(data)
            await ep.recv(bytearray(1))

        async def raw_get():
            await ep.send(bytearray(b"\x02"))
            await ep.recv(sink)

        peers = {v: PeerBackend(cluster.addresses, secret=cluster.secret, verify=v) for v in (True, False)}
        t = {k: [] for k in ("raw_put", "raw_get", "put", "get", "put_nv", "get_nv")}
        for i in range(reps + 1):  # the first round warms connections and pages; dropped
            for key, fn in (
                ("raw_put", lambda: run(raw_put())),
                ("put", lambda: peers[True].put("bench/obj", data)),
                ("raw_get", lambda: run(raw_get())),
                ("get", lambda: peers[True].get("bench/obj")),
                ("put_nv", lambda: peers[False].put("bench/obj", data)),
                ("get_nv", lambda: peers[False].get("bench/obj")),
            ):
                t0 = time.perf_counter()
                out = fn()
                dt = time.perf_counter() - t0
                if key.startswith("get"):
                    assert out is not None and out.nbytes == nbytes
                del out
                if i:
                    t[key].append(dt)
        print(f"\n== peer tier, {mib} MiB object, {reps} reps, replication 1, loopback TCP ==")
        for key, label in (("raw_put", "raw ucxx send"), ("put", "PeerBackend.put (xxh3 verify)"),
                           ("put_nv", "PeerBackend.put (no verify)"), ("raw_get", "raw ucxx recv"),
                           ("get", "PeerBackend.get (xxh3 verify)"), ("get_nv", "PeerBackend.get (no verify)")):
            bound = t["raw_put"] if "put" in key else t["raw_get"]
            ratio = statistics.median(t[key]) / statistics.median(bound)
            print(f"{label:32s} {_stats(t[key])}  {_gbps(nbytes, t[key]):5.2f} GB/s  ratio to raw {ratio:4.2f}")
        for p in peers.values():
            p.close()
    finally:
        cluster.close()
        raw_proc.kill()
        raw_proc.wait()


def bench_device(mib: int, reps: int, ntensors: int = 50) -> None:
    import torch

    from backends.device import DeviceBackend

    per = (mib << 20) // ntensors // 4
    state = {f"layer{i}.w": torch.randn(per) for i in range(ntensors)}
    bound_dst = {k: torch.empty_like(v) for k, v in state.items()}
    dev = DeviceBackend("cpu")
    tb, ts = [], []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        for k, v in state.items():
            bound_dst[k].copy_(v)
        dt_b = time.perf_counter() - t0
        t0 = time.perf_counter()
        snap = dev.snapshot("bench/rank0", state)
        snap.wait()
        dt_s = time.perf_counter() - t0
        snap.release()
        if i:
            tb.append(dt_b)
            ts.append(dt_s)
    print(f"\n== device tier (cpu), snapshot of {mib} MiB in {ntensors} tensors, {reps} reps ==")
    print(f"{'bare copy_ (bound)':32s} {_stats(tb)}")
    print(f"{'DeviceBackend.snapshot stall':32s} {_stats(ts)}  ratio to bound {statistics.median(ts) / statistics.median(tb):4.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--snap-mib", type=int, default=512)
    ap.add_argument("--raw-server", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--skip-peer", action="store_true")
    args = ap.parse_args()
    if args.raw_server is not None:
        _raw_server(args.raw_server)
        return
    os.environ.setdefault("UCXX_LOG_LEVEL", "FATAL")
    if not args.skip_peer:
        bench_peer(args.mib, args.reps)
    bench_device(args.snap_mib, args.reps)


if __name__ == "__main__":
    main()
