"""gc cannot break a live trainer: ``tierstore admin gc`` run beside a differential (and a layer-wise)
trainer never deletes what the trainer's next delta or layer-wise step reads, so every step the trainer
reports committed restores, bitwise; ``--keep-last 0`` is refused."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tierstore.train.checkpointer import Checkpointer
from tierstore.train.policies import differential, layerwise

ROOT = Path(__file__).resolve().parents[1]


def _admin(redis_url: str, durable: Path, host_root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierstore.cli", "admin", "--redis", redis_url, "--durable",
                           f"file://{durable}", "--host-root", str(host_root), "--json", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_keep_last_zero_is_refused(store, tmp_path, redis_url, shm_root):
    torch.manual_seed(0)
    ck = Checkpointer(store, "gz", torch.nn.Linear(4, 4), keep_last=None)
    ck.restore()
    ck.save(0)
    ck.wait()
    ck.close()
    p = _admin(redis_url, tmp_path / "durable", shm_root / "node0", "gc", "gz", "--keep-last", "0", "--yes")
    assert p.returncode == 2 and "at least" in p.stderr.lower() or ">= 1" in p.stderr, p.stderr
    assert store.list("gz")  # nothing was deleted


@pytest.mark.parametrize("policy", [lambda: differential(base_every=4, payoff=None),
                                    lambda: layerwise(tau=0.05, max_staleness=3)], ids=["differential", "layerwise"])
def test_admin_gc_beside_a_live_trainer_never_breaks_a_committed_step(store, tmp_path, redis_url, shm_root,
                                                                      policy):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    ck = Checkpointer(store, "glive", net, opt, policy=policy(), keep_last=2)
    ck.restore()
    saved: dict[int, dict[str, torch.Tensor]] = {}
    stop = threading.Event()
    runs: list[subprocess.CompletedProcess] = []

    def operator():
        while not stop.is_set():
            runs.append(_admin(redis_url, tmp_path / "durable", shm_root / "node0", "gc", "glive",
                               "--keep-last", "1", "--yes"))

    t = threading.Thread(target=operator)
    t.start()
    try:
        g = torch.Generator().manual_seed(1)
        for s in range(16):
            opt.zero_grad()
            net(torch.randn(8, 16, generator=g)).square().mean().backward()
            opt.step()
            ck.save(s)
            assert ck.wait() == "committed"
            saved[s] = {k: v.clone() for k, v in net.state_dict().items()}
    finally:
        stop.set()
        t.join()
    assert runs and all(r.returncode == 0 for r in runs), [r.stderr for r in runs if r.returncode]
    assert any(json.loads(r.stdout).get("deleted") for r in runs)  # it did collect, beside the trainer
    ck.close()
    store.flush()
    committed = [s for s, st in store.steps.steps("glive") if st in ("committed", "durable")]
    assert committed and committed[-1] == 15
    for s in committed:  # every step the index still reports restores, bitwise (within a layer-wise bound)
        net2 = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
        ck2 = Checkpointer(store, "glive", net2, policy=policy(), keep_last=None)
        got, _ = ck2.restore(step=s, read_only=True, only=["model"])
        assert got == s
        for k, v in net2.state_dict().items():
            assert any(torch.equal(v, saved[v_s][k]) for v_s in range(max(0, s - 3), s + 1)), (s, k)
        ck2.close()
