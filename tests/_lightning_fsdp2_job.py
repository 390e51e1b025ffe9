"""The ranks of tests/test_lightning_fsdp2.py: Lightning's FSDP2 strategy with sharded tierstore saves.

``python -m tests._lightning_fsdp2_job MODE HOME CKPT_DIR OUT``, one process per rank, launched with the
launcher's environment (Lightning starts no processes itself).

``two`` (2 ranks): A, the uninterrupted run, trains 8 steps saving every 4 (``last.ckpt`` too), and writes at the
start of step 4 this rank's local shards and (rank 0) the full state, which the step-4 checkpoint holds; B resumes
from ``epoch=0-step=4.ckpt`` and trains to step 8; C resumes with ``ckpt_path="last"`` (A's step 8) and trains 2
more. Each rank writes A's and B's final local shards (parameters and AdamW state), C's restored ones and the runs'
losses. ``one`` (1 rank): D resumes the step-4 checkpoint on one FSDP2 rank (resharded) and trains to step 6,
saving there; it writes the full state it restored and its losses. ``four`` (4 ranks): E resumes the step-4
checkpoint on four FSDP2 ranks and trains to step 6, saving there; it writes the full state it restored.
``reboot-a``, ``reboot-b``, ``reboot-c`` (2 ranks): sharded saves at 2 and 4 made durable; a resume saving 6 and 8
in host memory only (no migration); after the test's reboot, ``ckpt_path="last"`` (which names step 8, gone) and
an uninterrupted reference run, each writing its final local shards. Then a run whose ``on_save_checkpoint`` replaces
the state dict is refused at its first save (``ConfigError``), before anything is written.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch

from tests import _lightning_job as J
from tests import _reshard as R
from tierstore.errors import ConfigError


def _strategy(world: int) -> Any:
    from tierstore.interop.lightning import TierStoreModelParallelStrategy

    return TierStoreModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1,
                                          save_distributed_checkpoint=True)


def _cb(store: Any, ckpt_dir: str, every: int, last: bool = True) -> Any:
    from tierstore.interop.lightning import TierStoreCheckpoint

    return TierStoreCheckpoint(store=store, dirpath=ckpt_dir, every_n_train_steps=every, save_last=last,
                               save_top_k=-1)


def _optimizer(trainer: pl.Trainer) -> torch.optim.Optimizer:
    (opt,) = trainer.optimizers
    return opt


class Probe(pl.Callback):
    """Writes the state at the start of step ``at``'s batch (``at=None``: when training starts, after a restore):
    this rank's local shards to ``OUT.<name>.local.<rank>.pt`` and, with ``full``, the full state (collective) to
    ``OUT.<name>.full.pt`` from rank 0."""

    def __init__(self, out: str, name: str, at: int | None = None, full: bool = False) -> None:
        self.out, self.name, self.at, self.full = out, name, at, full

    def _write(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        opt = _optimizer(trainer)
        torch.save(R.local_state(module, opt), f"{self.out}.{self.name}.local.{trainer.global_rank}.pt")
        if self.full:
            full = R.full_state(module, opt)
            if trainer.global_rank == 0:
                torch.save(full, f"{self.out}.{self.name}.full.pt")

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.at is None:
            self._write(trainer, module)

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if self.at is not None and trainer.global_step == self.at:
            self._write(trainer, module)


class Rewrites(J.Sharded):
    """Replaces the state dict Lightning saves with copies: a sharded save refuses it (it stores the live shards)."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["state_dict"] = {k: v.detach().clone() for k, v in checkpoint["state_dict"].items()}


def main(argv: list[str]) -> int:
    import tierstore

    mode, home, ck, out = argv
    rank = int(os.environ["RANK"])
    store = tierstore.open(home, migrate=mode != "reboot-b")
    res: dict[str, Any] = {}
    mid = os.path.join(ck, "epoch=0-step=4.ckpt")
    if mode == "two":
        a = J.Sharded()
        t = J.trainer([_cb(store, ck, 4), Probe(out, "a4", at=4, full=True)], 8, devices=2, strategy=_strategy(2))
        t.fit(a, J.data(rank, 2))
        torch.save(R.local_state(a, _optimizer(t)), f"{out}.a.local.{rank}.pt")
        b = J.Sharded()
        t = J.trainer([_cb(store, ck + "-b", 4)], 8, devices=2, strategy=_strategy(2))
        t.fit(b, J.data(rank, 2), ckpt_path=mid)
        torch.save(R.local_state(b, _optimizer(t)), f"{out}.b.local.{rank}.pt")
        c = J.Sharded()
        J.trainer([_cb(store, ck, 100, last=False), Probe(out, "c")], 10, devices=2, strategy=_strategy(2)).fit(
            c, J.data(rank, 2), ckpt_path="last")
        res = {"a": a.losses, "b": b.losses, "c": c.losses}
    elif mode == "reboot-a":  # sharded saves at 2 and 4, then everything durable
        J.trainer([_cb(store, ck, 2)], 4, devices=2, strategy=_strategy(2)).fit(J.Sharded(), J.data(rank, 2))
        store.flush()
    elif mode == "reboot-b":  # resumed, saves at 6 and 8 commit in host memory only (the migration is off)
        J.trainer([_cb(store, ck, 2)], 8, devices=2, strategy=_strategy(2)).fit(J.Sharded(), J.data(rank, 2),
                                                                                ckpt_path="last")
    elif mode == "reboot-c":  # after the reboot: "last" falls back to step 4; then an uninterrupted reference
        f = J.Sharded()
        t = J.trainer([_cb(store, ck, 100, last=False)], 8, devices=2, strategy=_strategy(2))
        t.fit(f, J.data(rank, 2), ckpt_path="last")
        torch.save(R.local_state(f, _optimizer(t)), f"{out}.f.local.{rank}.pt")
        ref = J.Sharded()
        t = J.trainer([], 8, devices=2, strategy=_strategy(2), enable_checkpointing=False)
        t.fit(ref, J.data(rank, 2))
        torch.save(R.local_state(ref, _optimizer(t)), f"{out}.ref.local.{rank}.pt")
        res = {"f": f.losses, "ref": ref.losses}
    elif mode == "four":  # resharded up: the 2-rank step-4 checkpoint on four FSDP2 ranks (the head's one row
        # lands on one rank, the others hold empty shards of it), training on and saving on four
        e = J.Sharded()
        J.trainer([_cb(store, ck + "-four", 2), Probe(out, "e", full=True)], 6, devices=4, strategy=_strategy(4)).fit(
            e, J.data(rank, 4), ckpt_path=mid)
        res = {"e": e.losses}
    else:
        d = J.Sharded()
        J.trainer([_cb(store, ck + "-one", 3), Probe(out, "d", full=True)], 6, devices=1, strategy=_strategy(1)).fit(
            d, J.data(0, 1), ckpt_path=mid)
        res = {"d": d.losses, "refused": None}
        try:  # a hook that rewrites the state dict: refused before anything is written
            J.trainer([_cb(store, ck + "-bad", 2)], 2, devices=1, strategy=_strategy(1)).fit(Rewrites(), J.data(0, 1))
        except ConfigError as e:
            res["refused"] = str(e)
    store.close()
    with open(f"{out}.{mode}.{rank}.json", "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
