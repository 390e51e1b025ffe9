"""Host-tier bytes after a Lightning run that saves every step with ``save_top_k=5`` (issue 29, items 2 and 5).

The run (``dirpath``) is one model; each checkpoint file is a step of it, pinned by its path. On a durable tier
slower than the saves (every durable put sleeps, a fault rule), pinned steps still migrate (the migrator never
skips a pinned step), and at the end of ``fit`` the IO waits for the migration and collects what no checkpoint
names (``settle``): the model keeps the 6 pinned steps (5 top-k files and ``last``), and host memory holds the
newest step alone, whatever ``save_top_k`` is.
"""

from __future__ import annotations

import pytest

pl = pytest.importorskip("lightning.pytorch", reason="needs PyTorch Lightning (the lightning extra)")

from tests import _lightning_job as J  # noqa: E402
from tests._runs import check_run  # noqa: E402
from tierstore.interop.lightning import TierStoreCheckpoint  # noqa: E402
from tierstore.interop.pointer import read_pointer  # noqa: E402
from tierstore.testing.faults import FaultPlan, FaultRule, install  # noqa: E402


def test_save_top_k_5_every_step_is_one_model_and_host_memory_follows_the_window(store, tmp_path):
    install(store, FaultPlan([FaultRule("backend.put@durable", "slow", delay_s=0.05)]))
    cb = TierStoreCheckpoint(store=store, dirpath=str(tmp_path), every_n_train_steps=1, save_last=True,
                             save_top_k=5, monitor="train_loss")
    J.trainer([cb], 12).fit(J.Net(), J.data())
    files = sorted(f for f in (p.name for p in tmp_path.iterdir()) if f.endswith(".ckpt"))
    assert len(files) == 6 and "last.ckpt" in files
    pointers = {str(tmp_path / f): read_pointer(tmp_path / f) for f in files}
    model = check_run(store, pointers)  # one model, six pinned steps, host memory: the newest step only
    assert sorted(m for m in store.models() if m.startswith("lightning.")) == [model]
    assert len(store.steps.steps(model)) <= len(files) + 1  # the top-k steps and the window, no more
    assert read_pointer(tmp_path / "last.ckpt").step == max(s for s, _ in store.steps.steps(model))
