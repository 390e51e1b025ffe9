"""A tiny but real Lightning job for tests/test_lightning.py: the module, its data, and the multi-process runs.

The model has no dropout and the data is a Stateful iterable (:class:`Batches`) with a permutation per epoch,
so a resumed run (Lightning restores the loader's position from the checkpoint's loop state) is bitwise the
uninterrupted one, mid-epoch and across epochs. ``python -m tests._lightning_job MODE ...`` is one rank of a
2-rank job launched by the test with the launcher's environment (Lightning then starts no processes itself).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import pathlib
import signal
import sys
from typing import Any

import lightning.pytorch as pl
import torch

STEPS_PER_EPOCH = 5
BATCH = 4


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


@dataclasses.dataclass
class Sched:
    warmup: int = 2
    decay: float = 0.5


class Net(pl.LightningModule):
    """Two blocks and a head (three layers for the Checkpointer), AdamW and a step LR schedule."""

    def __init__(self, root: pathlib.Path = pathlib.Path("/data"), args: argparse.Namespace | None = None,
                 mode: Mode = Mode.FAST, sched: Sched = Sched(), tags: frozenset = frozenset({"a", "b"}),
                 dtype: torch.dtype = torch.float32, **extra: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 16), torch.nn.Linear(16, 16)])
        self.head = torch.nn.Linear(16, 1)
        self.losses: dict[int, float] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x, y = batch[:, :8], batch[:, 8:]
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.losses[self.trainer.global_step] = float(loss.detach())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.02)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)}


class Sharded(Net):
    """``Net`` under FSDP2: ``configure_model`` shards each linear layer over the data-parallel mesh."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard  # lazy: only the FSDP2 job shards

        mesh = self.device_mesh["data_parallel"]
        for m in [*self.blocks, self.head]:
            fully_shard(m, mesh=mesh)
        fully_shard(self, mesh=mesh)


class Batches:
    """This rank's batches of a fixed table: a permutation per epoch drawn from ``(seed, epoch)``, and the
    position within the epoch: a Stateful iterable, so Lightning checkpoints it in its loop state and a resumed
    run draws what the uninterrupted one draws, mid-epoch and across epochs."""

    def __init__(self, rank: int = 0, world: int = 1, seed: int = 7) -> None:
        table = torch.randn(STEPS_PER_EPOCH * BATCH * world, 9, generator=torch.Generator().manual_seed(1234))
        self.rows, self.seed = table[rank::world], seed + rank
        self.epoch, self.pos, self._resume = -1, 0, False

    def __len__(self) -> int:
        return len(self.rows) // BATCH

    def __iter__(self) -> Any:
        if not self._resume:
            self.epoch, self.pos = self.epoch + 1, 0
        self._resume = False
        perm = torch.randperm(len(self.rows), generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch))
        while self.pos < len(self):
            ix = perm[self.pos * BATCH:(self.pos + 1) * BATCH]
            self.pos += 1
            yield self.rows[ix]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch, self.pos, self._resume = sd["epoch"], sd["pos"], sd["pos"] < len(self)


def data(rank: int = 0, world: int = 1) -> Batches:
    return Batches(rank, world)


def trainer(callbacks: list, max_steps: int, **kw: Any) -> pl.Trainer:
    kw.setdefault("accelerator", "cpu")
    return pl.Trainer(max_steps=max_steps, callbacks=callbacks, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0, **kw)


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    return {n: local(p.detach()).clone() for n, p in module.named_parameters()}


class KillAt(pl.Callback):
    """SIGKILL this process at the start of ``step``'s batch (after the previous step's checkpoint committed)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            wait = getattr(getattr(trainer.strategy, "checkpoint_io", None), "wait", None)
            if callable(wait):  # the previous save's commit (the IO saves in the background while fit runs)
                wait()
            os.kill(os.getpid(), signal.SIGKILL)


# ---- the 2-rank runs (one process per rank, launched by the test) ---------------------------------------

def _ddp(home: str, ckpt_dir: str, mode: str, kill: int, steps: int) -> dict[str, Any]:
    import tierstore
    from tierstore.interop.lightning import TierStoreCheckpoint
    from tierstore.train.policies import differential

    store = tierstore.open(home)
    rank = int(os.environ["RANK"])
    out: dict[str, Any] = {}
    if mode == "first":  # saves every 2 steps, killed at the start of step ``kill``
        cb = TierStoreCheckpoint(store=store, dirpath=ckpt_dir, every_n_train_steps=2, save_last=True, save_top_k=2,
                                 monitor="train_loss", policy=differential(base_every=3))
        trainer([cb, KillAt(kill)], steps, devices=2, strategy="ddp").fit(Net(), data(rank, 2))
        raise AssertionError("not killed")
    cb = TierStoreCheckpoint(store=store, dirpath=ckpt_dir, every_n_train_steps=2, save_last=True, save_top_k=2,
                             monitor="train_loss", policy=differential(base_every=3))
    net = Net()
    t = trainer([cb], steps, devices=2, strategy="ddp")
    t.fit(net, data(rank, 2), ckpt_path="last")
    out["resumed"] = {"losses": net.losses, "params": {n: p.tolist() for n, p in params(net).items()}}
    ref = Net()
    trainer([], steps, devices=2, strategy="ddp", enable_checkpointing=False).fit(ref, data(rank, 2))
    out["ref"] = {"losses": ref.losses, "params": {n: p.tolist() for n, p in params(ref).items()}}
    out["files"] = sorted(os.listdir(ckpt_dir))
    out["models"] = sorted(m for m in store.models() if m.startswith("lightning."))
    out["pins"] = {k: v for m in out["models"] for k, v in store.steps.pins(m).items()}
    out.update(_fsdp2(store, ckpt_dir + "-fsdp2", rank))
    store.close()
    return out


def _fsdp2(store: Any, ckpt_dir: str, rank: int) -> dict[str, Any]:
    """FSDP2 through TierStoreModelParallelStrategy: A runs 6 steps saving every 3; B resumes at 3 and runs to 6."""
    from tierstore.interop.lightning import TierStoreCheckpoint
    from tierstore.interop.pointer import read_pointer

    a = Sharded()
    cb = TierStoreCheckpoint(store=store, name="fsdp2", dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1)
    trainer([cb], 6, devices=2, strategy=_fsdp2_strategy()).fit(a, data(rank, 2))
    b = Sharded()
    mid = os.path.join(ckpt_dir, "epoch=0-step=3.ckpt")
    cb = TierStoreCheckpoint(store=store, name="fsdp2", dirpath=ckpt_dir + "-b", every_n_train_steps=3)
    trainer([cb], 6, devices=2, strategy=_fsdp2_strategy()).fit(b, data(rank, 2), ckpt_path=mid)
    pa, pb = params(a), params(b)
    full = {n: tuple(p.shape) for n, p in a.named_parameters()}
    return {"fsdp2": {"equal": pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa),
                      "losses_a": a.losses, "losses_b": b.losses, "layout": read_pointer(mid).info.get("layout"),
                      "sharded": all(tuple(pa[n].shape) != full[n] or full[n][0] == 1 for n in pa)}}


def _fsdp2_strategy() -> Any:
    from tierstore.interop.lightning import TierStoreModelParallelStrategy

    return TierStoreModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)  # FSDP2 over both ranks


def main(argv: list[str]) -> int:
    mode, home, ckpt_dir, out, kill, steps = argv[0], argv[1], argv[2], argv[3], int(argv[4]), int(argv[5])
    res = _ddp(home, ckpt_dir, mode, kill, steps)
    with open(f"{out}.{os.environ['RANK']}.json", "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
