"""State used by the DCP tests: PyTorch's own DCP test cases (test/distributed/checkpoint/e2e), adapted.

A small model with a module ``_extra_state``, AdamW with two param groups, a
cosine LR scheduler, a dataloader that keeps its state as pickled bytes per
data-parallel rank (as torchtitan's does) and a train state holding a BytesIO
(as torchtitan's and DCP's e2e test do). Everything non-tensor goes through
DCP's BYTE_IO path.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class Extra(nn.Module):
    """A module with ``_extra_state`` (DCP saves it as a non-tensor value)."""

    def __init__(self) -> None:
        super().__init__()
        self.version = 0

    def get_extra_state(self) -> Any:
        return {"version": self.version, "tag": "extra"}

    def set_extra_state(self, state: Any) -> None:
        self.version = state["version"]


class Net(nn.Module):
    """PyTorch's e2e ``TestDummyModel``, plus an ``_extra_state``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net1 = nn.Linear(8, 16)
        self.net2 = nn.Linear(16, 32)
        self.net3 = nn.Linear(32, 8)
        self.extra = Extra()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.net3(F.relu(self.net2(F.relu(self.net1(x))))))


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with two param groups: weights decay, biases do not."""
    named = list(model.named_parameters())
    return torch.optim.AdamW(
        [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
         {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lr": 0.05}],
        lr=0.1, betas=(0.9, 0.95))


def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)


class Loader:
    """A dataloader's state as torchtitan keeps it: pickled bytes under a per-rank key, and ints."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.position, self.epoch = rank, world, 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {f"dp_rank_{self.rank}": pickle.dumps({"position": self.position, "epoch": self.epoch}),
                "world_size": self.world}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        assert sd["world_size"] == self.world
        inner = pickle.loads(sd[f"dp_rank_{self.rank}"])  # the trainer's own bytes, as torchtitan does
        self.position, self.epoch = inner["position"], inner["epoch"]


@dataclass
class TrainState:
    """DCP's e2e ``TestTrainState``: tensors and a BytesIO of losses."""

    step: int = 0
    current_loss: float = -1.0
    losses: list[float] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        buf = io.BytesIO()
        torch.save(self.losses, buf)
        return {"step": torch.tensor(self.step, dtype=torch.int32),
                "current_loss": torch.tensor(self.current_loss, dtype=torch.float32), "losses": buf}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"].item())
        self.current_loss = float(sd["current_loss"].item())
        sd["losses"].seek(0)
        self.losses = torch.load(sd["losses"], weights_only=True)


def train(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, loader: Loader, ts: TrainState,
          steps: int, seed: int = 0) -> float:
    """``steps`` deterministic steps; returns the last loss."""
    g = torch.Generator().manual_seed(seed + 1000 * ts.step)
    loss = torch.zeros(())
    for _ in range(steps):
        x = torch.rand(8, 8, generator=g)
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        ts.step += 1
        ts.current_loss = float(loss.item())
        ts.losses.append(ts.current_loss)
        loader.position += 8
        base = getattr(model, "module", model)
        base.extra.version += 1
    return float(loss.item())
