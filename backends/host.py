"""The host tier: objects in shared-memory segments on the node.

Each object is one file below ``root`` (normally a directory in ``/dev/shm``),
so it outlives the process that wrote it and any process on the node can map
it. Placement is recorded in the Redis index by the tier manager, not here
(backends import neither ``tierstore`` nor ``consistency``).

Writes go through :meth:`HostBackend.reserve`: the caller gets a writable
memoryview of a segment, writes the object in place (the snapshot copy *is*
the host-tier copy), and :meth:`_HostReservation.commit` publishes it with an
atomic rename. Fresh shared memory is slow to write (every page faults:
~0.5 GB/s here against ~13 GB/s into mapped, faulted pages), so deleted
segments go to a pool (``root/.pool``) and are reused for objects of the same
size, and this process keeps their mappings. A segment enters the pool only
after ``recycle_grace_s`` so a reader that mapped the object just before its
deletion finishes first; readers copy out of a mapping and must not keep
views of objects that may be deleted.

Capacity: ``capacity_bytes`` bounds the bytes of published objects and
reservations; a write past it raises :class:`TierFullError` (the tier manager
evicts and retries). Pooled segments count against the budget too, and are
dropped first when room is needed.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from backends.base import Backend, Buffer, Reservation, as_buffers, total_size, validate_object_name
from tierstore.errors import KeyExistsError, TierFullError, TierUnavailableError

__all__ = ["HostBackend"]

_POOL = ".pool"
_TMP = ".tmp-"


def _mmap_writable(fd: int, nbytes: int, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED
    if populate and hasattr(mmap, "MAP_POPULATE"):
        flags |= mmap.MAP_POPULATE
    return mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


class _HostReservation(Reservation):
    def __init__(self, backend: HostBackend, name: str, tmp: Path, mm: mmap.mmap | None, nbytes: int):
        self.name = name
        self._backend = backend
        self._tmp = tmp
        self._mm = mm
        self.nbytes = nbytes
        self.buffer = memoryview(mm)[:nbytes] if mm is not None else memoryview(bytearray())
        self._done = False

    def commit(self, *, if_absent: bool = False) -> None:
        if self._done:
            raise RuntimeError(f"reservation for {self.name!r} already finished")
        final = self._backend._path(self.name)
        try:
            if if_absent:
                try:
                    os.link(self._tmp, final)
                except FileExistsError as e:
                    raise KeyExistsError(f"host object {self.name!r} exists", key=self.name, tier="host") from e
                os.unlink(self._tmp)
            else:
                os.replace(self._tmp, final)
        except KeyExistsError:
            self.abort()
            raise
        except OSError as e:
            self.abort()
            raise TierUnavailableError(f"cannot publish host object {self.name!r}: {e}", key=self.name) from e
        self._done = True
        self._backend._release_reservation(self, published=True)

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            os.unlink(self._tmp)
        except FileNotFoundError:
            pass
        self._backend._release_reservation(self, published=False)


class HostBackend(Backend):
    """Objects as files in a shared-memory directory of this node.

    Args:
        root: the directory (created if missing), e.g. ``/dev/shm/tierstore/node0``.
        capacity_bytes: the tier's budget; ``None`` means unbounded.
        pool_bytes: at most this many bytes of freed segments are kept for reuse.
        recycle_grace_s: a deleted segment is reused only after this many seconds.
        populate: pre-fault new segments' pages when mapping them (faster writes).
    """

    tier = "host"
    survives = "process"
    zero_copy_get = True
    reservable = True
    atomic_create_once = True

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        capacity_bytes: int | None = None,
        pool_bytes: int = 8 << 30,
        recycle_grace_s: float = 0.5,
        populate: bool = True,
    ) -> None:
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.pool_bytes = pool_bytes
        self.recycle_grace_s = recycle_grace_s
        self.populate = populate
        try:
            (self.root / _POOL).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TierUnavailableError(f"cannot create host tier directory {self.root}: {e}") from e
        self._lock = threading.Lock()
        # mappings this process holds, by (dev, inode): reused when a pooled segment comes back
        self._maps: dict[tuple[int, int], mmap.mmap] = {}
        self._reserved = 0
        self._closed = False

    # -- paths -------------------------------------------------------------------
    def _path(self, name: str) -> Path:
        validate_object_name(name)
        return self.root / name

    def _tmp_path(self, final: Path) -> Path:
        return final.parent / f"{_TMP}{final.name}.{uuid.uuid4().hex[:12]}"

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

    def _pool_entries(self) -> list[tuple[float, int, Path]]:
        out = []
        for entry in os.scandir(self.root / _POOL):
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            out.append((st.st_mtime, st.st_size, Path(entry.path)))
        return sorted(out)

    def _make_room(self, nbytes: int, reuse: Path | None) -> None:
        if self.capacity_bytes is None:
            return
        used = self.used_bytes()
        if reuse is not None:
            return  # reusing a segment adds nothing
        if used + nbytes <= self.capacity_bytes:
            return
        for _mtime, size, path in self._pool_entries():
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            used -= size
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

    # -- the pool ----------------------------------------------------------------
    def _take_from_pool(self, nbytes: int) -> Path | None:
        now = time.time()
        pool = self.root / _POOL
        for entry in os.scandir(pool):
            if not entry.name.startswith(f"{nbytes}."):
                continue
            try:
                if now - entry.stat().st_mtime < self.recycle_grace_s:
                    continue
                claimed = pool / f".claimed-{uuid.uuid4().hex}"
                os.rename(entry.path, claimed)  # atomic: only one process wins a segment
            except FileNotFoundError:
                continue
            return claimed
        return None

    def _map(self, fd: int, nbytes: int) -> mmap.mmap:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            mm = self._maps.get(key)
            if mm is not None and len(mm) == nbytes:
                return mm
        mm = _mmap_writable(fd, nbytes, self.populate)
        with self._lock:
            self._maps[key] = mm
            self._prune_maps()
        return mm

    def _prune_maps(self) -> None:
        """Drop mappings of segments that no longer exist anywhere (called with the lock)."""
        if len(self._maps) < 64:
            return
        live = set()
        for dirpath, _dirs, files in os.walk(self.root):
            for f in files:
                try:
                    st = os.stat(os.path.join(dirpath, f))
                except FileNotFoundError:
                    continue
                live.add((st.st_dev, st.st_ino))
        for key in [k for k in self._maps if k not in live]:
            mm = self._maps.pop(key)
            try:
                mm.close()
            except BufferError:
                self._maps[key] = mm  # still exported somewhere; keep it

    # -- the interface -------------------------------------------------------------
    def reserve(self, name: str, nbytes: int) -> Reservation:
        final = self._path(name)
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._tmp_path(final)
            reuse = self._take_from_pool(nbytes) if nbytes else None
            self._make_room(nbytes, reuse)
            if reuse is not None:
                os.rename(reuse, tmp)
                fd = os.open(tmp, os.O_RDWR)
            else:
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.ftruncate(fd, nbytes)
                    if nbytes:
                        os.posix_fallocate(fd, 0, nbytes)
                except OSError as e:
                    os.close(fd)
                    os.unlink(tmp)
                    raise TierFullError(
                        f"no shared memory left for {nbytes} bytes in {self.root}: {e}", tier="host", key=name
                    ) from e
            try:
                mm = self._map(fd, nbytes) if nbytes else None
            finally:
                os.close(fd)
        except (TierFullError, KeyExistsError):
            raise
        except OSError as e:
            raise TierUnavailableError(f"host tier at {self.root} failed: {e}", key=name, tier="host") from e
        with self._lock:
            self._reserved += nbytes
        return _HostReservation(self, name, tmp, mm, nbytes)

    def _release_reservation(self, res: _HostReservation, published: bool) -> None:
        with self._lock:
            self._reserved -= res.nbytes

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
        path = self._path(name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise TierUnavailableError(f"cannot read host object {name!r}: {e}", key=name, tier="host") from e
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return b""
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return memoryview(mm)

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
        path = self._path(name)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return False
        if 0 < size and self._pool_size() + size <= self.pool_bytes:
            target = self.root / _POOL / f"{size}.{uuid.uuid4().hex}"
            try:
                os.rename(path, target)
                os.utime(target)  # the grace period starts now
                return True
            except FileNotFoundError:
                return False
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False

    def _pool_size(self) -> int:
        return sum(size for _m, size, _p in self._pool_entries())

    def drain_pool(self) -> int:
        """Free every pooled segment; return the bytes freed."""
        freed = 0
        for _m, size, path in self._pool_entries():
            try:
                path.unlink()
                freed += size
            except FileNotFoundError:
                pass
        return freed

    def preallocate(self, sizes: Sequence[int]) -> None:
        """Put fresh, pre-faulted segments of these sizes into the pool (warm-up before training)."""
        for nbytes in sizes:
            if nbytes <= 0:
                continue
            self._make_room(nbytes, None)
            path = self.root / _POOL / f"{nbytes}.{uuid.uuid4().hex}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, nbytes)
                os.posix_fallocate(fd, 0, nbytes)
                self._map(fd, nbytes)
            finally:
                os.close(fd)
            os.utime(path, (0, 0))  # immediately reusable

    def list(self, prefix: str = "") -> Iterator[str]:
        names = []
        for dirpath, dirs, files in os.walk(self.root):
            dirs[:] = [d for d in dirs if d != _POOL]
            rel = os.path.relpath(dirpath, self.root)
            for f in files:
                if f.startswith(_TMP):
                    continue
                name = f if rel == "." else f"{rel}/{f}"
                if name.startswith(prefix):
                    names.append(name)
        return iter(sorted(names))

    def cleanup_temp(self, max_age_s: float = 3600.0) -> int:
        """Remove reservations abandoned by crashed writers older than ``max_age_s``."""
        removed = 0
        now = time.time()
        for dirpath, _dirs, files in os.walk(self.root):
            for f in files:
                if f.startswith((_TMP, ".claimed-")):
                    p = os.path.join(dirpath, f)
                    try:
                        if now - os.stat(p).st_mtime > max_age_s:
                            os.unlink(p)
                            removed += 1
                    except FileNotFoundError:
                        pass
        return removed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            maps, self._maps = self._maps, {}
        for mm in maps.values():
            try:
                mm.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with it

    def __repr__(self) -> str:
        return f"<HostBackend root={str(self.root)!r} capacity={self.capacity_bytes}>"
