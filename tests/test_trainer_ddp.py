"""A real 2-rank trainer on gloo: DDP, AdamW with two param groups, a cosine LR schedule, a dataloader-like
Stateful and RNG state, checkpointed through the Stateful Checkpointer, SIGKILLed, resumed.

One job trains one model copy per policy in lock-step (same data, same seeds), each with its own
Checkpointer and model name. Incarnation 1 checkpoints the DDP-*wrapped* model and runs until rank 1 dies
abruptly right after the saves of step ``KILL``; rank 0 is then SIGKILLed. Incarnation 2 restores into the
*unwrapped* model (wrapped in DDP only afterwards) and trains on. The reference is an uninterrupted run of
the same job without checkpoints. Also here: a save made on one rank only is a typed error naming the
missing rank within the grace (not the commit timeout), and FSDP2 (DTensor) state saved per local shard.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

# the module fixture makes real multi-process runs: minutes on a loaded 2-core machine, past the default bound
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[1]
KILL = 7
STOP = KILL + 8
STOP_LAYERWISE = KILL + 30
POLICIES = ("exact", "differential", "dedup", "replay", "layerwise")


def _policy(name: str):
    from tierstore.train import policies as P

    return {"exact": P.exact(), "differential": P.differential(base_every=4), "dedup": P.dedup(),
            "replay": P.replay(base_every=4), "layerwise": P.layerwise(tau=0.02, max_staleness=4)}[name]


def _init(rank: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=90))


def train_worker(rank: int, port: int, home: str, out: str, kill_at: int, ref: bool) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import tierstore
    from tests import _trainer as T
    from tierstore.testing.gpt import setup_determinism
    from tierstore.train.checkpointer import Checkpointer
    from tierstore.train.state import RNGState

    setup_determinism(0)
    _init(rank, port)
    store = tierstore.open(home=home)
    jobs = {}
    for name in POLICIES:
        model, opt, sched, loader = T.make(rank)
        state = {"model": model, "optim": opt, "sched": sched, "data": loader, "rng": RNGState()}
        first = kill_at >= 0
        if first and not ref:
            state["model"] = DDP(model)  # incarnation 1 checkpoints the wrapped model ...
        ck = None if ref else Checkpointer(store, f"gpt-{name}", state=state, policy=_policy(name))
        restored = None if ck is None else ck.restore().step  # ... incarnation 2 restores the bare one
        ddp = state["model"] if isinstance(state["model"], DDP) else DDP(model)
        jobs[name] = dict(ddp=ddp, opt=opt, sched=sched, loader=loader, ck=ck, restored=restored,
                          start=0 if restored is None else restored + 1,
                          stop=STOP_LAYERWISE if name == "layerwise" else STOP, losses={},
                          rng=None if restored is None else __import__("torch").get_rng_state())
    for step in range(min(j["start"] for j in jobs.values()), max(j["stop"] for j in jobs.values())):
        for name, j in jobs.items():
            if j["start"] <= step < j["stop"]:
                if j["rng"] is not None:
                    __import__("torch").set_rng_state(j["rng"])
                j["losses"][step] = T.train_step(j["ddp"], j["opt"], j["sched"], j["loader"], world=2)
                j["rng"] = __import__("torch").get_rng_state()  # each job keeps its own RNG stream
                if j["ck"] is not None:
                    j["ck"].save(step)
        if step == kill_at and rank == 1:
            os._exit(17)
    result = {}
    for name, j in jobs.items():
        outcome = j["ck"].wait() if j["ck"] is not None else None
        if j["ck"] is not None:
            j["ck"].close()
        result[name] = {"restored": j["restored"], "losses": j["losses"], "outcome": outcome}
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    store.close()
    dist.destroy_process_group()


def missing_worker(rank: int, port: int, home: str, out: str) -> None:
    """Only rank 0 calls save() for some steps: it must say which rank is missing, within the grace."""
    import torch
    import torch.distributed as dist

    import tierstore
    from tierstore.errors import CommitError
    from tierstore.train.checkpointer import Checkpointer
    from tierstore.train.policies import dedup, exact, layerwise

    _init(rank, port)
    store = tierstore.open(home=home)
    res: dict = {}
    for name, pol in (("exact", exact()), ("layerwise", layerwise(tau=0.0, max_staleness=2)), ("dedup", dedup())):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        ck = Checkpointer(store, f"miss-{name}", model, policy=pol, missing_rank_grace=2.0, timeout=60)
        ck.save(0)
        assert ck.wait() == "committed"
        if rank == 0:
            t0 = time.monotonic()
            try:
                ck.save(1)  # layerwise: the ranks' all_reduce would hang; it waits the grace and raises
                ck.wait()
                res[name] = {"error": None}
            except CommitError as e:
                res[name] = {"error": type(e).__name__, "missing": e.fields.get("missing_ranks"),
                             "seconds": time.monotonic() - t0, "msg": str(e),
                             "state": store.steps.state(f"miss-{name}", 1)}
        dist.barrier()
        ck.close()
    # a master-only save that nobody waits for is reported by the next save
    ck = Checkpointer(store, "miss-next", torch.nn.Linear(2, 2), missing_rank_grace=1.0)
    ck.save(0)
    assert ck.wait() == "committed"
    if rank == 0:
        ck.save(1)
        time.sleep(1.5)
        try:
            ck.save(2)
            res["next"] = {"error": None}
        except CommitError as e:
            res["next"] = {"error": type(e).__name__, "missing": e.fields.get("missing_ranks"),
                           "step": e.fields.get("step"), "state": store.steps.state("miss-next", 1)}
    dist.barrier()
    ck.close()
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(res, f)
    dist.barrier()
    store.close()
    dist.destroy_process_group()


def fsdp_worker(rank: int, port: int, home: str, out: str) -> None:
    """FSDP2 (fully_shard): DTensor parameters and optimizer state saved per local shard with placements."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import tierstore
    from tierstore.train.checkpointer import Checkpointer

    _init(rank, port)
    mesh = init_device_mesh("cpu", (2,))
    store = tierstore.open(home=home)

    def build(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3))  # 3 rows: uneven shards
        for layer in m:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m, torch.optim.AdamW(m.parameters(), lr=0.1)

    def step(m, o, i):
        torch.manual_seed(100 + i)
        m(torch.randn(4, 8)).sum().backward()
        o.step()
        o.zero_grad()

    m, o = build(0)
    ck = Checkpointer(store, "fsdp", m, o)
    for i in range(3):
        step(m, o, i)
        ck.save(i)
    res = {"outcome": ck.wait()}
    ck.close()
    m2, o2 = build(1)
    ck2 = Checkpointer(store, "fsdp", m2, o2)
    res["restored"] = ck2.restore().step
    res["equal"] = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(m.parameters(), m2.parameters()))
    full = [p.full_tensor() for p in m2.parameters()]  # what the step holds, gathered
    step(m, o, 3)
    step(m2, o2, 3)
    res["continue_equal"] = all(torch.equal(a.to_local(), b.to_local())
                                for a, b in zip(m.parameters(), m2.parameters()))
    ck2.close()
    plain = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3))
    ck3 = Checkpointer(store, "fsdp", plain)  # a sharded checkpoint into an unsharded model: full tensors
    ck3.restore(read_only=True)
    res["plain"] = all(torch.equal(a, b) for a, b in zip(plain.parameters(), full))
    res["plain_resharded"] = ck3.report.resharded
    ck3.close()
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(res, f)
    dist.barrier()
    store.close()
    dist.destroy_process_group()


