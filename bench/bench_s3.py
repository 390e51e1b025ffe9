"""Durable-tier micro-benchmark: S3Backend (moto over HTTP, own process) and LocalFSBackend.

Run: ``python -m bench.bench_s3 [--mib 64] [--reps 3]``. Prints medians
(min-max) per put and get of one object, for a single PUT against multipart
with parallel parts, and a plain GET against parallel ranged GETs, beside the
local-directory backend (with and without fsync). moto is a functional fake,
not a performance model of S3: read the S3 rows as the client-side overhead
(no concatenation, parallel parts) on loopback, not as S3 throughput.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable

import numpy as np

from backends.localfs import LocalFSBackend
from backends.s3 import S3Backend, S3Config
from tierstore.ports import free_port

MiB = 1024 * 1024


def timeit(fn: Callable[[], object], reps: int) -> tuple[float, float, float]:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts), max(ts)


def row(label: str, t: tuple[float, float, float], nbytes: int) -> None:
    med, lo, hi = t
    print(f"{label:<46} {med * 1e3:8.1f} ms ({lo * 1e3:.1f}-{hi * 1e3:.1f})  {nbytes / med / 2**30:6.2f} GiB/s")


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("moto server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    n = args.mib * MiB
    data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    bufs = [memoryview(a) for a in np.array_split(data, 8)]  # 8 tensors, never joined
    for k, v in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}.items():
        os.environ.setdefault(k, v)
    proc, url = start_moto()
    try:
        configs = {
            "single PUT / one GET": S3Config(multipart_threshold=4 * n, part_size=4 * n),
            "multipart 8 MiB x4 / ranged GET x4": S3Config(multipart_threshold=8 * MiB, part_size=8 * MiB),
            "multipart 16 MiB x4 / ranged GET x4": S3Config(),
        }
        for label, cfg in configs.items():
            b = S3Backend("bench", endpoint_url=url, region_name="us-east-1", config=cfg)
            if label.startswith("single"):
                b.client.create_bucket(Bucket="bench")
            row(f"s3 put  {label}", timeit(lambda b=b: b.put("obj", bufs), args.reps), n)
            row(f"s3 get  {label}", timeit(lambda b=b: b.get("obj"), args.reps), n)
            b.close()
    finally:
        proc.kill()
        proc.wait()
    for fsync in (True, False):
        with tempfile.TemporaryDirectory() as d:
            b = LocalFSBackend(d, fsync=fsync)
            row(f"localfs put fsync={fsync}", timeit(lambda b=b: b.put("m/l/1/0", bufs), args.reps), n)
            row(f"localfs get fsync={fsync}", timeit(lambda b=b: b.get("m/l/1/0"), args.reps), n)


if __name__ == "__main__":
    main()
