"""Lossless XOR deltas between two versions of a tensor (TierCheck differential checkpoints).

A delta is the XOR of the two versions' bit patterns, byte-shuffled: all
byte 0s of every element, then all byte 1s, and so on, as one flat uint8
tensor of ``numel * itemsize`` bytes. Consecutive optimizer steps change
mostly low mantissa bits, so the shuffled delta has long runs of zero bytes
(the sign/exponent planes) that lz4 compresses well, where the raw weights do
not compress at all. The delta is exact: ``apply_xor_delta(base,
xor_delta(new, base))`` is bitwise ``new`` for every dtype, NaNs included.

Protocol::

    d = xor_delta(new, base)            # same shape and dtype
    restored = apply_xor_delta(base, d)  # or apply_xor_delta(base, d, out=t)

A part of a delta: the elements ``s .. s + n`` of each run ``s`` of a box hold
their bytes at :func:`shuffled_starts` (one run per byte plane); those bytes,
read in that order, are the delta of the box on its own (its elements in
row-major order), so ``apply_xor_delta(base_box, part)`` rebuilds the box.

On CPU both directions run in cache-sized chunks with numpy (one pass over
the inputs, one over the output); on other devices they use torch ops there.
"""

from __future__ import annotations

import numpy as np
import torch

from tierstore.errors import CorruptObjectError, RestoreMismatchError

__all__ = ["apply_xor_delta", "delta_nbytes", "shuffled_starts", "xor_delta"]

# Elements per chunk: 256 Ki elements keep a chunk's intermediate in L2.
_CHUNK = 1 << 18
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def delta_nbytes(t: torch.Tensor) -> int:
    """Size in bytes of the delta of a tensor shaped like ``t``."""
    return t.numel() * t.element_size()


def shuffled_starts(starts: np.ndarray, numel: int, itemsize: int) -> np.ndarray:
    """Where runs of elements (``starts``, ascending) lie in the delta of a ``numel``-element tensor: plane ``k``
    of run ``s`` at byte ``k * numel + s``; every plane's runs, planes in order (ascending)."""
    return (np.arange(itemsize, dtype=np.int64)[:, None] * numel + np.asarray(starts, dtype=np.int64)[None, :]
            ).reshape(-1)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """Contiguous 1-D uint8 view of ``t``'s bit pattern (copies only if non-contiguous)."""
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:  # a size-1 slice keeps its odd stride
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def _np_words(t: torch.Tensor, size: int) -> np.ndarray:
    return _flat_bytes(t).numpy().view(_UINT[size])


def _check_pair(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise RestoreMismatchError(f"{what}: both operands must be tensors")
    if a.dtype != b.dtype or a.shape != b.shape:
        raise RestoreMismatchError(
            f"{what}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}",
            dtype=str(a.dtype), shape=tuple(a.shape),
        )
    if a.device != b.device:
        raise RestoreMismatchError(f"{what}: tensors on {a.device} and {b.device}")


def xor_delta(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Return the byte-shuffled XOR of ``new`` and ``base`` as a flat uint8 tensor.

    Raises:
        RestoreMismatchError: shapes, dtypes or devices differ.
    """
    _check_pair(new, base, "xor_delta")
    size, n = new.element_size(), new.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=new.device)
    if new.device.type != "cpu":
        x = torch.bitwise_xor(_flat_bytes(new).view(_TORCH_INT[size]), _flat_bytes(base).view(_TORCH_INT[size]))
        return x.view(torch.uint8).view(n, size).t().contiguous().view(-1)
    a, b = _np_words(new, size), _np_words(base, size)
    out = np.empty((size, n), dtype=np.uint8)
    tmp = np.empty(min(n, _CHUNK), dtype=a.dtype)
    for s in range(0, n, _CHUNK):
        e = min(n, s + _CHUNK)
        x = np.bitwise_xor(a[s:e], b[s:e], out=tmp[: e - s])
        out[:, s:e] = x.view(np.uint8).reshape(e - s, size).T
    return torch.from_numpy(out.reshape(-1))


def apply_xor_delta(base: torch.Tensor, delta: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuild the tensor a delta was taken from: the exact inverse of :func:`xor_delta`.

    Args:
        base: the version the delta was taken against.
        delta: flat uint8 tensor of ``base.numel() * base.element_size()`` bytes.
        out: optional target shaped and typed like ``base`` (any strides); it is
            filled in place and returned. ``out`` may be ``base`` itself.

    Raises:
        RestoreMismatchError: ``out`` does not match ``base``.
        CorruptObjectError: ``delta`` has the wrong dtype or length.
    """
    if out is not None:
        _check_pair(out, base, "apply_xor_delta out")
    size, n = base.element_size(), base.numel()
    if not isinstance(delta, torch.Tensor) or delta.dtype != torch.uint8 or delta.numel() != n * size:
        got = f"{delta.dtype}[{delta.numel()}]" if isinstance(delta, torch.Tensor) else type(delta).__name__
        raise CorruptObjectError(f"delta must be uint8[{n * size}] for {base.dtype}{list(base.shape)}, got {got}")
    if n == 0:
        result = torch.empty_like(base, memory_format=torch.contiguous_format)
    elif base.device.type != "cpu" or delta.device != base.device:
        d = delta.to(base.device).reshape(size, n).t().contiguous().view(_TORCH_INT[size]).view(-1)
        x = torch.bitwise_xor(_flat_bytes(base).view(_TORCH_INT[size]), d)
        result = x.view(torch.uint8).view(base.dtype).view(base.shape)
    else:
        b = _np_words(base, size)
        d_np = delta.detach().contiguous().numpy().reshape(size, n)
        target = out if out is not None and out.is_contiguous() and out.device.type == "cpu" else None
        result = target if target is not None else torch.empty(base.shape, dtype=base.dtype)
        r = result.reshape(-1).view(torch.uint8).numpy().view(b.dtype)
        tmp = np.empty((min(n, _CHUNK), size), dtype=np.uint8)
        for s in range(0, n, _CHUNK):
            e = min(n, s + _CHUNK)
            t = tmp[: e - s]
            t[:] = d_np[:, s:e].T
            np.bitwise_xor(b[s:e], t.view(b.dtype).reshape(-1), out=r[s:e])
        if target is not None:
            return target
    if out is not None:
        with torch.no_grad():
            out.copy_(result)
        return out
    return result
