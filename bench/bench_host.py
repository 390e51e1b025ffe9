"""Host-tier put/get throughput next to the physical limit and torch.save, in one run.

    python -m bench.bench_host [--gib 1.0] [--layers 20] [--tensors 10] [--repeats 5]

Systems, alternated round-robin each repeat, same bytes:

- ``copy``: ``copy_`` of every tensor into pre-allocated tensors (the bound);
- ``put``: ``store.snapshot`` of each layer (the stall: one copy straight into
  the shared-memory object) and ``finish()`` (checksum, publish, index);
  the previous step's objects are deleted so their segments are reused;
- ``get``: ``store.get(key, out=...)`` of every layer into pre-allocated tensors
  (checksum verified, then one copy);
- ``torch.save``: of the whole state to ``/dev/shm``, and ``torch.load`` back
  (``weights_only=True``).

Prints a markdown table of medians (min–max) and ratios to ``copy``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.0f} ms ({min(xs) * 1e3:.0f}–{max(xs) * 1e3:.0f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--tensors", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)

    import tierstore
    from tierstore import ShardKey

    nbytes = int(a.gib * (1 << 30))
    numel = nbytes // 4 // (a.layers * a.tensors)
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}": {f"t{j}": torch.randn(numel, generator=g) for j in range(a.tensors)} for i in range(a.layers)}
    dst = {lay: {n: torch.empty_like(t) for n, t in ts.items()} for lay, ts in state.items()}
    total = sum(t.numel() * 4 for ts in state.values() for t in ts.values())

    tmp = tempfile.mkdtemp(prefix="tsbench-")
    shm = tempfile.mkdtemp(prefix="tsbench-", dir="/dev/shm")
    store = tierstore.open(tmp, durable="none", host_root=os.path.join(shm, "host"))
    results: dict[str, list[float]] = {k: [] for k in ("copy", "put stall", "put committed", "get", "torch.save", "torch.load")}
    try:
        for step in range(a.repeats + 1):
            t0 = time.perf_counter()
            for lay, ts in state.items():
                for n, t in ts.items():
                    dst[lay][n].copy_(t)
            copy_s = time.perf_counter() - t0

            t0 = time.perf_counter()
            pend = [store.snapshot(ShardKey("bench", lay, step, 0), ts) for lay, ts in state.items()]
            stall = time.perf_counter() - t0
            for pnd in pend:
                pnd.finish()
            committed = time.perf_counter() - t0
            if step:
                for lay in state:
                    store.delete(ShardKey("bench", lay, step - 1, 0))

            t0 = time.perf_counter()
            for lay in state:
                store.get(ShardKey("bench", lay, step, 0), out=dst[lay])
            get_s = time.perf_counter() - t0

            path = os.path.join(shm, "state.pt")
            t0 = time.perf_counter()
            torch.save(state, path)
            save_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            torch.load(path, weights_only=True)
            load_s = time.perf_counter() - t0
            os.unlink(path)
            if step == 0:
                continue  # warm-up: first segments are fresh shared memory
            for k, v in zip(results, (copy_s, stall, committed, get_s, save_s, load_s)):
                results[k].append(v)
    finally:
        store.close()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    bound = statistics.median(results["copy"])
    print(f"\nhost tier, {total / (1 << 30):.2f} GiB in {a.layers} shards of {a.tensors} tensors, "
          f"{a.repeats} repeats, torch {torch.__version__}, {os.cpu_count()} cores\n")
    print("| what | time, median (min–max) | GB/s | / copy bound |")
    print("| --- | --- | --- | --- |")
    for k, xs in results.items():
        med = statistics.median(xs)
        print(f"| {k} | {_fmt(xs)} | {total / med / 1e9:.2f} | {med / bound:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
