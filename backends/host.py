"""The host tier: objects in shared-memory segments on the node.

Each object is one file below ``root`` (normally a directory in ``/dev/shm``),
so it outlives the process that wrote it and any process on the node can map
it. Placement is recorded in the Redis index by the tier manager, not here
(backends import neither ``tierstore`` nor ``consistency``).

Writes go through :meth:`HostBackend.reserve`: the caller gets a writable
memoryview of a segment, writes the object in place (the snapshot copy *is*
the host-tier copy) in a temporary file of ``root/.tmp``, and
:meth:`_HostReservation.commit` publishes it with an atomic rename (making the
object's directory then, off the snapshot's path). Deleted segments go to a bounded reuse pool and the writing
process keeps their mappings (see :mod:`backends.host_pool`): fresh shared
memory is ~20x slower to write than mapped, faulted pages.

Reads (:meth:`HostBackend.get`) return a read-only view of the object that
holds a shared ``flock`` on its file for as long as the view (or anything made
from it) is alive: a segment is never recycled while a reader still has it,
so a view stays valid and unchanged even if the object is deleted meanwhile.
An object this process wrote is read through its kept mapping (no page
faults); any other is mapped with ``MAP_POPULATE`` (page tables filled once,
not page by page). Views pin shared memory: release them when done.

Page-locking: a CUDA process's writes call :meth:`HostBackend.pin` on the
reservation's buffer first, which registers the segment's mapping with the
CUDA driver once, within ``pin_bytes`` (:mod:`backends.pinning`), so
device-to-host copies into it run at the copy engine's rate; nothing is
registered otherwise.

Capacity: ``capacity_bytes`` bounds the bytes of published objects and
reservations; a write past it raises :class:`TierFullError` (the tier manager
evicts and retries). Pooled segments count against the budget too, and are
dropped first when room is needed.
"""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
import resource
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from backends.base import (
    Backend,
    Buffer,
    Reservation,
    as_buffers,
    check_range,
    total_size,
    validate_object_name,
)
from backends.host_pool import DEFAULT_SEGMENTS, SegmentPool
from backends.pinning import Pinner
from tierstore.errors import KeyExistsError, TierFullError, TierUnavailableError

__all__ = ["HostBackend", "default_pin_bytes"]

_POOL = ".pool"
_TMPDIR = ".tmp"  # reservations are written here, then renamed into place by commit
_TMP = ".tmp-"
_POOL_TALLY = "pool-tally"  # in _TMPDIR (not listed, never cleaned up): the pool's count and bytes (host_pool)
_OPEN_RETRIES = 8
_MAPS_PER_SEGMENT = 4  # kept mappings per pooled segment of the budget (HostBackend's pool_segments)


