"""What a framework run's checkpoints must look like in the store (tierstore.interop.pointer): one model for the
run, each checkpoint a step of it pinned by its path, nothing retention would still collect, and host memory
holding only what the newest step and the pinned steps not yet durable read."""

from __future__ import annotations

import os

from consistency.closure import reachable
from consistency.gc import Retention


def check_run(store, pointers: dict) -> str:
    """``pointers``: label (the checkpoint's path) -> its Pointer. Returns the run's model."""
    models = {p.model for p in pointers.values()}
    assert len(models) == 1, f"a run is one model: {models}"
    model = models.pop()
    assert store.steps.pins(model) == {os.path.abspath(k): p.step for k, p in pointers.items()}
    states = dict(store.steps.steps(model))
    for label, p in pointers.items():
        assert states.get(p.step) in ("committed", "durable"), (label, p.step, states)
    report = store.gc(model, Retention(keep_last=1))  # a dry run: what a collection would still take
    assert report.dropped_steps == [], f"left uncollected: {report.dropped_steps} of {states}"
    host = store.host.tier
    keys = store.list(model)
    in_host = {k for k, r in zip(keys, store.index.get_objects(keys)) if r is not None and host in r.tiers}
    newest = max(states)
    # what memory may hold: the objects a restore of the newest step or of a pinned step not yet durable reads
    # (a differential step's delta chain reaches objects saved at retired steps: they stay until it is durable)
    live = sorted({newest} | {p.step for p in pointers.values() if states[p.step] != "durable"})
    allowed = reachable(store.steps, model, live)
    assert in_host <= allowed, (sorted({k.step for k in in_host - allowed}), live, states)
    return model
