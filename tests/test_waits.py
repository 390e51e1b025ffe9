"""Every wait ends (issue 28): a durable tier whose put hangs, an index server that stops answering.

Real parts: the Redis-protocol server of the fixtures (a private one where it is stopped with SIGSTOP, so no
other test's server is touched; SIGCONT always follows, in a finally), a local durable directory whose puts
block on an Event the test sets at the end (a stuck NFS or FUSE mount). Each bound is asserted by the call
ending (a thread joined with a generous guard), never by how fast it was.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import torch

import tierstore
from tests.redis_server import RedisProcess
from tierstore import ShardKey
from tierstore.errors import DurableTimeoutError, TierUnavailableError
from tierstore.train.checkpointer import Checkpointer

GUARD_S = 120  # a call still blocked after this never ends (the old code's close() blocked for ever)
SLACK_S = 30  # a bound is asserted as the bound plus this (a loaded machine), never as a speed


class HungPuts:
    """A durable tier whose object puts block until ``release`` is set (epoch records go through)."""

    def __init__(self, inner):
        self.inner = inner
        self.release = threading.Event()
        self.entered = threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put(self, name, data, *, if_absent=False):
        if not name.endswith(".epoch"):
            self.entered.set()
            self.release.wait(GUARD_S * 2)
        return self.inner.put(name, data, if_absent=if_absent)


def _open(tmp_path, redis_url, shm_root, **options):
    return tierstore.open(tmp_path / "home", redis=redis_url, durable=f"file://{tmp_path / 'durable'}",
                          host_root=str(shm_root / "node0"), node_id="node0", **options)


def _ends(fn, guard: float = GUARD_S):
    """Run ``fn`` on a thread; return (ended, its result or error)."""
    out: dict = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(guard)
    return not t.is_alive(), out


def test_a_hung_durable_put_is_reported_and_every_wait_ends(tmp_path, redis_url, shm_root, caplog):
    store = _open(tmp_path, redis_url, shm_root, durable_stall_s=0.5, close_timeout_s=3.0, flush_timeout_s=2.0)
    hung: list[HungPuts] = []
    store.rewire(tier=lambda b: hung.append(HungPuts(b)) or hung[-1] if b.tier == "durable" else b)
    tier = hung[0]
    caplog.set_level(logging.WARNING, logger="tierstore.migration")
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    ck = Checkpointer(store, "hung", model, rank=0, world_size=1, keep_last=3)
    try:
        states = []
        for step in range(1, 31):  # saves go on: they wait for the memory tiers only
            ck.save(step)
            states.append(ck.wait())
        assert states == ["committed"] * 30
        assert tier.entered.is_set()
        # reported within about durable_stall_s: the watchdog's warning names the tier, the step and the put
        ended, _ = _ends(lambda: _until(lambda: store.durable_stalled()))
        assert ended and store.durable_stalled()
        key, phase, _age = store.durable_stalled()[0]
        assert key.model == "hung" and phase == "put to the durable tier"
        # the watchdog warns at its next wake-up (a quarter of durable_stall_s) after stalled() says so
        _until(lambda: any("stalled" in r.getMessage() for r in caplog.records))
        warned = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
        assert warned and "durable tier" in warned[0] and f"step {key.step} of hung" in warned[0]
        # wait(durable=True) ends within its bound, typed, naming the tier and the step
        ended, out = _ends(lambda: ck.wait(timeout=1.0, durable=True), 1.0 + SLACK_S)
        assert ended, "wait(durable=True) never ended"
        err = out.get("error")
        assert isinstance(err, DurableTimeoutError), out
        assert err.tier == "durable" and err.step == 30 and err.model == "hung"
        assert "put to the durable tier" in str(err)
        # flush() too (StoreConfig.flush_timeout_s), naming the steps still memory-only
        ended, out = _ends(store.flush, 2.0 + SLACK_S)
        assert ended and isinstance(out.get("error"), DurableTimeoutError), out
        assert ("hung", key.step) in out["error"].steps and "flush_timeout_s" in str(out["error"])
        ck.close()
        caplog.clear()
        ended, out = _ends(store.close, 3.0 + SLACK_S)  # close_timeout_s: returns, naming what stays memory-only
        assert ended, "store.close() never returned"
        assert "error" not in out, out
        left = out["result"]
        assert left == store.memory_only_at_close and ("hung", key.step) in left and ("hung", 30) in left
        said = [r.getMessage() for r in caplog.records if "stay memory-only" in r.getMessage()]
        assert said and f"hung@{key.step}" in said[0]
    finally:
        tier.release.set()
        store.close()


def _until(cond, guard: float = GUARD_S) -> bool:
    import time

    deadline = time.monotonic() + guard
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_close_returns_within_its_bound_when_the_index_stops_answering(tmp_path, shm_root):
    rp = RedisProcess(tmp_path / "redis-private")
    (tmp_path / "redis-private").mkdir()
    rp.start()
    store = None
    stopped = False
    try:
        store = _open(tmp_path, rp.url, shm_root, index_timeout_s=1.0, index_ack_timeout_s=0.2,
                      close_timeout_s=3.0)
        hung: list[HungPuts] = []
        store.rewire(tier=lambda b: hung.append(HungPuts(b)) or hung[-1] if b.tier == "durable" else b)
        store.begin_step("silent", 1, 1)
        info = store.put(ShardKey("silent", "a", 1, 0), {"w": torch.ones(16)})
        store.vote("silent", 1, 0, [info])
        assert _until(hung[0].entered.is_set)  # the migration holds its object; it records it in the index next
        os.kill(rp.proc.pid, signal.SIGSTOP)  # a partition: the server accepts nothing, answers nothing
        stopped = True
        hung[0].release.set()  # the migration's next call is to the silent index
        # one index call fails typed within its bound: one socket timeout (max(index_timeout_s,
        # index_ack_timeout_s + 5) = 5.2 s), never resent after it
        ended, out = _ends(lambda: store.steps.steps("silent"), 2 * 5.2 + SLACK_S)
        assert ended and isinstance(out.get("error"), TierUnavailableError), out
        ended, out = _ends(store.close, 3.0 + SLACK_S)
        assert ended, "store.close() waited on the silent index"
        assert "error" not in out, out
        assert ("silent", 1) in out["result"]  # its migration did not finish: it stays memory-only
    finally:
        if stopped:
            os.kill(rp.proc.pid, signal.SIGCONT)
        if store is not None:
            store.close()
        rp.stop()


def test_wait_durable_returns_once_the_step_is_durable(store):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    ck = Checkpointer(store, "durwait", model, rank=0, world_size=1)
    try:
        ck.save(1)
        assert ck.wait(durable=True) == "committed"
        assert store.steps.state("durwait", 1) == "durable"
        ck.save(2)
        ck.wait()
        store.flush()
        assert ck.wait(durable=True) == "committed"  # already durable: returns at once
    finally:
        ck.close()


class HungEverything(HungPuts):
    """A durable tier whose every put hangs, the epoch records' too (a mount that stopped answering)."""

    def put(self, name, data, *, if_absent=False):
        self.entered.set()
        self.release.wait(GUARD_S * 2)
        return self.inner.put(name, data, if_absent=if_absent)


