"""Shared mappings of files that hold no file descriptor, unmapped when nothing uses them any more.

Python's :class:`mmap.mmap` keeps a duplicate of the file descriptor for as
long as the mapping lives (3.13's ``trackfd=False`` is not available on 3.11),
so a process that keeps many mappings for reuse runs into its open-file
limit. A :class:`Mapping` calls ``mmap(2)`` through ctypes instead, and the
descriptor can be closed at once.

Lifetime is reference counting, so it is safe by construction: every view
(:meth:`Mapping.view`) is a ctypes array over the mapping that holds a
reference to its :class:`Mapping`, and memoryviews, numpy arrays and torch
tensors made from a view keep that array alive. ``munmap`` runs only when the
last of them is gone; there is no explicit close. Linux and other POSIX
systems with a C library ``mmap``.

A mapping a CUDA process writes into may be page-locked (``pinned``:
:mod:`backends.pinning`); its registration is undone before ``munmap`` and
before :func:`release_pages` gives its pages back.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

__all__ = ["Mapping", "release_pages"]

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_madvise = _libc.madvise
_madvise.restype = ctypes.c_int
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MAP_FAILED = ctypes.c_void_p(-1).value


class Mapping:
    """A shared read-write mapping of ``length`` bytes of the file ``fd`` (``fd`` may be closed afterwards).

    Args:
        fd: an open file descriptor, readable and writable.
        length: bytes to map from offset 0 (the file may be shorter later:
            bytes past its end must not be touched, they fault with SIGBUS).
        populate: fill the page tables now (``MAP_POPULATE``), not page by page.

    Raises:
        OSError: ``mmap(2)`` failed.
    """

    __slots__ = ("addr", "length", "pinned", "pinner")

    def __init__(self, fd: int, length: int, *, populate: bool = False) -> None:
        if length <= 0:
            raise ValueError("length must be positive")
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        addr = _mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {length} bytes failed: {os.strerror(err)}")
        self.addr: int = addr
        self.length = length
        self.pinned = 0  # bytes page-locked from addr (backends.pinning); 0: pageable
        self.pinner: Any = None  # the Pinner that registered them

    def view(self, nbytes: int, *, keep: Any = None) -> memoryview:
        """A writable byte view of the first ``nbytes``; it (and ``keep``) keep the mapping alive."""
        if not 0 < nbytes <= self.length:
            raise ValueError(f"view of {nbytes} bytes of a {self.length}-byte mapping")
        arr = (ctypes.c_ubyte * nbytes).from_address(self.addr)
        arr._tierstore_mapping = self  # type: ignore[attr-defined]
        if keep is not None:
            arr._tierstore_keep = keep  # type: ignore[attr-defined]
        return memoryview(arr).cast("B")

    def __len__(self) -> int:
        return self.length

    def __del__(self) -> None:
        addr = getattr(self, "addr", None)  # unset if mmap(2) failed in __init__
        if addr is not None:
            if getattr(self, "pinned", 0) and self.pinner is not None:
                self.pinner.unpin(self)  # unregistered before the memory is unmapped
            _munmap(addr, self.length)


def release_pages(buf: memoryview) -> None:
    """Punch the pages under ``buf`` out of its shared-memory file (``MADV_REMOVE``); the mapping stays.

    ``buf`` is a view of a :class:`Mapping` (:meth:`Mapping.view`) or of an
    :class:`mmap.mmap`. The whole mapping is released; a later write faults
    in a fresh zero page.

    Raises:
        OSError: the kernel refused (not a shared-memory mapping).
        ValueError: ``buf`` is not a view of a mapping.
    """
    obj = buf.obj
    if isinstance(obj, mmap.mmap):
        obj.madvise(mmap.MADV_REMOVE)
        return
    mapping = getattr(obj, "_tierstore_mapping", None)
    if not isinstance(mapping, Mapping):
        raise ValueError(f"not a view of a shared mapping: {type(obj).__name__}")
    if mapping.pinned and mapping.pinner is not None:
        mapping.pinner.unpin(mapping)  # page-locked pages must not be given back while registered
    if _madvise(mapping.addr, mapping.length, mmap.MADV_REMOVE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_REMOVE) failed: {os.strerror(err)}")