def default_pin_bytes() -> int:
    """A quarter of the machine's physical memory (0 where it cannot be told)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError):
        return 0


class _Held:
    """How many descriptors this process's read views hold open (each view holds its object's shared lock
    through one), against a budget of half the soft limit of open files: past it, reads return private
    copies (no descriptor held) instead of views, so a restore that keeps a view of every object of a large
    state (thousands of layers) never runs the process out of descriptors (``EMFILE``)."""

    lock = threading.Lock()
    count = 0

    @classmethod
    def take(cls) -> None:
        with cls.lock:
            cls.count += 1

    @classmethod
    def give(cls) -> None:
        with cls.lock:
            cls.count -= 1

    @classmethod
    def full(cls) -> bool:
        return cls.count >= read_view_budget()


def read_view_budget() -> int:
    """How many read views (one open descriptor each) this process may hold at once: half its soft limit of
    open files (the rest is the trainer's, its sockets' and the store's own), at least 16."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(16, soft // 2)


def _mapped(fd: int, length: int, offset: int = 0) -> mmap.mmap:
    """A read-only shared mapping (page tables filled at once) that holds a duplicate of ``fd``, counted."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mm = mmap.mmap(fd, length, flags=flags, prot=mmap.PROT_READ, offset=offset)
    _Held.take()
    weakref.finalize(mm, _Held.give)
    return mm


def _private(fd: int, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` read into private memory (no descriptor held after)."""
    parts = []
    while length > 0:
        got = os.pread(fd, length, offset)
        if not got:
            break
        parts.append(got)
        offset += len(got)
        length -= len(got)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class _ReadPin:
    """A reader's open file (holding its shared lock), closed when the last view of it goes."""

    __slots__ = ("fd", "ident")

    def __init__(self, fd: int, ident: tuple[int, int]) -> None:
        self.fd = fd
        self.ident = ident  # the file's (st_dev, st_ino)
        _Held.take()

    def __del__(self) -> None:
        os.close(self.fd)
        _Held.give()


_PUBLISH_TRIES = 4  # a publish makes its directory again this often when a delete's pruning races it


def _make_dir(path: str) -> None:
    """``path`` as a directory: one ``mkdir`` where its parent exists (a step's directory under its layer's, the
    usual case), else every missing level."""
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    except FileNotFoundError:
        os.makedirs(path, exist_ok=True)


class _HostReservation(Reservation):
    def __init__(self, backend: HostBackend, name: str, tmp: str, view: memoryview | None, nbytes: int,
                 ident: tuple[int, int]):
        self.name = name
        self._backend = backend
        self._tmp = tmp
        self._ident = ident
        self.nbytes = nbytes
        self.buffer = view if view is not None else memoryview(bytearray())
        self._done = False

    def commit(self, *, if_absent: bool = False) -> None:
        if self._done:
            raise RuntimeError(f"reservation for {self.name!r} already finished")
        final = self._backend._spath(self.name)
        try:
            for attempt in range(_PUBLISH_TRIES):
                try:
                    self._publish(final, if_absent)
                    break
                except FileNotFoundError:
                    # its directory's first object (made here, not in reserve: the stall), or a delete of the
                    # directory's last object removed it meanwhile (HostBackend.delete prunes empty ones)
                    if attempt == _PUBLISH_TRIES - 1:
                        raise
                    _make_dir(os.path.dirname(final))
        except KeyExistsError:
            self.abort()
            raise
        except OSError as e:
            self.abort()
            raise TierUnavailableError(f"cannot publish host object {self.name!r}: {e}", key=self.name) from e
        self._done = True
        self._release_buffer()
        self._backend._pool.moved(*self._ident, final)
        self._backend._release_reservation(self.nbytes)

    def _publish(self, final: str, if_absent: bool) -> None:
        if if_absent:
            try:
                os.link(self._tmp, final)
            except FileExistsError as e:
                raise KeyExistsError(f"host object {self.name!r} exists", key=self.name, tier="host") from e
            os.unlink(self._tmp)
        else:
            os.replace(self._tmp, final)

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._release_buffer()
        try:
            os.unlink(self._tmp)
        except FileNotFoundError:
            pass
        self._backend._pool.discard(*self._ident)
        self._backend._release_reservation(self.nbytes)

    def views(self, key: Any, make: Any) -> Any:
        """Those kept with this segment's mapping for ``key`` (the last reservation of the same segment in this
        process that asked), else ``make(buffer)``, kept with it (:meth:`SegmentPool.views`)."""
        mapping = getattr(self.buffer.obj, "_tierstore_mapping", None)
        if mapping is None or self._done:
            return make(self.buffer)
        return self._backend._pool.views(self._ident, mapping, key, lambda: make(self.buffer))

    def _release_buffer(self) -> None:
        """Let go of the mapping (so the pool may unmap it under its budget), unless the caller still uses it."""
        try:
            self.buffer.release()
        except BufferError:
            pass  # an array over the buffer is alive: the mapping stays until it goes


class HostBackend(Backend):
    """Objects as files in a shared-memory directory of this node.

    Args:
        root: the directory (created if missing), e.g. ``/dev/shm/tierstore/node0``.
        capacity_bytes: the tier's budget; ``None`` means unbounded.
        pool_bytes: at most this many bytes of freed segments are kept for reuse (node-wide).
        pool_segments: at most this many freed segments wait in the pool (node-wide; default 4096), and
            this process keeps mappings of at most four times as many segments (a checkpoint's two live
            generations and the pooled one of a state of that many objects, each written and reread with no
            page faults). Neither holds a file descriptor.
        recycle_grace_s: a deleted segment is reused only after this many seconds (readers are protected
            by their locks whatever this is; a grace only spreads reuse).
        populate: pre-fault new segments' pages when mapping them (faster writes).
        pin_bytes: at most this many bytes of segments page-locked by this process for CUDA copies
            (:meth:`pin`); ``None``: a quarter of the machine's memory; 0: never.
        pin_calls: the registration calls (:class:`backends.pinning.Pinner`); ``None``: CUDA's.
    """

    tier = "host"
    survives = "process"
    zero_copy_get = True
    reservable = True
    atomic_create_once = True
    ranged_get = True

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        capacity_bytes: int | None = None,
        pool_bytes: int = 8 << 30,
        pool_segments: int = DEFAULT_SEGMENTS,
        recycle_grace_s: float = 0.0,
        populate: bool = True,
        pin_bytes: int | None = None,
        pin_calls: Any = None,
    ) -> None:
        self.root = Path(root)
        self._root_s = str(self.root)
        if pin_bytes is None:
            pin_bytes = default_pin_bytes()
        self.pinner = Pinner(pin_bytes, pin_calls)
        self.capacity_bytes = capacity_bytes
        self.pool_bytes = pool_bytes
        self.pool_segments = pool_segments
        self.recycle_grace_s = recycle_grace_s
        self.populate = populate
        try:
            (self.root / _POOL).mkdir(parents=True, exist_ok=True)
            (self.root / _TMPDIR).mkdir(exist_ok=True)
        except OSError as e:
            raise TierUnavailableError(f"cannot create host tier directory {self.root}: {e}") from e
        self._tmpdir = str(self.root / _TMPDIR)
        self._tmp_pid, self._tmp_token, self._tmp_count = 0, "", itertools.count()
        self._pool = SegmentPool(self.root / _POOL, max_bytes=pool_bytes, max_segments=pool_segments,
                                 max_maps=_MAPS_PER_SEGMENT * pool_segments, grace_s=recycle_grace_s, populate=populate,
                                 tally=self.root / _TMPDIR / _POOL_TALLY)
        self._lock = threading.Lock()
        self._reserved = 0
        self._closed = False

    # -- paths -------------------------------------------------------------------
    def _spath(self, name: str) -> str:
        """The object's file, a str: the read paths' (pathlib costs more than their syscalls)."""
        validate_object_name(name)
        return f"{self._root_s}/{name}"

    def _path(self, name: str) -> Path:
        return Path(self._spath(name))

    def _tmp_path(self) -> str:
        # unique among every process sharing the tier: this backend's random token (a fork keeps it, so the pid
        # too) and a counter; a str: pathlib costs more than the syscalls here
        pid = os.getpid()
        if pid != self._tmp_pid:
            self._tmp_pid, self._tmp_token = pid, f"{pid}.{uuid.uuid4().hex[:16]}."
        return f"{self._tmpdir}/{_TMP}{self._tmp_token}{next(self._tmp_count)}"

    # -- capacity ----------------------------------------------------------------
    def used_bytes(self) -> int:
        """Bytes of published objects, pending reservations and pooled segments on this node."""
        total = 0
        for dirpath, _dirs, files in os.walk(self.root):
            for f in files:
                try:
                    total += os.stat(os.path.join(dirpath, f)).st_blocks * 512
                except FileNotFoundError:
                    pass
        return total

    def _make_room(self, nbytes: int) -> None:
        """Check a fresh segment of ``nbytes`` fits the capacity, freeing pooled segments if needed."""
        if self.capacity_bytes is None:
            return
        used = self.used_bytes()
        if used + nbytes > self.capacity_bytes:
            used -= self._pool.free(used + nbytes - self.capacity_bytes)
        if used + nbytes <= self.capacity_bytes:
            return
        raise TierFullError(
            f"host tier at {self.root} is full: {used} of {self.capacity_bytes} bytes used, "
            f"{nbytes} more needed",
            tier="host",
            needed=nbytes,
            used=used,
            capacity=self.capacity_bytes,
        )

    def _fresh(self, path: str | Path, nbytes: int, *, name: str) -> int:
        """Create a segment of ``nbytes`` at ``path``; return its open fd."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # FileNotFoundError: no directory
        try:
            os.ftruncate(fd, nbytes)
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            raise TierFullError(
                f"no shared memory left for {nbytes} bytes in {self.root}: {e}", tier="host", key=name
            ) from e
        return fd

    # -- the interface -------------------------------------------------------------
    def reserve(self, name: str, nbytes: int) -> Reservation:
        validate_object_name(name)  # before anything is allocated
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        try:
            tmp = self._tmp_path()
            try:
                fd = self._segment(tmp, nbytes, name)
            except FileNotFoundError:  # the directory went away (a node's tier wiped): make it again
                (self.root / _TMPDIR).mkdir(parents=True, exist_ok=True)
                (self.root / _POOL).mkdir(parents=True, exist_ok=True)
                fd = self._segment(tmp, nbytes, name)
            try:
                st = os.fstat(fd)
                ident = (st.st_dev, st.st_ino)
                view = self._pool.mapping(fd, nbytes, tmp, ident) if nbytes else None
            except BaseException:
                os.unlink(tmp)
                raise
            finally:
                os.close(fd)
        except (TierFullError, KeyExistsError):
            raise
        except OSError as e:
            raise TierUnavailableError(f"host tier at {self.root} failed: {e}", key=name, tier="host") from e
        with self._lock:
            self._reserved += nbytes
        return _HostReservation(self, name, tmp, view, nbytes, ident)

    def pin(self, buffer: memoryview) -> bool:
        """Page-lock the segment under a reservation's ``buffer`` (a CUDA process writes into it next).

        Returns whether it is page-locked; ``False`` (over the budget, no CUDA, a
        failed registration, not a view of a segment) leaves it pageable: copies
        into it are ordinary ones. See :mod:`backends.pinning`.
        """
        mapping = getattr(buffer.obj, "_tierstore_mapping", None) if isinstance(buffer, memoryview) else None
        if mapping is None or len(buffer) == 0:
            return False
        return self.pinner.pin(mapping, len(buffer))

    def _segment(self, tmp: str, nbytes: int, name: str) -> int:
        """An open fd of a segment of exactly ``nbytes`` at ``tmp``: a pooled one, else fresh."""
        fd = self._pool.take(nbytes, tmp)
        if fd is None:  # nothing to reuse: fresh shared memory (slow to write: every page faults)
            self._make_room(nbytes)
            fd = self._fresh(tmp, nbytes, name=name)
        return fd

    def _release_reservation(self, nbytes: int) -> None:
        with self._lock:
            self._reserved -= nbytes

    def put(self, name: str, data: Buffer | Sequence[Buffer], *, if_absent: bool = False) -> None:
        parts = as_buffers(data)
        final = self._path(name)
        if if_absent and final.exists():
            raise KeyExistsError(f"host object {name!r} exists", key=name, tier="host")
        res = self.reserve(name, total_size(parts))
        try:
            off = 0
            for p in parts:
                res.buffer[off : off + p.nbytes] = p
                off += p.nbytes
        except BaseException:
            res.abort()
            raise
        res.commit(if_absent=if_absent)

    def get(self, name: str) -> memoryview | bytes | None:
        """A read-only view of the object, holding a shared lock on it while alive; ``None`` if absent."""
        path = self._spath(name)
        for _ in range(_OPEN_RETRIES):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                return None
            except OSError as e:
                raise TierUnavailableError(f"cannot read host object {name!r}: {e}", key=name, tier="host") from e
            pinned = False
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a writer is claiming this segment: the object was deleted; look again
                st = os.fstat(fd)
                try:
                    now = os.stat(path)
                except FileNotFoundError:
                    return None
                if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    continue  # replaced between open and lock; look again
                size = st.st_size
                if size == 0:
                    return b""
                if _Held.full():  # as many views as descriptors allow are alive: a private copy, no lock kept
                    return _private(fd, 0, size)
                kept = self._pool.kept(st.st_dev, st.st_ino, size)
                if kept is not None:  # no page faults: the pages are mapped in this process already
                    pinned = True
                    return kept.view(size, keep=_ReadPin(fd, (st.st_dev, st.st_ino))).toreadonly()
                return memoryview(_mapped(fd, size))  # holds a dup of fd: the lock lives on
            except OSError as e:
                raise TierUnavailableError(f"cannot read host object {name!r}: {e}", key=name, tier="host") from e
            finally:
                if not pinned:
                    os.close(fd)
        raise TierUnavailableError(f"host object {name!r} kept changing while being opened", key=name, tier="host")

    def views_of(self, blob: Any, key: Any, make: Callable[[memoryview], Any]) -> Any:
        """Views over the memory of ``blob`` (what :meth:`get` returned) that depend only on ``key``: those kept
        with its segment's mapping (a writer's of the same segment and ``key``: :meth:`_HostReservation.views`),
        else ``make(writable view of that memory)``'s, kept; ``None`` where ``blob`` is not a view of a kept
        mapping. They are read only while ``blob`` is alive (its shared lock keeps the segment from reuse)."""
        arr = getattr(blob, "obj", None)
        mapping = getattr(arr, "_tierstore_mapping", None)
        pin = getattr(arr, "_tierstore_keep", None)
        if mapping is None or not isinstance(pin, _ReadPin):
            return None
        size = len(blob)
        return self._pool.views(pin.ident, mapping, key, lambda: make(mapping.view(size)))

    def get_range(self, name: str, offset: int, length: int) -> memoryview | bytes | None:
        """A read-only view of the bytes ``[offset, offset + length)`` of the object, holding a shared lock on it
        while alive (as :meth:`get`'s view does). An object this process wrote is read through its kept mapping
        (no page faults); any other has only the pages of the range mapped, their page tables filled at once
        (``MAP_POPULATE``: a fault per page costs more than the copy of it)."""
        check_range(offset, length)
        path = self._spath(name)
        for _ in range(_OPEN_RETRIES):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                return None
            except OSError as e:
                raise TierUnavailableError(f"cannot read host object {name!r}: {e}", key=name, tier="host") from e
            pinned = False
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a writer is claiming this segment: the object was deleted; look again
                st = os.fstat(fd)
                try:
                    now = os.stat(path)
                except FileNotFoundError:
                    return None
                if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    continue  # replaced between open and lock; look again
                stop = min(offset + length, st.st_size)
                if stop <= offset:
                    return b""
                if _Held.full():  # as many views as descriptors allow are alive: a private copy, no lock kept
                    return _private(fd, offset, stop - offset)
                kept = self._pool.kept(st.st_dev, st.st_ino, st.st_size)
                if kept is not None:  # the pages are mapped in this process already
                    pinned = True
                    view = kept.view(st.st_size, keep=_ReadPin(fd, (st.st_dev, st.st_ino)))
                    return view[offset:stop].toreadonly()
                start = offset - offset % mmap.ALLOCATIONGRANULARITY
                mm = _mapped(fd, stop - start, start)  # holds a dup of fd: the lock lives on
                return memoryview(mm)[offset - start : stop - start].toreadonly()
            except OSError as e:
                raise TierUnavailableError(f"cannot read host object {name!r}: {e}", key=name, tier="host") from e
            finally:
                if not pinned:
                    os.close(fd)
        raise TierUnavailableError(f"host object {name!r} kept changing while being opened", key=name, tier="host")

    def tail(self, name: str, nbytes: int) -> bytes | None:
        """The last ``nbytes`` of the object, read without mapping it (a trailer check).

        Under a shared lock, as :meth:`get`: a segment being recycled is never read.
        """
        path = self._spath(name)
        for _ in range(_OPEN_RETRIES):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                return None
            except OSError as e:
                raise TierUnavailableError(f"cannot read host object {name!r}: {e}", key=name, tier="host") from e
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a writer is claiming this segment: the object was deleted; look again
                st = os.fstat(fd)
                try:
                    now = os.stat(path)
                except FileNotFoundError:
                    return None
                if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    continue
                n = min(nbytes, st.st_size)
                return os.pread(fd, n, st.st_size - n) if n else b""
            except OSError as e:
                raise TierUnavailableError(f"cannot read host object {name!r}: {e}", key=name, tier="host") from e
            finally:
                os.close(fd)
        raise TierUnavailableError(f"host object {name!r} kept changing while being opened", key=name, tier="host")

    def size(self, name: str) -> int | None:
        try:
            return self._path(name).stat().st_size
        except FileNotFoundError:
            return None

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def version(self, name: str) -> tuple[int, int, int, int] | None:
        """``(device, inode, size, change time ns)`` of the object, or ``None``; differs once it is replaced.

        Publishing renames a segment into place, which sets its change time, so
        an object put again (even into a reused pooled segment) gets a new version.
        """
        try:
            st = self._path(name).stat()
        except FileNotFoundError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns)

    def delete(self, name: str) -> bool:
        path = self._spath(name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        if not self._pool.give(path, st.st_size, (st.st_dev, st.st_ino)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                return False
            self._pool.discard(st.st_dev, st.st_ino)
        self._prune(os.path.dirname(path))
        return True

    def _prune(self, directory: str) -> None:
        """Remove an object's directory (its layer's and step's) once it is empty: every step saved would
        otherwise leave one empty directory per layer in shared memory for good (tmpfs inodes, and every
        listing walks them). A publish into it meanwhile makes it again (``_PUBLISH_TRIES``)."""
        if directory == self._root_s:
            return
        try:
            os.rmdir(directory)
        except OSError:  # not empty (another rank's copy of the step), or already gone
            pass

    def drain_pool(self) -> int:
        """Free every pooled segment; return the bytes freed."""
        return self._pool.free(-1)

    def preallocate(self, sizes: Sequence[int]) -> int:
        """Make sure this process has fresh, mapped segments of ``sizes`` in the pool (warm-up before training).

        Bounded by the pool's budget (``pool_segments`` segments, ``pool_bytes``);
        segments this process already pooled count, so repeating a call adds
        nothing. Returns the number of segments added.
        """

        def make(path: Path, nbytes: int) -> None:
            self._make_room(nbytes)
            fd = self._fresh(path, nbytes, name=path.name)
            try:
                self._pool.mapping(fd, nbytes, str(path))
            finally:
                os.close(fd)

        return self._pool.preallocate(sizes, make)

    def list(self, prefix: str = "") -> Iterator[str]:
        names = []
        for dirpath, dirs, files in os.walk(self.root):
            dirs[:] = [d for d in dirs if d not in (_POOL, _TMPDIR)] if dirpath == str(self.root) else dirs
            rel = os.path.relpath(dirpath, self.root)
            for f in files:
                if f.startswith(_TMP):
                    continue
                name = f if rel == "." else f"{rel}/{f}"
                if name.startswith(prefix):
                    names.append(name)
        return iter(sorted(names))

    def cleanup_temp(self, max_age_s: float = 3600.0) -> int:
        """Remove reservations abandoned by crashed writers older than ``max_age_s``.

        A reservation's age is that of its file's change time: the claim of a
        pooled segment renames it into ``.tmp``, which sets the change time,
        while its modification time is that of the object it held last (hours
        old, perhaps). So a reservation just made from an old segment is young.
        """
        removed = 0
        now = time.time()
        for dirpath, _dirs, files in os.walk(self.root):
            for f in files:
                if f.startswith((_TMP, ".claimed-")):
                    p = os.path.join(dirpath, f)
                    try:
                        st = os.stat(p)
                        if now - max(st.st_mtime, st.st_ctime) > max_age_s:
                            os.unlink(p)
                            removed += 1
                    except FileNotFoundError:
                        pass
        return removed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.close()

    def __repr__(self) -> str:
        return f"<HostBackend root={str(self.root)!r} capacity={self.capacity_bytes}>"
