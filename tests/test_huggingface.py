"""The Hugging Face Trainer on tierstore (tierstore.interop.huggingface), with the real transformers, CPU, gloo.

A 2-layer GPT-2 with dropout trains 12 steps saving every 4 (6 steps an epoch per rank); fresh Trainers resume
through the Trainer's own ``resume_from_checkpoint`` from ``checkpoint-4`` (the first epoch) and from
``checkpoint-8`` (the second), and must equal the uninterrupted run bit for bit: every per-step log entry
(loss, grad_norm, learning_rate, epoch: the Trainer restored its data position, epoch and logging counters
itself) and the final weights. The checkpoint directories hold the pointer and the Trainer's
``trainer_state.json``, no weight or optimizer files. ``resume_from_checkpoint=True`` with
``save_total_limit=2`` resumes from the newest complete directory and the rotation leaves exactly the kept
directories' models in the store. On 1 process (in this one) and on 2 (torch.distributed, gloo).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs transformers (the hf extra)")

from tests import _hf_job as H
from tierstore.errors import CheckpointNotFoundError, ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _check(res: dict) -> None:
    a = res["A"]
    assert a["dirs"] == ["checkpoint-12", "checkpoint-4", "checkpoint-8"]
    assert a["files"] == ["tierstore.json", "trainer_state.json"]  # no weights, optimizer, scheduler, RNG files
    assert sorted(map(int, a["log"])) == list(range(1, 13))
    for tag, epoch in (("B", 0), ("C", 1)):
        r = res[tag]
        assert int(r["epoch_at_start"]) == epoch  # resumed in the first epoch, then in the second
        assert sorted(map(int, r["log"])) == list(range(1, 13))
        for step, entry in r["log"].items():
            assert entry == a["log"][step], (tag, step, entry, a["log"][step])
        assert r["params"] == a["params"], tag
    d = res["D"]
    assert d["dirs"] == ["checkpoint-12", "checkpoint-16"]  # resumed from 12 (the newest), rotated to 2 kept
    assert sorted(map(int, d["log"])) == list(range(1, 17))
    assert d["pointer_models"] == [d["model"]] and d["per_directory"] == []  # the run is one model
    assert d["pins"] == d["want"] and len(d["pins"]) == 2  # rotation: the pins follow the directories


def test_trainer_resumes_bitwise_in_the_first_and_a_later_epoch_one_process(store, tmp_path, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    _check(json.loads(json.dumps(H.run_all(store, str(tmp_path)))))  # keys as the 2-process run's JSON has them
    from tierstore.interop.huggingface import TierStoreTrainer

    t = TierStoreTrainer(model=H.model(), args=H.args(str(tmp_path / "E")), train_dataset=H.Windows(),
                         store=store)
    ptr = json.loads((tmp_path / "A" / "checkpoint-12" / "tierstore.json").read_text())
    store.delete_model(ptr["model"], force=True)  # the directory outlives its model: a typed error, not a fresh run
    with pytest.raises(CheckpointNotFoundError, match="not in this store"):
        t.train(resume_from_checkpoint=str(tmp_path / "A" / "checkpoint-12"))
    only = TierStoreTrainer(model=H.model(), args=H.args(str(tmp_path / "G"), max_steps=4, save_only_model=True),
                            train_dataset=H.Windows(), store=store)
    only.train()  # save_only_model: the weights and the TrainerState, no optimizer, scheduler or RNG
    ptr = json.loads((tmp_path / "G" / "checkpoint-4" / "tierstore.json").read_text())
    assert ptr["info"]["entries"] == ["model", "trainer_state"]
    again = TierStoreTrainer(model=H.model(), args=H.args(str(tmp_path / "G"), max_steps=6, save_only_model=True),
                             train_dataset=H.Windows(), store=store)
    again.train(resume_from_checkpoint=True)  # resumes the weights and the position, as the Trainer's own files do
    assert again.state.global_step == 6 and H.params(again.model) != H.params(H.model())
    with pytest.raises(ConfigError, match="load_best_model_at_end"):
        TierStoreTrainer(model=H.model(), args=H.args(str(tmp_path / "F"), load_best_model_at_end=True,
                                                       eval_strategy="steps", eval_steps=4),
                         train_dataset=H.Windows(), eval_dataset=H.Windows(), store=store)


def test_trainer_resumes_bitwise_on_two_processes(tmp_path):
    from tests import _warm
    from tests._ranks import run_ranks

    out = tmp_path / "out"
    job = run_ranks("tests._hf_job", [str(out), str(tmp_path / "home")], preload=_warm.HF, timeout_s=400)
    assert job.codes == [0, 0], job.tail()
    for rank in range(2):  # each rank's own RNG (dropout) and the replicas stored once (dedup)
        got = json.loads(Path(f"{out}.{rank}.json").read_text())
        _check(got)
        # each train() makes the run's gloo group and its end destroys it: four runs, no group more than after one
        assert len(got["groups"]) == 4 and len(set(got["groups"])) == 1, got["groups"]


def test_lazy_saves_resume_bitwise_in_the_first_and_a_later_epoch(store, tmp_path, monkeypatch):
    """``store_lazy=True``: the parameters and the optimizer state are copied while the next step computes, its
    optimizer step waiting for the copy; every resume is still bitwise the uninterrupted run (a copy that read
    the state after the next update would not be). Each copy is held until the next optimizer step is about to
    run (a step pre-hook installed before the store's), so the copy and the update meet every time."""
    import threading

    from transformers import TrainerCallback

    from tierstore.interop import huggingface
    from tierstore.train.checkpointer import Checkpointer

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    made, real_init, real_lazy, real_trainer_init = [], Checkpointer.__init__, Checkpointer._lazy, \
        huggingface.TierStoreTrainer.__init__
    permits, pending = threading.Semaphore(0), []

    def init(self, *a, **kw):
        if "trainer_state" in (kw.get("state") or {}):  # a save's Checkpointer (a resume's load makes its own)
            made.append(kw.get("lazy", False))
        real_init(self, *a, **kw)

    def held(self, job, *a, **kw):
        assert permits.acquire(timeout=60)
        return real_lazy(self, job, *a, **kw)

    def release_pending(trainer) -> bool:
        ck = getattr(trainer, "_ts_ck", None)
        job = ck[0]._gate._current if ck else None
        if job is not None and not job.released:
            permits.release()
            return True
        return False

    class Release(TrainerCallback):
        trainer = None
        hooked = False

        def on_step_begin(self, args, state, control, **kw):
            if not self.hooked:  # before the store's own hook (its Checkpointer is made at the first save)
                self.trainer.optimizer.optimizer.register_step_pre_hook(lambda *a: (release_pending(self.trainer), None)[1])
                self.hooked = True
            ck = getattr(self.trainer, "_ts_ck", None)
            job = ck[0]._gate._current if ck else None
            pending.append(job is not None and not job.released)

        def on_train_end(self, args, state, control, **kw):
            release_pending(self.trainer)  # the last save's copy: no step follows it

    def trainer_init(self, *a, **kw):
        real_trainer_init(self, *a, **kw)
        self.add_callback(type("R", (Release,), {"trainer": self}))

    monkeypatch.setattr(Checkpointer, "__init__", init)
    monkeypatch.setattr(Checkpointer, "_lazy", held)
    monkeypatch.setattr(huggingface.TierStoreTrainer, "__init__", trainer_init)
    _check(json.loads(json.dumps(H.run_all(store, str(tmp_path), store_lazy=True))))
    assert made and all(made), made  # every run's Checkpointer saved lazily
    assert any(pending), pending  # a step began while the previous save's copy was still pending


def test_a_save_returns_before_its_commit_and_the_pointer_follows_it(store, tmp_path, monkeypatch):
    """``store_async`` (the default): ``_save_checkpoint`` returns while the step's commit is still held up (the
    training goes on); the pointer appears only once the step is committed; the next save waits for the previous
    one; a directory whose save never committed (``trainer_state.json`` alone) is skipped by a resume; a commit
    that fails raises, typed, at the next call that waits for it, and writes no pointer."""
    import threading

    from tierstore.errors import CommitError
    from tierstore.interop.huggingface import TierStoreTrainer, last_checkpoint
    from tierstore.train.checkpointer import Checkpointer

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    gate, seen = threading.Event(), []
    real_wait = Checkpointer.wait

    def held_wait(self, *a, **kw):  # the commit waits off the training thread are held until it went on
        name = threading.current_thread().name
        seen.append(name)
        if name.startswith("tierstore-hf-save"):
            assert gate.wait(60)
        return real_wait(self, *a, **kw)

    monkeypatch.setattr(Checkpointer, "wait", held_wait)

    class Watch(TierStoreTrainer):
        def training_step(self, *a, **kw):
            if self.state.global_step == 5:  # after the save of checkpoint-4 returned
                assert not (tmp_path / "run" / "checkpoint-4" / "tierstore.json").exists()  # not committed yet
                assert (tmp_path / "run" / "checkpoint-4" / "trainer_state.json").exists()
                gate.set()
            return super().training_step(*a, **kw)

    t = Watch(model=H.model(), args=H.args(str(tmp_path / "run"), max_steps=8), train_dataset=H.Windows(),
              store=store)
    t.train()
    # each save's commit was waited for off the training thread
    assert sum(n.startswith("tierstore-hf-save") for n in seen) == 2, seen
    for n in (4, 8):
        ptr = json.loads((tmp_path / "run" / f"checkpoint-{n}" / "tierstore.json").read_text())
        assert store.steps.state(ptr["model"], ptr["step"]) in ("committed", "durable")
    # a save that never committed: trainer_state.json alone; a resume takes the newest that did
    (tmp_path / "run" / "checkpoint-12").mkdir()
    (tmp_path / "run" / "checkpoint-12" / "trainer_state.json").write_text("{}")
    assert last_checkpoint(tmp_path / "run", store) == str(tmp_path / "run" / "checkpoint-8")
    monkeypatch.setattr(Checkpointer, "wait", lambda self, *a, **kw: "aborted")
    bad = TierStoreTrainer(model=H.model(), args=H.args(str(tmp_path / "bad"), max_steps=4),
                           train_dataset=H.Windows(), store=store)
    with pytest.raises(CommitError, match="aborted"):
        bad.train()  # its only save fails: raised when train() ends, which waits for it
    assert not (tmp_path / "bad" / "checkpoint-4" / "tierstore.json").exists()


def test_save_total_limit_every_step_on_a_slow_durable_tier_leaves_the_newest_step_alone_in_memory(
        store, tmp_path, monkeypatch):
    """A save per step with ``save_total_limit=3`` on a durable tier slower than the saves: the steps whose
    migration was still running when a later save collected are kept in memory then; at the end of ``train()``
    (``store_settle``) the run waits for the migration and collects them, so host memory holds the newest step
    alone and the run keeps exactly the pinned steps of the directories left. ``store_settle=False`` leaves
    them."""
    from tests._runs import check_run
    from tierstore.interop.huggingface import TierStoreTrainer
    from tierstore.interop.pointer import read_pointer
    from tierstore.testing.faults import FaultPlan, FaultRule, install

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    install(store, FaultPlan([FaultRule("backend.put@durable", "slow", delay_s=0.05)]))

    def run(out, **kw):
        t = TierStoreTrainer(model=H.model(), args=H.args(str(out), max_steps=8, save_steps=1, save_total_limit=3),
                             train_dataset=H.Windows(), store=store, **kw)
        t.train()
        dirs = sorted(p for p in out.iterdir() if p.name.startswith("checkpoint-"))
        return {str(d): read_pointer(d / "tierstore.json") for d in dirs}

    pointers = run(tmp_path / "settled")
    assert len(pointers) == 3
    check_run(store, pointers)  # one model, three pinned steps, host memory: the newest step only

    left = run(tmp_path / "unsettled", store_settle=False)
    model = next(iter(left.values())).model
    host = store.host.tier
    in_memory = {k.step for k, r in zip(store.list(model), store.index.get_objects(store.list(model)))
                 if r is not None and host in r.tiers}
    assert len(in_memory) > 1, in_memory  # what store_settle collects: steps left in memory after the last save


def test_a_hung_durable_tier_delays_the_end_of_train_by_store_timeout_at_most(store, tmp_path, monkeypatch, caplog):
    """Every durable put hangs: the first save's durable epoch record and each pin's record are waited for
    ``pin_record_timeout_s`` at most (then warned about), the saves still commit in host memory, and the end of
    ``train()`` waits for their migration (``store_settle``) for ``store_timeout`` seconds, logs that it did not
    finish, and returns: a hung durable tier never hangs a run, and its checkpoints still resume."""
    import logging
    import time

    from tierstore.interop.huggingface import TierStoreTrainer
    from tierstore.testing.faults import FaultPlan, FaultRule, install

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    plan = install(store, FaultPlan([FaultRule("backend.put@durable", "hang", delay_s=120)]))
    store.steps.pin_record_timeout_s = 2  # the durable records' bound (the first save's epoch record, the pins)
    try:
        t = TierStoreTrainer(model=H.model(), args=H.args(str(tmp_path / "out"), max_steps=4, save_steps=2),
                             train_dataset=H.Windows(), store=store, store_timeout=3)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="tierstore.interop.huggingface"):
            t.train()
        took = time.monotonic() - t0
        assert took < 60, took  # the records' bounds (2 s), the settle's (3 s) and the training, not the hang (120 s)
        assert any("migration did not finish" in r.getMessage() for r in caplog.records)
        again = TierStoreTrainer(model=H.model(), args=H.args(str(tmp_path / "out"), max_steps=6, save_steps=2),
                                 train_dataset=H.Windows(), store=store, store_timeout=3, store_settle=False)
        again.train(resume_from_checkpoint=True)  # from memory: checkpoint-4 committed there
        assert again.state.global_step == 6
    finally:
        plan.arm()  # let the hung puts go
