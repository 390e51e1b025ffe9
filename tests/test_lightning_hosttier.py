"""Host-tier bytes after a Lightning run that saves every step with ``save_top_k=5`` (issue 29, item 5).

Each checkpoint path is its own model; ``last.ckpt`` is re-saved at every step, and a re-save collects the
path's older steps only once their migration finished. On a durable tier slower than the saves (every durable
put sleeps, a fault rule), the re-saves defer collecting nearly every older ``last`` step, and nothing collected
them after the last save: the host tier kept several full copies of ``last``. At the end of ``fit`` the IO now
waits for the migration and collects them (``settle``): each of the 6 models (5 top-k files and ``last``)
keeps exactly its newest step, and host memory holds nothing else.
"""

from __future__ import annotations

import pytest

pl = pytest.importorskip("lightning.pytorch", reason="needs PyTorch Lightning (the lightning extra)")

from tests import _lightning_job as J  # noqa: E402
from tierstore.interop.lightning import TierStoreCheckpoint  # noqa: E402
from tierstore.interop.pointer import read_pointer  # noqa: E402
from tierstore.testing.faults import FaultPlan, FaultRule, install  # noqa: E402


def test_save_top_k_5_every_step_leaves_one_step_per_kept_checkpoint(store, tmp_path):
    install(store, FaultPlan([FaultRule("backend.put@durable", "slow", delay_s=0.05)]))
    cb = TierStoreCheckpoint(store=store, dirpath=str(tmp_path), every_n_train_steps=1, save_last=True,
                             save_top_k=5, monitor="train_loss")
    J.trainer([cb], 12).fit(J.Net(), J.data())
    files = sorted(f for f in (p.name for p in tmp_path.iterdir()) if f.endswith(".ckpt"))
    assert len(files) == 6 and "last.ckpt" in files
    pointers = {f: read_pointer(tmp_path / f) for f in files}
    models = sorted(m for m in store.models() if m.startswith("lightning."))
    assert models == sorted(p.model for p in pointers.values())  # one model per kept file, no other
    host = store.host.tier
    for f, p in pointers.items():
        assert [s for s, _ in store.steps.steps(p.model)] == [p.step], f  # the older steps were collected
        keys = store.list(p.model)
        in_host = {k.step for k, r in zip(keys, store.index.get_objects(keys)) if r is not None and host in r.tiers}
        assert in_host <= {p.step}, (f, in_host)
    assert read_pointer(tmp_path / "last.ckpt").step >= 11  # last.ckpt was re-saved at every step
