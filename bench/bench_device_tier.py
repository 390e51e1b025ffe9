"""The device tier next to the host path: snapshot stall, drain, and rollback, in one run.

    python -m bench.bench_device_tier [--device cuda] [--gib 1.0] [--layers 16] [--repeats 5]

Per repeat, the same state (``--layers`` layers of fp32 tensors on ``--device``)
is saved through two stores on the same host tier and index:

- ``copy``: ``copy_`` of every tensor into pre-allocated tensors on the same
  device (the bound of a device snapshot);
- ``host stall`` / ``host committed``: ``device_tier="off"``: ``store.snapshot``
  of each layer (a copy into the shared-memory object: device to host on a
  GPU) and ``finish()``;
- ``device stall``: ``device_tier`` on (``cuda``, or ``cpu`` for ``--device
  cpu``): ``store.snapshot`` of each layer, then a synchronisation of the
  device, so the stall counts the device copy (the trainer's stream is fenced
  behind it); ``device drain``: the ``finish()`` of those objects (device
  buffers into the host tier, seal, publish), which a trainer runs in the
  background (``finish_async``);
- ``rollback device`` / ``rollback host``: ``store.get(key, out=...)`` of every
  layer into the model's tensors, from the device buffers and from the host tier.

Prints a markdown table of medians (min–max) and the ratio to ``copy``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from tierstore.embedded import stop_server


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f} ms ({min(xs) * 1e3:.1f}–{max(xs) * 1e3:.1f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--tensors", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)

    import tierstore
    from tierstore import ShardKey

    dev = torch.device(a.device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    numel = int(a.gib * (1 << 30)) // 4 // (a.layers * a.tensors)
    state = {f"layer{i}": {f"t{j}": torch.randn(numel, device=dev) for j in range(a.tensors)} for i in range(a.layers)}
    dst = {lay: {n: torch.empty_like(t) for n, t in ts.items()} for lay, ts in state.items()}
    total = sum(t.numel() * 4 for ts in state.values() for t in ts.values())

    tmp = tempfile.mkdtemp(prefix="tsbench-")
    shm = tempfile.mkdtemp(prefix="tsbench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    common = dict(durable="none", host_root=os.path.join(shm, "host"))
    host_store = tierstore.open(tmp, device_tier="off", **common)
    dev_store = tierstore.open(tmp, device_tier=a.device if a.device != "cuda" else "auto", **common)
    names = ("copy", "host stall", "host committed", "device stall", "device drain", "rollback device",
             "rollback host")
    results: dict[str, list[float]] = {k: [] for k in names}
    try:
        for step in range(a.repeats + 1):
            sync()
            t0 = time.perf_counter()
            for lay, ts in state.items():
                for n, t in ts.items():
                    dst[lay][n].copy_(t)
            sync()
            copy_s = time.perf_counter() - t0

            t0 = time.perf_counter()
            pend = [host_store.snapshot(ShardKey("host", lay, step, 0), ts) for lay, ts in state.items()]
            host_stall = time.perf_counter() - t0
            for pnd in pend:
                pnd.finish()
            host_committed = time.perf_counter() - t0

            sync()
            t0 = time.perf_counter()
            pend = [dev_store.snapshot(ShardKey("dev", lay, step, 0), ts) for lay, ts in state.items()]
            sync()
            dev_stall = time.perf_counter() - t0
            staged = sum(pnd.staged is not None for pnd in pend)
            t0 = time.perf_counter()
            for pnd in pend:
                pnd.finish()
            drain = time.perf_counter() - t0

            t0 = time.perf_counter()
            for lay in state:
                dev_store.get(ShardKey("dev", lay, step, 0), out=dst[lay])
            sync()
            roll_dev = time.perf_counter() - t0
            t0 = time.perf_counter()
            for lay in state:
                host_store.get(ShardKey("host", lay, step, 0), out=dst[lay])
            sync()
            roll_host = time.perf_counter() - t0
            if step:
                for lay in state:
                    host_store.delete(ShardKey("host", lay, step - 1, 0))
                    dev_store.delete(ShardKey("dev", lay, step - 1, 0))
                for k, v in zip(names, (copy_s, host_stall, host_committed, dev_stall, drain, roll_dev, roll_host)):
                    results[k].append(v)
            if staged != len(pend):
                print(f"step {step}: {len(pend) - staged} of {len(pend)} objects took the host path (no room)")
        reads = dev_store.device_tier.reads if dev_store.device_tier is not None else 0
    finally:
        dev_store.close()
        host_store.close()
        stop_server(tmp)  # the embedded index server the run started
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    bound = statistics.median(results["copy"])
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"\n{total / (1 << 30):.2f} GiB in {a.layers} layers on {a.device} ({name}), {a.repeats} repeats; "
          f"{reads} reads served by the device tier\n")
    print("| system | time | x copy |\n| --- | --- | --- |")
    for k in names:
        print(f"| {k} | {_fmt(results[k])} | {statistics.median(results[k]) / bound:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
