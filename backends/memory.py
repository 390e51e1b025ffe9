"""An in-process, thread-safe dict backend: the reference implementation.

:class:`MemoryBackend` keeps objects as immutable ``bytes`` in a dict guarded
by one lock. It is the simplest backend that passes the conformance suite, and
the one unit tests of pure logic (policies, the read path, garbage collection)
run against. Its data lives and dies with the process, so it is a "device"-class
tier: it survives a failed step, not a process crash.

Protocol: any thread may call any method at any time; every call is atomic
with respect to the others. ``get`` returns the stored ``bytes`` object itself
(no copy; immutable, so it stays valid after a delete). ``reserve`` hands out a
private ``bytearray``; ``commit`` publishes a copy of it atomically.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from backends.base import Backend, Buffer, Reservation, as_buffers, check_range, validate_object_name
from tierstore.errors import InvalidValueError, KeyExistsError, TierFullError

__all__ = ["MemoryBackend", "MemoryReservation"]


class MemoryBackend(Backend):
    """Objects in a dict, optionally bounded by ``capacity_bytes``.

    Args:
        capacity_bytes: the most bytes held at once (committed objects plus
            open reservations); ``None`` for no bound. A put or reserve beyond
            it raises :class:`~tierstore.errors.TierFullError` (no eviction:
            that is the tier manager's job).
    """

    tier = "device"
    survives = "step"
    zero_copy_get = True
    reservable = True
    atomic_create_once = True
    ranged_get = True

    def __init__(self, capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise InvalidValueError("capacity_bytes must be >= 0 or None", field="capacity_bytes")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._objects: dict[str, bytes] = {}
        self._used = 0
        self._reserved = 0
        self._closed = False

    # -- helpers -------------------------------------------------------------------
    def _check_room(self, name: str, nbytes: int, replacing: int) -> None:
        """Raise TierFullError if ``nbytes`` more (less ``replacing``) would not fit. Lock held."""
        if self.capacity_bytes is None:
            return
        need = self._used + self._reserved - replacing + nbytes
        if need > self.capacity_bytes:
            raise TierFullError(
                f"memory tier full: {name!r} needs {nbytes} bytes, "
                f"{self.capacity_bytes - self._used - self._reserved} free",
                key=name,
                tier=self.tier,
                needed=nbytes,
                capacity=self.capacity_bytes,
            )

    def _publish(self, name: str, data: bytes, if_absent: bool) -> None:
        """Store ``data`` under ``name``. Lock held."""
        old = self._objects.get(name)
        if old is not None and if_absent:
            raise KeyExistsError(f"object {name!r} already exists", key=name, tier=self.tier)
        self._check_room(name, len(data), len(old) if old is not None else 0)
        self._objects[name] = data
        self._used += len(data) - (len(old) if old is not None else 0)

    # -- the interface -------------------------------------------------------------
    def put(self, name: str, data: Buffer | Sequence[Buffer], *, if_absent: bool = False) -> None:
        validate_object_name(name)
        bufs = as_buffers(data)
        blob = bytes(bufs[0]) if len(bufs) == 1 else b"".join(bufs)
        with self._lock:
            self._publish(name, blob, if_absent)

    def get(self, name: str) -> bytes | None:
        validate_object_name(name)
        with self._lock:
            return self._objects.get(name)

    def get_range(self, name: str, offset: int, length: int) -> bytes | None:
        validate_object_name(name)
        check_range(offset, length)
        with self._lock:
            data = self._objects.get(name)
        return None if data is None else data[offset : offset + length]

    def delete(self, name: str) -> bool:
        validate_object_name(name)
        with self._lock:
            old = self._objects.pop(name, None)
            if old is None:
                return False
            self._used -= len(old)
            return True

    def exists(self, name: str) -> bool:
        validate_object_name(name)
        with self._lock:
            return name in self._objects

    def list(self, prefix: str = "") -> Iterator[str]:
        with self._lock:
            names = sorted(n for n in self._objects if n.startswith(prefix))
        return iter(names)

    def size(self, name: str) -> int | None:
        validate_object_name(name)
        with self._lock:
            data = self._objects.get(name)
            return None if data is None else len(data)

    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def reserve(self, name: str, nbytes: int) -> MemoryReservation:
        validate_object_name(name)
        if not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidValueError(f"nbytes must be a non-negative int, got {nbytes!r}", field="nbytes")
        with self._lock:
            self._check_room(name, nbytes, 0)
            self._reserved += nbytes
        return MemoryReservation(self, name, nbytes)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._objects.clear()
            self._used = 0

    def __repr__(self) -> str:
        return f"<MemoryBackend objects={len(self._objects)} used={self._used}>"


class MemoryReservation(Reservation):
    """A private ``bytearray`` published by :meth:`commit` (a copy) or dropped by :meth:`abort`."""

    def __init__(self, backend: MemoryBackend, name: str, nbytes: int) -> None:
        self.name = name
        self._backend = backend
        self._nbytes = nbytes
        self._data: bytearray | None = bytearray(nbytes)
        self.buffer = memoryview(self._data)

    def _release(self) -> None:
        """Give the reserved bytes back to the budget. Backend lock held."""
        self._backend._reserved -= self._nbytes
        self._data = None

    def commit(self, *, if_absent: bool = False) -> None:
        b = self._backend
        with b._lock:
            if self._data is None:
                raise InvalidValueError(f"reservation for {self.name!r} is already finished", key=self.name)
            blob = bytes(self._data)
            old = b._objects.get(self.name)
            if old is not None and if_absent:
                raise KeyExistsError(f"object {self.name!r} already exists", key=self.name, tier=b.tier)
            # the reserved bytes become the object's: no second capacity check
            self._release()
            b._objects[self.name] = blob
            b._used += len(blob) - (len(old) if old is not None else 0)

    def abort(self) -> None:
        with self._backend._lock:
            if self._data is not None:
                self._release()
