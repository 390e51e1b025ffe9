"""PyTorch's DCP test cases that run on CPU, adapted to TierStoreWriter/TierStoreReader, on real gloo ranks.

Adapted from torch's test/distributed/checkpoint/e2e/test_e2e_save_and_load.py (e2e save/load of a
DDP or FSDP model with its optimizer, a Stateful object and a train state holding a BytesIO; async
save with thread and process executors; partial load; ``_load_state_dict_from_keys``) and the FSDP2
resharding tests (save on 2 ranks, load on 1 and on 4). FSDP2 (``fully_shard``) runs on gloo/CPU in
torch 2.13, so it is used as is. Plus the rank/world/collectives cases DCP passes to a storage layer:
``use_collectives=False``, ``no_dist=True`` with a process group up, ``process_group=`` a subgroup.

Each scenario runs ``python -m tests.test_dcp_dist <scenario> <rank> <world> <port> <home> <out>``
per rank and writes ``{check: bool}``; the tests assert every check.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import _warm
from tests._leaks import purge_homes
from tests.redis_server import free_port

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 420


def _diff(a: Any, b: Any, path: str = "") -> str | None:
    """Where ``a`` and ``b`` first differ (tensors bitwise, dtype included), or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return None if ok else path or "."
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(map(str, a.keys() ^ b.keys()))}"
        return next((d for k in a if (d := _diff(a[k], b[k], f"{path}.{k}")) is not None), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: lengths {len(a)} != {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _diff(x, y, f"{path}.{i}")) is not None), None)
    return None if a == b else f"{path}: {a!r} != {b!r}"


def _same(a: Any, b: Any) -> bool:
    d = _diff(a, b)
    if d is not None:
        print(f"differs at {d}", file=sys.stderr)
    return d is None


# ------------------------------------------------------------------------------ the ranks


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


def _snapshot(model, opt, sched, loader, ts) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))  # on every rank
    return {"model": _clone(msd), "optim": _clone(osd), "sched": _clone(sched.state_dict()), "loader": (loader.position, loader.epoch),
            "train": (ts.step, ts.current_loss, list(ts.losses)),
            "extra": getattr(model, "module", model).extra.version}


