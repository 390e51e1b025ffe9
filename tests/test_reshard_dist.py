"""Elastic restore with real gloo ranks: a checkpoint of 2 ranks restores on 4 ranks and on 1, bitwise.

One run of 2 worker processes (this file's ``__main__``, mode ``save``) trains and saves, under several
policies: an FSDP2 (``fully_shard``) GPT with AdamW (``exact``, ``dedup``, ``differential``), a replicated
GPT whose AdamW is partitioned across the ranks, ZeRO-1 style (``exact``, ``dedup``: per-part refs), and a
replicated GPT under ``dedup`` (whole refs). Rank 0 writes the full state each saved as the reference.

One run of 4 worker processes (mode ``load``) restores each into FSDP2 on 4 ranks (1-D mesh), one into HSDP
(a 2 x 2 mesh, which then saves a step of its own), the partitioned ones into a 4-way partition, the
replicated one into FSDP2; each rank compares its restored state, gathered, with the reference, and writes
what it read (bytes) against what its shard holds. A byte flipped in the host-tier copy of an object the 4
ranks range-read is caught: they fall back to the durable copy and still restore bitwise.

The test process then restores into plain modules (no FSDP, one process) with a writer's ``restore()``
and with ``load()``, refuses other models with messages naming what differs, and fails typed when a
range read finds no valid copy.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

import tierstore
from tests import _warm
from tests import _reshard as R
from tests._tiers import live_path
from tests.redis_server import free_port
from tierstore.errors import RestoreMismatchError
from tierstore.keys import ShardKey
from tierstore.train.checkpointer import Checkpointer, load
from tierstore.train.policies import dedup, differential, exact

ROOT = Path(__file__).resolve().parents[1]
FSDP_MODELS = {"fx": exact, "fd": dedup, "ff": lambda: differential(base_every=3, payoff=None)}
ZERO_MODELS = {"zx": exact, "zd": dedup}


def _init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _shard(model: torch.nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)


def save_worker(rank: int, port: int, home: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    _init(rank, 2, port)
    store = tierstore.open(home=home)
    refs: dict[str, dict] = {}
    # FSDP2 on 2 ranks, saved at steps 0..3 under three policies
    model = R.make(seed=0)
    _shard(model, init_device_mesh("cpu", (2,)))
    opt = R.adamw(model)
    cks = {name: Checkpointer(store, name, model, opt, pol()) for name, pol in FSDP_MODELS.items()}
    for step in range(4):
        model(*R.batch(step, rank)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for ck in cks.values():
            ck.save(step)
            assert ck.wait() == "committed"
    for ck in cks.values():
        ck.close()
    refs["fsdp"] = R.full_state(model, opt)
    kinds = sorted({store.info(k).kind for k in store.list("ff", step=3)})
    # ZeRO-1 style: replicated parameters, AdamW partitioned across the ranks (two groups)
    model = R.make(seed=1)
    opt = R.adamw(model, (rank, 2))
    cks = {name: Checkpointer(store, name, model, opt, pol()) for name, pol in ZERO_MODELS.items()}
    for step in range(2):
        R.zero_step(model, opt, step, rank, 2)
        for ck in cks.values():
            ck.save(step)
            assert ck.wait() == "committed"
    for ck in cks.values():
        ck.close()
    torch.save(R.full_state(model, opt), f"{out}.zero.{rank}.pt")
    # replicated parameters, SGD momentum that differs per rank, under dedup: per-part refs ("state" part)
    model = R.make(seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(*R.batch(0, 0)).backward()
    opt.step()
    with torch.no_grad():
        for st in opt.state.values():
            st["momentum_buffer"].add_(float(rank + 1))
    ck = Checkpointer(store, "zs", model, opt, dedup())
    ck.save(0)
    assert ck.wait() == "committed"
    ck.close()
    torch.save(R.full_state(model, opt), f"{out}.zs.{rank}.pt")
    zs_refs = sum(1 for k in store.list("zs", step=0) if "_refs" in (store.get(k).metadata or {}))
    # replicated (DDP-like) under dedup: whole-object refs
    model = R.make(seed=2)
    opt = R.adamw(model)
    ck = Checkpointer(store, "pd", model, opt, dedup())
    model(*R.batch(0, 0)).backward()  # the same data on both ranks: identical state, written once
    opt.step()
    ck.save(0)
    assert ck.wait() == "committed"
    ck.close()
    refs["pd"] = R.full_state(model, opt)
    pd_kinds = sorted({store.info(k).kind for k in store.list("pd", step=0)})
    if rank == 0:
        torch.save(refs, f"{out}.ref.pt")
        Path(f"{out}.save.json").write_text(json.dumps({"ff_kinds": kinds, "zs_refs": zs_refs,
                                                         "pd_kinds": pd_kinds}))
    dist.barrier()
    store.close()
    dist.destroy_process_group()


def load_worker(rank: int, port: int, home: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    _init(rank, 4, port)
    store = tierstore.open(home=home)
    refs = torch.load(f"{out}.ref.pt", weights_only=True)
    zero_ref = {**torch.load(f"{out}.zero.0.pt", weights_only=True), **torch.load(f"{out}.zero.1.pt",
                                                                                    weights_only=True)}
    result: dict[str, dict] = {}

    def check(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, ck: Checkpointer, want: dict,
              partitioned: bool = False) -> None:
        got = R.full_state(model, opt)
        if partitioned:  # only this rank's partition of the optimizer state is here
            want = {n: t for n, t in want.items() if not n.startswith("optim/") or n in got}
        result[name] = {"step": ck.report.step, "bad": R.differences(got, want),
                        "resharded": ck.report.resharded, "bytes_read": ck.report.bytes_read,
                        "bad_copies": ck.report.bad_copies,
                        "shard_bytes": R.local_bytes(model, opt),
                        "optim_tensors": sum(1 for n in got if n.startswith("optim/"))}

    mesh1 = init_device_mesh("cpu", (4,))
    for name, pol in FSDP_MODELS.items():
        model = R.make(seed=9)
        _shard(model, mesh1)
        opt = R.adamw(model)
        ck = Checkpointer(store, name, model, opt, pol())
        ck.restore()
        check(name, model, opt, ck, refs["fsdp"])
        ck.close()
    # HSDP: a 2 x 2 mesh (replicate x shard), then a step saved from it
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = R.make(seed=9)
    _shard(model, mesh2)
    opt = R.adamw(model)
    ck = Checkpointer(store, "fx", model, opt)
    ck.restore(read_only=True)
    check("hsdp", model, opt, ck, refs["fsdp"])
    ck.close()
    ck = Checkpointer(store, "hs", model, opt)
    ck.save(7)
    assert ck.wait() == "committed"
    ck.close()
    hs_ref = R.full_state(model, opt)
    for name in ZERO_MODELS:
        model = R.make(seed=9)
        opt = R.adamw(model, (rank, 4))
        ck = Checkpointer(store, name, model, opt, ZERO_MODELS[name]())
        ck.restore()
        check(name, model, opt, ck, zero_ref, partitioned=True)
        ck.close()
    model = R.make(seed=9)
    _shard(model, mesh1)
    opt = R.adamw(model)
    ck = Checkpointer(store, "pd", model, opt, dedup())
    ck.restore()
    check("pd", model, opt, ck, refs["pd"])
    ck.close()
    # each rank restores what its namesake (rank % 2) saved: compared shard by shard, cut by torch itself
    model = R.make(seed=9)
    _shard(model, mesh1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ck = Checkpointer(store, "zs", model, opt, dedup())
    ck.restore()
    want = torch.load(f"{out}.zs.{rank % 2}.pt", weights_only=True)
    got = R.local_state(model, opt)
    cut = R.cut_like(want, model)
    result["zs"] = {"step": ck.report.step, "bad": R.differences(got, cut), "resharded": ck.report.resharded,
                    "optim_tensors": sum(1 for n in got if n.startswith("optim/")), "bad_copies": []}
    ck.close()
    Path(f"{out}.load.{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        torch.save(hs_ref, f"{out}.hs.pt")
    dist.barrier()
    store.close()
    dist.destroy_process_group()


def _run(mode: str, world: int, home: Path, out: Path, deadline_s: float = 400) -> list[int]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [_warm.popen([sys.executable, "-m", "tests.test_reshard_dist", mode, str(r), str(port), str(home),
                               str(out)], cwd=ROOT, env=env) for r in range(world)]
    deadline = time.monotonic() + deadline_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    return [p.wait() for p in procs]


def _plain_restore(store, name: str, part: bool = False):
    model = R.make(seed=5)
    opt = R.adamw(model)
    ck = Checkpointer(store, name, model, opt, FSDP_MODELS.get(name, ZERO_MODELS.get(name, exact))())
    step = ck.restore().step
    got = R.full_state(model, opt)
    report = ck.report
    ck.close()
    return step, got, report


def test_two_rank_fsdp2_checkpoint_restores_on_four_ranks_and_on_one(tmp_path):
    home, out = tmp_path / "home", tmp_path / "run"
    assert _run("save", 2, home, out) == [0, 0]
    saved = json.loads(Path(f"{out}.save.json").read_text())
    assert "delta" in saved["ff_kinds"] and "full" in saved["ff_kinds"]  # differential: deltas to reshard
    assert saved["zs_refs"] > 0 and "ref" in saved["pd_kinds"]  # dedup: per-part and whole refs
    refs = torch.load(f"{out}.ref.pt", weights_only=True)
    zero_ref = {**torch.load(f"{out}.zero.0.pt", weights_only=True), **torch.load(f"{out}.zero.1.pt",
                                                                                    weights_only=True)}

    # one flipped byte in the host-tier copy of an object the 4 ranks read by ranges
    with tierstore.open(home=home) as store:
        victim = ShardKey("fx", "blocks.0", 3, 0)
        p = live_path(store.host.root, store, victim)
        raw = bytearray(p.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        p.write_bytes(bytes(raw))

    assert _run("load", 4, home, out) == [0, 0, 0, 0]
    loads = [json.loads(Path(f"{out}.load.{r}.json").read_text()) for r in range(4)]
    for r, res in enumerate(loads):
        for name, got in res.items():
            assert got["bad"] == [], (r, name, got["bad"][:5])
            assert got["step"] == (1 if name in ZERO_MODELS else 0 if name in ("pd", "zs") else 3)
            assert got["resharded"], (r, name)
            assert got["optim_tensors"] > 0
        assert res["fx"]["bad_copies"] == [] or all("host" in b for b in res["fx"]["bad_copies"])
    assert any(res["fx"]["bad_copies"] for res in loads)  # the flipped chunk was read, caught, read elsewhere

    # one process, no FSDP: a writer's restore and an evaluator's load get full tensors
    with tierstore.open(home=home) as store:
        for name in FSDP_MODELS:
            step, got, report = _plain_restore(store, name)
            assert step == 3 and R.differences(got, refs["fsdp"]) == [], name
            assert report.resharded
        for name in ZERO_MODELS:
            step, got, _ = _plain_restore(store, name)
            assert step == 1 and R.differences(got, zero_ref) == [], name
        model = R.make(seed=6)
        assert load(store, "fx", {"model": model}).step == 3
        weights = {n: t for n, t in refs["fsdp"].items() if not n.startswith("optim/")}
        assert R.differences(R.full_state(model, None), weights) == []
        model = R.make(seed=6)
        opt = R.adamw(model)
        assert load(store, "hs", {"model": model, "optim": opt}).step == 7
        assert R.differences(R.full_state(model, opt), torch.load(f"{out}.hs.pt", weights_only=True)) == []

        # other models are refused, naming what differs, and nothing of them changes
        for what, (cfg, needle) in R.OTHER.items():
            model = R.make(seed=7, cfg=cfg)
            before = {n: t.clone() for n, t in model.state_dict().items()}
            with pytest.raises(RestoreMismatchError, match=needle):
                load(store, "fx", {"model": model})
            assert all(torch.equal(before[n], t) for n, t in model.state_dict().items()), what
        model = R.make(seed=7).double()
        with pytest.raises(RestoreMismatchError, match="float64"):
            load(store, "fx", {"model": model})


if __name__ == "__main__":
    a = sys.argv[1:]
    worker = {"save": save_worker, "load": load_worker}[a[0]]
    worker(int(a[1]), int(a[2]), a[3], a[4])
