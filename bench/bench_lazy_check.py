"""The lazy save's stall with and without the fingerprint check (``StoreConfig.lazy_check``), against the copy bound.

One process, the workload of ``tierstore bench`` in small: ``--layers`` layers of one parameter and its AdamW state
(``step``, ``exp_avg``, ``exp_avg_sq``), ``--size-gib`` in all, saved by ``Checkpointer(lazy=True)`` (exact policy,
``keep_last=1``, host tier, no durable tier). Each round: ``save(step)``, a stand-in forward/backward
(``--fwd-bwd-s`` of sleep, during which the copy runs), ``optimizer.step()`` (no gradients: only the pre-hooks, the
gate), ``wait()``. The stall is the trainer's time in ``save()`` plus its wait at the gate
(``ckpt.stats.save_s + wait_s``); the bound is a ``copy_`` of every tensor into preallocated memory. Also the time of
one :class:`~tierstore.train.lazy.Fingerprint` take alone (what the check adds at ``save()``).

    PYTHONPATH=. python bench/bench_lazy_check.py --size-gib 0.25 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch import nn

import tierstore
from tierstore.home import purge
from tierstore.train.checkpointer import Checkpointer
from tierstore.train.lazy import Fingerprint
from tierstore.train.policies import exact


def _workload(size_gib: float, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    n = int(size_gib * (1 << 30) / 4 / 3 / layers)  # param + exp_avg + exp_avg_sq, float32
    root = nn.Module()
    params = []
    for i in range(layers):
        sub = nn.Module()
        sub.param = nn.Parameter(torch.randn(n))
        root.add_module(f"l{i}", sub)
        params.append(sub.param)
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n)}
    return root, opt


def _bound(tensors: list[torch.Tensor], rounds: int) -> float:
    dst = [torch.empty_like(t) for t in tensors]
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for d, t in zip(dst, tensors):
            d.copy_(t)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=0.25)
    ap.add_argument("--layers", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fwd-bwd-s", type=float, default=0.5)
    ap.add_argument("--checks", default="off,sample,full")
    a = ap.parse_args()
    torch.manual_seed(0)
    module, opt = _workload(a.size_gib, a.layers)
    tensors = [*module.parameters(), *(v for s in opt.state.values() for v in s.values())]
    bound = _bound(tensors, a.rounds)
    print(f"{len(tensors)} tensors, {sum(t.numel() * t.element_size() for t in tensors) / (1 << 30):.3f} GiB; "
          f"copy bound {bound * 1e3:.1f} ms")
    versions = [("l", str(i), t, t._version) for i, t in enumerate(tensors)]
    with tempfile.TemporaryDirectory() as home:
        for check in a.checks.split(","):
            takes = []
            if check != "off":
                for _ in range(a.rounds):
                    t0 = time.perf_counter()
                    Fingerprint(versions, check).take()
                    takes.append(time.perf_counter() - t0)
            store = tierstore.open(f"{home}/{check}", durable="none", device_tier="off", lazy_check=check)
            ck = Checkpointer(store, f"lazycheck-{check}", module, opt, policy=exact(), keep_last=1, lazy=True,
                              layer_fn=lambda n: n.split(".", 1)[0])
            stalls = []
            try:
                for step in range(a.rounds + 1):
                    before = ck.stats.save_s + ck.stats.wait_s
                    ck.save(step)
                    time.sleep(a.fwd_bwd_s)  # the stand-in forward/backward: the copy runs meanwhile
                    opt.step()  # no gradients: the pre-hooks (the gate) run, nothing changes
                    stall = ck.stats.save_s + ck.stats.wait_s - before
                    assert ck.wait() == "committed"
                    if step:  # the first round warms the host tier up
                        stalls.append(stall)
            finally:
                ck.close()
                store.close()
                purge(f"{home}/{check}")  # the embedded index server stays after close(), and the host tier
            take = f"; one take {statistics.median(takes) * 1e3:.2f} ms ({statistics.median(takes) / bound:.3f}x)" \
                if takes else ""
            print(f"lazy_check={check}: stall median {statistics.median(stalls) * 1e3:.1f} ms "
                  f"({statistics.median(stalls) / bound:.3f}x the bound), max {max(stalls) / bound:.3f}x{take}")


if __name__ == "__main__":
    main()
