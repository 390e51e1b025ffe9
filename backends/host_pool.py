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
bytes, node-wide (oldest entries are freed first). Every process of the node
checks it against one tally, the pool's count and bytes in ``.tmp/pool-tally``
(16 bytes, read and written under an exclusive ``flock``), so deleting a step
of thousands of objects does not list the pool once per object, and ranks
deleting at the same moment cannot each fill it. Whatever adds an entry (a
delete, :meth:`SegmentPool.preallocate`) adds it to the tally and renames it
in while holding the lock; a claim or a drop takes an entry out without
touching the tally (the stall stays lock-free), so the tally can only count
more than the pool holds, never less. When it says the budget is reached, the
pool is listed under the lock; if it is full, its oldest entries are freed
until an eighth of the budget is left beside the new one (a pool kept full is
listed once per eighth, not at every delete); the tally is set to what is
left. A crash can leave it counting more, never less. A lock not had within
``_TALLY_WAIT_S`` (its holder stopped) frees the segment instead of pooling
it, and so do this process's deletes for ``_TALLY_SKIP_S`` after, without
waiting. A claim tries the segments this process pooled first (no listing);
each process keeps at most ``max_maps`` mappings (least recently used first
to go; one still in use is unmapped when its last view goes). Neither holds a
file descriptor (the tally's is closed after each use): pooled segments are
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
import logging
import os
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.shm_mapping import Mapping

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_SEGMENTS", "SegmentPool", "size_class"]

DEFAULT_SEGMENTS = 4096
_SWEEP_EVERY = 64
_OWN_TRIES = 8  # a claim tries at most this many of this process's pooled segments of a size before listing
_TALLY_WAIT_S = 5.0  # a delete that waits this long for the tally's lock frees its segment instead of pooling it
_TALLY_SKIP_S = 30.0  # after such a wait, this process's deletes free their segments without waiting, this long

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


class _Tally:
    """The pool's count and bytes, node-wide: 16 bytes in ``path``, read and written under an exclusive ``flock``
    (see the module docstring: it counts at least what the pool holds)."""

    _ROW = struct.Struct("<qq")

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()  # the threads of this process, one at a time
        self.why = ""  # why the last locked() gave no descriptor
        self._skip_until = 0.0  # after a wait that ended unlocked (a holder stopped): no wait until then

    @contextmanager
    def locked(self, wait_s: float | None = None) -> Iterator[int | None]:
        """A descriptor of the file, under the lock, closed after (the pool holds no descriptor between
        calls); ``None`` if the lock was not had within ``wait_s`` (then, without waiting, for ``_TALLY_SKIP_S``)
        or the file cannot be opened: :attr:`why` says which, where it is news (empty in the skip)."""
        wait_s = _TALLY_WAIT_S if wait_s is None else wait_s
        now = time.monotonic()
        self.why = ""
        if now < self._skip_until:  # one wait in vain (said once), not one per delete of a step of thousands
            yield None
            return
        deadline = now + wait_s
        stuck = f"its lock was not free within {wait_s:g} s (not waited for again for {_TALLY_SKIP_S:g} s)"
        if not self._lock.acquire(timeout=wait_s):
            self._skip_until, self.why = time.monotonic() + _TALLY_SKIP_S, stuck
            yield None
            return
        try:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError as e:
                self._skip_until = time.monotonic() + _TALLY_SKIP_S
                self.why = f"it cannot be opened ({e}; not tried again for {_TALLY_SKIP_S:g} s)"
                yield None
                return
            try:
                delay = 0.0005
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            self._skip_until, self.why = time.monotonic() + _TALLY_SKIP_S, stuck
                            yield None
                            return
                        time.sleep(delay)
                        delay = min(delay * 2, 0.02)
                yield fd
            finally:
                os.close(fd)  # the lock goes with it
        finally:
            self._lock.release()

    def read(self, fd: int) -> tuple[int, int] | None:
        """``(count, bytes)``, or ``None`` where the file holds none (new, or cut short)."""
        raw = os.pread(fd, self._ROW.size, 0)
        if len(raw) < self._ROW.size:
            return None
        count, nbytes = self._ROW.unpack(raw)
        return (count, nbytes) if count >= 0 and nbytes >= 0 else None

    def write(self, fd: int, count: int, nbytes: int) -> None:
        os.pwrite(fd, self._ROW.pack(max(0, count), max(0, nbytes)), 0)


class SegmentPool:
    """The ``.pool`` directory of one host tier root plus this process's kept mappings.

    Args:
        directory: the pool directory (created by the backend).
        max_bytes: at most this many bytes of segments wait in the pool.
        max_segments: at most this many segments wait in the pool.
        max_maps: at most this many mappings kept by this process.
        grace_s: a segment is reused only this long after it entered the pool.
        populate: pre-fault the pages of new mappings (faster writes).
        tally: the file of the pool's count and bytes, shared by every process (see the module docstring).
    """

    def __init__(self, directory: Path, *, max_bytes: int, max_segments: int, max_maps: int, grace_s: float,
                 populate: bool, tally: Path) -> None:
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
        self._tally = _Tally(str(tally))

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

    def give(self, path: str, size: int, ident: tuple[int, int]) -> bool:
        """Move the deleted object at ``path`` (``size`` bytes, file ``ident``: its (st_dev, st_ino)) into the
        pool; ``False`` if it does not fit, or is no longer there (the caller unlinks what is).

        Checked against the node's tally, under its lock (see the module docstring); where the tally says the
        budget is reached, the pool is listed and its oldest entries are freed to make room.
        """
        if size <= 0 or size > self.max_bytes or self.max_segments <= 0:
            return False
        with self._tally.locked() as fd:
            if fd is None:
                if self._tally.why:
                    log.warning("the host pool's tally %s: %s; deleted segments are freed, not pooled",
                                self._tally.path, self._tally.why)
                return False
            tally = self._tally.read(fd)
            if tally is None or tally[0] + 1 > self.max_segments or tally[1] + size > self.max_bytes:
                tally, fits = self._fit(1, size)
                if not fits:
                    self._tally.write(fd, *tally)
                    return False
            count, total = tally
            name = self._new_name(size)
            dest = f"{self._dir_s}/{name}"
            self._tally.write(fd, count + 1, total + size)  # first: a crash after it counts one too many
            try:
                os.rename(path, dest)
            except FileNotFoundError:
                self._tally.write(fd, count, total)
                return False
        with self._lock:
            self._own.setdefault(size, []).append(name)  # a claim takes it without listing the pool
        self.moved(*ident, dest)
        return True

    def _listed(self) -> tuple[int, int]:
        """The pool's count and bytes, listed."""
        entries = self.entries()
        return len(entries), sum(e.size for e in entries)

    def _fit(self, count: int, size: int) -> tuple[tuple[int, int], bool]:
        """List the pool and free its oldest entries until ``count`` more segments of ``size`` bytes in all
        fit (called under the tally's lock); the pool's count and bytes after, and whether they fit.

        Where some must go, they go until an eighth of both budgets is left beside the new ones: a pool that
        stays full (a step's deletes larger than the budget) is then listed once per eighth of its budget,
        not at every delete."""
        entries = self.entries()
        total = sum(e.size for e in entries)
        held = len(entries)
        seg_cap, byte_cap = self.max_segments, self.max_bytes
        if held + count > seg_cap or total + size > byte_cap:
            seg_cap, byte_cap = seg_cap - seg_cap // 8, byte_cap - byte_cap // 8
        for e in entries:  # oldest first
            if held + count <= seg_cap and total + size <= byte_cap:
                break
            if self._drop(e):
                held -= 1
                total -= e.size
        return (held, total), held + count <= self.max_segments and total + size <= self.max_bytes

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
        todo = []
        for nbytes in sizes:
            if nbytes <= 0:
                continue
            if have.get(nbytes, 0) > 0:
                have[nbytes] -= 1
                continue
            todo.append(nbytes)
        if not todo:
            return 0
        added = 0
        with self._tally.locked() as fd:  # under the lock: ranks starting together share the budget
            if fd is None:
                log.warning("the host pool's tally %s: %s; nothing preallocated", self._tally.path,
                            self._tally.why or "its lock was not free lately")
                return 0
            count, total = self._listed()
            fits, c, t = [], count, total
            for nbytes in todo:
                if c + 1 > self.max_segments or t + nbytes > self.max_bytes:
                    break
                fits.append(nbytes)
                c, t = c + 1, t + nbytes
            self._tally.write(fd, c, t)  # first: a crash while they are made counts too many, never too few
            try:
                for nbytes in fits:
                    name = self._new_name(nbytes, time.time_ns() - self.grace_ns)  # reusable at once
                    make(self.dir / name, nbytes)
                    with self._lock:
                        self._own.setdefault(nbytes, []).append(name)
                    count += 1
                    total += nbytes
                    added += 1
            finally:
                self._tally.write(fd, count, total)
        return added

    def close(self) -> None:
        """Forget every kept mapping (each is unmapped when its last view goes)."""
        with self._lock:
            self._maps.clear()
            self._views.clear()
            self._own.clear()
