"""One writer per DCP step, in real processes: a second concurrent writer of a step is refused before it writes
and the committed step loads the winner's data; a 2-rank job whose attempt timed out (a rank stalled before its
vote, the job restarted) saves the step again, while the stalled rank, woken up, writes nothing into it.

Workers run as ``python -m tests.test_dcp_writers <scenario> <json args>``; each writes its results as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import _warm
from tests.redis_server import free_port
from tierstore import ShardKey
from tierstore.errors import KeyExistsError, StepBusyError
from tierstore.interop import dcp as tsdcp
from tierstore.interop.dcp import TierStoreReader, TierStoreWriter

ROOT = Path(__file__).resolve().parents[1]
WAIT = 180.0  # seconds any one wait may take before the test fails (a loaded machine is slow, never wrong)


def _state(rank: int, gen: int) -> dict[str, Any]:
    """Rank ``rank``'s state of generation ``gen`` (distinct names per rank: DCP writes a shared name once)."""
    g = torch.Generator().manual_seed(1000 * gen + rank)
    return {f"w{rank}": torch.randn(9, 4, generator=g), f"b{rank}": torch.randn(5, generator=g).to(torch.bfloat16),
            f"note{rank}": f"generation {gen} of rank {rank}"}


def _like(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else "" for k, v in sd.items()}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        (isinstance(x, torch.Tensor) and x.dtype == b[k].dtype and torch.equal(x, b[k])) or x == b[k]
        for k, x in a.items())


def _wait_for(path: Path, procs: list[subprocess.Popen] = ()) -> None:
    deadline = time.monotonic() + WAIT
    while not path.exists():
        for p in procs:
            assert p.poll() is None, f"a worker exited ({p.returncode}) before {path.name}"
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.01)


def _spawn(scenario: str, **args: Any) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return _warm.popen([sys.executable, "-m", "tests.test_dcp_writers", scenario, json.dumps(args)], cwd=ROOT,
                            env=env)


def _config(store) -> dict:
    return dataclasses.asdict(store.config)


# ------------------------------------------------------------------------------ the workers


