"""Page-locked ("pinned") host-tier segments, for a CUDA process, within a budget of bytes.

A device-to-host copy into pageable memory is staged by the driver through a
pinned bounce buffer (~5 GB/s here on an H200); into page-locked memory it
runs at the copy engine's rate (PCIe Gen5: ~50 GB/s) and asynchronously on a
side stream. So the host tier's shared-memory segments that a CUDA process
writes into are registered with the CUDA driver (``cudaHostRegister``) once,
on their mapping in this process, and stay registered while the segment and
its mapping are reused from step to step (:mod:`backends.host_pool`).

Protocol: :meth:`backends.host.HostBackend.pin` calls :meth:`Pinner.pin` with
the :class:`~backends.shm_mapping.Mapping` a reservation writes into and the
bytes the object needs. A mapping is registered at most once for a given
length (a later object of the same segment that needs more bytes
re-registers it; one that needs fewer reuses the registration). The
registration is undone by :meth:`Pinner.unpin`, which the mapping calls
before ``munmap`` (when its last view goes: the pool forgot it, or the
segment was freed) and before its pages are punched out; so memory is never
unmapped, nor given back to the system, while registered.

Budget: at most ``budget_bytes`` registered in this process at once (pinned
memory cannot be swapped or reclaimed: pinning too much starves the host).
A segment that does not fit, or whose registration fails (no CUDA, a driver
error, ``RLIMIT_MEMLOCK``), stays pageable: the copy into it is an ordinary,
slower one. Nothing is registered in a process that never writes CUDA
tensors, nor on a machine without CUDA.

The registration calls are injected (``register(addr, nbytes) -> bool``,
``unregister(addr)``), so the budget, fallback and unregister-before-free
logic is tested without a GPU; :func:`cuda_calls` gives CUDA's, through
``torch.cuda.cudart()``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Pinner", "cuda_calls"]

log = logging.getLogger(__name__)

_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process

Register = Callable[[int, int], bool]
Unregister = Callable[[int], None]


def cuda_calls() -> tuple[Register, Unregister] | None:
    """``(register, unregister)`` through CUDA's runtime, or ``None`` without a usable CUDA device."""
    try:
        import torch  # lazy: a backend imports torch only where a tensor is involved
    except ImportError:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        rt = torch.cuda.cudart()
    except Exception as e:  # noqa: BLE001 - no runtime: nothing is pinned
        log.debug("no CUDA runtime for pinning: %r", e)
        return None

    def register(addr: int, nbytes: int) -> bool:
        return int(rt.cudaHostRegister(addr, nbytes, _PORTABLE)) == 0

    def unregister(addr: int) -> None:
        err = int(rt.cudaHostUnregister(addr))
        if err:
            log.warning("cudaHostUnregister(0x%x) failed with CUDA error %d", addr, err)

    return register, unregister


class Pinner:
    """Registers mappings for this process within ``budget_bytes``; see the module docstring.

    Args:
        budget_bytes: at most this many bytes registered at once (0: never pin).
        calls: ``(register, unregister)``; ``None``: CUDA's (:func:`cuda_calls`), looked up at the first pin.

    Attributes:
        pinned_bytes: bytes registered now.
        pins: mappings registered; ``hits``: pins that found the mapping registered already;
        fallbacks: pins refused by the budget; ``failures``: registrations that failed.
    """

    def __init__(self, budget_bytes: int, calls: tuple[Register, Unregister] | None = None) -> None:
        self.budget_bytes = max(0, int(budget_bytes))
        self._calls = calls
        self._looked_up = calls is not None
        self._lock = threading.RLock()  # unpin runs from a mapping's __del__, maybe inside pin() of this thread
        self.pinned_bytes = 0
        self.pins = self.hits = self.fallbacks = self.failures = 0

    def _get_calls(self) -> tuple[Register, Unregister] | None:
        if not self._looked_up:
            self._calls = cuda_calls()
            self._looked_up = True
        return self._calls

    def pin(self, mapping: Any, nbytes: int) -> bool:
        """Make the first ``nbytes`` of ``mapping`` page-locked; ``False``: it stays pageable (budget, failure)."""
        if nbytes <= 0 or self.budget_bytes <= 0:
            return False
        with self._lock:
            if mapping.pinned == nbytes:
                self.hits += 1
                return True
            calls = self._get_calls()
            if calls is None:
                self.failures += 1
                return False
            register, _ = calls
            if mapping.pinned:  # registered for a shorter object of this segment: once more, longer
                self.unpin(mapping)
            if self.pinned_bytes + nbytes > self.budget_bytes:
                self.fallbacks += 1
                return False
            try:
                ok = register(mapping.addr, nbytes)
            except Exception as e:  # noqa: BLE001 - a failed registration means a pageable copy, not an error
                log.debug("registration of %d bytes failed: %r", nbytes, e)
                ok = False
            if not ok:
                self.failures += 1
                if self.failures == 1:
                    log.info("host-tier segment of %d bytes could not be page-locked: pageable copies", nbytes)
                return False
            mapping.pinned = nbytes
            mapping.pinner = self
            self.pinned_bytes += nbytes
            self.pins += 1
            return True

    def unpin(self, mapping: Any) -> None:
        """Undo ``mapping``'s registration (before it is unmapped or its pages are released). Idempotent."""
        with self._lock:
            n = mapping.pinned
            if not n:
                return
            mapping.pinned = 0
            mapping.pinner = None
            self.pinned_bytes -= n
            calls = self._calls
        if calls is not None:
            try:
                calls[1](mapping.addr)
            except Exception as e:  # noqa: BLE001 - at interpreter exit the runtime may be gone
                log.debug("unregister of 0x%x failed: %r", mapping.addr, e)

    def stats(self) -> dict[str, int]:
        return {"budget_bytes": self.budget_bytes, "pinned_bytes": self.pinned_bytes, "pins": self.pins,
                "hits": self.hits, "fallbacks": self.fallbacks, "failures": self.failures}
