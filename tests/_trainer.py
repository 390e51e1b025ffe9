"""A small but real training loop for the Checkpointer's tests: the demo GPT with AdamW over two param
groups, a cosine LR schedule, a dataloader that keeps its own position and generator, and random token
masking drawn from the global torch RNG (so the RNG state matters for a bitwise resume).

``ADOPTION`` below marks the lines a trainer adds to checkpoint with tierstore (see README, "Training loop").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tierstore.testing.gpt import GPT, GPTConfig, char_dataset

CFG = GPTConfig(d_model=32, n_layer=2, n_head=2, block=32)


class Loader:
    """A dataloader-like Stateful: an epoch-wise permutation of windows, its position, its generator."""

    def __init__(self, rank: int, batch: int = 4, seed: int = 0, windows: int = 512) -> None:
        self.data = char_dataset()
        self.rank, self.batch, self.windows = rank, batch, windows
        self.gen = torch.Generator().manual_seed(seed * 1000 + rank)
        self.epoch, self.pos = 0, 0
        self.perm = torch.randperm(windows, generator=self.gen)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos + self.batch > self.windows:
            self.epoch, self.pos = self.epoch + 1, 0
            self.perm = torch.randperm(self.windows, generator=self.gen)
        ix = (self.perm[self.pos: self.pos + self.batch] * 997) % (len(self.data) - CFG.block - 1)
        self.pos += self.batch
        x = torch.stack([self.data[i: i + CFG.block] for i in ix.tolist()])
        y = torch.stack([self.data[i + 1: i + 1 + CFG.block] for i in ix.tolist()])
        return x, y

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "gen": self.gen.get_state(), "perm": self.perm,
                "format": b"loader-v1"}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        assert sd["format"] == b"loader-v1"
        self.epoch, self.pos = sd["epoch"], sd["pos"]
        self.gen.set_state(sd["gen"])
        self.perm = sd["perm"].clone()


def make(rank: int = 0, seed: int = 0, optim: str = "adamw"):
    """(model, optimizer, scheduler, loader), identical on every rank for a seed."""
    torch.manual_seed(seed)
    model = GPT(CFG)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    if optim == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), foreach=False)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=30, eta_min=1e-4)
    return model, opt, sched, Loader(rank, seed=seed)


def train_step(model, opt, sched, loader, world: int = 1, ddp: bool = True) -> float:
    """One step; with ``ddp=False`` and several ranks the gradients are averaged by hand."""
    x, y = loader.next()
    x = torch.where(torch.rand(x.shape) < 0.1, torch.zeros_like(x), x)  # global RNG: masking
    opt.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    if world > 1 and not ddp:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
    opt.step()
    sched.step()
    return float(loss.item())
