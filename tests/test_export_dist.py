"""Export and import with two real gloo ranks: FSDP2 shards reassembled, DDP replicas trained from an import.

Each test runs two worker processes (this file's ``__main__``), then exports from
the test process and compares with the full tensors the workers wrote.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

import tierstore
from tests import _warm
from tests._trainer import CFG
from tests.redis_server import free_port
from tests.test_export import bits, load_export, pretrained
from tierstore.interop.export import export_model
from tierstore.interop.importing import import_model
from tierstore.keys import ShardKey
from tierstore.testing.gpt import GPT

ROOT = Path(__file__).resolve().parents[1]


def _init(rank: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)


def fsdp_worker(rank: int, port: int, home: str, out: str) -> None:
    """FSDP2 on 2 ranks (uneven shards), AdamW, 3 saved steps; rank 0 writes the full tensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import tierstore
    from tierstore.train.checkpointer import Checkpointer

    _init(rank, port)
    mesh = init_device_mesh("cpu", (2,))
    store = tierstore.open(home=home)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3), torch.nn.Linear(3, 5))
    for layer in m:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    ck = Checkpointer(store, "fsdp", m, opt)
    for i in range(3):
        torch.manual_seed(100 + i)
        m(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        ck.save(i)
    outcome = ck.wait()
    ck.close()
    full = {n: t.full_tensor() for n, t in m.state_dict().items()}
    names = {id(p): n for n, p in m.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            full[f"optim/{names[id(p)]}/{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    if rank == 0:
        torch.save(full, f"{out}.pt")
        Path(f"{out}.json").write_text(json.dumps({"outcome": outcome}))
    dist.barrier()
    store.close()
    dist.destroy_process_group()


def ddp_worker(rank: int, port: int, home: str, out: str) -> None:
    """DDP on 2 ranks from an imported base (differential policy); rank 0 writes the live state."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import tierstore
    from tests._trainer import make, train_step
    from tierstore.train.checkpointer import Checkpointer
    from tierstore.train.policies import differential

    _init(rank, port)
    store = tierstore.open(home=home)
    model, opt, sched, loader = make(rank)
    ddp = DDP(model)
    ck = Checkpointer(store, "ft", state={"model": ddp, "optim": opt, "sched": sched}, policy=differential(50))
    restored = ck.restore().step
    for step in range(1, 3):
        train_step(ddp, opt, sched, loader, world=2)
        ck.save(step)
    outcome = ck.wait()
    ck.close()
    if rank == 0:
        names = {id(p): n for n, p in model.named_parameters()}
        live = dict(model.state_dict())
        live.update({f"optim/{names[id(p)]}/{k}": v for p, st in opt.state.items() for k, v in st.items()})
        torch.save(live, f"{out}.pt")
        Path(f"{out}.json").write_text(json.dumps({"outcome": outcome, "restored": restored}))
    dist.barrier()
    store.close()
    dist.destroy_process_group()


def _run(mode: str, home: Path, out: Path, deadline_s: float = 240) -> list[int]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [_warm.popen([sys.executable, "-m", "tests.test_export_dist", mode, str(r), str(port), str(home),
                               str(out)], cwd=ROOT, env=env) for r in range(2)]
    deadline = time.monotonic() + deadline_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    return [p.wait() for p in procs]


def test_fsdp2_shards_are_reassembled_bitwise(tmp_path):
    home = tmp_path / "home"
    assert _run("fsdp", home, tmp_path / "live") == [0, 0]
    assert json.loads((tmp_path / "live.json").read_text())["outcome"] == "committed"
    full = torch.load(tmp_path / "live.pt", weights_only=True)
    with tierstore.open(home=home) as store:
        assert store.info(ShardKey("fsdp", "2", 2, 1)) is not None  # both ranks hold a piece of every layer
        rep = export_model(store, "fsdp", tmp_path / "out", max_shard_size="200B")
        rep_t = export_model(store, "fsdp", tmp_path / "out_t", step=2, format="torch", model_only=True)
    got = load_export(tmp_path / "out")
    assert rep.step == 2 and len(rep.files) > 2 and set(got) == set(full)
    for n, t in full.items():
        assert bits(got[n], t), n
    got_t = torch.load(tmp_path / "out_t" / "pytorch_model.bin", weights_only=True)
    assert set(got_t) == {n for n in full if not n.startswith("optim/")}
    assert all(bits(got_t[n], full[n]) for n in got_t)
    assert rep_t.skipped == ["optim"]


def test_import_for_two_ddp_ranks_train_export_bitwise(tmp_path):
    home = tmp_path / "home"
    src, sd = pretrained(tmp_path, sharded=True)
    with tierstore.open(home=home) as store:
        rep = import_model(store, src, "ft", module=GPT(CFG), world_size=2)
        assert rep.world_size == 2 and store.info(ShardKey("ft", "embed", 0, 1)).kind == "ref"
    assert _run("ddp", home, tmp_path / "live") == [0, 0]
    res = json.loads((tmp_path / "live.json").read_text())
    assert res == {"outcome": "committed", "restored": 0}
    live = torch.load(tmp_path / "live.pt", weights_only=True)
    with tierstore.open(home=home) as store:
        kinds = {store.info(k).kind for k in store.list("ft", step=1)}
        out = export_model(store, "ft", tmp_path / "out", max_shard_size="64KB")
    assert out.step == 2 and "full" in kinds  # the layers gained optimizer state: written full once
    got = load_export(tmp_path / "out")
    assert set(got) == set(live)
    for n, t in live.items():
        assert bits(got[n], t), n
    assert not all(bits(got[n], t) for n, t in sd.items())  # it trained


if __name__ == "__main__":
    a = sys.argv[1:]
    worker = {"fsdp": fsdp_worker, "ddp": ddp_worker}[a[0]]
    worker(int(a[1]), int(a[2]), a[3], a[4])
