"""A tensor read and verified, not yet copied: what a resharding restore hands the load for optimizer state.

A resharding restore (:mod:`tierstore.train.reshard`) assembles each tensor
of the target from the saved ranks' pieces. Every chunk those pieces need is
verified when the layer is read, before any rank loads anything
(:func:`~tierstore.train.restoring.prepare_agreed`); the bytes themselves are
copied only by the load (:meth:`~tierstore.train.layers.StateMap.apply`),
straight into the optimizer's own state tensor where it has one of the same
shape, dtype and device (its pages already there), else into a new tensor.
So a failed restore still changes nothing, and the load writes each byte
once, with no staging tensor in between.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["PendingTensor"]


class PendingTensor:
    """The verified parts of a tensor (``shape``, ``dtype``), copied into memory on :meth:`fill`.

    ``parts``: ``(slices, write)`` pairs: ``write(out)`` copies that part's verified bytes into ``out``, the
    target's ``slices``; the parts cover the tensor (checked by the reader that made them).
    """

    __slots__ = ("dtype", "parts", "shape")

    def __init__(self, shape: Sequence[int], dtype: torch.dtype,
                 parts: Sequence[tuple[tuple[slice, ...], Callable[[torch.Tensor], None]]]) -> None:
        self.shape = torch.Size(int(s) for s in shape)
        self.dtype = dtype
        self.parts = list(parts)

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def fill(self, out: torch.Tensor) -> torch.Tensor:
        """Copy every part into ``out`` (of this shape and dtype, on any device); returns ``out``."""
        if tuple(out.shape) != tuple(self.shape) or out.dtype != self.dtype:
            raise ValueError(f"out is {out.dtype} {tuple(out.shape)}, the tensor {self.dtype} {tuple(self.shape)}")
        for slices, write in self.parts:
            write(out[slices])
        return out

    def tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The tensor, in new memory on ``device``."""
        return self.fill(torch.empty(self.shape, dtype=self.dtype, device=device))

    def __repr__(self) -> str:
        return f"PendingTensor({self.dtype}, {tuple(self.shape)}, {len(self.parts)} part(s))"