from tests._leaks import purge_homes  # noqa: E402
from tests._ranks import run_ranks  # noqa: E402


def _run(args: list[str], kill: bool = False, deadline_s: float = 300) -> list[int]:
    # kill: rank 1 exiting 17 takes the surviving rank down with the job
    job = run_ranks("tests.test_trainer_ddp", lambda r, port: [args[0], str(r), str(port), *args[1:]],
                    timeout_s=deadline_s, torchrun=False, dies_with=17 if kill else None)
    if job.codes != [0, 0] and not kill:
        print(job.tail())
    return job.codes


def _load(out: Path) -> list[dict]:
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]


_DONE: list = []  # this session's results: the runs are made once even when the module's fixtures are set up again


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs (data only: their homes are purged at teardown). Made once per pytest session (each xdist worker
    is one): a worker whose queue ran dry between two tests of this file sets the module's fixtures up again."""
    if _DONE:
        yield _DONE[0]
        return
    tmp = tmp_path_factory.mktemp("ddp")
    assert _run(["train", str(tmp / "home"), str(tmp / "first"), str(KILL), "0"], kill=True)[1] == 17
    assert _run(["train", str(tmp / "home"), str(tmp / "second"), "-1", "0"]) == [0, 0]
    assert _run(["train", str(tmp / "refhome"), str(tmp / "ref"), "-1", "1"]) == [0, 0]
    _DONE.append((_load(tmp / "second"), _load(tmp / "ref")))
    yield _DONE[0]
    purge_homes(tmp / "home", tmp / "refhome")