def _ddp(rank: int, world: int, store, res: dict) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests import dcp_cases as cases
    from tierstore.interop.dcp import TierStoreReader, TierStoreWriter

    def fresh():
        model = DDP(cases.Net())
        opt = cases.optimizer(model)
        return model, opt, cases.scheduler(opt), cases.Loader(rank, world), cases.TrainState()

    def app(model, opt, sched, loader, ts) -> dict:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd, "sched": sched, "data": loader, "train": ts}

    def load(step: int | None, **kw):
        objs = fresh()
        sd = app(*objs)
        dcp.load(sd, storage_reader=TierStoreReader(store, "ddp", step), **kw)
        set_state_dict(objs[0], objs[1], model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return objs

    def check(name: str, objs, loaded) -> None:
        res[name] = _same(_snapshot(*objs), _snapshot(*loaded))
        # both train one more step: same loss, same state (bitwise)
        a = cases.train(*objs, steps=1)
        b = cases.train(*loaded, steps=1)
        res[name + "/next-step"] = a == b and _same(_snapshot(*objs), _snapshot(*loaded))

    objs = fresh()
    # the same data on every rank: DCP takes a plain (non-DTensor) value with the same key on every rank as
    # replicated and writes it once, so the train state (losses) must agree across ranks, as it does in training
    cases.train(*objs, steps=2)
    dcp.save(app(*objs), storage_writer=TierStoreWriter(store, "ddp", step=1))
    first = _snapshot(*objs)
    check("sync-save", objs, load(1))
    lr = load(1)[1].param_groups[1]["lr"]
    res["lr-restored"] = lr == first["optim"]["param_groups"][1]["lr"] and lr != 0.05  # 0.05: a fresh optimizer's

    fut = dcp.async_save(app(*objs), storage_writer=TierStoreWriter(store, "ddp", step=2),
                         async_checkpointer_type=AsyncCheckpointerType.THREAD)
    fut.result()
    check("async-thread", objs, load(None))  # the newest committed step: 2

    # the process executor pickles the writer into its own process, which reopens the store there
    fut = dcp.async_save(app(*objs), storage_writer=TierStoreWriter(store, "ddp", step=3),
                         async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    fut.result(timeout=TIMEOUT)
    check("async-process", objs, load(3))

    # use_collectives=False: every rank saves alone, and loads its own keys back (rank 1's included)
    dcp.save(app(*objs), storage_writer=TierStoreWriter(store, "ddp", step=4), use_collectives=False)
    check("no-collectives", objs, load(4))

    # partial load (DCP's test_partial_load): only the model, from a checkpoint with the optimizer too
    m, o, *_ = fresh()
    msd, _ = get_state_dict(m, o)
    dcp.load({"model": msd}, storage_reader=TierStoreReader(store, "ddp", 1))
    res["partial-model"] = _same({k: v for k, v in msd.items() if isinstance(v, torch.Tensor)},
                                 {k: v for k, v in first["model"].items() if isinstance(v, torch.Tensor)})
    got = _load_state_dict_from_keys("model", storage_reader=TierStoreReader(store, "ddp", 1))["model"]
    res["from-keys-model"] = _same(got, first["model"])
    ost = _load_state_dict_from_keys("optim.state", storage_reader=TierStoreReader(store, "ddp", 1))["optim"]
    res["from-keys-optim-state"] = "param_groups" not in ost and _same(ost["state"], first["optim"]["state"])

    # no_dist=True with a process group up: a single-process save and load (it hung before)
    mine = {"w": torch.full((3,), float(rank)), "meta": {"rank": rank}}
    dcp.save(mine, storage_writer=TierStoreWriter(store, f"nodist{rank}", 0), no_dist=True)
    back = {"w": torch.zeros(3), "meta": {"rank": -1}}
    dcp.load(back, storage_reader=TierStoreReader(store, f"nodist{rank}", 0), no_dist=True)
    res["no-dist"] = _same(back, mine)
    dist.barrier()


def _fsdp_model(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests import dcp_cases as cases

    model = cases.Net()
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        for m in (model.net1, model.net2, model.net3):
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = cases.optimizer(model)
    return model, opt, cases.scheduler(opt), cases.Loader(0, 1), cases.TrainState()


def _fsdp_save(rank: int, world: int, store, res: dict, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    from tests import dcp_cases as cases
    from tierstore.interop import dcp as tsdcp
    from tierstore.interop.dcp import TierStoreWriter

    objs = _fsdp_model(world)
    cases.train(*objs, steps=2, seed=0)
    msd, osd = get_state_dict(objs[0], objs[1])
    res["sharded"] = isinstance(msd["net1.weight"], DTensor) and msd["net1.weight"].to_local().shape[0] == 16 // world
    state = {"model": msd, "optim": osd, "train": objs[4]}
    dcp.save(state, storage_writer=TierStoreWriter(store, "fsdp", step=1))
    # the typed front door: async save of the next step
    cases.train(*objs, steps=1, seed=0)
    msd, osd = get_state_dict(objs[0], objs[1])
    tsdcp.async_save({"model": msd, "optim": osd, "train": objs[4]}, TierStoreWriter(store, "fsdp", step=2)).result()
    snap = _snapshot(*objs)
    if rank == 0:
        torch.save({"model": snap["model"], "optim": snap["optim"], "train": snap["train"]}, out + ".ref.pt")
    res["saved"] = True


def _fsdp_load(rank: int, world: int, store, res: dict, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from tierstore.interop.dcp import TierStoreReader

    objs = _fsdp_model(world)
    msd, osd = get_state_dict(objs[0], objs[1])
    state = {"model": msd, "optim": osd, "train": objs[4]}
    dcp.load(state, storage_reader=TierStoreReader(store, "fsdp"), no_dist=world == 1)
    set_state_dict(objs[0], objs[1], model_state_dict=state["model"], optim_state_dict=state["optim"])
    snap = _snapshot(*objs)
    ref = torch.load(Path(out).parent / "fsdp.save.ref.pt", weights_only=True)
    res[f"model-{world}"] = _same(snap["model"], ref["model"])
    res[f"optim-{world}"] = _same(snap["optim"], ref["optim"])
    res[f"train-{world}"] = _same(list(snap["train"]), list(ref["train"]))


def _subgroups(rank: int, world: int, store, res: dict) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from tierstore.interop.dcp import TierStoreReader, TierStoreWriter

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    gid = rank // 2
    mine = {f"w{rank}": torch.full((4,), float(rank)), f"note{rank}": f"rank {rank}"}
    dcp.save(mine, storage_writer=TierStoreWriter(store, f"sub{gid}", 0), process_group=groups[gid])
    back = {f"w{rank}": torch.zeros(4), f"note{rank}": ""}
    dcp.load(back, storage_reader=TierStoreReader(store, f"sub{gid}", 0), process_group=groups[gid])
    res["subgroup"] = _same(back, mine) and store.steps.records(f"sub{gid}", [0])[0].world == 3
    dist.barrier()


def worker(scenario: str, rank: int, world: int, port: int, home: str, out: str) -> None:
    import torch.distributed as dist

    import tierstore

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    store = tierstore.open(home=home)
    res: dict[str, bool] = {}
    try:
        if scenario == "ddp":
            _ddp(rank, world, store, res)
        elif scenario == "fsdp-save":
            _fsdp_save(rank, world, store, res, out)
        elif scenario == "fsdp-load":
            _fsdp_load(rank, world, store, res, out)
            if world == 4:
                _subgroups(rank, world, store, res)
    finally:
        with open(f"{out}.{rank}.json", "w") as f:
            json.dump(res, f)
        store.close()
        if world > 1:
            dist.destroy_process_group()


# ------------------------------------------------------------------------------ the tests


def _run(scenario: str, world: int, home: Path, out: Path) -> list[dict]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [_warm.popen([sys.executable, "-m", "tests.test_dcp_dist", scenario, str(r), str(world), str(port),
                               str(home), str(out)], cwd=ROOT, env=env) for r in range(world)]
    try:
        codes = [p.wait(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * world, f"{scenario}: exit codes {codes}"
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(world)]


def _all_true(results: list[dict], want: set[str]) -> None:
    for rank, res in enumerate(results):
        assert set(res) >= want, (rank, sorted(want - set(res)))
        assert all(res.values()), (rank, {k: v for k, v in res.items() if not v})


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp-ddp")
    yield _run("ddp", 2, tmp / "home", tmp / "ddp")
    purge_homes(tmp / "home")


@pytest.fixture(scope="module")
def fsdp_home(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp-fsdp")
    res = _run("fsdp-save", 2, tmp / "home", tmp / "fsdp.save")
    _all_true(res, {"saved", "sharded"})
    yield tmp
    purge_homes(tmp / "home")


def test_ddp_adamw_state_dict_round_trip_sync_and_async(ddp_results):
    """DDP + AdamW (two groups) + cosine scheduler + dataloader bytes + BytesIO train state + _extra_state, bitwise."""
    names = {"sync-save", "async-thread", "async-process"}
    _all_true(ddp_results, names | {n + "/next-step" for n in names} | {"lr-restored"})


def test_ddp_use_collectives_false_keeps_every_ranks_keys(ddp_results):
    _all_true(ddp_results, {"no-collectives", "no-collectives/next-step"})


def test_partial_load(ddp_results):
    _all_true(ddp_results, {"partial-model", "from-keys-model", "from-keys-optim-state"})


def test_no_dist_with_a_process_group_up(ddp_results):
    _all_true(ddp_results, {"no-dist"})


def test_fsdp2_reshard_2_to_1(fsdp_home):
    _all_true(_run("fsdp-load", 1, fsdp_home / "home", fsdp_home / "fsdp.load1"), {"model-1", "optim-1", "train-1"})


def test_fsdp2_reshard_2_to_4_and_subgroups(fsdp_home):
    res = _run("fsdp-load", 4, fsdp_home / "home", fsdp_home / "fsdp.load4")
    _all_true(res, {"model-4", "optim-4", "train-4", "subgroup"})


if __name__ == "__main__":
    a = sys.argv[1:]
    worker(a[0], int(a[1]), int(a[2]), int(a[3]), a[4], a[5])
