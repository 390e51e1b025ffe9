"""Kill-and-restore runs of the small GPT on two real gloo ranks and a real embedded store.

One job trains one model copy per policy in lock-step (same data, same seeds),
each with its own Checkpointer and model name. Incarnation 1 runs until rank 1
dies abruptly (``os._exit``) right after issuing the saves of step ``KILL``;
rank 0 is then SIGKILLed. Incarnation 2 restarts both ranks, restores each
policy's model and trains on. The reference is the uninterrupted trajectory,
computed in this process by emulating the two ranks (bitwise equal to gloo
with two ranks; checked by the uninterrupted first part of the run).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

# the module fixture makes real multi-process runs: minutes on a loaded 2-core machine, past the default bound
pytestmark = pytest.mark.timeout(900)

KILL = 7
STOP_EXACT = KILL + 8
STOP_LAYERWISE = KILL + 52
POLICIES = {
    "exact": STOP_EXACT,
    "differential": STOP_EXACT,
    "dedup": STOP_EXACT,
    "layerwise": STOP_LAYERWISE,
}
ROOT = Path(__file__).resolve().parents[1]


def _policy(name: str):
    from tierstore.train import policies as P

    return {
        "exact": P.exact(),
        "differential": P.differential(base_every=5),
        "dedup": P.dedup(),
        "layerwise": P.layerwise(tau=0.02, max_staleness=4),
    }[name]


def worker(rank: int, world: int, port: int, home: str, out: str, kill_at: int) -> None:
    """One rank of one incarnation (run as ``python -m tests.test_training_run``)."""
    import torch.distributed as dist

    import tierstore
    from tierstore.train.checkpointer import Checkpointer
    from tierstore.testing.gpt import (
        char_dataset,
        get_batch,
        make_model,
        setup_determinism,
        train_step,
    )

    t0 = time.perf_counter()
    setup_determinism(0)
    from datetime import timedelta

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    store = tierstore.open(home=home)
    data = char_dataset()
    jobs = {}
    for name, stop in POLICIES.items():
        model, opt = make_model(seed=0)
        ck = Checkpointer(store, f"gpt-{name}", model, opt, _policy(name))
        restored, extra = ck.restore()
        start = 0 if restored is None else restored + 1
        assert restored is None or extra == {"next": start}
        jobs[name] = dict(model=model, opt=opt, ck=ck, start=start, stop=stop, restored=restored, losses={})
    print(f"rank {rank}: set up in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    last = max(j["stop"] for j in jobs.values())
    for step in range(min(j["start"] for j in jobs.values()), last):
        x, y = get_batch(data, step, rank, 8, 64, 0)
        for name, j in jobs.items():
            if j["start"] <= step < j["stop"]:
                j["losses"][step] = train_step(j["model"], j["opt"], x, y, world)
                j["ck"].save(step, extra={"next": step + 1})
        if step == kill_at and rank == 1:
            os._exit(17)  # abrupt: background saves of this step may be half done
    result = {}
    for name, j in jobs.items():
        outcome = j["ck"].wait()
        j["ck"].close()
        result[name] = {
            "restored": j["restored"],
            "losses": j["losses"],
            "outcome": outcome,
            "stats": j["ck"].stats.as_dict(),
        }
    print(f"rank {rank}: done in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    store.close()
    dist.destroy_process_group()


from tests._leaks import purge_homes  # noqa: E402
from tests._ranks import run_ranks  # noqa: E402


def _run(home: Path, out: Path, kill_at: int) -> list[int]:
    # rank 1 exiting 17 (the kill point) takes the surviving rank down with the job
    job = run_ranks("tests.test_training_run",
                    lambda r, port: [str(r), "2", str(port), str(home), str(out), str(kill_at)],
                    timeout_s=240, torchrun=False, dies_with=17)
    if job.codes[1] != 17 and job.codes != [0, 0]:
        print(job.tail())
    return job.codes


_DONE: list = []  # this session's results: the runs are made once even when the module's fixtures are set up again


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs (data only: their homes are purged at teardown). Made once per pytest session (each xdist worker
    is one): a worker whose queue ran dry between two tests of this file sets the module's fixtures up again."""
    from tierstore.testing.gpt import make_model, setup_determinism, train_emulated

    if _DONE:
        yield _DONE[0]
        return
    tmp = tmp_path_factory.mktemp("run")
    codes1 = _run(tmp / "home", tmp / "first", KILL)
    assert codes1[1] == 17, codes1
    codes2 = _run(tmp / "home", tmp / "second", -1)
    assert codes2 == [0, 0], codes2
    res = [json.loads((tmp / f"second.{r}.json").read_text()) for r in range(2)]
    setup_determinism(0)
    model, opt = make_model(seed=0)
    ref = train_emulated(model, opt, 0, STOP_LAYERWISE, world_size=2)
    _DONE.append((res, ref))
    yield res, ref
    purge_homes(tmp / "home")


@pytest.mark.parametrize("name", ["exact", "differential", "dedup"])
def test_loss_after_restore_is_bitwise_identical(runs, name):
    res, ref = runs
    for rank in range(2):
        r = res[rank][name]
        assert r["restored"] is not None and KILL - 3 <= r["restored"] <= KILL
        assert r["outcome"] == "committed"
        losses = {int(k): v for k, v in r["losses"].items()}
        assert sorted(losses) == list(range(r["restored"] + 1, STOP_EXACT))
        for step, loss in losses.items():
            assert loss == ref[rank][step], (name, rank, step, loss, ref[rank][step])


def test_layerwise_deviation_is_small(runs):
    res, ref = runs
    worst = 0.0
    for rank in range(2):
        r = res[rank]["layerwise"]
        assert r["restored"] is not None
        losses = {int(k): v for k, v in r["losses"].items()}
        steps = sorted(losses)[:50]
        assert len(steps) == 50
        for s in steps:
            worst = max(worst, abs(losses[s] - ref[rank][s]) / ref[rank][s])
    ex = res[0]["exact"]["stats"]["logical_bytes"] / max(1, len(res[0]["exact"]["losses"]))
    lw = res[0]["layerwise"]["stats"]["logical_bytes"] / max(1, len(res[0]["layerwise"]["losses"]))
    print(f"\nlayerwise: worst post-restore loss deviation {worst:.4%}; bytes per save {lw:.0f} vs exact {ex:.0f} "
          f"({ex / lw:.2f}x smaller)")
    assert worst <= 0.005
    assert lw < ex


def test_dedup_halves_bytes(runs):
    res, _ = runs
    # per save: the two policies may have restored from different steps
    ex = sum(res[r]["exact"]["stats"]["bytes"] for r in range(2)) / res[0]["exact"]["stats"]["saves"]
    dd = sum(res[r]["dedup"]["stats"]["bytes"] for r in range(2)) / res[0]["dedup"]["stats"]["saves"]
    ratio = dd / ex
    print(f"\ndedup: bytes written per save {dd:.0f} vs {ex:.0f} without dedup: ratio {ratio:.3f}")
    assert 0.45 <= ratio <= 0.6
    refs = sum(res[r]["dedup"]["stats"]["objects"]["ref"] for r in range(2))
    fulls = sum(res[r]["dedup"]["stats"]["objects"]["full"] for r in range(2))
    assert refs == fulls


if __name__ == "__main__":
    a = sys.argv[1:]
    worker(int(a[0]), int(a[1]), int(a[2]), a[3], a[4], int(a[5]))
