"""The standalone ``pytorch_lightning`` package with ``TierStoreCheckpoint`` (issue 29, item 4), for real.

``TierStoreCheckpoint`` is a ``lightning.pytorch`` ``ModelCheckpoint``: a ``pytorch_lightning.Trainer`` does not
see it as a checkpoint callback, so it would add its own, ``ckpt_path="last"`` would find nothing, and every
run would silently start fresh and overwrite the checkpoints. It is refused instead, with the fix, before the
run restores or saves anything.
"""

from __future__ import annotations

import os

import pytest

ptl = pytest.importorskip("pytorch_lightning", reason="needs the standalone pytorch_lightning package")
pytest.importorskip("lightning.pytorch", reason="needs PyTorch Lightning (the lightning extra)")

import torch  # noqa: E402

from tierstore.errors import ConfigError  # noqa: E402
from tierstore.interop.lightning import TierStoreCheckpoint  # noqa: E402


class Net(ptl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.lin(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_standalone_pytorch_lightning_trainer_is_refused_with_the_fix(store, tmp_path):
    ckpts = tmp_path / "ckpts"
    cb = TierStoreCheckpoint(store=store, dirpath=str(ckpts), every_n_train_steps=1, save_last=True)
    trainer = ptl.Trainer(max_steps=2, callbacks=[cb], logger=False, accelerator="cpu", enable_progress_bar=False,
                          enable_model_summary=False, default_root_dir=str(tmp_path / "root"))
    data = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4)
    with pytest.raises(ConfigError, match=r"import the Trainer and the LightningModule from lightning\.pytorch"):
        trainer.fit(Net(), data, ckpt_path="last")
    assert trainer.global_step == 0  # nothing trained, nothing saved: neither pointers nor Lightning's own files
    assert not ckpts.exists() and not (tmp_path / "root").exists()
    assert not [m for m in store.models() if m.startswith("lightning.")]
    assert not os.path.exists("checkpoints")
