"""Host-tier put/get throughput next to the physical limit and torch.save, in one run, with where the stall goes.

    python -m bench.bench_host [--gib 1.0] [--layers 20] [--tensors 10] [--repeats 5] [--ranks 1] [--threads T]

Systems, alternated round-robin each repeat, same bytes, every rank at once
(``--ranks`` processes, a barrier before each timed part, as ``tierstore bench``
runs them; torch threads per rank: ``--threads``, default CPUs // ranks):

- ``copy``: ``copy_`` of every tensor into pre-allocated tensors (the bound);
- ``put``: ``store.snapshot`` of each layer (the stall: one copy straight into
  the shared-memory object) and ``finish()`` (checksum, publish, index);
  the previous step's objects are deleted so their segments are reused;
- ``get``: ``store.get(key, out=...)`` of every layer into pre-allocated tensors
  (checksum verified, then one copy);
- ``torch.save``: of the whole state to ``/dev/shm``, and ``torch.load`` back
  (``weights_only=True``).

The put stall is split into its parts (summed over the layers of a round):
``reserve`` (claiming and mapping a pooled segment), ``write`` (the copy into
it, header included), the rest (plan, key, metadata), and the minor page
faults taken during the stall. Prints a markdown table of medians (min–max,
slowest rank per round) and ratios to ``copy``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tierstore.ports import free_port

KEYS = ("copy", "put stall", "  reserve", "  write", "  other", "put committed", "get", "torch.save", "torch.load")


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.0f} ms ({min(xs) * 1e3:.0f}–{max(xs) * 1e3:.0f})"


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _rank(rank: int, a: argparse.Namespace, port: int, tmp: str, shm: str, out: dict) -> None:
    import tierstore
    from tierstore import ShardKey
    from tierstore.codec.write import EncodePlan

    world = a.ranks
    torch.set_num_threads(a.threads or max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))
    nbytes = int(a.gib * (1 << 30))
    numel = nbytes // 4 // (a.layers * a.tensors)
    g = torch.Generator().manual_seed(rank)
    state = {f"layer{i}": {f"t{j}": torch.randn(numel, generator=g) for j in range(a.tensors)} for i in range(a.layers)}
    dst = {lay: {n: torch.empty_like(t) for n, t in ts.items()} for lay, ts in state.items()}
    total = sum(t.numel() * 4 for ts in state.values() for t in ts.values())

    if rank:
        _barrier(world)  # rank 0 starts the embedded server the ranks share
    store = tierstore.open(tmp, durable="none", host_root=os.path.join(shm, "host"))
    if not rank:
        _barrier(world)
    spent = {"reserve": 0.0, "write": 0.0}
    host_reserve = store.host.reserve
    plan_write = EncodePlan.write

    def reserve(name: str, n: int) -> Any:
        t0 = time.perf_counter()
        try:
            return host_reserve(name, n)
        finally:
            spent["reserve"] += time.perf_counter() - t0

    def write(self: Any, buf: memoryview, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        try:
            plan_write(self, buf, **kwargs)
        finally:
            spent["write"] += time.perf_counter() - t0

    store.host.reserve = reserve  # type: ignore[method-assign]
    EncodePlan.write = write  # type: ignore[method-assign]
    results: dict[str, list[float]] = {k: [] for k in KEYS}
    faults: list[int] = []
    try:
        for step in range(a.repeats + 1):
            _barrier(world)
            t0 = time.perf_counter()
            for lay, ts in state.items():
                for n, t in ts.items():
                    dst[lay][n].copy_(t)
            copy_s = time.perf_counter() - t0

            _barrier(world)
            spent["reserve"] = spent["write"] = 0.0
            f0 = _faults()
            t0 = time.perf_counter()
            pend = store.snapshot_many([(ShardKey("bench", lay, step, rank), ts, None) for lay, ts in state.items()])
            stall = time.perf_counter() - t0
            f_stall = _faults() - f0
            res_s, wr_s = spent["reserve"], spent["write"]
            for pnd in pend:
                pnd.finish()
            committed = time.perf_counter() - t0
            _barrier(world)
            if step:
                for lay in state:
                    store.delete(ShardKey("bench", lay, step - 1, rank))

            _barrier(world)
            t0 = time.perf_counter()
            for lay in state:
                store.get(ShardKey("bench", lay, step, rank), out=dst[lay])
            get_s = time.perf_counter() - t0

            path = os.path.join(shm, f"state{rank}.pt")
            _barrier(world)
            t0 = time.perf_counter()
            torch.save(state, path)
            save_s = time.perf_counter() - t0
            _barrier(world)
            t0 = time.perf_counter()
            torch.load(path, weights_only=True)
            load_s = time.perf_counter() - t0
            os.unlink(path)
            if step == 0:
                continue  # warm-up: first segments are fresh shared memory
            vals = (copy_s, stall, res_s, wr_s, stall - res_s - wr_s, committed, get_s, save_s, load_s)
            for k, v in zip(KEYS, vals):
                results[k].append(v)
            faults.append(f_stall)
    finally:
        EncodePlan.write = plan_write  # type: ignore[method-assign]
        store.close()
    out[rank] = {"results": results, "faults": faults, "total": total}
    _barrier(world)
    if world > 1:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="bytes per rank")
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--tensors", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ranks", type=int, default=1, help="processes saving at once (gloo barrier between parts)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: CPUs // ranks)")
    a = p.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="tsbench-")
    shm = tempfile.mkdtemp(prefix="tsbench-", dir="/dev/shm")
    port = free_port()
    out: dict = mp.Manager().dict() if a.ranks > 1 else {}
    try:
        if a.ranks > 1:
            mp.spawn(_rank, args=(a, port, tmp, shm, out), nprocs=a.ranks, join=True)
        else:
            _rank(0, a, port, tmp, shm, out)
    finally:
        from tierstore.embedded import stop_server  # lazy: only to stop the server the run started

        stop_server(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    ranks = [out[r] for r in range(a.ranks)]
    n = min(len(r["results"]["copy"]) for r in ranks)
    slowest = {k: [max(r["results"][k][i] for r in ranks) for i in range(n)] for k in KEYS}
    total = ranks[0]["total"]
    bound = statistics.median(slowest["copy"])
    load = os.getloadavg()[0]
    print(f"\nhost tier, {total / (1 << 30):.2f} GiB per rank in {a.layers} shards of {a.tensors} tensors, "
          f"{a.ranks} rank(s), {a.repeats} repeats, torch {torch.__version__}, {os.cpu_count()} cores, "
          f"load {load:.2f}; slowest rank per round\n")
    print("| what | time, median (min–max) | GB/s | / copy bound |")
    print("| --- | --- | --- | --- |")
    for k, xs in slowest.items():
        med = statistics.median(xs)
        rate = f"{total / med / 1e9:.2f}" if med > 0 and not k.startswith(" ") else ""
        print(f"| {k} | {_fmt(xs)} | {rate} | {med / bound:.2f} |")
    print(f"\nminor page faults during the put stall, per round: {[r['faults'] for r in ranks]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
