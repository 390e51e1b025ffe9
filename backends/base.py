"""The backend interface every tier implements, and the helpers they share.

A backend only moves bytes. It stores opaque objects under *object names*:
``/``-separated paths whose segments are validated names (see
:func:`validate_object_name`), so no name can escape a backend's root.

Protocol (who calls what): the tier manager (:class:`tierstore.store.TierStore`)
is the only caller in the library. It calls :meth:`Backend.put` (or, where
``reservable`` is true, :meth:`Backend.reserve` then ``commit``),
:meth:`Backend.get` (or :meth:`Backend.get_range` for a byte range),
:meth:`Backend.delete`, :meth:`Backend.exists`, :meth:`Backend.list`, and
:meth:`Backend.close` once at the end.

Errors: a miss is ``None`` (``get``) or ``False`` (``delete``/``exists``);
a failure is a typed :class:`~tierstore.errors.TierStoreError`
(``TierUnavailableError``, ``AccessDeniedError``, ``TierFullError``,
``KeyExistsError``), raised ``from`` the native error. The caller decides
whether to fall back to another tier.

Capabilities are class attributes, not methods.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, Self

from tierstore.errors import InvalidKeyError, InvalidValueError

__all__ = [
    "Backend",
    "Buffer",
    "Reservation",
    "as_buffers",
    "check_range",
    "total_size",
    "validate_object_name",
]

#: What ``put`` takes: one bytes-like object or a sequence of them (written in order).
Buffer = bytes | bytearray | memoryview

MAX_OBJECT_NAME_LEN = 1024
_SEGMENT_RE = re.compile(r"[A-Za-z0-9._-]+")
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)*")  # segments of _SEGMENT_RE, "/"-separated
_DOT_SEGMENT_RE = re.compile(r"(?:^|/)\.(?:/|$)")  # a segment that is just "."


def validate_object_name(name: object) -> str:
    """Return ``name`` if it is a safe object name, else raise :class:`InvalidKeyError`.

    An object name is 1..1024 characters of ``/``-separated segments, each of
    ``[A-Za-z0-9._-]+``, none ``.`` and none holding ``..``: no absolute
    paths, no traversal, no empty segments.
    """
    if not isinstance(name, str):
        raise InvalidKeyError(f"an object name must be a str, got {type(name).__name__}", field="name")
    if not name or len(name) > MAX_OBJECT_NAME_LEN:
        raise InvalidKeyError(
            f"an object name must be 1..{MAX_OBJECT_NAME_LEN} characters, got {len(name)}", field="name"
        )
    if _NAME_RE.fullmatch(name) and ".." not in name and not _DOT_SEGMENT_RE.search(name):
        return name  # every segment checked at once (this runs for every object a save writes)
    for seg in name.split("/"):
        if not _SEGMENT_RE.fullmatch(seg) or seg == "." or ".." in seg:
            raise InvalidKeyError(f"object name {name[:80]!r} has an invalid segment {seg[:40]!r}", field="name")
    raise AssertionError(f"object name {name!r}: no invalid segment found")  # the two checks disagree


def as_buffers(data: Buffer | Sequence[Buffer]) -> list[memoryview]:
    """Normalise ``put``'s data argument to a list of flat byte memoryviews."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        parts: Iterable[Buffer] = (data,)
    elif isinstance(data, (list, tuple)):
        parts = data
    else:
        raise InvalidValueError(
            f"data must be bytes-like or a list of bytes-like objects, got {type(data).__name__}"
        )
    out = []
    for p in parts:
        if not isinstance(p, (bytes, bytearray, memoryview)):
            raise InvalidValueError(f"data parts must be bytes-like, got {type(p).__name__}")
        mv = memoryview(p)
        if mv.ndim != 1 or mv.itemsize != 1 or mv.format not in ("B", "b", "c"):
            mv = mv.cast("B")
        out.append(mv)
    return out


def total_size(buffers: Sequence[memoryview]) -> int:
    return sum(b.nbytes for b in buffers)


