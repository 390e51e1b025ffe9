"""Trainer state that is not a module's tensors: safe JSON encoding, RNG state, wrapper prefixes.

The Checkpointer saves ``Stateful`` objects (anything with ``state_dict()`` and
``load_state_dict()``, the protocol DCP and torchtitan use). The values their
state dicts hold besides tensors are encoded as tagged JSON by
:mod:`tierstore.train.values` (:func:`encode`, :func:`decode`, re-exported
here); nothing ever unpickles.

Wrapper prefixes: :func:`unwrap` peels ``DistributedDataParallel``,
``DataParallel`` and ``torch.compile`` wrappers off a module, and
:func:`normalise_fqn` drops the wrapper components (``_orig_mod``,
``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``) inside names, so a
checkpoint of a wrapped model restores into the bare one and back.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from tierstore.train.values import TAGS, allow_value_types, decode, encode

try:  # optional: numpy RNG state and arrays in trainer state (torch works without numpy)
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with every torch wheel we test
    np = None  # type: ignore[assignment]

__all__ = [
    "TAGS",
    "RNGState",
    "Stateful",
    "allow_value_types",
    "decode",
    "encode",
    "is_stateful",
    "normalise_fqn",
    "optimizer_types",
    "unwrap",
]

_WRAPPER_PARTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


@runtime_checkable
class Stateful(Protocol):
    """What the Checkpointer saves: ``state_dict()`` and ``load_state_dict(sd)``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` has callable ``state_dict`` and ``load_state_dict`` (and is not a class)."""
    return (not isinstance(obj, type) and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


# ---- RNG state -------------------------------------------------------------------------------

class RNGState:
    """The process's random generators as one ``Stateful``: torch (CPU and CUDA), Python, numpy.

    Put it in the Checkpointer's state (``"rng": RNGState()``) so a resumed run
    draws the same numbers (dropout masks, sampling) as the uninterrupted one.
    Each rank saves its own generators.
    """

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if np is not None:
            sd["numpy"] = np.random.get_state(legacy=True)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state_all()
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"].clone())
        random.setstate(_tuplify(state_dict["python"]))
        if np is not None and "numpy" in state_dict:
            np.random.set_state(tuple(state_dict["numpy"]))
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([t.clone() for t in state_dict["cuda"]])


def _tuplify(v: Any) -> Any:
    return tuple(_tuplify(x) for x in v) if isinstance(v, (list, tuple)) else v


# ---- wrappers --------------------------------------------------------------------------------

def unwrap(module: nn.Module) -> nn.Module:
    """The module under DDP / DataParallel / ``torch.compile`` wrappers (the module itself if none)."""
    seen = 0
    while seen < 16:
        seen += 1
        inner = getattr(module, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(inner, nn.Module):
            module = inner
            continue
        if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            module = module.module
            continue
        break
    return module


def optimizer_types(opt: Any) -> list[str]:
    """The class qualnames of an optimizer: the innermost first, then the wrappers around it.

    Wrappers that hold the real optimizer as ``.optimizer`` (Accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``) are peeled: the first name is what a checkpoint stores as the
    optimizer's type (``"class"`` of its entry) and what a restore compares.
    """
    names = []
    seen = 0
    while opt is not None and seen < 16:
        seen += 1
        names.append(type(opt).__qualname__)
        inner = getattr(opt, "optimizer", None)
        opt = inner if isinstance(inner, torch.optim.Optimizer) and inner is not opt else None
    return names[::-1]


def normalise_fqn(name: str) -> str:
    """``name`` without wrapper components (``_orig_mod``, ``_fsdp_wrapped_module``, ...)."""
    parts = name.split(".")
    if not _WRAPPER_PARTS.intersection(parts):
        return name
    return ".".join(p for p in parts if p not in _WRAPPER_PARTS)
