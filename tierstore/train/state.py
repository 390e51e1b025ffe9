"""Trainer state that is not a module's tensors: safe JSON encoding, RNG state, wrapper prefixes.

The Checkpointer saves ``Stateful`` objects (anything with ``state_dict()`` and
``load_state_dict()``, the protocol DCP and torchtitan use). Their state dicts
mix tensors with plain values. :func:`encode` turns such a value into JSON,
moving every tensor out into a name -> tensor table (the tensors are stored
as tensors, in the step's ``_state`` layer); :func:`decode` is its inverse.
Nothing here ever unpickles: bytes travel as base64 and come back as bytes.

Encoding (JSON values are themselves; everything else is a one-key object)::

    None, bool, int, str, finite float, list   -> themselves
    dict with str keys (none of them a tag)    -> a JSON object
    other dicts                                 {"__kv__": [[key, value], ...]}
    tuple (and torch.Size, named tuples)        {"__tuple__": [...]}
    bytes, bytearray                            {"__bytes__": "<base64>"}
    nan, inf, -inf                              {"__float__": "nan" | "inf" | "-inf"}
    torch.Tensor                                {"__tensor__": "<name in the table>"}
    numpy array                                 {"__ndarray__": "<name in the table>"}
    numpy scalar                                {"__npscalar__": ["<dtype>", value]}

Anything else (an arbitrary object, a function, a set, a distributed tensor
outside a module) is refused with :class:`~tierstore.errors.InvalidValueError`
naming where it sits (``sched.lr_lambdas[0]``), before anything is written.

Wrapper prefixes: :func:`unwrap` peels ``DistributedDataParallel``,
``DataParallel`` and ``torch.compile`` wrappers off a module, and
:func:`normalise_fqn` drops the wrapper components (``_orig_mod``,
``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``) inside names, so a
checkpoint of a wrapped model restores into the bare one and back.
"""

from __future__ import annotations

import base64
import math
import random
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from tierstore.errors import CorruptObjectError, InvalidValueError

try:  # optional: numpy RNG state and arrays in trainer state (torch works without numpy)
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with every torch wheel we test
    np = None  # type: ignore[assignment]

__all__ = [
    "TAGS",
    "RNGState",
    "Stateful",
    "decode",
    "encode",
    "is_stateful",
    "normalise_fqn",
    "unwrap",
]

TAGS = ("__kv__", "__tuple__", "__bytes__", "__float__", "__tensor__", "__ndarray__", "__npscalar__")
_WRAPPER_PARTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
_MAX_DEPTH = 200