def check_range(offset: object, length: object) -> None:
    """Raise :class:`InvalidValueError` unless ``offset`` and ``length`` are non-negative ints."""
    for what, v in (("offset", offset), ("length", length)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise InvalidValueError(f"a range {what} must be a non-negative int, got {v!r}")


class Reservation(ABC):
    """Space reserved in a tier for one object, written in place, then published.

    ``buffer`` is a writable memoryview of exactly the reserved size. Nothing
    is visible under the name until :meth:`commit`; :meth:`abort` (or garbage
    collection of an abandoned reservation) frees the space.
    """

    name: str
    buffer: memoryview

    @abstractmethod
    def commit(self, *, if_absent: bool = False) -> None:
        """Publish the object atomically under its name."""

    @abstractmethod
    def abort(self) -> None:
        """Drop the reservation; idempotent."""

    def views(self, key: Hashable, make: Callable[[memoryview], Any]) -> Any:
        """``make(buffer)``: views over :attr:`buffer` that depend only on ``key`` (where a writer's tensors
        go). A tier whose reservations reuse the same memory (the host tier's pooled segments) may return the
        ones it kept from the last reservation of that memory with the same ``key`` instead."""
        return make(self.buffer)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


class Backend(ABC):
    """One tier's storage. Subclasses set the capability attributes below."""

    #: tier name: "device", "host", "peer" or "durable".
    tier: ClassVar[str] = ""
    #: the failure class the stored data survives: "step", "process", "node" or "cluster".
    survives: ClassVar[str] = ""
    #: get() returns a view of stored memory (no copy); valid until the object is deleted.
    zero_copy_get: ClassVar[bool] = False
    #: reserve() is supported (write in place, then commit).
    reservable: ClassVar[bool] = False
    #: put(..., if_absent=True) is atomic against concurrent writers.
    atomic_create_once: ClassVar[bool] = True
    #: reads come from this machine's memory or disks (whole objects are cheap to re-read and hash).
    local_reads: ClassVar[bool] = False
    #: get_range() reads only the bytes asked for (without it, the default reads the whole object).
    ranged_get: ClassVar[bool] = False

    # -- the interface -------------------------------------------------------------
    @abstractmethod
    def put(self, name: str, data: Buffer | Sequence[Buffer], *, if_absent: bool = False) -> None:
        """Store ``data`` under ``name``, replacing any object unless ``if_absent``.

        A put is atomic: a reader sees the old object, the new one, or nothing,
        never a partial write.

        Raises:
            KeyExistsError: ``if_absent`` and the name exists.
            TierFullError, TierUnavailableError, AccessDeniedError.
        """

    @abstractmethod
    def get(self, name: str) -> bytes | memoryview | None:
        """Return the object's bytes, or ``None`` if there is none."""

    @abstractmethod
    def delete(self, name: str) -> bool:
        """Delete the object; return whether it existed."""

    @abstractmethod
    def exists(self, name: str) -> bool:
        """Whether an object is stored under ``name``."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield the names that start with ``prefix`` (a string prefix, not a path), sorted."""

    def close(self) -> None:
        """Release clients, files and memory maps. Idempotent."""

    # -- optional, with defaults built from the above ------------------------------
    def reserve(self, name: str, nbytes: int) -> Reservation:
        """Reserve ``nbytes`` for ``name`` to be written in place (``reservable`` tiers)."""
        raise NotImplementedError(f"{type(self).__name__} does not support reserve()")

    def size(self, name: str) -> int | None:
        """The object's size in bytes, or ``None`` if there is none."""
        data = self.get(name)
        return None if data is None else len(data)

    def tail(self, name: str, nbytes: int) -> bytes | None:
        """The last ``nbytes`` bytes of the object (all of it if shorter), or ``None`` if there is none.

        Backends that can read a range override this (a trailer check reads 16 bytes, not the object).
        """
        data = self.get(name)
        if data is None:
            return None
        try:
            return bytes(data[-nbytes:]) if nbytes else b""
        finally:
            if isinstance(data, memoryview):
                data.release()

    def get_range(self, name: str, offset: int, length: int) -> bytes | memoryview | None:
        """The object's bytes ``[offset, offset + length)``, or ``None`` if there is none.

        Fewer bytes (possibly none) where the object ends before ``offset +
        length``, as slicing does. Backends that read a range without the rest
        set ``ranged_get`` and override this; the default reads the whole
        object for each call, so a caller of such a backend reads it once and
        slices it itself.

        Raises:
            InvalidValueError: a negative or non-int ``offset`` or ``length``.
        """
        check_range(offset, length)
        data = self.get(name)
        if data is None:
            return None
        try:
            return bytes(data[offset : offset + length])
        finally:
            if isinstance(data, memoryview):
                data.release()

    def put_many(self, items: Iterable[tuple[str, Buffer | Sequence[Buffer]]]) -> None:
        for name, data in items:
            self.put(name, data)

    def get_many(self, names: Iterable[str]) -> dict[str, bytes | memoryview | None]:
        return {name: self.get(name) for name in names}

    def delete_many(self, names: Iterable[str]) -> int:
        return sum(1 for name in names if self.delete(name))

    def used_bytes(self) -> int | None:
        """Bytes this tier currently holds, where the backend can tell cheaply."""
        return None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} tier={self.tier}>"
