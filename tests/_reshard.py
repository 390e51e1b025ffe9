"""Helpers of the resharding tests: the model, its optimizer, training steps, and full reference state.

The model is the demo GPT with widths that do not divide by 4 (uneven FSDP2 shards on 4 ranks, pieces that
straddle two saved shards); AdamW has two param groups. Every function is deterministic for its arguments.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tierstore.testing.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab=64, d_model=30, n_layer=2, n_head=2, block=16)
OTHER = {  # models a checkpoint of CFG must not restore into, and what the error must name
    "wider": (GPTConfig(vocab=64, d_model=32, n_layer=2, n_head=2, block=16), "global shape"),
    "deeper": (GPTConfig(vocab=64, d_model=30, n_layer=3, n_head=2, block=16), "blocks.2"),
}


def groups(params: list[torch.nn.Parameter], part: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """AdamW's two groups (decay for matrices); with ``part = (rank, world)`` only every world-th parameter."""
    keep = params if part is None else params[part[0]::part[1]]
    ids = {id(p) for p in keep}
    decay = [p for p in params if p.dim() >= 2 and id(p) in ids]
    rest = [p for p in params if p.dim() < 2 and id(p) in ids]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def make(seed: int = 0, cfg: GPTConfig = CFG) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def adamw(model: torch.nn.Module, part: tuple[int, int] | None = None) -> torch.optim.AdamW:
    return torch.optim.AdamW(groups(list(model.parameters()), part), lr=0.02, betas=(0.9, 0.95))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, CFG.vocab, (2, CFG.block), generator=g)
    return x, torch.roll(x, 1, dims=1)


def zero_step(model: GPT, opt: torch.optim.Optimizer, step: int, rank: int, world: int) -> None:
    """A ZeRO-1 style step: averaged gradients, each rank updates its partition, the owners broadcast."""
    loss = model(*batch(step, rank))
    loss.backward()
    params = list(model.parameters())
    for p in params:
        dist.all_reduce(p.grad)
        p.grad.div_(world)
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        for i, p in enumerate(params):
            dist.broadcast(p.data, src=i % world)


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """``param/<n>``, ``buffer/<n>``, ``optim/<n>/<key>`` as full tensors (collective for DTensors)."""
    out: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters())
    for n, t in model.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        out[("param/" if n in params else "buffer/") + n] = full.detach().clone()
    if opt is not None:
        names = {id(p): n for n, p in params.items()}
        for p, st in opt.state.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    full = v.full_tensor() if isinstance(v, DTensor) else v
                    out[f"optim/{names[id(p)]}/{k}"] = full.detach().clone()
    return out


def differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not bitwise equal (or missing on either side)."""
    bad = sorted(set(got) ^ set(want))
    for n in sorted(set(got) & set(want)):
        a, b = got[n], want[n]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.reshape(-1).view(torch.uint8)
                                                                        if a.numel() else a,
                                                                        b.reshape(-1).view(torch.uint8)
                                                                        if b.numel() else b):
            bad.append(n)
    return bad


def local_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer | None) -> int:
    """Bytes of this rank's own shard of the model and optimizer state (what a restore must fill)."""
    def nb(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    total = sum(nb(t) for t in model.state_dict().values())
    if opt is not None:
        total += sum(nb(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    return total


def local_state(model: torch.nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """As :func:`full_state`, but each DTensor's local shard (no collective)."""
    out: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters())
    for n, t in model.state_dict().items():
        out[("param/" if n in params else "buffer/") + n] = (t.to_local() if isinstance(t, DTensor) else t).clone()
    if opt is not None:
        names = {id(p): n for n, p in params.items()}
        for p, st in opt.state.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    out[f"optim/{names[id(p)]}/{k}"] = (v.to_local() if isinstance(v, DTensor) else v).clone()
    return out


def cut_like(full: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``full`` cut into this rank's shards as torch itself cuts them (``distribute_tensor``, no collective)."""
    from torch.distributed.tensor import distribute_tensor

    live = {("param/" + n): p for n, p in model.named_parameters()}
    out = {}
    for n, t in full.items():
        like = live.get(n if not n.startswith("optim/") else "param/" + n[len("optim/"):].rpartition("/")[0])
        if isinstance(like, DTensor) and t.dim():
            t = distribute_tensor(t, like.device_mesh, like.placements, src_data_rank=None).to_local()
        out[n] = t
    return out
