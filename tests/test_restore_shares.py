"""Gloo ranks restore with each rank checking its share of the copies, and still agree on a step every
share verified.

The resolve of a collective restore checks on each rank only the copies of its own saved rank (together the
ranks check every copy once; each checking every rank's copies cost ranks x objects checks per rank). The
attack: steps 0-3 saved, then rank 0's copy of step 3 and rank 1's copy of step 2 deleted from every tier. Rank
0's share verifies up to step 2, rank 1's up to step 3 but not 2: the oldest of the newest each resolved (2)
is not one every share verified. The ranks must go on down, together, to step 1, and restore it bitwise; each
rank's resolve must have checked its own copies alone; the next save commits. On another world size (3 ranks
restoring a 2-rank checkpoint) restoring rank r checks the saved ranks s % 3 == r, and a copy lost from one
share still takes every rank to the older step.
"""

from __future__ import annotations

import json
import sys

import tierstore
from tests._ranks import run_ranks
from tests._tiers import live_name
from tests.test_restore_verify import _model, _part, _same, _save_next_and_part, _snapshot, _train_and_save
from tierstore.keys import ShardKey
from tierstore.train.checkpointer import Checkpointer


def _lose_own_copy(store, name: str, step: int, rank: int) -> None:
    """Delete ``rank``'s copy of a layer of ``step`` (host only: the store has no other tier)."""
    key = next(k for k in store.list(name, step=step) if k.layer != "_state" and k.rank == rank)
    assert store.host.delete(live_name(store, key))


def _restore_counting_checks(store, name: str):
    """A writer's restore of ``name`` into a fresh model; returns the Checkpointer, the model and optimizer,
    the step restored, and the saved ranks whose copies this rank's resolve checked (the trailer reads)."""
    checked: list[str] = []
    tail = store.host.tail
    store.host.tail = lambda obj, n: (checked.append(obj), tail(obj, n))[1]
    try:
        m, opt = _model(5)
        ck = Checkpointer(store, name, m, opt)
        step = ck.restore().step
    finally:
        store.host.tail = tail
    return ck, m, opt, step, sorted({ShardKey.parse(n.split(".")[0]).rank for n in checked})


def worker(rank: int, port: int, home: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    store = tierstore.open(home=home, durable="none")
    saved = _train_and_save(store, "shares", 4, seed=rank)
    dist.barrier()
    _lose_own_copy(store, "shares", {0: 3, 1: 2}[rank], rank)  # rank 0 its copy of step 3, rank 1 of step 2
    dist.barrier()
    ck2, m2, o2, step, checked = _restore_counting_checks(store, "shares")
    result: dict = {"restored": step, "state": _same(_snapshot(m2, o2), saved[step]), "checked": checked}
    _save_next_and_part(store, ck2, m2, o2, result, out, rank)


def elastic_worker(mode: str, rank: int, port: int, home: str, out: str) -> None:
    """``save``: 2 ranks save steps 0-3 (each its own model), then saved rank 1's copy of step 3 is deleted.
    ``load``: 3 ranks restore: restoring rank r checks the saved ranks s % 3 == r (rank 2 none)."""
    import torch
    import torch.distributed as dist

    world = 2 if mode == "save" else 3
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    store = tierstore.open(home=home, durable="none")
    result = None
    if mode == "save":
        saved = _train_and_save(store, "elastic", 4, seed=rank)
        torch.save(saved[2], f"{out}.saved2.{rank}.pt")
        dist.barrier()
        if rank == 1:
            _lose_own_copy(store, "elastic", 3, 1)
    else:
        ck2, m2, o2, step, checked = _restore_counting_checks(store, "elastic")
        want = torch.load(f"{out}.saved2.{rank % 2}.pt", weights_only=True)
        result = {"restored": step, "state": _same(_snapshot(m2, o2), want), "checked": checked}
        ck2.close()
    _part(store, out, rank, result)


def test_three_ranks_restoring_two_ranks_checkpoint_share_the_checks_and_fall_back_together(tmp_path):
    """Another world size: restoring rank r checks the saved ranks s % 3 == r, so saved rank 1's copies are
    rank 1's share alone, and its lost copy of step 3 takes every rank to step 2."""
    home, out = str(tmp_path / "home"), str(tmp_path / "out")
    for mode, world in (("save", 2), ("load", 3)):
        job = run_ranks("tests.test_restore_shares", lambda r, port, mode=mode: [mode, str(r), str(port), home, out],
                        world=world, torchrun=False)
        assert job.codes == [0] * world, job.tail()
    res = [json.loads(open(f"{out}.{r}.json").read()) for r in range(3)]
    assert res == [{"restored": 2, "state": True, "checked": c} for c in ([0], [1], [])], res


def test_two_ranks_check_their_own_shares_and_go_down_together_to_a_step_every_share_verified(tmp_path):
    job = run_ranks("tests.test_restore_shares",
                    lambda r, port: [str(r), str(port), str(tmp_path / "home"), str(tmp_path / "out")], torchrun=False)
    assert job.codes == [0, 0], job.tail()
    res = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(2)]
    for r, got in enumerate(res):
        assert got == {"restored": 1, "state": True, "checked": [r], "next": "committed"}, (r, got)


if __name__ == "__main__":
    a = sys.argv[1:]
    if a[0] in ("save", "load"):
        elastic_worker(a[0], int(a[1]), int(a[2]), a[3], a[4])
    else:
        worker(int(a[0]), int(a[1]), a[2], a[3])