@pytest.mark.parametrize("name", ["exact", "differential", "dedup", "replay"])
def test_ddp_trainer_resumes_bitwise_after_sigkill(runs, name):
    res, ref = runs
    for rank in range(2):
        r = res[rank][name]
        assert r["restored"] is not None and KILL - 3 <= r["restored"] <= KILL, r["restored"]
        assert r["outcome"] == "committed"
        losses = {int(k): v for k, v in r["losses"].items()}
        assert sorted(losses) == list(range(r["restored"] + 1, STOP))
        want = {int(k): v for k, v in ref[rank][name]["losses"].items()}
        for step, loss in losses.items():
            assert loss == want[step], (name, rank, step, loss, want[step])


def test_ddp_trainer_layerwise_within_its_bound(runs):
    res, ref = runs
    worst = 0.0
    for rank in range(2):
        r = res[rank]["layerwise"]
        assert r["restored"] is not None and r["outcome"] == "committed"
        want = {int(k): v for k, v in ref[rank]["layerwise"]["losses"].items()}
        for k, v in r["losses"].items():
            worst = max(worst, abs(v - want[int(k)]) / want[int(k)])
    print(f"\nlayerwise (DDP, cosine LR): worst post-restore loss deviation {worst:.4%}")
    assert worst <= 0.01


def test_save_on_one_rank_names_the_missing_rank(tmp_path):
    assert _run(["missing", str(tmp_path / "home"), str(tmp_path / "out")], deadline_s=200) == [0, 0]
    res = _load(tmp_path / "out")[0]
    for name in ("exact", "layerwise", "dedup"):
        r = res[name]
        assert r["error"] == "CommitError" and r["missing"] == [1], (name, r)
        assert r["seconds"] < 20, (name, r["seconds"])  # the grace (2 s), not the commit timeout (60 s)
        assert "rank(s) [1] did not call save(1)" in r["msg"]
        assert r["state"] in ("aborted", None), (name, r["state"])  # voted down (layerwise: before writing)
    assert res["next"] == {"error": "CommitError", "missing": [1], "step": 1, "state": "aborted"}


def test_fsdp2_dtensor_state_round_trips_per_shard(tmp_path):
    assert _run(["fsdp", str(tmp_path / "home"), str(tmp_path / "out")], deadline_s=200) == [0, 0]
    for r in _load(tmp_path / "out"):
        assert r["outcome"] == "committed" and r["restored"] == 2
        assert r["equal"] and r["continue_equal"]
        assert r["plain"] is True and r["plain_resharded"] == ["0", "1"]  # each rank: whole tensors, by ranges


if __name__ == "__main__":
    a = sys.argv[1:]
    mode, rank, port = a[0], int(a[1]), int(a[2])
    if mode == "train":
        train_worker(rank, port, a[3], a[4], int(a[5]), a[6] == "1")
    elif mode == "missing":
        missing_worker(rank, port, a[3], a[4])
    else:
        fsdp_worker(rank, port, a[3], a[4])
