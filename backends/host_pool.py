"""The host tier's reuse pool of shared-memory segments, and this process's mappings of them.

Fresh shared memory is slow to write: every page faults (~0.5 GB/s here,
against ~8-13 GB/s into mapped, faulted pages), and even re-mapping a
segment whose pages exist costs ~0.1 s per GiB to populate the page tables.
So a deleted object's segment goes to the pool (``root/.pool``, shared by
every process of the node) instead of being freed, and the process that
wrote it keeps its mapping; the next object of a similar size reuses both.

Pool entries are named ``<size>.<t_ns>.<rand>``: the size and the time the
segment entered the pool are read from the name, so no ``stat`` is needed to
choose or age one. Claiming an entry is an atomic ``rename`` out of the pool
(one process wins), then a non-blocking exclusive ``flock``: readers hold a
shared lock on every object they have mapped (see
:meth:`backends.host.HostBackend.get`), so a segment still being read is freed
(its reader keeps the pages) instead of being overwritten. A claimed segment
never returns to the pool: a drain (:meth:`SegmentPool.free`, in any process)
that ran since the claim would miss it. A segment is reused by *size class* (sizes
within 1/8 of a power of two share a class): it is truncated or grown to the
new object's exact size (objects are files of their exact length).

Budget: the pool holds at most ``max_segments`` segments and ``max_bytes``
bytes (node-wide; oldest entries are freed first). A delete checks it against
a listing of the pool at most a second old while that listing leaves an
eighth of the budget to spare, and against a fresh listing otherwise, so
deleting a step of thousands of objects does not list the pool once per
object; what other processes pool within that second can overshoot the
budget by at most that eighth (concurrent deleters near the budget, by one
segment each). A claim tries the segments this process pooled first (no
listing); each process keeps at most ``max_maps``
mappings (least recently used first to go; one still in use is unmapped when
its last view goes). Neither holds a file descriptor: pooled segments are
files in a directory, and kept mappings are :class:`backends.shm_mapping.Mapping`
(the descriptor is closed once mapped). A kept mapping of a segment that
another process freed would keep its memory alive unseen, so mappings whose
file is no longer where this process left it are dropped every
``_SWEEP_EVERY`` new mappings, or every quarter as many new mappings as are
kept where that is more (a sweep stats each kept mapping).

Page-locked mappings (:mod:`backends.pinning`): a kept mapping stays
registered while its segment waits in the pool and is reused by this
process at the same size; a segment claimed at another size, or last pooled
by another process (which may have resized it meanwhile), has its
registration undone first (it would hold stale pages); a mapping is
unregistered before it is unmapped.

Protocol: :class:`HostBackend` calls :meth:`SegmentPool.take` to claim a
segment into a reservation's temporary path, :meth:`SegmentPool.mapping` to
map it (reusing a kept mapping), :meth:`SegmentPool.give` when an object is
deleted, and :meth:`SegmentPool.close` at the end.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.shm_mapping import Mapping

__all__ = ["DEFAULT_SEGMENTS", "SegmentPool", "size_class"]

DEFAULT_SEGMENTS = 4096
_SWEEP_EVERY = 64
_OWN_TRIES = 8  # a claim tries at most this many of this process's pooled segments of a size before listing
_RECOUNT_S = 1.0  # a delete lists the pool again once its last listing is this old (budget: SegmentPool.give)

_CLASS_BITS = 3  # 8 classes per power of two: a reused segment is within 12.5% of the object's size


def size_class(nbytes: int) -> int:
    """The size class of ``nbytes``: the smallest multiple of ``2**(bit_length - 4)`` at least ``nbytes``."""
    if nbytes <= 1 << (_CLASS_BITS + 1):
        return nbytes
    step = 1 << (nbytes.bit_length() - _CLASS_BITS - 1)
    return -(-nbytes // step) * step


@dataclass
class _Entry:
    name: str
    size: int
    t_ns: int


def _parse(name: str) -> _Entry | None:
    parts = name.split(".")
    try:
        size = int(parts[0])
        t_ns = int(parts[1]) if len(parts) == 3 else 0  # "<size>.<uuid>": an older layout, oldest
    except (ValueError, IndexError):
        return None
    return _Entry(name, size, t_ns)


def _map_class(fd: int, nbytes: int, populate: bool) -> Mapping:
    """Map the segment ``fd`` (``nbytes`` long) for its whole size class.

    The segment can later be regrown within its class and keep this mapping
    (until then, bytes past the file's end must not be touched: SIGBUS).
    ``populate`` fills the page tables up to the file's end.
    """
    return Mapping(fd, size_class(nbytes), populate=populate)


def try_lock_exclusive(fd: int) -> bool:
    """Whether no reader holds the file open under a shared lock (the lock is not kept)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


class SegmentPool:
    """The ``.pool`` directory of one host tier root plus this process's kept mappings.

    Args:
        directory: the pool directory (created by the backend).
        max_bytes: at most this many bytes of segments wait in the pool.
        max_segments: at most this many segments wait in the pool.
        max_maps: at most this many mappings kept by this process.
        grace_s: a segment is reused only this long after it entered the pool.
        populate: pre-fault the pages of new mappings (faster writes).
    """

    def __init__(self, directory: Path, *, max_bytes: int, max_segments: int, max_maps: int, grace_s: float,
                 populate: bool) -> None:
        self.dir = directory
        self._dir_s = str(directory)
        self.max_bytes = max_bytes
        self.max_segments = max_segments
        self.max_maps = max(1, max_maps)
        self.grace_ns = int(grace_s * 1e9)
        self.populate = populate
        self._lock = threading.Lock()
        # (dev, ino) -> (mapping, the path it was last seen at); least recently used first
        self._maps: OrderedDict[tuple[int, int], tuple[Mapping, str]] = OrderedDict()
        self._new_maps = 0
        # (dev, ino) -> (the kept mapping, a writer's key, its views over that mapping): one per kept mapping,
        # forgotten with it (the views hold the mapping: unmapped once both are gone)
        self._views: dict[tuple[int, int], tuple[Mapping, Any, Any]] = {}
        # pool entries this process put there, oldest first (claimed first: no listing, and their mapping is
        # likely kept): size -> names
        self._own: dict[int, list[str]] = {}
        # (monotonic time, count, bytes) of the pool at its last listing, plus this process's gives since
        self._tally: tuple[float, int, int] | None = None

    # -- naming ------------------------------------------------------------------
    def _new_name(self, size: int, t_ns: int | None = None) -> str:
        return f"{size}.{time.time_ns() if t_ns is None else t_ns}.{uuid.uuid4().hex[:12]}"

    def entries(self) -> list[_Entry]:
        """The pool's entries, oldest first."""
        out = []
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        for n in names:
            e = _parse(n)
            if e is not None:
                out.append(e)
        out.sort(key=lambda e: e.t_ns)
        return out

    def pooled_bytes(self) -> int:
        return sum(e.size for e in self.entries())

    # -- mappings ------------------------------------------------------------------
    def mapping(self, fd: int, nbytes: int, path: str, key: tuple[int, int] | None = None) -> memoryview:
        """A writable view of the first ``nbytes`` of the file ``fd``, through a mapping kept for reuse.

        ``key`` is the file's (st_dev, st_ino) where the caller has it; ``fd``
        may be closed once this returns.
        """
        if key is None:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
        with self._lock:
            kept = self._maps.get(key)
            if kept is not None and len(kept[0]) >= nbytes:
                self._maps[key] = (kept[0], path)
                self._maps.move_to_end(key)
                return kept[0].view(nbytes)
        m = _map_class(fd, nbytes, self.populate)
        with self._lock:
            self._forget(key)
            self._maps[key] = (m, path)
            self._new_maps += 1
            if self._new_maps >= max(_SWEEP_EVERY, len(self._maps) // 4):  # a sweep stats every kept mapping
                self._new_maps = 0
                self._drop_stale()
            while len(self._maps) > self.max_maps:
                old, _ = self._maps.popitem(last=False)  # unmapped when its last view goes
                self._views.pop(old, None)
        return m.view(nbytes)

    def _forget(self, key: tuple[int, int]) -> None:
        """Forget the kept mapping of file ``key`` and the views kept with it (called with the lock)."""
        self._maps.pop(key, None)
        self._views.pop(key, None)

    def views(self, ident: tuple[int, int], mapping: Mapping, key: Any, make: Callable[[], Any]) -> Any:
        """The views kept for ``key`` with the kept mapping ``mapping`` of file ``ident``, else ``make()``'s,
        kept with it while that mapping is kept (one key per mapping: the last asked)."""
        with self._lock:
            got = self._views.get(ident)
            if got is not None and got[0] is mapping and got[1] == key:
                return got[2]
        made = make()
        with self._lock:
            kept = self._maps.get(ident)
            if kept is not None and kept[0] is mapping:
                self._views[ident] = (mapping, key, made)
        return made

    def kept(self, dev: int, ino: int, nbytes: int) -> Mapping | None:
        """The kept mapping of file (dev, ino) if it covers ``nbytes``, else ``None``."""
        with self._lock:
            kept = self._maps.get((dev, ino))
            if kept is None or len(kept[0]) < nbytes:
                return None
            self._maps.move_to_end((dev, ino))
            return kept[0]

    def moved(self, dev: int, ino: int, path: str) -> None:
        """Record that file (dev, ino) is now at ``path`` (it was renamed by this process)."""
        with self._lock:
            kept = self._maps.get((dev, ino))
            if kept is not None:
                self._maps[(dev, ino)] = (kept[0], path)

    def discard(self, dev: int, ino: int) -> None:
        """Forget the kept mapping of a file that was freed (unmapped when its last view goes)."""
        with self._lock:
            self._forget((dev, ino))

    def _drop_stale(self) -> None:
        """Forget mappings whose file is not where this process last saw it (called with the lock)."""
        for key, (_m, path) in list(self._maps.items()):
            try:
                st = os.stat(path)
                live = (st.st_dev, st.st_ino) == key
            except OSError:
                live = False
            if not live:
                self._forget(key)

    # -- taking and giving -------------------------------------------------------------
    def _claim(self, name: str, tmp: str) -> int | None:
        """Move pool entry ``name`` to ``tmp`` and open it; ``None`` if gone or still being read."""
        src = f"{self._dir_s}/{name}"
        try:
            os.rename(src, tmp)  # atomic: one process wins a segment
        except FileNotFoundError:
            if not os.path.isdir(os.path.dirname(tmp)):
                raise  # the caller's directory is gone, not the segment
            return None
        fd = os.open(tmp, os.O_RDWR)
        if try_lock_exclusive(fd):
            return fd
        # a reader still holds a view of the object this segment was: free it (the reader's mapping keeps its
        # pages until it goes). Not back into the pool: a drain that ran since the rename (the tier's last holder
        # letting go, in another process) would never see it, and it would outlive every user of the tier.
        st = os.fstat(fd)
        os.close(fd)
        os.unlink(tmp)
        self.discard(st.st_dev, st.st_ino)
        return None

    def take(self, nbytes: int, tmp: str) -> int | None:
        """Claim a pooled segment for an object of ``nbytes`` into ``tmp``; return an open fd, or ``None``.

        Exact sizes first (this process's entries, then anyone's), then the same
        size class; the segment is resized to exactly ``nbytes``.
        """
        if nbytes <= 0:
            return None
        cls = size_class(nbytes)
        now = time.time_ns()
        tried: set[str] = set()
        for exact in (True, False):
            for name in self._candidates(nbytes if exact else None, cls):
                if name in tried:
                    continue
                tried.add(name)
                e = _parse(name)
                if e is None or now - e.t_ns < self.grace_ns:
                    continue
                own = self._forget_own(e)
                fd = self._claim(name, tmp)
                if fd is None:
                    continue
                if not own or e.size != nbytes:
                    # another process may have resized it since this one's mapping was page-locked (the
                    # registration would hold stale pages), or it is resized now: the registration goes first
                    self._unpin(fd)
                if e.size != nbytes:
                    try:
                        os.ftruncate(fd, nbytes)
                        if nbytes > e.size:
                            os.posix_fallocate(fd, 0, nbytes)
                    except OSError:
                        os.close(fd)
                        os.unlink(tmp)
                        raise
                return fd
        return None

    def _candidates(self, exact: int | None, cls: int) -> Iterator[str]:
        """Names of pooled segments that fit: this process's first (their mappings are kept), then anyone's."""
        with self._lock:
            # a few of the oldest: a claim that fails them all (taken by another process, still read) lists the pool
            if exact is not None:
                own = self._own.get(exact, [])[:_OWN_TRIES]
            else:
                own = [n for s, names in self._own.items() if size_class(s) == cls for n in names[:_OWN_TRIES]]
        yield from own
        for e in self.entries():
            if (e.size == exact) if exact is not None else (size_class(e.size) == cls):
                yield e.name

    def _forget_own(self, e: _Entry) -> bool:
        """Forget that this process pooled ``e``; whether it had."""
        with self._lock:
            names = self._own.get(e.size)
            if names and e.name in names:
                names.remove(e.name)
                if not names:
                    del self._own[e.size]
                return True
            return False

    def _unpin(self, fd: int) -> None:
        """Undo the page-locking of this process's kept mapping of the file ``fd``, if any (backends.pinning)."""
        st = os.fstat(fd)
        with self._lock:
            kept = self._maps.get((st.st_dev, st.st_ino))
        m = kept[0] if kept is not None else None
        if m is not None and m.pinned and m.pinner is not None:
            m.pinner.unpin(m)

    def give(self, path: Path, size: int) -> bool:
        """Move the deleted object at ``path`` into the pool; ``False`` if it does not fit (caller unlinks).

        Older entries are freed to make room within the budget. The pool is listed (its count and bytes)
        only when the last listing is over ``_RECOUNT_S`` old or shows less than an eighth of the budget to
        spare: deleting a step of thousands of objects lists it a few times, not once per object.
        """
        if size <= 0 or size > self.max_bytes or self.max_segments <= 0:
            return False
        if not self._roomy(size):
            entries = self.entries()
            total = sum(e.size for e in entries)
            count = len(entries)
            for e in entries:  # oldest first
                if count < self.max_segments and total + size <= self.max_bytes:
                    break
                if self._drop(e):
                    count -= 1
                    total -= e.size
            with self._lock:
                self._tally = (time.monotonic(), count, total)
            if count >= self.max_segments or total + size > self.max_bytes:
                return False
        name = self._new_name(size)
        try:
            st = os.stat(path)
            os.rename(path, self.dir / name)
        except FileNotFoundError:
            return False
        with self._lock:
            self._own.setdefault(size, []).append(name)  # a claim takes it without listing the pool
            if self._tally is not None:
                t, count, total = self._tally
                self._tally = (t, count + 1, total + size)
        self.moved(st.st_dev, st.st_ino, str(self.dir / name))
        return True

    def _roomy(self, size: int) -> bool:
        """Whether the last listing (at most ``_RECOUNT_S`` old, with this process's gives since added) leaves
        an eighth of both budgets to spare after ``size`` more bytes: then the pool need not be listed."""
        with self._lock:
            tally = self._tally
        if tally is None:
            return False
        t, count, total = tally
        if time.monotonic() - t > _RECOUNT_S:
            return False
        return (count + 1 <= self.max_segments - self.max_segments // 8 - 1
                and total + size <= self.max_bytes - self.max_bytes // 8)

    def _drop(self, e: _Entry) -> bool:
        path = self.dir / e.name
        try:
            st = os.stat(path)
            os.unlink(path)
        except FileNotFoundError:
            return False
        self._forget_own(e)
        self.discard(st.st_dev, st.st_ino)  # its memory goes back to the system now, not when swept
        return True

    def free(self, nbytes: int) -> int:
        """Free pooled segments, oldest first, until ``nbytes`` are freed (all with ``nbytes < 0``)."""
        freed = 0
        for e in self.entries():
            if 0 <= nbytes <= freed:
                break
            if self._drop(e):
                freed += e.size
        return freed

    def preallocate(self, sizes: Sequence[int], make: Callable[[Path, int], None]) -> int:
        """Top the pool up so this process holds pooled segments of ``sizes`` (a multiset), within budget.

        ``make(path, nbytes)`` creates a fresh, mapped segment at ``path``.
        Segments this process already pooled count; so calling it again with
        the same sizes adds nothing. Returns the number of segments added.
        """
        with self._lock:
            have = {s: len(n) for s, n in self._own.items()}
        entries = self.entries()
        count, total = len(entries), sum(e.size for e in entries)
        added = 0
        for nbytes in sizes:
            if nbytes <= 0:
                continue
            if have.get(nbytes, 0) > 0:
                have[nbytes] -= 1
                continue
            if count + 1 > self.max_segments or total + nbytes > self.max_bytes:
                break
            name = self._new_name(nbytes, time.time_ns() - self.grace_ns)  # reusable at once
            make(self.dir / name, nbytes)
            with self._lock:
                self._own.setdefault(nbytes, []).append(name)
            count += 1
            total += nbytes
            added += 1
        return added

    def close(self) -> None:
        """Forget every kept mapping (each is unmapped when its last view goes)."""
        with self._lock:
            self._maps.clear()
            self._views.clear()
            self._own.clear()
