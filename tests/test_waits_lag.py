"""The bounded lag holds under a slow durable tier: a step every few saves becomes durable (issue 28).

The durable tier here takes one put per save (a gate the test opens once after each save), so the durable
tier is about five saves behind per step (four layer objects and the durable manifest). Before the fix, a
step whose last object had migrated counted as no longer migrating while its callback wrote the durable
manifest, and the next save's retention (keep_last=3) retired it: 60 saves ended with no step durable.
The test counts puts and saves, never seconds.
"""

from __future__ import annotations

import threading
import time

import torch

from backends.base import Backend
from consistency.steprecords import durable_lag
from tierstore.train.checkpointer import Checkpointer


class OnePutPerPermit:
    """A durable tier whose every put waits for a permit the test hands out (a deterministic slow tier)."""

    def __init__(self, inner: Backend):
        self.inner = inner
        self.gated = False
        self.permits = threading.Semaphore(0)
        self.done = 0
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put(self, name, data, *, if_absent=False):
        if self.gated and not name.endswith(".epoch"):  # the objects and durable manifests, not epoch records
            assert self.permits.acquire(timeout=60), "the test never handed out a permit"
        self.inner.put(name, data, if_absent=if_absent)
        with self._lock:
            self.done += 1


def test_a_step_every_few_saves_becomes_durable_under_a_slow_durable_tier(store):
    gate: list[OnePutPerPermit] = []

    def wrap(b):
        if b.tier != "durable":
            return b
        gate.append(OnePutPerPermit(b))
        return gate[0]

    store.rewire(tier=wrap)
    tier = gate[0]
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])  # 4 layers: 4 objects a step
    ck = Checkpointer(store, "lagload", model, rank=0, world_size=1, keep_last=3)
    tier.gated = True
    newest: list[int | None] = []
    try:
        for step in range(1, 41):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            ck.save(step)
            assert ck.wait() == "committed"
            before = tier.done
            tier.permits.release()  # one put per save: the durable tier lags about five saves per step
            deadline = time.monotonic() + 60  # a hang guard, not a speed assertion
            while tier.done == before and time.monotonic() < deadline:
                time.sleep(0.005)
            assert tier.done > before, "the migrator never used its put (nothing to migrate?)"
            newest.append(durable_lag(store.steps.records("lagload"), store.index.server_time()).newest_durable)
        durable_steps = {s for s in newest if s is not None}
        assert durable_steps, f"no step became durable in 40 saves: {newest}"
        # bounded: after the first durable step, the durable tier is never more than a few steps' puts behind
        first = next(i for i, s in enumerate(newest) if s is not None)
        assert first < 15, f"the first durable step came only at save {first + 1}: {newest}"
        for i in range(first, len(newest)):
            assert newest[i] is not None and (i + 1) - newest[i] <= 15, f"lag unbounded at save {i + 1}: {newest}"
        assert len(durable_steps) >= 3, f"too few steps became durable: {newest}"
    finally:
        tier.gated = False
        for _ in range(64):
            tier.permits.release()
        ck.close()
        store.flush()
