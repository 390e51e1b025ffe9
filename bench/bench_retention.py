"""The Checkpointer's retention pass on one rank, by world size: its own rank's listing against every rank's.

After each save, every rank runs retention over its objects (``tierstore.train.writing.retain``). What it
reads before deciding, beside the step records:

* ``rank``: the rank listing (``ObjectIndex.list_rank_objects``, one ``ZRANGEBYLEX`` of this rank's
  members), the closure of this rank's objects of the steps in flight, and the kept steps' complete sets of
  this rank alone (``plan_retention(rank=)``); what it does since this change, wherever every link of the
  model is rank-local;
* ``world``: every rank's object names (``ZRANGE`` of the model's listing) and the closure of every rank's
  objects of the steps in flight; what it did before, and still does for a model whose links leave a rank.

Both run in the same process against the same index, alternately, on the state a save leaves: ``--layers``
objects per rank for each of 3 committed steps and a 4th in flight (each rank has written its objects and
not voted), deltas on the previous step's copy. Records only: the index is what is measured, no copy is
written. Reported per world size: the median time of the listing and of the plan (its closure reads
included), names listed, records read, and the ratio world / rank. Nothing is deleted (the plan is computed,
not carried out), so every round sees the same state. The parsed manifests are kept between passes, as the
Checkpointer keeps them (a warm-up pass fills the cache).

Run: ``python -m bench.bench_retention [--worlds 8,64,256] [--layers 50] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import tierstore
from consistency.gc import Retention, plan_retention
from tierstore.embedded import stop_server
from tierstore.keys import ShardKey

__all__ = ["main"]

M = "bench-retention"


def _populate(store, world: int, layers: int) -> None:
    index = store.index
    for step in (1, 2, 3, 4):
        store.begin_step(M, step, world)
        for rank in range(world):
            entries = [{"key": ShardKey(M, f"l{i:04d}", step, rank), "kind": "full" if step == 1 else "delta",
                        "base": None if step == 1 else ShardKey(M, f"l{i:04d}", step - 1, rank),
                        "size": 1 << 20, "checksum": "0" * 32, "tiers": ["host"]} for i in range(layers)]
            _olds, refused = index.record_objects(entries)
            if refused is not None:
                raise refused
            if step < 4:
                recs = index.get_objects([e["key"] for e in entries])
                store.vote(M, step, rank, recs)


class _Counted:
    """Counts the records read through ``get_objects`` while the plan is computed."""

    def __init__(self, index):
        self.index, self.records = index, 0
        self.get_objects = index.get_objects

    def __enter__(self):
        def counted(keys):
            self.records += len(keys)
            return self.get_objects(keys)
        self.index.get_objects = counted
        return self

    def __exit__(self, *exc):
        del self.index.get_objects


def _one(store, how: str, rank: int, cache: dict) -> tuple[float, float, int, int]:
    t0 = time.perf_counter()
    if how == "rank":
        objects, local = store.index.list_rank_objects(M, rank)
        if not local:
            raise RuntimeError(f"{M} is marked as linking across ranks: the rank listing is not what retention reads")
    else:
        objects = store.index.list_objects(M)
    t1 = time.perf_counter()
    with _Counted(store.index) as c:
        plan_retention(store.steps, M, Retention(keep_last=1), objects=objects, cache=cache,
                       rank=rank if how == "rank" else None)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, len(objects), c.records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="8,64,256", help="world sizes (comma separated)")
    ap.add_argument("--layers", type=int, default=50, help="objects per rank and step")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    print("| world | objects in the index | listing (ms): rank / world | plan (ms): rank / world "
          "| names listed: rank / world | records read: rank / world | pass: world / rank |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for world in [int(w) for w in args.worlds.split(",")]:
        home = tempfile.mkdtemp(prefix="bench-retention-")
        store = tierstore.open(home, durable="none", device_tier="off",
                               host_root=tempfile.mkdtemp(dir="/dev/shm", prefix="tierstore-bench-retention"))
        try:
            _populate(store, world, args.layers)
            got: dict[str, list[tuple[float, float, int, int]]] = {"rank": [], "world": []}
            caches: dict[str, dict] = {"rank": {}, "world": {}}
            for how in ("rank", "world"):  # the Checkpointer keeps the parsed manifests between passes
                _one(store, how, world // 2, caches[how])
            for _ in range(args.repeats):
                for how in ("rank", "world"):
                    got[how].append(_one(store, how, world // 2, caches[how]))
            med = {h: (statistics.median(g[0] for g in v) * 1e3, statistics.median(g[1] for g in v) * 1e3,
                       v[0][2], v[0][3]) for h, v in got.items()}
            r, w = med["rank"], med["world"]
            print(f"| {world} | {4 * world * args.layers:,} | {r[0]:.1f} / {w[0]:.1f} | {r[1]:.1f} / {w[1]:.1f} "
                  f"| {r[2]:,} / {w[2]:,} | {r[3]:,} / {w[3]:,} | {(w[0] + w[1]) / (r[0] + r[1]):.1f}x |",
                  flush=True)
        finally:
            store.close()
            stop_server(home)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
