"""A stateful property test of the commit protocol (hypothesis RuleBasedStateMachine).

Random interleavings of begin, prepare (full or delta), vote (yes or no),
crash + restore (a new epoch: the old ranks live on as zombies), time
passing (an injected clock against the step timeout), expiry, migration
(flush), gc and restore, against the real Redis-protocol server and a local
durable directory. A model predicts every state; the invariants:

- a committed step is never lost or changed (until the retention drops it),
  and restore returns the newest one, bitwise;
- an aborted step is never committed or returned;
- a fenced rank's put or vote raises FencedError and changes nothing;
- gc never deletes an object a kept step reaches.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
import redis
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import tierstore
from consistency.gc import Retention
from consistency.twophase import StepProtocol
from tierstore import ShardKey
from tierstore.delta import xor_delta
from tierstore.errors import FencedError
from tierstore.errors import MigrationError

M = "sm"
WORLD = 2
TIMEOUT = 10.0
ENV: dict[str, str] = {}


def data(step: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 7919 + rank)
    return {"w": torch.randn(32, generator=g), "m": torch.randn(4, generator=g).half()}


class Clock:
    t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


class Protocol(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        redis.Redis.from_url(ENV["url"]).flushall()
        self.root = Path(ENV["tmp"]) / uuid.uuid4().hex[:8]
        self.store = tierstore.open(self.root / "home", redis=ENV["url"], durable=f"file://{self.root / 'd'}",
                                    host_root=str(Path(ENV["shm"]) / self.root.name), node_id="n")
        self.clock = Clock()
        self.store.steps = StepProtocol(self.store.index, self.store.durable, step_timeout_s=TIMEOUT,
                                        clock=self.clock)
        self.epoch = self.store.open_epoch(M)
        self.actors = [{"rank": r, "epoch": self.epoch, "infos": {}, "voted": set()} for r in range(WORLD)]
        self.next_step = 1
        self.steps: dict[int, dict] = {}  # step -> {state, started, votes, epoch}
        self.manifests: dict[int, str] = {}  # committed step -> its manifest, as first seen

    def teardown(self):
        if hasattr(self, "store"):
            self.store.close()
            shutil.rmtree(self.root, ignore_errors=True)
            shutil.rmtree(Path(ENV["shm"]) / self.root.name, ignore_errors=True)

    # -- the model ---------------------------------------------------------------------
    def committed(self) -> list[int]:
        return sorted(s for s, v in self.steps.items() if v["state"] == "committed")

    def _decide_stale(self, s: int) -> str:
        v = self.steps[s]
        if v["state"] == "preparing" and self.clock.t - v["started"] > TIMEOUT:
            v["state"] = "aborted"
        return v["state"]

    # -- rules -------------------------------------------------------------------------
    @rule()
    def begin(self):
        s = self.next_step
        self.next_step += 1
        self.store.begin_step(M, s, WORLD, layout={"layers": ["a"]}, epoch=self.epoch)
        self.steps[s] = {"state": "preparing", "started": self.clock.t, "votes": set(), "epoch": self.epoch}

    def _to_prepare(self) -> list[tuple[dict, int]]:
        return [(a, s) for a in self.actors for s, v in sorted(self.steps.items())
                if v["state"] == "preparing" and s not in a["voted"] and s not in a["infos"]]

    def _to_vote(self) -> list[tuple[dict, int]]:
        return [(a, s) for a in self.actors for s in sorted(a["infos"]) if s not in a["voted"]]

    @precondition(lambda self: self._to_prepare())
    @rule(pick=st.integers(0, 1 << 16), delta=st.booleans())
    def prepare(self, pick, delta):
        cands = self._to_prepare()
        a, s = cands[pick % len(cands)]
        key = ShardKey(M, "a", s, a["rank"])
        bases = [c for c in self.committed() if c < s]
        new = data(s, a["rank"])
        try:
            if delta and bases:
                old_key = key.with_step(bases[-1])
                old = data(bases[-1], a["rank"])
                layout = {n: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                          for n, t in old.items()}
                info = self.store.put(key, {n: xor_delta(new[n], old[n]) for n in new}, {"_delta": layout},
                                      kind="delta", base=old_key, epoch=a["epoch"])
            else:
                info = self.store.put(key, new, epoch=a["epoch"])
        except FencedError:
            assert a["epoch"] < self.epoch
            return
        assert a["epoch"] == self.epoch
        a["infos"][s] = info

    @precondition(lambda self: self._to_vote())
    @rule(pick=st.integers(0, 1 << 16), ok=st.sampled_from([True, True, True, False]))
    def vote(self, pick, ok):
        cands = self._to_vote()
        a, s = cands[pick % len(cands)]
        v = self.steps[s]
        if a["epoch"] == self.epoch and v["epoch"] < self.epoch:
            return  # a new incarnation only votes on steps it began
        try:
            got = self.store.vote(M, s, a["rank"], [a["infos"][s]] if ok else [], ok=ok, epoch=a["epoch"])
            if s in self.steps and self.steps[s]["state"] == "preparing" and a["epoch"] < self.epoch:
                raise AssertionError(f"a zombie's vote for step {s} was accepted")
        except FencedError:
            assert a["epoch"] < self.epoch
            return
        assert a["epoch"] == self.epoch
        a["voted"].add(s)
        state = self._decide_stale(s)
        if state == "preparing":
            if not ok:
                v["state"] = "aborted"
            else:
                v["votes"].add(a["rank"])
                if len(v["votes"]) == WORLD:
                    v["state"] = "committed"
        assert got.replace("durable", "committed") == v["state"], (s, got, v)

    @rule(dt=st.sampled_from([3.0, 11.0]))
    def time_passes(self, dt):
        self.clock.t += dt

    @precondition(lambda self: self.steps)
    @rule(pick=st.integers(0, 63))
    def expire(self, pick):
        s = sorted(self.steps)[pick % len(self.steps)]
        got = self.store.steps.abort_if_stale(M, s)
        assert got.replace("durable", "committed") == self._decide_stale(s)

    @rule()
    def migrate(self):
        try:
            self.store.flush()
        except MigrationError as e:  # only objects gc deleted before their migration may fail
            for key, _err in e.failures:
                assert self.store.info(key) is None, key

    @rule(keep_last=st.integers(1, 3), every=st.integers(0, 3))
    def gc(self, keep_last, every):
        before = dict(self.store.steps.steps(M))
        self.store.gc(M, Retention(keep_last=keep_last, keep_durable_every=every), dry_run=False)
        committed = self.committed()
        kept = set(committed[-keep_last:])
        if every:
            kept |= {s for s in committed if before.get(s) == "durable" and s % every == 0}
        for s in committed:
            if s not in kept:
                del self.steps[s]
                self.manifests.pop(s, None)
        for s in kept:
            self.check_step(s)

    @rule()
    def crash_and_restore(self):
        """Every rank crashes (or is presumed dead); a new incarnation restores. The old ones live on as zombies."""
        self.epoch = self.store.open_epoch(M)
        for a in self.actors:
            a["infos"].clear()  # a zombie's pending shards were written before the restore
        self.actors = self.actors[-WORLD:] + [
            {"rank": r, "epoch": self.epoch, "infos": {}, "voted": set()} for r in range(WORLD)]
        committed = self.committed()
        if committed:
            res = self.store.resolve(M)
            assert res.step == committed[-1]
            self.check_step(res.step)

    def check_step(self, s: int):
        for r in range(WORLD):
            got = self.store.get(ShardKey(M, "a", s, r))
            assert all(torch.equal(got.tensors[n], t) for n, t in data(s, r).items()), (s, r)

    # -- invariants --------------------------------------------------------------------
    @invariant()
    def states_match_the_model(self):
        if not hasattr(self, "store"):
            return
        stored = {s: st.replace("durable", "committed") for s, st in self.store.steps.steps(M)}
        for s, v in self.steps.items():
            if v["state"] == "committed":
                assert stored.get(s) == "committed", (s, stored)
            elif v["state"] == "aborted":
                assert stored.get(s) == "aborted", (s, stored)
        assert {s for s, st in stored.items() if st == "committed"} == set(self.committed())

    @invariant()
    def committed_manifests_never_change(self):
        if not hasattr(self, "store"):
            return
        for s in self.committed():
            m = self.store.steps.manifest(M, s)
            body = repr(m["ranks"])
            assert self.manifests.setdefault(s, body) == body


@pytest.fixture(scope="module", autouse=True)
def _services(redis_proc, tmp_path_factory):
    """The state machine runs as a unittest TestCase: it gets its services through ENV."""
    shm = Path("/dev/shm" if Path("/dev/shm").is_dir() else "/tmp") / f"tierstore-sm-{uuid.uuid4().hex[:8]}"
    shm.mkdir()
    if redis_proc.proc is None or redis_proc.proc.poll() is not None:
        redis_proc.start()
    ENV.update(url=redis_proc.url, tmp=str(tmp_path_factory.mktemp("sm")), shm=str(shm))
    yield
    shutil.rmtree(shm, ignore_errors=True)


TestProtocol = Protocol.TestCase
TestProtocol.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                 suppress_health_check=list(HealthCheck))
TestProtocol = pytest.mark.timeout(170)(TestProtocol)
