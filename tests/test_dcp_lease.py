"""DCP claims are leases (consistency/attempts.py, tierstore/interop/dcp_storage.py): a dead writer's claim lapses
within one lease, so a 2-rank job SIGKILLed mid-step and restarted at once saves the same step number again (and
loads it back bitwise, never the dead attempt's objects); a live writer keeps its lease through a write slower than
several leases (the renewal runs beside the write), and a second live writer is refused, told the lease.

Workers run as ``python -m tests.test_dcp_lease <scenario> <json args>``; each writes its results as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from consistency.attempts import Lease
from consistency.twophase import StepProtocol
from tests import _warm
from tests.redis_server import free_port
from tests.test_dcp_writers import WAIT, _config, _like, _open, _outcome, _same, _state, _wait_for
from tests.test_twophase import Clock
from tierstore import ShardKey
from tierstore.errors import StepBusyError
from tierstore.interop import dcp as tsdcp
from tierstore.interop.dcp import TierStoreReader, TierStoreWriter

ROOT = Path(__file__).resolve().parents[1]


def _spawn(scenario: str, **args: Any) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return _warm.popen([sys.executable, "-m", "tests.test_dcp_lease", scenario, json.dumps(args)], cwd=ROOT,
                            env=env)


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=WAIT)


# ------------------------------------------------------------------------------ the workers


def _job(a: dict) -> None:
    """A rank of a 2-rank gloo job. ``first``: save step 1, then step 2, where rank 1 writes its object and votes
    and rank 0 hangs inside its write (the test SIGKILLs both). Otherwise (the job restarted at once): load the
    newest step, save step 2 again (default lease), load it back."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from tierstore.interop.dcp_storage import DATA_LAYER
    from tierstore.store import TierStore

    rank, d, m = a["rank"], Path(a["dir"]), a["model"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a['port']}", rank=rank, world_size=2)
    store = _open(a["cfg"])
    if a["first"]:
        dcp.save(_state(rank, 1), storage_writer=TierStoreWriter(store, m, 1))
        put = TierStore.put

        def mid_step_put(self, key, *args, **kw):
            if key.layer != DATA_LAYER or key.step != 2:
                return put(self, key, *args, **kw)
            if rank == 0:
                (d / "writing.0").touch()
                time.sleep(3600)  # killed here, mid-write: its claim is never renewed again
            out = put(self, key, *args, **kw)  # rank 1: a partial attempt's object, then its vote
            (d / "written.1").touch()
            return out

        TierStore.put = mid_step_put  # type: ignore[method-assign]
        dcp.save(_state(rank, 1), storage_writer=TierStoreWriter(store, m, 2))
        return  # not reached: both ranks are killed
    res: dict[str, Any] = {}
    back = _like(_state(rank, 1))
    tsdcp.load(back, TierStoreReader(store, m))  # the newest committed step: 1
    res["resumed-from-1"] = _same(back, _state(rank, 1))
    w = TierStoreWriter(store, m, 2)
    res["saved"] = _outcome(lambda: tsdcp.save(_state(rank, 2), w))
    if rank == 0:
        res["attempt"], res["previous"] = w.attempt, w.previous_attempt
    back = _like(_state(rank, 2))
    tsdcp.load(back, TierStoreReader(store, m, 2))
    res["loaded-2"] = _same(back, _state(rank, 2))
    (d / f"job.{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    store.close()
    dist.destroy_process_group()


def _slow(a: dict) -> None:
    """One live writer of step ``step`` whose write takes ``write_s`` (several leases) after touching ``mark``."""
    from tierstore.interop.dcp_storage import DATA_LAYER
    from tierstore.store import TierStore

    store = _open(a["cfg"])
    put = TierStore.put

    def slow_put(self, key, *args, **kw):
        if key.layer == DATA_LAYER:
            Path(a["mark"]).touch()
            time.sleep(a["write_s"])  # a long write: no storage call, no progress, the lease must hold
        return put(self, key, *args, **kw)

    TierStore.put = slow_put  # type: ignore[method-assign]
    w = TierStoreWriter(store, a["model"], a["step"], lease=a["lease"])
    res = _outcome(lambda: tsdcp.save(_state(0, 1), w, no_dist=True))
    res["attempt"] = w.attempt
    Path(a["out"]).write_text(json.dumps(res))
    store.close()


# ------------------------------------------------------------------------------ the tests


def test_a_leased_claim_lapses_unrenewed_and_holds_while_renewed(store):
    """The protocol on the real index, time injected: renewals keep a claim, one lease without them lapses it."""
    m, clock = f"lease{uuid.uuid4().hex[:8]}", Clock()
    sp = StepProtocol(store.index, store.durable, step_timeout_s=600, clock=clock)
    assert sp.claim(m, 1, 2, "a", lease_s=10).attempt == 1
    clock.t += 8
    assert sp.renew(m, 1, "a") == "preparing"
    clock.t += 7  # 15 s after the claim, 7 s after the renewal: still held
    with pytest.raises(StepBusyError, match=r"it holds a lease of 10 s, last renewed 7\.0 s ago: the lease lapses "
                                            r"in 3\.0 s") as ei:
        sp.claim(m, 1, 2, "b", lease_s=10)
    assert ei.value.fields["lease_s"] == 10 and ei.value.fields["lapses_in_s"] == pytest.approx(3.0)
    assert sp.renew(m, 1, "b") == "taken"  # another writer's renewal renews nothing
    clock.t += 3.5  # 10.5 s without a renewal: lapsed (the step's timeout is 600 s)
    c = sp.claim(m, 1, 2, "b", lease_s=10)
    assert (c.attempt, c.previous_state) == (2, "aborted")
    assert c.previous == "lease lapsed: its writer last renewed it 10.5 s before, its lease is 10 s"
    assert sp.renew(m, 1, "a") == "taken"  # the dead writer's renewals (it was not dead after all) stop
    with pytest.raises(StepBusyError, match="held by attempt 2 of another writer"):
        store.put(ShardKey(m, "a", 1, 0), {"w": torch.ones(2)}, attempt="a")
    recs = [store.put(ShardKey(m, "a", 1, r), {"w": torch.full((2,), 2.0 + r)}, attempt="b") for r in range(2)]
    assert sp.vote(m, 1, 0, [recs[0]], attempt="b") == "preparing"
    assert sp.vote(m, 1, 1, [recs[1]], attempt="b") == "committed"
    assert sp.renew(m, 1, "b") == "committed"  # nothing left to renew


def test_the_lease_thread_renews_until_the_step_is_decided(store):
    m = f"lease{uuid.uuid4().hex[:8]}"
    sp = StepProtocol(store.index, store.durable)
    sp.claim(m, 1, 1, "t", lease_s=0.6)
    lease = Lease(sp, m, 1, "t", 0.6)
    try:
        deadline = time.monotonic() + WAIT
        while lease.renewals < 3:
            assert time.monotonic() < deadline, "the lease was never renewed"
            time.sleep(0.05)
        assert sp.vote(m, 1, 0, [store.put(ShardKey(m, "a", 1, 0), {"w": torch.ones(2)}, attempt="t")],
                       attempt="t") == "committed"
        lease._thread.join(timeout=WAIT)
        assert not lease._thread.is_alive() and lease.state == "committed"  # it stopped by itself
    finally:
        lease.stop()


def test_a_slow_live_writer_keeps_its_lease_and_a_second_live_writer_is_refused_naming_it(store, tmp_path):
    m, lease = "slowpoke", 1.0
    slow = _spawn("slow", cfg=_config(store), model=m, step=4, lease=lease, write_s=4 * lease,
                  mark=str(tmp_path / "writing"), out=str(tmp_path / "slow.json"))
    try:
        _wait_for(tmp_path / "writing", [slow])
        time.sleep(1.5 * lease)  # longer than the lease: only renewals beside the write keep the claim
        with pytest.raises(StepBusyError, match=r"it holds a lease of 1 s, last renewed [0-9.]+ s ago: the lease "
                                                r"lapses in [0-9.]+ s unless its writer \(alive\) renews it"):
            tsdcp.save(_state(0, 2), TierStoreWriter(store, m, 4, lease=lease), no_dist=True)
        assert slow.wait(timeout=WAIT) == 0
    finally:
        _kill([slow])
    res = json.loads((tmp_path / "slow.json").read_text())
    assert res == {"ok": True, "attempt": 1}, res  # never taken over
    back = _like(_state(0, 1))
    tsdcp.load(back, TierStoreReader(store, m, 4), no_dist=True)
    assert _same(back, _state(0, 1))  # the slow writer's data, bitwise


def test_a_job_killed_mid_step_and_restarted_at_once_saves_the_same_step_again(store, tmp_path):
    m, cfg = "killed", _config(store)
    port = free_port()
    job1 = [_spawn("job", cfg=cfg, model=m, rank=r, port=port, dir=str(tmp_path), first=True) for r in range(2)]
    job2: list[subprocess.Popen] = []
    try:
        _wait_for(tmp_path / "writing.0", job1)
        _wait_for(tmp_path / "written.1", job1)
        _kill(job1)  # SIGKILL, both ranks: rank 1 wrote its object and voted, rank 0 died inside its write
        assert store.steps.state(m, 2) == "preparing"
        port = free_port()
        job2 = [_spawn("job", cfg=cfg, model=m, rank=r, port=port, dir=str(tmp_path), first=False)
                for r in range(2)]
        assert [p.wait(timeout=WAIT) for p in job2] == [0, 0]
    finally:
        _kill(job1 + job2)
    res = [json.loads((tmp_path / f"job.{r}.json").read_text()) for r in range(2)]
    for r in range(2):
        assert res[r]["resumed-from-1"] and res[r]["saved"] == {"ok": True} and res[r]["loaded-2"], (r, res[r])
    # taken over because the lease lapsed, not because the attempt timed out (its timeout is 600 s)
    assert res[0]["attempt"] == 2 and res[0]["previous"].startswith("lease lapsed: its writer last renewed it"), res[0]
    both = {**_state(0, 2), **_state(1, 2)}  # the new attempt's data, bitwise; never the dead attempt's rank 1 object
    back = _like(both)
    tsdcp.load(back, TierStoreReader(store, m, 2), no_dist=True)
    assert _same(back, both)
    (rec,) = store.steps.records(m, [2])
    assert rec.state in ("committed", "durable") and rec.attempt == 2


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"job": _job, "slow": _slow}[sys.argv[1]](json.loads(sys.argv[2]))