def _gated(mark: str, gate: str):
    """A DCP save planner that stops at its first ``resolve_data`` (after the plan, before any write) until
    ``gate`` exists, having touched ``mark``: a save paused between its claim of the step and its writes."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class Gated(DefaultSavePlanner):
        opened = False

        def resolve_data(self, item):
            if not self.opened:
                Path(mark).touch()
                deadline = time.monotonic() + WAIT
                while not Path(gate).exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                self.opened = True
            return super().resolve_data(item)

    return Gated()


def _open(cfg: dict):
    import tierstore
    from tierstore.config import StoreConfig

    return tierstore.open(config=StoreConfig(**cfg))


def _outcome(fn) -> dict:
    try:
        fn()
        return {"ok": True}
    except Exception as e:  # noqa: BLE001  # reported to the test, which asserts the type
        return {"ok": False, "error": type(e).__name__, "message": str(e)}


def _solo(a: dict) -> None:
    """One process saving step ``step`` (optionally paused between its plan and its writes)."""
    store = _open(a["cfg"])
    planner = _gated(a["mark"], a["gate"]) if a.get("gate") else None
    res = _outcome(lambda: tsdcp.save(_state(0, a["gen"]), TierStoreWriter(store, a["model"], a["step"]),
                                      no_dist=True, planner=planner))
    Path(a["out"]).write_text(json.dumps(res))
    store.close()


def _racer(a: dict) -> None:
    """Save steps 0..n-1, each started together with the other racer (a file barrier per step)."""
    store = _open(a["cfg"])
    me, other, d = a["id"], 1 - a["id"], Path(a["dir"])
    results = []
    for step in range(a["steps"]):
        (d / f"ready.{me}.{step}").touch()
        _wait_for(d / f"ready.{other}.{step}")
        results.append(_outcome(lambda s=step: tsdcp.save(_state(0, 10 * s + me), TierStoreWriter(
            store, a["model"], s), no_dist=True)))
    Path(a["out"]).write_text(json.dumps(results))
    store.close()


def _job(a: dict) -> None:
    """A rank of a 2-rank job. ``first``: save step 1, then step 2 with rank 1 stalling before its write (a
    zombie once the job is gone). Otherwise (the restarted job): load the newest step, save step 2 paused at
    ``gate``, load it back."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from tierstore.interop.dcp_storage import DATA_LAYER
    from tierstore.store import TierStore

    rank, d, m = a["rank"], Path(a["dir"]), a["model"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a['port']}", rank=rank, world_size=2)
    store = _open(a["cfg"])
    res: dict[str, Any] = {}
    if a["first"]:
        dcp.save(_state(rank, 1), storage_writer=TierStoreWriter(store, m, 1))
        if rank == 1:
            put = TierStore.put

            def stalling_put(self, key, *args, **kw):
                if key.layer == DATA_LAYER and key.step == 2:
                    (d / "stalled").touch()
                    os.kill(os.getpid(), signal.SIGSTOP)  # stalled before its write and its vote
                    out = _outcome(lambda: put(self, key, *args, **kw))  # woken up after the job restarted
                    (d / "zombie.json.tmp").write_text(json.dumps(out))
                    os.replace(d / "zombie.json.tmp", d / "zombie.json")  # whole: the test reads it once it exists
                return put(self, key, *args, **kw)

            TierStore.put = stalling_put  # type: ignore[method-assign]
        dcp.save(_state(rank, 2), storage_writer=TierStoreWriter(store, m, 2, step_timeout=a["step_timeout"]))
        return  # not reached: rank 1 stalls, and rank 0 is killed waiting for it
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger("tierstore.interop.dcp_storage").addHandler(Keep())
    back = _like(_state(rank, 1))
    tsdcp.load(back, TierStoreReader(store, m))  # the newest committed step: 1
    res["resumed-from-1"] = _same(back, _state(rank, 1))
    w = TierStoreWriter(store, m, 2)
    res["saved"] = _outcome(lambda: tsdcp.save(_state(rank, 2), w, planner=_gated(str(d / f"gated.{rank}"),
                                                                                  str(d / "go"))))
    if rank == 0:
        res["attempt"], res["previous"], res["messages"] = w.attempt, w.previous_attempt, messages
    back = _like(_state(rank, 2))
    tsdcp.load(back, TierStoreReader(store, m, 2))
    res["loaded-2"] = _same(back, _state(rank, 2))
    (d / f"job.{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    store.close()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ the tests


def test_second_writer_of_a_step_is_refused_before_it_writes(store, tmp_path):
    m = "solo"
    first = _spawn("solo", cfg=_config(store), model=m, step=4, gen=1, mark=str(tmp_path / "planned"),
                   gate=str(tmp_path / "go"), out=str(tmp_path / "first.json"))
    try:
        _wait_for(tmp_path / "planned", [first])  # the first save holds step 4 and has not written yet
        with pytest.raises(StepBusyError, match="being saved by another writer"):
            tsdcp.save(_state(0, 2), TierStoreWriter(store, m, 4), no_dist=True)
        assert store.list(m) == []  # the second writer wrote nothing (and the first has not yet)
        (tmp_path / "go").touch()
        assert first.wait(timeout=WAIT) == 0
    finally:
        if first.poll() is None:
            first.kill()
    assert json.loads((tmp_path / "first.json").read_text()) == {"ok": True}
    back = _like(_state(0, 1))
    tsdcp.load(back, TierStoreReader(store, m, 4), no_dist=True)
    assert _same(back, _state(0, 1))  # the first writer's data, bitwise
    assert store.steps.records(m, [4])[0].attempt == 1
    with pytest.raises(KeyExistsError):  # once committed, the step is refused as saved
        tsdcp.save(_state(0, 2), TierStoreWriter(store, m, 4), no_dist=True)


def test_a_save_after_an_attempt_that_timed_out_is_a_new_attempt_naming_the_timeout(store, caplog):
    """The fast case of the restarted job below: a dead writer's attempt (begun, never voted) times out.

    The dead attempt had two ranks and wrote rank 1's object and its metadata (keys the new, one-rank attempt
    never writes): the load reads the objects the new attempt's manifest names, never those."""
    m = "late"
    store.steps.begin(m, 3, 3, layout={"layers": ["dcp", "dcp-metadata"]}, timeout_s=0.2)
    for layer, rank in (("dcp", 1), ("dcp-metadata", 2)):
        store.put(ShardKey(m, layer, 3, rank), {"metadata.json": torch.zeros(3, dtype=torch.uint8)})
    time.sleep(0.3)  # the index's clock decides; any wait past the timeout will do
    w = TierStoreWriter(store, m, 3)
    with caplog.at_level("WARNING", logger="tierstore.interop.dcp_storage"):
        tsdcp.save(_state(0, 1), w, no_dist=True)
    assert w.attempt == 2 and w.previous_attempt.startswith("timed out: it began")
    assert "attempt 1 did not commit (timed out: it began" in caplog.text and "its timeout is 0.2 s" in caplog.text
    for step in (3, None):  # by number, and as the newest committed step
        back = _like(_state(0, 1))
        tsdcp.load(back, TierStoreReader(store, m, step), no_dist=True)
        assert _same(back, _state(0, 1))


def test_two_processes_racing_for_each_step_commit_exactly_one_with_its_own_data(store, tmp_path):
    m, steps = "race", 6
    procs = [_spawn("racer", cfg=_config(store), model=m, id=i, steps=steps, dir=str(tmp_path),
                    out=str(tmp_path / f"racer.{i}.json")) for i in range(2)]
    try:
        assert [p.wait(timeout=WAIT) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = [json.loads((tmp_path / f"racer.{i}.json").read_text()) for i in range(2)]
    for step in range(steps):
        outcomes = [results[i][step] for i in range(2)]
        winners = [i for i in range(2) if outcomes[i]["ok"]]
        assert len(winners) == 1, (step, outcomes)
        loser = outcomes[1 - winners[0]]
        assert loser["error"] in ("StepBusyError", "KeyExistsError"), (step, loser)
        back = _like(_state(0, 0))
        tsdcp.load(back, TierStoreReader(store, m, step), no_dist=True)
        assert _same(back, _state(0, 10 * step + winners[0])), step
        assert store.steps.records(m, [step])[0].attempt == 1


def test_restarted_job_saves_a_step_whose_attempt_timed_out_and_the_stalled_rank_writes_nothing(store, tmp_path):
    m, cfg, timeout = "restart", _config(store), 2.0
    port = free_port()
    job1 = [_spawn("job", cfg=cfg, model=m, rank=r, port=port, dir=str(tmp_path), first=True,
                   step_timeout=timeout) for r in range(2)]
    job2: list[subprocess.Popen] = []
    try:
        _wait_for(tmp_path / "stalled", job1)
        stalled_at = time.monotonic()
        job1[0].kill()  # the launcher restarts the job; rank 1 stays behind, stopped: a zombie
        job1[0].wait(timeout=WAIT)
        assert store.steps.state(m, 2) == "preparing"
        time.sleep(max(0.0, timeout + 0.5 - (time.monotonic() - stalled_at)))  # the attempt is past its timeout
        port = free_port()
        job2 = [_spawn("job", cfg=cfg, model=m, rank=r, port=port, dir=str(tmp_path), first=False)
                for r in range(2)]
        for r in range(2):  # the new attempt holds step 2, no rank of it wrote yet: wake the zombie up now
            _wait_for(tmp_path / f"gated.{r}", job2)
        os.kill(job1[1].pid, signal.SIGCONT)
        _wait_for(tmp_path / "zombie.json")
        zombie = json.loads((tmp_path / "zombie.json").read_text())
        job1[1].kill()
        (tmp_path / "go").touch()
        assert [p.wait(timeout=WAIT) for p in job2] == [0, 0]
    finally:
        for p in job1 + job2:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
    assert zombie["ok"] is False and zombie["error"] == "StepBusyError", zombie
    res = [json.loads((tmp_path / f"job.{r}.json").read_text()) for r in range(2)]
    for r in range(2):
        assert res[r]["resumed-from-1"] and res[r]["saved"] == {"ok": True} and res[r]["loaded-2"], (r, res[r])
    assert res[0]["attempt"] == 2 and res[0]["previous"].startswith("timed out: it began"), res[0]
    assert any("attempt 1 did not commit (timed out: it began" in s and "its timeout is 2 s" in s
               and "saving the step again as attempt 2" in s for s in res[0]["messages"]), res[0]["messages"]
    both = {**_state(0, 2), **_state(1, 2)}  # every rank's data of the new attempt, bitwise, read in one process
    back = _like(both)
    tsdcp.load(back, TierStoreReader(store, m, 2), no_dist=True)
    assert _same(back, both)
    (rec,) = store.steps.records(m, [2])
    assert rec.state in ("committed", "durable") and rec.attempt == 2


if __name__ == "__main__":
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    {"solo": _solo, "racer": _racer, "job": _job}[sys.argv[1]](json.loads(sys.argv[2]))
