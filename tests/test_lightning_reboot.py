"""Lightning on tierstore after a node reboot right after a save (issue 29, item 1), with the real Lightning.

The store is the embedded default (``tierstore.open(home)``: its own index server, a host tier in shared
memory, a durable directory in the home). Run A saves every 2 steps to step 4 and everything becomes durable;
run B resumes with ``ckpt_path="last"`` and saves at 6 and 8 with the migration not yet run (a store opened with
``migrate=False``: the state a SIGKILL right after those saves leaves). Then the reboot: the index server is
stopped and the host tier wiped. The same command again (``ckpt_path="last"``) resumes from the newest step a
tier still holds (global step 4, durable), says so, and is bitwise an uninterrupted run; an explicit path whose
step is gone raises ``CheckpointGoneError`` naming that step. Also: the pointer names its store, so a script
started from another working directory (no store given) finds it. On two processes (DDP, gloo) the same,
with run B SIGKILLed right after its save of step 8 (``tests/_lightning_reboot_job.py``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="needs PyTorch Lightning (the lightning extra)")

import tierstore  # noqa: E402
from tests import _lightning_job as J  # noqa: E402
from tierstore.embedded import stop_server  # noqa: E402
from tierstore.errors import CheckpointGoneError  # noqa: E402
from tierstore.interop.lightning import TierStoreCheckpoint  # noqa: E402
from tierstore.interop.pointer import read_pointer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _cb(store, d, **kw):
    return TierStoreCheckpoint(store=store, dirpath=str(d), every_n_train_steps=2, save_last=True, save_top_k=-1,
                               **kw)


def _reboot(home: Path) -> None:
    """A node reboot: the index server stops (its append-only file survives), shared memory is emptied."""
    stop_server(home)
    shm = Path(os.environ["TIERSTORE_SHM_DIR"])
    for p in shm.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def test_reboot_right_after_a_save_resumes_from_the_newest_durable_step(tmp_path, caplog):
    home, ckpts = tmp_path / "home", tmp_path / "ckpts"
    ref = J.Net()
    J.trainer([], 8, enable_checkpointing=False).fit(ref, J.data())

    s = tierstore.open(home)
    J.trainer([_cb(s, ckpts)], 4).fit(J.Net(), J.data())
    s.flush()  # steps 2 and 4 durable
    s.close()
    s = tierstore.open(home, migrate=False)  # saves 6 and 8 commit in host memory only
    J.trainer([_cb(s, ckpts)], 8).fit(J.Net(), J.data(), ckpt_path="last")
    assert read_pointer(ckpts / "last.ckpt").info["global_step"] == 8
    s.close()
    _reboot(home)

    s = tierstore.open(home)
    try:
        with pytest.raises(CheckpointGoneError) as e:  # an explicit path whose step is gone: typed, names step 4
            J.trainer([_cb(s, ckpts)], 8).fit(J.Net(), J.data(), ckpt_path=str(ckpts / "epoch=1-step=8.ckpt"))
        assert e.value.newest_global_step == 4 and "global step 4" in str(e.value)
        assert e.value.newest is not None and read_pointer(e.value.newest).info["global_step"] == 4

        b = J.Net()
        with caplog.at_level(logging.WARNING, logger="tierstore.interop.lightning"):
            J.trainer([_cb(s, ckpts)], 8).fit(b, J.data(), ckpt_path="last")
        said = [r.getMessage() for r in caplog.records if "resuming from the newest step" in r.getMessage()]
        assert len(said) == 1 and "global step 4" in said[0] and "global step 8" in said[0]
        assert sorted(b.losses) == [4, 5, 6, 7]  # resumed at global step 4, the newest durable one
        assert all(b.losses[k] == ref.losses[k] for k in b.losses)
        pr, pb = J.params(ref), J.params(b)
        assert all(torch.equal(pr[n], pb[n]) for n in pr)
    finally:
        s.close()


def test_the_pointer_names_its_store_and_another_directory_finds_it(tmp_path, monkeypatch):
    home, ckpts = tmp_path / "home", tmp_path / "ckpts"
    for k in ("TIERSTORE_HOME", "TIERSTORE_REDIS", "TIERSTORE_DURABLE"):
        monkeypatch.delenv(k, raising=False)
    ref = J.Net()
    J.trainer([], 4, enable_checkpointing=False).fit(ref, J.data())
    s = tierstore.open(home)
    try:
        J.trainer([_cb(s, ckpts)], 2).fit(J.Net(), J.data())
        assert read_pointer(ckpts / "last.ckpt").store["home"] == str(home.resolve())
    finally:
        s.close()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # its default store would be ./.tierstore here
    b, cb = J.Net(), _cb(None, ckpts)
    try:
        J.trainer([cb], 4).fit(b, J.data(), ckpt_path="last")
    finally:
        cb.io.store.flush()
        cb.io.store.close()
    assert sorted(b.losses) == [2, 3] and all(b.losses[k] == ref.losses[k] for k in b.losses)
    assert not (elsewhere / ".tierstore").exists() and cb.io.store.config.home == str(home.resolve())


def _launch(phase: str, home: Path, ckpts: Path, out: Path) -> list[int]:
    from tests import _warm
    from tests._ranks import run_ranks

    job = run_ranks("tests._lightning_reboot_job", [phase, str(home), str(ckpts), str(out)], preload=_warm.LIGHTNING)
    if phase != "b" and job.codes != [0, 0]:
        print(job.tail())
    return job.codes


def test_reboot_right_after_a_save_on_two_processes(tmp_path):
    home, ckpts, out = tmp_path / "home", tmp_path / "ckpts", tmp_path / "out"
    assert _launch("a", home, ckpts, out) == [0, 0]
    assert _launch("b", home, ckpts, out) == [-signal.SIGKILL] * 2  # right after the save of step 8
    assert read_pointer(ckpts / "last.ckpt").info["global_step"] == 8
    _reboot(home)
    assert _launch("c", home, ckpts, out) == [0, 0]
    for rank in range(2):
        res = json.loads(Path(f"{out}.{rank}.json").read_text())
        got, ref = res["resumed"], res["ref"]
        assert sorted(map(int, got["losses"])) == [4, 5, 6, 7], rank  # from global step 4, the newest durable
        assert all(got["losses"][s] == ref["losses"][s] for s in got["losses"]), rank
        assert got["params"] == ref["params"], rank
