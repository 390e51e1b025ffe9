"""The Checkpointer's verified restore on one rank, its verify modes side by side, over a plain copy, in one run.

    python -m bench.bench_restore_verify [--gib 1.0] [--layers 50] [--repeats 5] [--threads 2]

The state: ``--layers`` linear layers holding ``--gib`` of float32 in all, committed once to the host tier
(embedded index, no durable tier). Each round, in one process, alternating:

- ``copy``: ``copy_`` of every tensor of the state from a clone (the bound);
- read-only restores (an evaluator's: weights only, nothing to hold back), timed until they return, verified:
  ``in_pass`` (each copy hashed as it is copied) and ``before_return`` (copied, then hashed on a thread of its
  own from the first copy on; the default where a core per local rank is free, ``restoring.core_free``);
- a writer's restore of weights and SGD momentum, timed until ``before_update()`` returns (the verdict the
  first update waits for): the hashing after the copies, or from the first copy on (the default where a core
  is free).

Prints the median of each over the median copy. Nothing is asserted: figures, not tests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

import tierstore
import tierstore.train.restore_side as restore_side
from tierstore.embedded import stop_server
from tierstore.train.checkpointer import Checkpointer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--layers", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    n = int(a.gib * 2**30 / 8 / a.layers)  # weights + momentum: half each
    net = torch.nn.Sequential(*[torch.nn.Linear(1, n, bias=False) for _ in range(a.layers)])
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for q in net.parameters():
        q.grad = torch.zeros_like(q)
    opt.step()
    tmp, shm = tempfile.mkdtemp(prefix="bench-rv-"), tempfile.mkdtemp(prefix="bench-rv-", dir="/dev/shm")
    home = os.path.join(tmp, "home")
    store = tierstore.open(home=home, host_root=os.path.join(shm, "host"), durable="none", device_tier="off")
    writer = Checkpointer(store, "rv", net, opt, keep_last=1)
    reader = Checkpointer(store, "rv", net)
    real = restore_side.read_unverified
    try:
        writer.save(1)
        assert writer.wait() == "committed"
        tensors = [*net.parameters(), *(opt.state[q]["momentum_buffer"] for q in net.parameters())]
        clones = [t.detach().clone() for t in tensors]
        times: dict[str, list[float]] = {k: [] for k in (
            "copy", "read-only, in_pass", "read-only, before_return", "writer, hashed after the copies",
            "writer, hashed from the first copy")}
        for _ in range(a.repeats):
            t = time.perf_counter()
            with torch.no_grad():
                for d, s in zip(tensors, clones):
                    d.copy_(s)
            times["copy"].append(time.perf_counter() - t)
            for mode in ("in_pass", "before_return"):
                t = time.perf_counter()
                reader.restore(read_only=True, verify=mode)
                times[f"read-only, {mode}"].append(time.perf_counter() - t)
            for label, eager in (("writer, hashed after the copies", False), ("writer, hashed from the first copy", True)):
                restore_side.read_unverified = (  # type: ignore[assignment]
                    lambda ck, res, layers, eager=False, _e=eager: real(ck, res, layers, eager=_e))
                t = time.perf_counter()
                writer.restore()
                writer.before_update()
                times[label].append(time.perf_counter() - t)
                restore_side.read_unverified = real
    finally:
        restore_side.read_unverified = real
        reader.close()
        writer.close()
        store.close()
        stop_server(home)
        shutil.rmtree(shm, ignore_errors=True)  # the host tier: 1 GiB of shared memory
        shutil.rmtree(tmp, ignore_errors=True)
    copy = statistics.median(times["copy"])
    print(f"{a.gib} GiB in {a.layers} layers (+ momentum), one rank, {a.threads} torch threads, "
          f"{os.cpu_count()} CPUs, medians of {a.repeats}")
    print("| restore | ms | × copy |\n| --- | --- | --- |")
    for k, v in times.items():
        m = statistics.median(v)
        print(f"| {k} | {m * 1e3:.0f} | {m / copy:.2f} |")


if __name__ == "__main__":
    main()
