"""Two gloo ranks resume past a committed step that one of them cannot read, and save its number again.

Rank 1's object of step 2 is corrupted in every tier after the job stopped: rank 0 could still read step 2,
rank 1 cannot, so both ranks restore step 1 (one agreed step) and then both save step 2 at once, racing to
supersede the lost step; the new step 2 commits as one new attempt and a later restore returns it bitwise.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch

from tierstore.ports import free_port

from tests import _warm

ROOT = Path(__file__).resolve().parent.parent
M = "sup2"


def _net(rank: int) -> torch.nn.Module:
    torch.manual_seed(rank)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))


def worker(rank: int, port: int, home: str, phase: str, out: str) -> None:
    import torch.distributed as dist

    import tierstore
    from tierstore.train.checkpointer import Checkpointer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    store = tierstore.open(home)
    net = _net(rank)
    ck = Checkpointer(store, M, net, keep_last=None)
    result: dict = {}
    step, _ = ck.restore()
    result["restored"] = step
    result["fell_back"] = ck.report.fell_back
    if phase == "first":
        for s in range(3):
            with torch.no_grad():
                net[0].weight.add_(1.0)
            ck.save(s)
        result["outcome"] = ck.wait()
    elif phase == "resume":
        with torch.no_grad():
            for p in net.parameters():
                p.fill_(10.0 + rank)
        ck.save(2)  # both ranks supersede the lost step 2 at once
        ck.save(3)
        result["outcome"] = ck.wait()
    else:
        result["values"] = sorted({float(p.detach().flatten()[0]) for p in net.parameters()})
    ck.close()
    dist.barrier()
    Path(f"{out}.{rank}.json").write_text(json.dumps(result))
    store.close()
    dist.destroy_process_group()


def _run(tmp_path: Path, phase: str) -> list[dict]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = tmp_path / phase
    procs = [_warm.popen([sys.executable, "-m", "tests.test_supersede_dist", str(r), str(port),
                               str(tmp_path / "home"), phase, str(out)], cwd=ROOT, env=env) for r in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]


def test_two_ranks_resume_past_a_step_one_cannot_read(tmp_path):
    import tierstore
    from tests._tiers import flip_everywhere

    first = _run(tmp_path, "first")
    assert all(r["outcome"] in ("committed", "durable") for r in first)
    store = tierstore.open(tmp_path / "home")
    try:
        store.flush()
        key = next(info.key for info in store.resolve(M, step=2).objects.values() if info.key.rank == 1)
        flip_everywhere(store, key)  # one byte flipped in every tier that holds rank 1's object of step 2
    finally:
        store.close()

    resumed = _run(tmp_path, "resume")
    assert [(r["restored"], r["fell_back"]) for r in resumed] == [(1, True), (1, True)]
    assert all(r["outcome"] in ("committed", "durable") for r in resumed)

    store = tierstore.open(tmp_path / "home")
    try:
        (rec,) = store.steps.records(M, [2])
        assert rec.state in ("committed", "durable") and rec.attempt == 2
    finally:
        store.close()
    check = _run(tmp_path, "check")
    assert [r["restored"] for r in check] == [3, 3]
    assert [r["values"] for r in check] == [[10.0], [11.0]]


if __name__ == "__main__":
    a = sys.argv[1:]
    worker(int(a[0]), int(a[1]), a[2], a[3], a[4])
