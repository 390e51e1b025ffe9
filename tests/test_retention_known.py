"""Retention deletes the Checkpointer's own objects by the records it wrote, without reading them again.

Reading the record of every object it deletes was a third of the Checkpointer's retention pass at 1,000
objects per step (docs/benchmarks.md, "Garbage collections inside a save"). The Checkpointer keeps the
records its saves wrote, by step, and retention takes an object's copy name from there
(``consistency.gc.retire``'s ``known``). What must hold, tried on the real Redis server and host tier:

- in steady state a pass reads no record of an object it deletes, and every retired step's objects go, with
  their directories in the host tier;
- a stale known record (the index names another copy) deletes nothing: the record stays, and the next pass,
  which reads it, deletes it.

What a writer keeps per step stays bounded too: the save statistics' bytes per step keep the last steps saved.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import consistency.gc as gcmod
from tierstore.train.checkpointer import Checkpointer


@pytest.fixture()
def bare(tmp_path, redis_url, shm_root):
    import tierstore

    s = tierstore.open(tmp_path / "home", redis=redis_url, durable="none", host_root=str(shm_root / "known"),
                       node_id="known")
    yield s
    s.close()


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4))
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def _spy(monkeypatch, store) -> list[list]:
    """The keys each ``get_objects`` call made inside ``retire`` asked for."""
    reads: list[list] = []
    inside = [False]
    real_retire, real_get = gcmod.retire, store.index.get_objects

    def retire(*a, **kw):
        inside[0] = True
        try:
            return real_retire(*a, **kw)
        finally:
            inside[0] = False

    def get_objects(keys):
        if inside[0]:
            reads.append(list(keys))
        return real_get(keys)

    monkeypatch.setattr("tierstore.train.writing.retire", retire)
    monkeypatch.setattr(store.index, "get_objects", get_objects)
    return reads


def test_a_pass_deletes_its_own_objects_without_reading_their_records(bare, monkeypatch):
    m, opt = _model()
    ck = Checkpointer(bare, "known", m, opt, keep_last=1)
    reads = _spy(monkeypatch, bare)
    for step in range(1, 6):
        ck.save(step)
        assert ck.wait() == "committed"
    steps = sorted({k.step for k in bare.list("known")})
    assert steps == [4, 5], steps  # keep_last=1: the newest committed and the one before its save's vote
    assert not [k for keys in reads for k in keys], f"retention read the records it deletes: {reads}"
    model_dir = bare.host.root / "known"
    dirs = sorted({p.name for layer in model_dir.iterdir() for p in layer.iterdir()})
    assert dirs == ["4", "5"], f"the host tier kept the directories of deleted steps: {dirs}"
    ck.close()


def test_a_stale_known_record_deletes_nothing_and_the_next_pass_reads_it(bare, monkeypatch):
    m, opt = _model()
    ck = Checkpointer(bare, "stale", m, opt, keep_last=1)
    ck.save(1)
    assert ck.wait() == "committed"
    victim = sorted(ck._written[1])[0]
    # what the writer remembers names another copy than the index does (as after a replaced record)
    ck._written[1][victim] = dataclasses.replace(ck._written[1][victim], name=f"{victim}.notthecopy")
    reads = _spy(monkeypatch, bare)
    ck.save(2)
    assert ck.wait() == "committed"
    ck.save(3)  # its pass retires step 1: every object of it goes but the one whose known name is stale
    assert ck.wait() == "committed"
    left = [k for k in bare.list("stale") if k.step == 1]
    assert left == [victim], left
    assert bare.index.get_object(victim) is not None, "a stale name deleted the record"
    assert 1 not in ck._written, "the retired step's records were kept"
    ck.save(4)  # the next pass reads the record and deletes it
    assert ck.wait() == "committed"
    assert not [k for k in bare.list("stale") if k.step == 1]
    assert [victim] in reads, reads
    ck.close()


def test_the_bytes_per_step_keep_the_last_steps_saved_not_every_step_ever(monkeypatch):
    """``SaveStats.per_step`` grew by an entry per step for good: a run that saves every step for a million
    steps held a million entries."""
    from types import SimpleNamespace

    from tierstore.train.writing import SaveStats

    monkeypatch.setattr(SaveStats, "PER_STEP_KEPT", 3)
    stats = SaveStats()
    for step in range(1, 7):
        stats.record(step, [SimpleNamespace(size=10 * step, kind="full")] * 2)
    assert stats.per_step == {4: 80, 5: 100, 6: 120}
    assert stats.bytes == sum(20 * s for s in range(1, 7)) and stats.objects["full"] == 12