def test_a_first_save_on_a_hung_durable_tier_waits_for_its_epoch_record_a_bounded_time(
        tmp_path, redis_url, shm_root, caplog):
    """The first save of an incarnation records its epoch in the durable tier, create-once, before the index hands
    it out. With every durable put hung, that record is waited for ``pin_record_timeout_s`` at most: then it is
    warned about (as a tier that cannot be written), the epoch is taken in the index, and the save commits in
    memory; the record is written when the tier answers."""
    store = _open(tmp_path, redis_url, shm_root, close_timeout_s=3.0, flush_timeout_s=2.0)
    hung: list[HungPuts] = []
    store.rewire(tier=lambda b: hung.append(HungEverything(b)) or hung[-1] if b.tier == "durable" else b)
    store.steps.pin_record_timeout_s = 2.0
    caplog.set_level(logging.WARNING, logger="consistency.epochs")
    ck = Checkpointer(store, "hung-epoch", torch.nn.Linear(8, 8), rank=0, world_size=1, keep_last=3)
    try:
        ended, out = _ends(lambda: (ck.save(1), ck.wait())[1])
        assert ended and out.get("result") == "committed", out
        assert hung[0].entered.is_set()
        assert any("not recorded in the durable tier" in r.getMessage() and "did not answer within 2 s"
                   in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
        assert ck.epoch is not None and ck.epoch >= 1
        ended, _ = _ends(ck.close, guard=2.0 + 3.0 + SLACK_S)
        assert ended
    finally:
        hung[0].release.set()
        store.close()
    store = _open(tmp_path, redis_url, shm_root)
    try:  # the record follows once the tier answers (its put was left running, not dropped)
        import time

        deadline = time.monotonic() + SLACK_S
        while store.steps.epochs.durable_epoch("hung-epoch") < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert store.steps.epochs.durable_epoch("hung-epoch") >= 1
    finally:
        store.close()
