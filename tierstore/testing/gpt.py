"""A small, deterministic char-level GPT for tests, the demo and benchmarks.

The text is real and on every machine: the source files of Python's standard
library (``sysconfig.get_paths()["stdlib"]``), sorted by path, read until
``max_bytes``, mapped to 7-bit ASCII (a fixed vocabulary of 128). Batches are
a pure function of ``(seed, step, rank)``, so the data position of a resumed
run is its step: nothing else has to be checkpointed for the data loader.

Determinism: :func:`setup_determinism` fixes seeds, ``torch.use_deterministic_algorithms(True)``
and one intra-op thread; attention is written out (no fused kernels). Data
parallel training averages gradients with ``all_reduce`` over the default
(gloo) process group; with two ranks the sum is commutative, so every rank
holds bitwise identical parameters and optimizer state.
"""

from __future__ import annotations

import math
import os
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPT",
    "GPTConfig",
    "char_dataset",
    "get_batch",
    "make_model",
    "setup_determinism",
    "train",
    "train_emulated",
    "train_step",
]


@dataclass(frozen=True)
class GPTConfig:
    """Model size; the defaults give ~0.2 M parameters."""

    vocab: int = 128
    d_model: int = 64
    n_layer: int = 4
    n_head: int = 4
    block: int = 64


class _Block(nn.Module):
    mask: torch.Tensor

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.fc = nn.Linear(c.d_model, 4 * c.d_model)
        self.out = nn.Linear(4 * c.d_model, c.d_model)
        self.register_buffer("mask", torch.tril(torch.ones(c.block, c.block, dtype=torch.bool)), persistent=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_head
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q = q.view(b, t, h, d // h).transpose(1, 2)
        k = k.view(b, t, h, d // h).transpose(1, 2)
        v = v.view(b, t, h, d // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embedding, ``n_layer`` blocks, final norm, LM head.

    Parameter prefixes (the default checkpoint layers): ``embed``, ``pos``,
    ``blocks.<i>``, ``ln_f``, ``head``.
    """

    def __init__(self, c: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.block, c.d_model)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        x = self.embed(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


_DATA_CACHE: dict[int, torch.Tensor] = {}


def char_dataset(max_bytes: int = 1 << 20) -> torch.Tensor:
    """Tokens (int64, 0..127) of the stdlib's ``.py`` sources, sorted by path."""
    if max_bytes in _DATA_CACHE:
        return _DATA_CACHE[max_bytes]
    root = sysconfig.get_paths()["stdlib"]
    files: list[str] = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__"))
        files.extend(os.path.join(d, n) for n in names if n.endswith(".py"))
    files.sort()
    buf = bytearray()
    for path in files:
        try:
            with open(path, "rb") as f:
                buf += f.read()
        except OSError:
            continue
        if len(buf) >= max_bytes:
            break
    if len(buf) < 4096:
        raise RuntimeError(f"the stdlib at {root} holds too little source text")
    data = torch.frombuffer(bytearray(buf[:max_bytes]), dtype=torch.uint8).clone()
    data = torch.where(data < 128, data, torch.full_like(data, ord("?"))).long()
    _DATA_CACHE[max_bytes] = data
    return data


def get_batch(
    data: torch.Tensor, step: int, rank: int, batch_size: int, block: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``rank`` at ``step``: a pure function of its arguments."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    ix = torch.randint(0, len(data) - block - 1, (batch_size,), generator=g)
    x = torch.stack([data[i : i + block] for i in ix.tolist()])
    y = torch.stack([data[i + 1 : i + 1 + block] for i in ix.tolist()])
    return x, y


def setup_determinism(seed: int = 0) -> None:
    """Seeds, deterministic algorithms, one intra-op thread."""
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)


def make_model(
    config: GPTConfig = GPTConfig(), seed: int = 0, lr: float = 3e-3, optim: str = "adamw"
) -> tuple[GPT, torch.optim.Optimizer]:
    """A freshly initialised model (same on every rank for a seed) and its optimizer."""
    torch.manual_seed(seed)
    model = GPT(config)
    if optim == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, foreach=False)
    return model, opt


def train_step(
    model: GPT, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, world_size: int = 1
) -> float:
    """One step: forward, backward, gradient average over the group, update."""
    opt.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    if world_size > 1:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world_size)
    opt.step()
    return float(loss.item())


def train(
    model: GPT,
    opt: torch.optim.Optimizer,
    start: int,
    stop: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    batch_size: int = 8,
    seed: int = 0,
    data: torch.Tensor | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train steps ``start .. stop-1``; returns their losses.

    ``on_step(step, loss)`` runs after each update (the place to call
    ``Checkpointer.save(step)``: the state then is "after step ``step``", and a
    run resumed from it continues at ``step + 1``).
    """
    data = char_dataset() if data is None else data
    block = model.config.block
    losses = []
    for step in range(start, stop):
        x, y = get_batch(data, step, rank, batch_size, block, seed)
        loss = train_step(model, opt, x, y, world_size)
        losses.append(loss)
        if on_step is not None:
            on_step(step, loss)
    return losses


def train_emulated(
    model: GPT,
    opt: torch.optim.Optimizer,
    start: int,
    stop: int,
    *,
    world_size: int = 2,
    batch_size: int = 8,
    seed: int = 0,
    data: torch.Tensor | None = None,
) -> list[list[float]]:
    """Data-parallel training of ``world_size`` ranks emulated in one process.

    Bitwise identical to :func:`train` on ``world_size`` gloo ranks for two
    ranks (the gradient sum of two operands is commutative); the reference
    trajectory of the tests. Returns per rank the losses of ``start .. stop-1``.
    """
    data = char_dataset() if data is None else data
    block = model.config.block
    params = list(model.parameters())
    losses: list[list[float]] = [[] for _ in range(world_size)]
    for step in range(start, stop):
        grads: list[torch.Tensor | None] | None = None
        for r in range(world_size):
            x, y = get_batch(data, step, r, batch_size, block, seed)
            opt.zero_grad(set_to_none=True)
            loss = model(x, y)
            loss.backward()
            losses[r].append(float(loss.item()))
            cur = [p.grad.clone() if p.grad is not None else None for p in params]
            if grads is None:
                grads = cur
            else:
                grads = [a.add_(b) if a is not None and b is not None else a for a, b in zip(grads, cur)]
        for p, g in zip(params, grads or []):
            p.grad = None if g is None else g.div_(world_size)
        opt.step()
    return losses
