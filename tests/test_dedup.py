"""Tests of tierstore.train.dedup: owner assignment (pure) and detection over real gloo ranks."""

from __future__ import annotations


import torch
import torch.multiprocessing as mp

from tierstore.train.dedup import DedupPlanner, assign_owners, part_digests, split_parts


def _d(x: int) -> bytes:
    return bytes([x]) * 16


def test_part_digests_split_state_and_optim():
    a = {"param/w": torch.ones(4), "optim/w/exp_avg": torch.zeros(4)}
    b = {"param/w": torch.ones(4), "optim/w/exp_avg": torch.ones(4)}
    da, db = part_digests(a), part_digests(b)
    assert da["state"] == db["state"] and da["optim"][0] != db["optim"][0]
    assert da["state"][1] == 16 and da["optim"][1] == 16
    assert part_digests(a, "blake2s")["state"][0] != da["state"][0]
    assert set(split_parts(a)) == {"state", "optim"}
    # names count, not just bytes
    assert part_digests({"param/v": torch.ones(4)})["state"] != da["state"]


def test_assign_owners_balances_full_replicas():
    # 4 layers of different sizes, identical on 2 ranks (data parallel)
    sizes = {"a": 400, "b": 300, "c": 200, "d": 100}
    rank = {ln: {"state": (_d(i), n), "optim": (_d(10 + i), 2 * n)} for i, (ln, n) in enumerate(sizes.items())}
    owners = assign_owners([rank, rank])
    load = [0, 0]
    for ln, parts in owners.items():
        assert parts["state"] == parts["optim"]  # both parts to one owner: whole-shard refs
        o = parts["state"][0]
        assert parts["state"] == [o, o]
        load[o] += 3 * sizes[ln]
    assert sorted(load) == [1500, 1500]


def test_assign_owners_judges_parts_separately():
    # ZeRO-1 style: parameters replicated, optimizer state differs
    r0 = {"x": {"state": (_d(1), 100), "optim": (_d(2), 200)}}
    r1 = {"x": {"state": (_d(1), 100), "optim": (_d(3), 200)}}
    owners = assign_owners([r0, r1])
    assert owners["x"]["optim"] == [0, 1]
    o = owners["x"]["state"][0]
    assert owners["x"]["state"] == [o, o]


def test_assign_owners_three_ranks_partial_classes():
    t = [{"x": {"state": (_d(1), 10), "optim": (_d(1), 10)}} for _ in range(3)]
    t[2] = {"x": {"state": (_d(9), 10), "optim": (_d(9), 10)}}
    owners = assign_owners(t)
    assert owners["x"]["state"][2] == 2
    assert owners["x"]["state"][0] == owners["x"]["state"][1] in (0, 1)


from tests.redis_server import free_port as _free_port  # noqa: E402


def _planner_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        pl = DedupPlanner()
        same = {"a": {"param/w": torch.ones(1000), "optim/w/m": torch.zeros(1000)}, "b": {"param/v": torch.ones(10)}}
        p1 = pl.plan(same)
        p2 = pl.plan(same)
        det = pl.detections
        diff = {"a": same["a"], "b": {"param/v": torch.full((10,), float(rank))}}
        p3 = pl.plan(diff)
        layout = {"a": same["a"]} if rank == 0 else {"a": same["a"], "c": {"param/z": torch.ones(1)}}
        p4 = pl.plan(layout)
        with open(f"{out}.{rank}", "w") as f:
            f.write(repr((p1, p2, det, p3, pl.detections, p4)))
    finally:
        dist.destroy_process_group()


def test_planner_over_two_gloo_ranks(tmp_path):
    out = str(tmp_path / "plan")
    mp.start_processes(_planner_worker, args=(_free_port(), out), nprocs=2, start_method="spawn")
    import ast

    res = [ast.literal_eval(open(f"{out}.{r}").read()) for r in range(2)]
    (p1a, p2a, deta, p3a, det2a, p4a), (p1b, p2b, detb, p3b, det2b, p4b) = res
    # identical layers: one owner per layer, agreed by both ranks, balanced (a and b to different ranks)
    for ln in ("a", "b"):
        assert p1a[ln]["state"] == p1b[ln]["state"] == p1a[ln]["optim"]
    assert p1a["a"]["state"] != p1a["b"]["state"]
    assert p2a == p1a and p2b == p1b and deta == detb == 2  # cached: no reassignment
    # b now differs: each rank owns its own; a keeps its owner
    assert p3a["b"]["state"] == 0 and p3b["b"]["state"] == 1 and p3a["a"] == p1a["a"]
    assert det2a == det2b == 3
    # layouts differ across ranks: no dedup
    assert all(o == 0 for ps in p4a.values() for o in ps.values())
    assert all(o == 1 for ps in p4b.values() for o in ps.values())
