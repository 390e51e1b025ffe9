"""The bound of a verified restore on this machine: a copy, against the ways to hash the same bytes with it.

    python -m bench.bench_verify_bound [--gib 1.0] [--repeats 5] [--span-mib 1]

One process, one buffer of ``--gib`` random bytes (the stored copy, as a host-tier segment: anonymous shared
memory) and one pre-allocated destination tensor; each round runs every variant once, alternating:

- ``copy``: ``torch`` ``copy_`` of the whole buffer (the benchmarks' ``copy`` bound);
- ``copy, memcpy by span``: ``memoryview`` slice assignment, ``--span-mib`` at a time;
- ``hash then copy, one pass``: xxh3-128 of a span, then its copy while it is in the cache (the verified
  read path, :func:`tierstore.codec.read._verify_and_copy`);
- ``hash then torch copy_, 8 spans at a time``: the same with torch's copy (its threads) of 8 spans;
- ``copy, then hash``: the copy, then a second pass hashing the source (a deferred verification after the
  copies);
- ``hash on a second thread, one span ahead``: a thread hashes span ``k + 1`` while this one copies span ``k``
  (the source then comes from the cache for the copy): what a free core buys.

Prints the median of each and its ratio to ``copy``. Nothing is asserted: figures, not tests. Where the two
cores share the memory bandwidth, a second thread buys nothing: the one pass is the bound of a verified read.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import xxhash


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--span-mib", type=float, default=1.0)
    a = p.parse_args(argv)
    n = int(a.gib * 2**30)
    span = int(a.span_mib * 2**20)
    m = mmap.mmap(-1, n)
    src = torch.frombuffer(m, dtype=torch.uint8)
    src.random_(0, 256)
    mv = memoryview(m)
    dst = torch.empty(n, dtype=torch.uint8)
    dst.fill_(0)  # faulted in: the bound copies into pre-allocated, touched memory
    dmv = memoryview(dst.numpy())
    digest = xxhash.xxh3_128_digest
    pool = ThreadPoolExecutor(1)

    def copy() -> None:
        dst.copy_(src)

    def memcpy() -> None:
        for o in range(0, n, span):
            dmv[o:o + span] = mv[o:o + span]

    def one_pass() -> None:
        for o in range(0, n, span):
            digest(mv[o:o + span])
            dmv[o:o + span] = mv[o:o + span]

    def one_pass_torch() -> None:
        for o in range(0, n, 8 * span):
            digest(mv[o:o + 8 * span])
            dst[o:o + 8 * span].copy_(src[o:o + 8 * span])

    def copy_then_hash() -> None:
        dst.copy_(src)
        for o in range(0, n, span):
            digest(mv[o:o + span])

    def ahead() -> None:
        d, s = dst.numpy(), np.frombuffer(mv, dtype=np.uint8)
        fut = pool.submit(digest, mv[0:span])
        for o in range(0, n, span):
            fut.result()
            if o + span < n:
                fut = pool.submit(digest, mv[o + span:o + 2 * span])
            np.copyto(d[o:o + span], s[o:o + span])  # numpy releases the GIL for the copy

    variants: dict[str, Callable[[], None]] = {
        "copy": copy, "copy, memcpy by span": memcpy, "hash then copy, one pass": one_pass,
        "hash then torch copy_, 8 spans at a time": one_pass_torch,
        "copy, then hash": copy_then_hash, "hash on a second thread, one span ahead": ahead}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(a.repeats + 1):
        for name, fn in variants.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    pool.shutdown()
    base = statistics.median(times["copy"][1:])
    print(f"{a.gib} GiB, spans of {a.span_mib} MiB, {torch.get_num_threads()} torch threads, medians of "
          f"{a.repeats} (the first round warms up)")
    print("| variant | ms | x copy |\n| --- | --- | --- |")
    for name, xs in times.items():
        med = statistics.median(xs[1:])
        print(f"| {name} | {med * 1e3:.0f} | {med / base:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
