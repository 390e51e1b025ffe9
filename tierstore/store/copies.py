"""Asynchronous device-to-host copies of one lazy save, on a side stream ordered after the trainer's stream.

Protocol (a lazy :class:`~tierstore.train.checkpointer.Checkpointer` with CUDA tensors):

1. ``save()``, on the trainer's thread: :meth:`DeviceCopies.after_current`
   records an event on the trainer's current stream and makes the device's
   side stream wait for it (no host sync): copies enqueued there read the
   state as of ``save()``.
2. The background thread calls :meth:`~tierstore.store.writing.WritePath.snapshot`
   with ``copies=``: each object is copied with ``non_blocking=True`` under
   :meth:`DeviceCopies.stream_context` into its host-tier reservation
   (page-locked where the budget allows: :mod:`backends.pinning`), then
   :meth:`DeviceCopies.enqueued` records the copies' event and the update gate
   is released.
3. The optimizer's pre-hook calls :meth:`DeviceCopies.order_update`: if the
   copies have not completed, the trainer's stream waits for their event
   (device side): the update's kernels run after the copies, and the host is
   never blocked.
4. Sealing (the checksum over the host copy) and any abort wait for the copies
   first (:meth:`DeviceCopies.synchronize`, on the background thread).

No GPU memory is allocated on this path: the copies go straight from the
parameters and optimizer state into the host tier. The source tensors are
referenced by the save until its objects are sealed (after the copies
completed), so the caching allocator never hands their memory to another
stream meanwhile.

Where tensors live on several CUDA devices, or on none, there is no
:class:`DeviceCopies` (``None``) and copies are synchronous, as before.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
else:  # torch is imported on first use (see tierstore.lazytorch)
    from tierstore.lazytorch import torch

__all__ = ["DeviceCopies", "cuda_device_of"]

_streams: dict[int, Any] = {}  # one side stream per device, reused by every save of the process
_streams_lock = threading.Lock()


def cuda_device_of(tensors: Iterable[torch.Tensor]) -> torch.device | None:
    """The one CUDA device of ``tensors`` (CPU ones beside them allowed); ``None``: none, or several."""
    dev = None
    for t in tensors:
        if t.is_cuda:  # (is_cuda / is_cpu: no device object per tensor; this runs in save())
            d = t.device
            if dev is not None and d != dev:
                return None
            dev = d
        elif not t.is_cpu:
            return None
    return dev


def _side_stream(device: torch.device) -> Any:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    with _streams_lock:
        s = _streams.get(idx)
        if s is None:
            s = _streams[idx] = torch.cuda.Stream(device=torch.device("cuda", idx))
        return s


class DeviceCopies:
    """The device-to-host copies of one save; see the module docstring."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = _side_stream(device)
        self.ready = torch.cuda.Event()
        self.ready.record(torch.cuda.current_stream(device))
        self.stream.wait_event(self.ready)
        self.done: Any = None

    @classmethod
    def after_current(cls, tensors: Iterable[torch.Tensor]) -> DeviceCopies | None:
        """Copies ordered after the caller's stream, if ``tensors`` live on one CUDA device; else ``None``."""
        dev = cuda_device_of(tensors)
        return cls(dev) if dev is not None else None

    def stream_context(self) -> AbstractContextManager[Any]:
        """Make the side stream current (the calling thread's) while copies are enqueued."""
        return torch.cuda.stream(self.stream)

    def enqueued(self) -> None:
        """Every copy of the save is enqueued: record their event."""
        ev = torch.cuda.Event()
        ev.record(self.stream)
        self.done = ev

    def completed(self) -> bool:
        return self.done is not None and bool(self.done.query())

    def synchronize(self) -> None:
        """Block the calling thread until the copies enqueued so far completed."""
        if self.done is not None:
            self.done.synchronize()
        else:
            self.stream.synchronize()

    def order_update(self) -> None:
        """Make the trainer's current stream wait for the copies (device side), unless they completed."""
        ev = self.done
        if ev is None:  # the save failed before its event: order after whatever it enqueued
            ev = torch.cuda.Event()
            ev.record(self.stream)
        if not ev.query():
            torch.cuda.current_stream(self.device).wait_event(ev)
