"""A DCP save and load on tierstore beside DCP's FileSystemWriter/Reader on /dev/shm, in one process, one run.

Each round saves the same state dict (``--mib`` MiB in 8 float32 tensors, plus a non-tensor value) once with
``TierStoreWriter`` (a new step; the claim, one object, the metadata, two votes) and once with
``FileSystemWriter`` (a new directory in /dev/shm), alternating which goes first, then loads each back into
preallocated tensors. Reported: the median and best milliseconds of each, and tierstore / FileSystem ratios.
The store is the embedded default with no durable tier (the commit path, without background migration).

Run: ``python -m bench.bench_dcp_writer [--mib 64] [--rounds 12]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

__all__ = ["main"]


def _state(mib: int) -> dict:
    n = mib * (1 << 20) // 4 // 8
    g = torch.Generator().manual_seed(0)
    return {**{f"layer{i}.weight": torch.randn(n, generator=g) for i in range(8)}, "step": 7, "note": "bench"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=12)
    a = ap.parse_args(argv)

    import tierstore
    from tierstore.embedded import stop_server
    from tierstore.interop import dcp as tsdcp
    from tierstore.interop.dcp import TierStoreReader, TierStoreWriter

    torch.set_num_threads(1)
    home = Path(tempfile.mkdtemp(prefix="bench-dcp-writer-"))
    shm = Path(tempfile.mkdtemp(prefix="bench-dcp-fs-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    store = tierstore.open(home, durable="none")
    sd = _state(a.mib)
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else type(v)() for k, v in sd.items()}
    t: dict[str, list[float]] = {"ts_save": [], "fs_save": [], "ts_load": [], "fs_load": []}

    def timed(name: str, fn) -> None:
        t0 = time.perf_counter()
        fn()
        t[name].append((time.perf_counter() - t0) * 1e3)

    try:
        for i in range(a.rounds + 1):  # round 0 warms both up and is not counted
            legs = [("ts_save", lambda i=i: tsdcp.save(sd, TierStoreWriter(store, "bench", step=i), no_dist=True)),
                    ("fs_save", lambda i=i: dcp.save(sd, storage_writer=dcp.FileSystemWriter(shm / str(i)),
                                                     no_dist=True))]
            for name, fn in legs if i % 2 == 0 else legs[::-1]:
                timed(name, fn)
            timed("ts_load", lambda i=i: tsdcp.load(target, TierStoreReader(store, "bench", i), no_dist=True))
            timed("fs_load", lambda i=i: dcp.load(target, storage_reader=dcp.FileSystemReader(shm / str(i)),
                                                  no_dist=True))
            shutil.rmtree(shm / str(i))
            if i == 0:
                for v in t.values():
                    v.clear()
    finally:
        store.close()
        stop_server(home)  # the embedded index server this run started
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in t.items()}
    out = {"mib": a.mib, "rounds": a.rounds,
           **{f"{k}_ms": round(med[k], 2) for k in t}, **{f"{k}_best_ms": round(min(v), 2) for k, v in t.items()},
           "save_ratio": round(med["ts_save"] / med["fs_save"], 3), "load_ratio": round(med["ts_load"] / med["fs_load"], 3)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
