"""A Lightning pointer read outside a Trainer (issue 29, item 6), with the real Lightning.

``Net.load_from_checkpoint(pointer)`` and ``torch.load(pointer)`` read the file with ``torch.load`` and fail on
the JSON; :func:`~tierstore.interop.lightning.load_from_checkpoint` builds the module from the pointer (saved
hyper-parameters, weights), and :func:`~tierstore.interop.lightning.export_checkpoint` writes the step as a
Lightning ``.ckpt`` that Lightning's own ``load_from_checkpoint`` and ``torch.load`` read.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="needs PyTorch Lightning (the lightning extra)")

from tests import _lightning_job as J  # noqa: E402
from tierstore.errors import CheckpointNotFoundError  # noqa: E402
from tierstore.interop.lightning import (  # noqa: E402
    TierStoreCheckpoint,
    export_checkpoint,
    load_from_checkpoint,
    read_checkpoint,
)


def test_load_from_checkpoint_and_export_of_a_pointer(store, tmp_path):
    net = J.Net(root=Path("/data/x"), args=argparse.Namespace(lr=0.1), mode=J.Mode.SLOW, extra_k=3)
    cb = TierStoreCheckpoint(store=store, dirpath=str(tmp_path / "c"), every_n_train_steps=2, save_last=True)
    J.trainer([cb], 4).fit(net, J.data())
    pointer = tmp_path / "c" / "last.ckpt"
    want = J.params(net)

    got = load_from_checkpoint(J.Net, pointer, store=store)
    assert isinstance(got, J.Net) and got.hparams.mode is J.Mode.SLOW and got.hparams.extra_k == 3
    assert got.hparams.root == Path("/data/x") and got.hparams.args.lr == 0.1
    assert all(torch.equal(want[n], p) for n, p in J.params(got).items())
    assert load_from_checkpoint(J.Net, pointer, store=store, extra_k=5).hparams.extra_k == 5  # as Lightning's

    out = export_checkpoint(pointer, tmp_path / "export" / "last.ckpt", store=store, cls=J.Net)
    again = J.Net.load_from_checkpoint(out, weights_only=False)  # Lightning's own, on the exported file
    assert all(torch.equal(want[n], p) for n, p in J.params(again).items()) and again.hparams.mode is J.Mode.SLOW
    raw = torch.load(out, weights_only=False)
    assert raw["global_step"] == 4 and raw["optimizer_states"][0]["state"]
    assert read_checkpoint(pointer, store)["global_step"] == 4
    with pytest.raises(CheckpointNotFoundError, match="not a tierstore pointer"):
        read_checkpoint(out, store)