@runtime_checkable
class Stateful(Protocol):
    """What the Checkpointer saves: ``state_dict()`` and ``load_state_dict(sd)``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` has callable ``state_dict`` and ``load_state_dict`` (and is not a class)."""
    return (not isinstance(obj, type) and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


# ---- safe encoding ---------------------------------------------------------------------------

def _is_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


def encode(value: Any, tensors: dict[str, torch.Tensor], prefix: str, where: str) -> Any:
    """JSON for ``value``; its tensors are added to ``tensors`` under ``prefix`` + a number.

    Args:
        value: a state dict, or any value inside one.
        tensors: the table the tensors go into (names must not repeat across calls:
            give each call its own ``prefix``).
        prefix: the names' prefix (``state/sched/``).
        where: the value's path for error messages (``sched``).

    Raises:
        InvalidValueError: a value that is neither JSON nor one of the types above;
            ``key`` names its path.
    """
    return _enc(value, tensors, prefix, where, 0)


def _refuse(where: str, what: str) -> InvalidValueError:
    return InvalidValueError(f"state {where!r}: {what}; only tensors, numpy arrays, bytes and JSON values "
                             "(None, bool, int, float, str, list, tuple, dict) can be checkpointed", key=where)


def _enc(v: Any, tensors: dict[str, torch.Tensor], prefix: str, where: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise _refuse(where, f"nested deeper than {_MAX_DEPTH} levels (a cycle?)")
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        if math.isfinite(v):
            return float(v)
        return {"__float__": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"__bytes__": base64.b64encode(bytes(v)).decode("ascii")}
    if _is_tensor(v):
        if type(v) is not torch.Tensor and not isinstance(v, nn.Parameter):
            raise _refuse(where, f"a {type(v).__name__} (a distributed tensor belongs to a module's state)")
        if v.layout != torch.strided or v.is_nested or v.is_quantized or v.device.type == "meta":
            raise _refuse(where, "a tensor that is not dense and strided (nested, sparse, quantized or meta)")
        name = f"{prefix}{len(tensors)}"
        tensors[name] = v.detach()
        return {"__tensor__": name}
    if np is not None and isinstance(v, np.ndarray):
        try:
            t = torch.from_numpy(np.ascontiguousarray(v))
        except TypeError as e:
            raise _refuse(where, f"a numpy array of dtype {v.dtype}") from e
        name = f"{prefix}{len(tensors)}"
        tensors[name] = t
        return {"__ndarray__": name}
    if np is not None and isinstance(v, np.generic):
        item = v.item()
        if not isinstance(item, (bool, int, float)):
            raise _refuse(where, f"a numpy scalar of dtype {v.dtype}")
        return {"__npscalar__": [v.dtype.str, _enc(item, tensors, prefix, where, depth + 1)]}
    if isinstance(v, tuple):
        return {"__tuple__": [_enc(x, tensors, prefix, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]}
    if isinstance(v, list):
        return [_enc(x, tensors, prefix, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
    if isinstance(v, Mapping):
        if all(isinstance(k, str) for k in v) and not any(k in TAGS for k in v):
            return {k: _enc(x, tensors, prefix, f"{where}.{k}", depth + 1) for k, x in v.items()}
        return {"__kv__": [[_enc(k, tensors, prefix, f"{where}.<key {k!r}>", depth + 1),
                            _enc(x, tensors, prefix, f"{where}[{k!r}]", depth + 1)] for k, x in v.items()]}
    raise _refuse(where, f"a {type(v).__module__}.{type(v).__qualname__}")


def decode(obj: Any, tensors: Mapping[str, torch.Tensor], where: str = "state") -> Any:
    """The value :func:`encode` encoded; tensors are taken from ``tensors`` (cloned by the caller if needed).

    Raises:
        CorruptObjectError: a malformed tag or a tensor missing from ``tensors``.
    """
    if isinstance(obj, list):
        return [decode(x, tensors, where) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        (tag, arg), = obj.items()
        if tag in TAGS:
            return _dec_tag(tag, arg, tensors, where)
    return {k: decode(x, tensors, f"{where}.{k}") for k, x in obj.items()}


def _dec_tag(tag: str, arg: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    try:
        if tag == "__tuple__":
            return tuple(decode(x, tensors, where) for x in arg)
        if tag == "__kv__":
            return {_hashable(decode(k, tensors, where)): decode(x, tensors, where) for k, x in arg}
        if tag == "__bytes__":
            return base64.b64decode(arg.encode("ascii"), validate=True)
        if tag == "__float__":
            return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[arg]
        if tag in ("__tensor__", "__ndarray__"):
            t = tensors[arg]
            if tag == "__ndarray__":
                if np is None:  # pragma: no cover
                    raise CorruptObjectError(f"state {where!r} holds a numpy array and numpy is not installed")
                return t.numpy().copy()
            return t
        if tag == "__npscalar__":
            if np is None:  # pragma: no cover
                raise CorruptObjectError(f"state {where!r} holds a numpy scalar and numpy is not installed")
            return np.dtype(arg[0]).type(arg[1])
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CorruptObjectError(f"state {where!r}: malformed {tag} entry ({e!r})", key=where) from e
    raise CorruptObjectError(f"state {where!r}: unknown tag {tag}", key=where)  # pragma: no cover


def _hashable(k: Any) -> Any:
    if isinstance(k, list):
        return tuple(_hashable(x) for x in k)
    if isinstance(k, dict):
        raise TypeError("a dict cannot be a key")
    return k


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


def normalise_fqn(name: str) -> str:
    """``name`` without wrapper components (``_orig_mod``, ``_fsdp_wrapped_module``, ...)."""
    parts = name.split(".")
    if not _WRAPPER_PARTS.intersection(parts):
        return name
    return ".".join(p for p in parts if p not in _WRAPPER_PARTS)
