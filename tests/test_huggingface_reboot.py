"""The Hugging Face Trainer on tierstore after a node reboot right after a save (issue 29, items 1 and 6).

The store is the embedded default (``tierstore.open(home)``). Run A (``max_steps=8``) stops after its save
at step 4, and everything becomes durable; run B resumes from it and saves ``checkpoint-8`` with the migration
not yet run (a store opened with ``migrate=False``: what a SIGKILL right after that save leaves). Then the
reboot: the index server stopped, the host tier wiped. ``resume_from_checkpoint=True`` resumes from the newest
checkpoint a tier still holds (``checkpoint-4``, durable), says so, and is bitwise the uninterrupted run; the
lost directory given explicitly raises ``CheckpointGoneError`` naming ``checkpoint-4``; a run with no
checkpoint yet starts fresh under ``resume_from_checkpoint=True`` instead of raising. On two processes
(torch.distributed, gloo) the same, with run B SIGKILLed right after its save (``tests/_hf_reboot_job.py``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs transformers (the hf extra)")

from transformers import TrainerCallback

import tierstore
from tests import _hf_job as H
from tierstore.embedded import stop_server
from tierstore.errors import CheckpointGoneError
from tierstore.interop.huggingface import TierStoreTrainer

ROOT = Path(__file__).resolve().parents[1]


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def _trainer(store, out, max_steps=8, callbacks=None, **kw):
    return TierStoreTrainer(model=H.model(), args=H.args(str(out), max_steps=max_steps, **kw), train_dataset=H.Windows(),
                            store=store, callbacks=callbacks)


def _reboot(home: Path) -> None:
    stop_server(home)
    shm = Path(os.environ["TIERSTORE_SHM_DIR"])
    for p in shm.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def test_reboot_right_after_a_save_resumes_from_the_newest_durable_checkpoint(tmp_path, monkeypatch, caplog):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    home, out = tmp_path / "home", tmp_path / "run"
    s = tierstore.open(home)
    try:
        ref = _trainer(s, tmp_path / "ref", save_strategy="no")
        ref.train()
        _trainer(s, out, callbacks=[StopAt(4)]).train()
        s.flush()  # checkpoint-4 durable
    finally:
        s.close()
    s = tierstore.open(home, migrate=False)  # checkpoint-8 commits in host memory only
    try:
        _trainer(s, out).train(resume_from_checkpoint=str(out / "checkpoint-4"))
    finally:
        s.close()
    assert sorted(os.listdir(out)) == ["checkpoint-4", "checkpoint-8"]
    _reboot(home)

    s = tierstore.open(home)
    try:
        with pytest.raises(CheckpointGoneError) as e:
            _trainer(s, out).train(resume_from_checkpoint=str(out / "checkpoint-8"))
        assert e.value.newest == str(out / "checkpoint-4") and e.value.newest_global_step == 4

        t = _trainer(s, out)
        with caplog.at_level(logging.WARNING, logger="tierstore.interop.huggingface"):
            t.train(resume_from_checkpoint=True)
        said = [r.getMessage() for r in caplog.records if "resuming from the newest checkpoint" in r.getMessage()]
        assert len(said) == 1 and "checkpoint-8 (" in said[0] and said[0].endswith("checkpoint-4")
        logged, want = H.steps_logged(t), H.steps_logged(ref)
        assert sorted(logged) == list(range(1, 9)) and all(logged[k] == want[k] for k in range(5, 9))
        assert H.params(t.model) == H.params(ref.model)

        fresh = _trainer(s, tmp_path / "fresh", max_steps=2)  # no checkpoint yet: starts, no guard needed
        fresh.train(resume_from_checkpoint=True)
        assert fresh.state.global_step == 2
    finally:
        s.close()


def test_the_pointer_names_its_store_and_another_directory_finds_it(tmp_path, monkeypatch, caplog):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TIERSTORE_HOME", "TIERSTORE_REDIS", "TIERSTORE_DURABLE"):
        monkeypatch.delenv(k, raising=False)
    home, out = tmp_path / "home", tmp_path / "run"
    s = tierstore.open(home)
    try:
        _trainer(s, out, max_steps=4).train()
    finally:
        s.close()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # its default store would be ./.tierstore here
    t = _trainer(None, out, max_steps=6)
    try:
        with caplog.at_level(logging.INFO, logger="tierstore.interop.huggingface"):
            t.train(resume_from_checkpoint=True)
        assert t.store.config.home == str(home.resolve()) and t.state.global_step == 6
        assert any("names the store at" in r.getMessage() for r in caplog.records)
        assert not (elsewhere / ".tierstore").exists()
    finally:
        t.store.flush()
        t.store.close()


def _launch(phase: str, home: Path, run: Path, out: Path) -> list[int]:
    from tests import _warm
    from tests._ranks import run_ranks

    job = run_ranks("tests._hf_reboot_job", [phase, str(home), str(run), str(out)], preload=_warm.HF, timeout_s=300)
    if phase != "b" and job.codes != [0, 0]:
        print(job.tail())
    return job.codes


def test_reboot_right_after_a_save_on_two_processes(tmp_path):
    home, run, out = tmp_path / "home", tmp_path / "run", tmp_path / "out"
    assert _launch("a", home, run, out) == [0, 0]
    assert _launch("b", home, run, out) == [-signal.SIGKILL] * 2  # right after the save of checkpoint-8
    assert sorted(os.listdir(run)) == ["checkpoint-4", "checkpoint-8"]
    _reboot(home)
    assert _launch("c", home, run, out) == [0, 0]
    for rank in range(2):
        res = json.loads(Path(f"{out}.{rank}.json").read_text())
        got, ref = res["resumed"], res["ref"]
        assert [m for m in res["said"] if "resuming from the newest checkpoint" in m and
                m.endswith("checkpoint-4")], (rank, res["said"])
        assert sorted(map(int, got["log"])) == list(range(1, 9)), rank
        assert all(got["log"][str(s)] == ref["log"][str(s)] for s in range(5, 9)), rank  # resumed at 4
        assert got["params"] == ref["params"], rank
