"""The device tier: reused snapshot buffers on the accelerator (or in this process's host memory).

Protocol (who calls what): the checkpointer calls :meth:`DeviceBackend.snapshot`
once per save, on the training thread, right after ``optimizer.step()``. That
call is the only part of a save that blocks training: it copies the tensors
into pre-allocated buffers reused from save to save (sized on first use) and
returns a :class:`DeviceSnapshot`. A background writer then reads
``snapshot.tensors`` (after :meth:`DeviceSnapshot.wait`) to encode and send
them to the slower tiers, and calls :meth:`DeviceSnapshot.release` when done.
:meth:`DeviceBackend.latest` hands the newest complete snapshot of a name back
for an in-process rollback.

Double buffering: each name has ``buffers_per_name`` (default 2) buffer sets.
Save N+1 copies into a free set while save N still drains from the other. A
set is free when its snapshot was released, it is not the latest of its
name (so a rollback source is never overwritten) and no reader pinned it
(:meth:`DeviceSnapshot.pin`: an older snapshot read for a rollback stays
intact until unpinned). If none is free, snapshot waits for a release
(``wait_timeout_s``, then :class:`TierFullError`; 0 fails at once).

On CUDA the buffers live on the device and the copies run on a side stream
that first waits for the current stream; the snapshot records an event.
``wait()`` blocks the host on it; ``fence()`` makes the current stream wait on
it without blocking the host (call it before the next optimizer step). On
CPU the copies are synchronous and the snapshot is complete on return.

The bytes interface (put/get/delete/exists/list) keeps plain objects in device
memory too, separate from snapshots, so the shared conformance suite applies.
Nothing here survives the process ("survives" = "step").

Memory bound: ``buffers_per_name`` x the largest snapshot of each name, plus
the bytes objects; ``capacity_bytes`` caps the total (:class:`TierFullError`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from backends.base import Backend, Buffer, as_buffers, total_size, validate_object_name
from tierstore.errors import InvalidValueError, KeyExistsError, TierFullError, TierUnavailableError

__all__ = ["DeviceBackend", "DeviceSnapshot"]

_ALIGN = 64


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(eq=False)
class _Slot:
    buffer: torch.Tensor  # flat uint8
    snapshot: DeviceSnapshot | None = None
    released: bool = True
    readers: int = 0  # pins of its snapshot (a rollback reading it): not reused while > 0


@dataclass(eq=False)
class DeviceSnapshot:
    """One save's copy of a set of tensors, in reused buffers.

    Attributes:
        name: the snapshot's name.
        seq: per-backend sequence number (increasing).
        tensors: name -> tensor view into the buffers (same dtype and shape as the source).
    """

    name: str
    seq: int
    tensors: dict[str, torch.Tensor]
    _backend: DeviceBackend = field(repr=False)
    _slot: _Slot = field(repr=False)
    _event: object | None = field(default=None, repr=False)

    @property
    def intact(self) -> bool:
        """Whether the buffers still hold this snapshot (no later snapshot reused them, not dropped)."""
        return self._backend._holds(self)

    @property
    def done(self) -> bool:
        """Whether the copies have finished (always true on CPU)."""
        return self._event is None or self._event.query()  # type: ignore[attr-defined]

    def wait(self) -> DeviceSnapshot:
        """Block until the copies finished; return self."""
        if self._event is not None:
            self._event.synchronize()  # type: ignore[attr-defined]
        return self

    def fence(self) -> None:
        """Make the current CUDA stream wait for the copies (no host block); no-op on CPU."""
        if self._event is not None:
            torch.cuda.current_stream(self._slot.buffer.device).wait_event(self._event)  # type: ignore[arg-type]

    def release(self) -> None:
        """The reader is done: the buffers may be reused by a later snapshot. Idempotent."""
        self._backend._release(self)

    def pin(self) -> bool:
        """Keep the buffers from reuse while reading them; ``False`` if a later snapshot already reused them.

        Each successful pin needs one :meth:`unpin`.
        """
        return self._backend._pin(self)

    def unpin(self) -> None:
        """Undo one successful :meth:`pin`."""
        self._backend._unpin(self)


class DeviceBackend(Backend):
    """Snapshot buffers and plain objects in device memory (host memory on a CPU device).

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a :class:`torch.device`.
        capacity_bytes: cap on buffers plus objects; ``None`` for no cap.
        buffers_per_name: buffer sets per snapshot name (2 = double buffering).
        wait_timeout_s: how long snapshot waits for a buffer set to be released.
        pin_memory: on a CPU device, pin the buffers (faster, async copies from CUDA sources).
    """

    tier = "device"
    survives = "step"
    zero_copy_get = False
    reservable = False
    atomic_create_once = True

    def __init__(self, device: str | torch.device = "cpu", *, capacity_bytes: int | None = None,
                 buffers_per_name: int = 2, wait_timeout_s: float = 300.0, pin_memory: bool = False) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise TierUnavailableError(f"device {self.device} requested but CUDA is not available", tier="device")
        if buffers_per_name < 1:
            raise InvalidValueError("buffers_per_name must be >= 1")
        self.capacity_bytes = capacity_bytes
        self.buffers_per_name = buffers_per_name
        self.wait_timeout_s = wait_timeout_s
        self.pin_memory = pin_memory and self.device.type == "cpu" and torch.cuda.is_available()
        self._cond = threading.Condition()
        self._slots: dict[str, list[_Slot]] = {}
        self._latest: dict[str, DeviceSnapshot] = {}
        self._objects: dict[str, torch.Tensor] = {}
        self._seq = 0
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # -- accounting ------------------------------------------------------------------
    def used_bytes(self) -> int:
        with self._cond:
            return self._used_locked()

    def _used_locked(self) -> int:
        slots = sum(s.buffer.numel() for ss in self._slots.values() for s in ss)
        return slots + sum(t.numel() for t in self._objects.values())

    def _check_room(self, extra: int, freeing: int = 0) -> None:
        if self.capacity_bytes is not None and self._used_locked() - freeing + extra > self.capacity_bytes:
            raise TierFullError(f"device tier full: {extra} more bytes exceed {self.capacity_bytes}",
                                tier="device", capacity=self.capacity_bytes, requested=extra)

    def _alloc(self, nbytes: int) -> torch.Tensor:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device, pin_memory=self.pin_memory)
        except torch.OutOfMemoryError as e:
            raise TierFullError(f"device {self.device} has no room for {nbytes} more bytes: {e}",
                                tier="device", requested=nbytes) from e

    # -- snapshots -------------------------------------------------------------------
    def snapshot(self, name: str, tensors: Mapping[str, torch.Tensor]) -> DeviceSnapshot:
        """Copy ``tensors`` into reused buffers for ``name``; return the snapshot handle.

        Blocks only for the copies (CPU) or for enqueueing them (CUDA). The
        source tensors must not change before the snapshot is done (``fence()``
        orders the next CUDA kernel after it).
        """
        validate_object_name(name)
        layout: list[tuple[str, torch.Tensor, int]] = []
        off = 0
        for key, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise InvalidValueError(f"snapshot {name!r}: {key!r} is a {type(t).__name__}, not a tensor")
            layout.append((key, t, off))
            off = _align(off + t.numel() * t.element_size())
        slot = self._acquire_slot(name, off)
        buf = slot.buffer
        views = {key: buf[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for key, t, o in layout}
        event = None
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for key, t, _ in layout:
                    views[key].copy_(t, non_blocking=True)
                    if t.is_cuda:
                        t.record_stream(self._stream)
                event = torch.cuda.Event()
                event.record(self._stream)
        else:
            non_blocking = self.pin_memory
            for key, t, _ in layout:
                views[key].copy_(t, non_blocking=non_blocking)
            if non_blocking and any(t.is_cuda for t in tensors.values()):
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream())
        with self._cond:
            self._seq += 1
            snap = DeviceSnapshot(name, self._seq, views, self, slot, event)
            slot.snapshot = snap
            self._latest[name] = snap
        return snap

    def _acquire_slot(self, name: str, nbytes: int) -> _Slot:
        with self._cond:
            slots = self._slots.setdefault(name, [])

            def free() -> _Slot | None:
                latest = self._latest.get(name)
                for s in slots:
                    if s.released and not s.readers and (latest is None or latest._slot is not s):
                        return s
                return None

            slot = free()
            if slot is None and len(slots) < self.buffers_per_name:
                self._check_room(nbytes)
                slot = _Slot(self._alloc(nbytes))
                slots.append(slot)
            elif slot is None:
                if not self._cond.wait_for(lambda: free() is not None, self.wait_timeout_s):
                    raise TierFullError(f"no released snapshot buffer for {name!r} within {self.wait_timeout_s}s",
                                        key=name, tier="device")
                slot = free()
                assert slot is not None
            if slot.buffer.numel() < nbytes:  # the state grew: regrow this set
                self._check_room(nbytes, freeing=slot.buffer.numel())
                slot.buffer = self._alloc(nbytes)
            slot.released = False
            return slot

    def _release(self, snap: DeviceSnapshot) -> None:
        with self._cond:
            if snap._slot.snapshot is snap:
                snap._slot.released = True
                self._cond.notify_all()

    def _holds(self, snap: DeviceSnapshot) -> bool:
        with self._cond:
            return snap._slot.snapshot is snap and any(snap._slot is s for s in self._slots.get(snap.name, ()))

    def _pin(self, snap: DeviceSnapshot) -> bool:
        with self._cond:
            if snap._slot.snapshot is not snap or not any(snap._slot is s for s in self._slots.get(snap.name, ())):
                return False
            snap._slot.readers += 1
            return True

    def _unpin(self, snap: DeviceSnapshot) -> None:
        with self._cond:
            snap._slot.readers -= 1
            self._cond.notify_all()

    def latest(self, name: str) -> DeviceSnapshot | None:
        """The newest snapshot of ``name`` (its buffers are not reused while it is the newest)."""
        with self._cond:
            return self._latest.get(name)

    def drop(self, name: str) -> None:
        """Forget ``name``'s snapshots and free their buffers."""
        with self._cond:
            self._slots.pop(name, None)
            self._latest.pop(name, None)
            self._cond.notify_all()

    # -- bytes interface -------------------------------------------------------------
    def put(self, name: str, data: Buffer | Sequence[Buffer], *, if_absent: bool = False) -> None:
        validate_object_name(name)
        bufs = as_buffers(data)
        n = total_size(bufs)
        host = torch.empty(n, dtype=torch.uint8)
        dst = host.numpy().data.cast("B") if n else memoryview(b"")
        pos = 0
        for b in bufs:
            if b.nbytes:
                dst[pos:pos + b.nbytes] = b
                pos += b.nbytes
        obj = host if self.device.type == "cpu" else host.to(self.device)
        with self._cond:
            old = self._objects.get(name)
            if if_absent and old is not None:
                raise KeyExistsError(f"device object {name!r} exists", key=name, tier="device")
            self._check_room(n, freeing=0 if old is None else old.numel())
            self._objects[name] = obj

    def get(self, name: str) -> memoryview | None:
        validate_object_name(name)
        with self._cond:
            obj = self._objects.get(name)
        if obj is None:
            return None
        host = obj if obj.device.type == "cpu" else obj.cpu()
        return host.numpy().data.cast("B") if host.numel() else memoryview(b"")

    def size(self, name: str) -> int | None:
        validate_object_name(name)
        with self._cond:
            obj = self._objects.get(name)
        return None if obj is None else obj.numel()

    def delete(self, name: str) -> bool:
        validate_object_name(name)
        with self._cond:
            return self._objects.pop(name, None) is not None

    def exists(self, name: str) -> bool:
        validate_object_name(name)
        with self._cond:
            return name in self._objects

    def list(self, prefix: str = "") -> Iterator[str]:
        with self._cond:
            names = sorted(n for n in self._objects if n.startswith(prefix))
        return iter(names)

    def close(self) -> None:
        with self._cond:
            self._objects.clear()
            self._slots.clear()
            self._latest.clear()
            self._cond.notify_all()

    def __repr__(self) -> str:
        return f"<DeviceBackend tier=device device={self.device}>"
