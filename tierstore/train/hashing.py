"""Tensor digests for redundancy detection (AdaCheck).

``tensor_digest`` hashes a tensor's dtype, shape and raw bytes, so two tensors
have equal digests exactly when they are bitwise identical with the same dtype
and shape (up to hash collisions: 128-bit digests). Ranks exchange digests
inside a communication group; a shard whose digests all match another rank's
is stored once (a *ref*). Contiguous CPU tensors are hashed in place without a
copy; non-contiguous ones are made contiguous first; device tensors are
copied to the host.

The digest is a 32-char lowercase hex string for every algorithm:
``"xxh3"`` (xxh3-128, the default, fast) or ``"blake2s"`` (blake2s with a
16-byte digest, cryptographic). Digests of different algorithms are not
comparable.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import xxhash

from tierstore.errors import InvalidValueError

__all__ = ["ALGORITHMS", "digest_many", "tensor_digest"]

ALGORITHMS = ("xxh3", "blake2s")
_DOMAIN = b"tierstore.tensor.v1\0"


def _hasher(algo: str) -> Any:
    if algo == "xxh3":
        return xxhash.xxh3_128()
    if algo == "blake2s":
        return hashlib.blake2s(digest_size=16)
    raise InvalidValueError(f"unknown digest algorithm {algo!r}; choose one of {ALGORITHMS}", entry="algo")


def _raw_view(t: torch.Tensor) -> memoryview:
    """A memoryview of ``t``'s bytes in row-major order; no copy for contiguous CPU tensors."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    flat = t.reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:  # a size-1 slice keeps its odd stride
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8).numpy().data


def tensor_digest(t: torch.Tensor, algo: str = "xxh3") -> str:
    """Return the hex digest of ``t``'s dtype, shape and bytes.

    Raises:
        InvalidValueError: ``t`` is not a dense tensor, or ``algo`` is unknown.
    """
    h = _hasher(algo)
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
        raise InvalidValueError(f"cannot digest a {type(t).__name__}: need a dense tensor with data", entry="t")
    shape = ",".join(str(d) for d in t.shape)
    h.update(_DOMAIN + f"{t.dtype}|{shape}|{t.numel() * t.element_size()}\0".encode())
    h.update(_raw_view(t))
    return h.hexdigest()


def digest_many(tensors: Mapping[str, torch.Tensor], algo: str = "xxh3") -> dict[str, str]:
    """Return ``{name: tensor_digest(tensor, algo)}`` for every entry, in order."""
    return {name: tensor_digest(t, algo) for name, t in tensors.items()}
