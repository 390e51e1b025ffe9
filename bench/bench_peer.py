"""Peer tier throughput against raw ucxx, and device-tier snapshot stall against a bare ``copy_``.

Run: ``python bench/bench_peer.py [--mib 256] [--reps 5] [--snap-mib 512]``

* peer put/get: :class:`backends.peer.PeerBackend` (replication 1) to one agent
  subprocess (host tier in /dev/shm), against raw ucxx of the same bytes to a
  bare receiver subprocess (pre-allocated, pre-faulted buffer), in the same
  run, alternating. Two transports, each with its own bound:

  - ``tcp``: the listener's endpoint (loopback TCP); PeerBackend with ``shm=False``.
  - ``shm``: endpoints from worker addresses with error handling off (UCX's
    shared-memory transports); PeerBackend's same-host lane (``shm=True``),
    which carries the agent's replies and get payloads (puts go over TCP
    either way, so only the ``tcp`` rows measure puts).

  Puts are steady state, as in training: each rep writes new names and the
  previous rep's objects were deleted (into the agent's pool) more than the
  pool's grace period before, so a put lands in a pooled, mapped segment.
  ``get(out=)`` receives into a caller's pre-faulted buffer; ``get(out=host
  reservation)`` into a reservation of the reader's own host tier (a pooled,
  mapped segment of the size, reused every rep), committed after: the read
  that also promotes the object to the local host tier on restore.
* trailer check: :meth:`backends.peer.PeerBackend.tail` of the last 16 bytes
  (one ``TAIL`` exchange), against the whole-object ``GET`` it did before
  (``Backend.tail``), in the same rounds.
* ranged read: :meth:`backends.peer.PeerBackend.get_range` of 1 MiB from the
  middle of the copy (one ``RANGE`` exchange: a resharded restore's slice),
  against the whole-object ``GET`` and slice it did before
  (``Backend.get_range``), in the same rounds.
* device snapshot: :meth:`backends.device.DeviceBackend.snapshot` against a
  bare ``copy_`` into pre-allocated tensors of the same sizes (the bound).

Medians with min-max, GB/s, and the throughput ratio to the raw bound of the
same transport (``x raw``: 1.00 = as fast as raw ucxx). Rows a PeerBackend
without ``shm``/``out`` (an older checkout) cannot run are skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from backends.ucx_util import import_ucxx, ucx_loop  # noqa: E402  (the repository on the path first)

_HELLO = 4096


def _raw_server(nbytes: int, mode: str) -> None:
    """Receive ``nbytes`` and ack (op 1), or send ``nbytes`` (op 2), forever; over TCP or shared memory."""
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
            except Exception:  # noqa: BLE001  the client hung up: this connection's loop ends, the server stays
                return

        if mode == "tcp":
            lst = ucxx.create_listener(handle, port=0)
            print(f"port={lst.port}", flush=True)
            await asyncio.Event().wait()
        print(f"addr={bytes(ucxx.get_worker_address()).hex()}", flush=True)
        hello = bytearray(_HELLO)
        await ucxx.recv(hello, tag=1)
        n = int.from_bytes(hello[:4], "little")
        ep = await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(bytes(hello[4:4 + n])),
                                                            endpoint_error_handling=False)
        op = bytearray(1)
        while True:
            await ucxx.recv(op, tag=3)
            if op[0] == 1:
                await ucxx.recv(buf, tag=4)
                await ep.send(bytearray(1), tag=5, force_tag=True)
            else:
                await ep.send(buf, tag=6, force_tag=True)

    asyncio.run(main())


class _Raw:
    """The client side of :func:`_raw_server`: ``put(data)`` and ``get(sink)`` coroutines."""

    def __init__(self, nbytes: int, mode: str, run) -> None:
        self.ucxx = import_ucxx()
        self.mode = mode
        self.proc = subprocess.Popen([sys.executable, __file__, "--raw-server", str(nbytes), "--raw-mode", mode],
                                     stdout=subprocess.PIPE)
        line = self.proc.stdout.readline().decode().strip()
        if mode == "tcp":
            self.ep = run(self.ucxx.create_endpoint("127.0.0.1", int(line.split("=")[1])))
        else:
            addr = self.ucxx.get_ucx_address_from_buffer(bytes.fromhex(line.split("=")[1]))
            self.ep = run(self.ucxx.create_endpoint_from_worker_address(addr, endpoint_error_handling=False))
            mine = bytes(self.ucxx.get_worker_address())
            hello = bytearray(_HELLO)
            hello[:4 + len(mine)] = len(mine).to_bytes(4, "little") + mine
            run(self.ep.send(hello, tag=1, force_tag=True))

    async def put(self, data) -> None:
        if self.mode == "tcp":
            await self.ep.send(bytearray(b"\x01"))
            await self.ep.send(data)
            await self.ep.recv(bytearray(1))
        else:
            await self.ep.send(bytearray(b"\x01"), tag=3, force_tag=True)
            await self.ep.send(data, tag=4, force_tag=True)
            await self.ep.recv(bytearray(1), tag=5, force_tag=True)

    async def get(self, sink) -> None:
        if self.mode == "tcp":
            await self.ep.send(bytearray(b"\x02"))
            await self.ep.recv(sink)
        else:
            await self.ep.send(bytearray(b"\x02"), tag=3, force_tag=True)
            await self.ep.recv(sink, tag=6, force_tag=True)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _stats(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1e3:8.1f} ms (min {min(xs) * 1e3:.1f}, max {max(xs) * 1e3:.1f})"


def _gbps(nbytes: int, xs: list[float]) -> float:
    return nbytes / statistics.median(xs) / 1e9


def bench_peer(mib: int, reps: int) -> None:
    from backends.base import Backend
    from backends.peer import PeerBackend
    from tests._agents import AgentCluster

    nbytes = mib << 20
    data = bytearray(os.urandom(1 << 20) * mib)
    loop = ucx_loop()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(600)

    from backends.host import HostBackend

    has_shm = "shm" in inspect.signature(PeerBackend.__init__).parameters
    has_out = "out" in inspect.signature(PeerBackend.get).parameters
    has_tail = "tail" in PeerBackend.__dict__  # an older checkout's peer tier read the whole object
    has_range = "get_range" in PeerBackend.__dict__  # likewise for a range
    modes = ["tcp", "shm"] if has_shm else ["tcp"]
    raws = {m: _Raw(nbytes, m, run) for m in modes}
    cluster = AgentCluster(1)
    try:
        host = HostBackend(cluster.base / "reader")  # the reading node's own host tier
        sink = bytearray(nbytes)
        out = bytearray(nbytes)  # the caller's buffer for get(out=): pre-faulted like the raw sink
        peers = {}
        for m in modes:
            for v in (True, False):
                kw = {"shm": m == "shm"} if has_shm else {}
                peers[m, v] = PeerBackend(cluster.addresses, secret=cluster.secret, verify=v, **kw)
        t: dict[str, list[float]] = {}

        def timed(key: str, fn, keep: bool) -> None:
            t0 = time.perf_counter()
            res = fn()
            dt = time.perf_counter() - t0
            if key.startswith(("get", "raw_get")) and not key.startswith("raw"):
                assert res is not None and res.nbytes == nbytes
            del res
            if keep:
                t.setdefault(key, []).append(dt)

        for i in range(reps + 1):  # the first round warms connections, pages and the agent's pool; dropped
            keep = i > 0
            for m in modes:
                timed(f"raw_put_{m}", lambda m=m: run(raws[m].put(data)), keep)
                for v in (True, False):
                    put_key = f"put_{m}_{'v' if v else 'nv'}" if m == "tcp" else "warm"  # lane puts are tcp puts
                    timed(put_key, lambda m=m, v=v: peers[m, v].put(f"bench/{m}{v}/{i}", data), keep)
                timed(f"raw_get_{m}", lambda m=m: run(raws[m].get(sink)), keep)
                for v in (True, False):
                    name = f"bench/{m}{v}/{i}"
                    timed(f"get_{m}_{'v' if v else 'nv'}", lambda m=m, v=v, name=name: peers[m, v].get(name), keep)
                    if has_out:
                        timed(f"getout_{m}_{'v' if v else 'nv'}",
                              lambda m=m, v=v, name=name: peers[m, v].get(name, out=out), keep)
                if has_tail:  # a trailer check (resolve's, of a copy held by a peer): TAIL, and the GET it was
                    name = f"bench/{m}True/{i}"
                    timed(f"tail_{m}", lambda m=m, name=name: peers[m, True].tail(name, 16), keep)
                    timed(f"tailget_{m}", lambda m=m, name=name: Backend.tail(peers[m, True], name, 16), keep)
                if has_range:  # a resharded restore's slice of a copy held by a peer: RANGE, and the GET it was
                    name, mid = f"bench/{m}True/{i}", nbytes // 2
                    timed(f"range_{m}", lambda m=m, name=name: peers[m, True].get_range(name, mid, 1 << 20), keep)
                    timed(f"rangeget_{m}", lambda m=m, name=name: Backend.get_range(peers[m, True], name, mid, 1 << 20),
                          keep)
                if has_out:
                    def into_host(m=m, name=f"bench/{m}True/{i}"):
                        res = host.reserve(f"local/{m}/{i}", nbytes)
                        view = peers[m, True].get(name, out=res.buffer)
                        res.commit()
                        return view
                    timed(f"getres_{m}_v", into_host, keep)
            for m in modes:
                for v in (True, False):
                    peers[m, v].delete(f"bench/{m}{v}/{i}")
                if has_out:
                    host.delete(f"local/{m}/{i}")
            time.sleep(0.7)  # past the agent pool's grace period: the next rep's puts reuse these segments
        print(f"\n== peer tier, {mib} MiB object, {reps} reps, replication 1, loopback ==")
        for m in modes:
            for kind, label in (("put", "put"), ("get", "get"), ("getout", "get(out=)"),
                                ("getres", "get(out=host res.)")):
                bound = t[f"raw_{'put' if kind == 'put' else 'get'}_{m}"]
                if (kind == "put" and f"put_{m}_v" in t) or kind == "get":
                    raw_label = f"raw ucxx {m} {'send' if kind == 'put' else 'recv'}"
                    print(f"{raw_label:44s} {_stats(bound)}  {_gbps(nbytes, bound):5.2f} GB/s  x raw 1.00")
                if kind == "put" and f"put_{m}_v" not in t:
                    continue
                for v in ("v", "nv"):
                    key = f"{kind}_{m}_{v}"
                    if key not in t:
                        continue
                    ratio = statistics.median(bound) / statistics.median(t[key])
                    label2 = f"PeerBackend.{label} {m} ({'xxh3' if v == 'v' else 'no verify'})"
                    print(f"{label2:44s} {_stats(t[key])}  {_gbps(nbytes, t[key]):5.2f} GB/s  x raw {ratio:4.2f}")
        partial = [  # the partial reads against the whole-object GET each did before, same rounds
            (has_tail, f"trailer check of a {mib} MiB copy on a peer (16 bytes)", "tail",
             "whole object by GET (before TAIL)", "PeerBackend.tail (TAIL)"),
            (has_range, f"1 MiB from the middle of a {mib} MiB copy on a peer (a ranged read)", "range",
             "whole object by GET, sliced (before RANGE)", "PeerBackend.get_range (RANGE)"),
        ]
        for present, title, key, old_label, new_label in partial:
            if not present:
                continue
            print(f"\n== {title}, the same rounds ==")
            for m in modes:
                before, now = t[f"{key}get_{m}"], t[f"{key}_{m}"]
                print(f"{old_label + ' ' + m:44s} {_stats(before)}")
                print(f"{new_label + ' ' + m:44s} {_stats(now)}  "
                      f"{statistics.median(before) / statistics.median(now):7.0f}x faster")
        for p in peers.values():
            p.close()
        host.close()
    finally:
        cluster.close()
        for r in raws.values():
            r.close()


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
    ap.add_argument("--raw-mode", default="tcp", help=argparse.SUPPRESS)
    ap.add_argument("--skip-peer", action="store_true")
    args = ap.parse_args()
    if args.raw_server is not None:
        _raw_server(args.raw_server, args.raw_mode)
        return
    os.environ.setdefault("UCXX_LOG_LEVEL", "FATAL")
    if not args.skip_peer:
        bench_peer(args.mib, args.reps)
    bench_device(args.snap_mib, args.reps)


if __name__ == "__main__":
    main()
