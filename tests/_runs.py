"""What a framework run's checkpoints must look like in the store (tierstore.interop.pointer): one model for the
run, each checkpoint a step of it pinned by its path, nothing retention would still collect, and host memory
holding only the newest step and pinned steps not yet durable."""

from __future__ import annotations

import os

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
    in_host = {k.step for k, r in zip(keys, store.index.get_objects(keys)) if r is not None and host in r.tiers}
    newest = max(states)
    assert in_host <= {newest} | {p.step for p in pointers.values() if states[p.step] != "durable"}, (in_host, states)
    return model
