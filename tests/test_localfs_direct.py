"""LocalFSBackend's direct writes: large puts bypass the page cache (O_DIRECT) and read back byte for byte.

Attacked the ways a filesystem or a caller can break them: pieces of every alignment and size around the
block size (a property test), a filesystem that refuses O_DIRECT at the open or at the first write (the put
must still land whole, from the file's start), an aligned short write, a full disk in the middle of a direct
write (nothing left behind), and a forked child writing beside its parent through its own bounce buffer.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import backends.localfs as localfs
from backends.localfs import DIRECT_MIN, TEMP_MARK, LocalFSBackend

pytestmark = pytest.mark.skipif(not getattr(os, "O_DIRECT", 0), reason="needs O_DIRECT (Linux)")

_REAL_OPEN = os.open
_REAL_WRITE = os.write


def _is_direct(fd: int) -> bool:
    """Whether ``fd`` is open with O_DIRECT now (a number is reused once closed)."""
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def _direct_fds(monkeypatch) -> set[int]:
    """Record the descriptors opened with O_DIRECT."""
    fds: set[int] = set()

    def spy(path, flags, *a, **kw):
        fd = _REAL_OPEN(path, flags, *a, **kw)
        if flags & os.O_DIRECT:
            fds.add(fd)
        return fd

    monkeypatch.setattr(os, "open", spy)
    return fds


def _aligned(nbytes: int, seed: int = 1) -> mmap.mmap:
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    m.write(os.urandom(min(nbytes, 1 << 16)) * (nbytes // (1 << 16)) + os.urandom(nbytes % (1 << 16)))
    return m


def _no_temp(root) -> bool:
    return not [p for _, _, fs in os.walk(root) for p in fs if TEMP_MARK in p]


def test_a_large_put_is_written_direct_and_reads_back_exactly(tmp_path, monkeypatch):
    fds = _direct_fds(monkeypatch)
    b = LocalFSBackend(tmp_path)
    page = _aligned(3 << 20)
    parts = [os.urandom(37), memoryview(page), os.urandom((1 << 20) + 5), memoryview(page)[4096 * 3 + 1:], b"x"]
    want = b"".join(bytes(p) for p in parts)
    b.put("m/l/1/0", parts)
    if not fds and not b.direct:
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    assert fds, "a put of several MiB was written through the page cache"
    assert b.direct
    assert b.get("m/l/1/0") == want
    assert b.size("m/l/1/0") == len(want)  # the last block's padding was truncated away
    assert b.get_range("m/l/1/0", len(want) - 7, 7) == want[-7:]
    assert _no_temp(tmp_path)


def test_small_puts_and_direct_false_go_through_the_page_cache(tmp_path, monkeypatch):
    fds = _direct_fds(monkeypatch)
    b = LocalFSBackend(tmp_path / "a")
    b.put("small", b"y" * (DIRECT_MIN - 1))
    off = LocalFSBackend(tmp_path / "b", direct=False)
    big = os.urandom(DIRECT_MIN + 1)
    off.put("big", big)
    assert not fds
    assert b.get("small") == b"y" * (DIRECT_MIN - 1) and off.get("big") == big


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(st.tuples(st.sampled_from(["bytes", "aligned", "offset"]),
                                 st.sampled_from([0, 1, 511, 4095, 4096, 4097, 8192, 12289, 65536, 4 << 20,
                                                  (4 << 20) + 3])),
                       min_size=1, max_size=6))
def test_any_layout_of_pieces_reads_back_exactly(tmp_path, monkeypatch, pieces):
    """Every mix of aligned and unaligned pieces, of sizes around the block and the bounce buffer's."""
    monkeypatch.setattr(localfs, "DIRECT_MIN", 0)  # every put takes the direct path
    b = LocalFSBackend(tmp_path)
    parts = []
    for kind, n in pieces:
        if kind == "bytes":
            parts.append(os.urandom(n))
        else:
            start = 4096 if kind == "aligned" else 4099
            m = _aligned(start + n + 1)
            parts.append(memoryview(m)[start:start + n])
    want = b"".join(bytes(p) for p in parts)
    b.put("k", parts)
    assert b.get("k") == want
    assert _no_temp(tmp_path)


@pytest.mark.parametrize("where", ["open", "write"])
def test_a_filesystem_that_refuses_o_direct_gets_the_whole_put_buffered(tmp_path, monkeypatch, where):
    refused: list[int] = []
    direct: set[int] = set()

    def open_(path, flags, *a, **kw):
        if flags & os.O_DIRECT and where == "open":
            refused.append(flags)
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = _REAL_OPEN(path, flags, *a, **kw)
        if flags & os.O_DIRECT:
            direct.add(fd)
        return fd

    def write(fd, data):
        if where == "write" and _is_direct(fd):
            refused.append(fd)
            if len(refused) > 1:  # one block landed, then the filesystem says no
                raise OSError(errno.EINVAL, "Invalid argument")
            return _REAL_WRITE(fd, memoryview(data)[:4096])
        return _REAL_WRITE(fd, data)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "write", write)
    b = LocalFSBackend(tmp_path)
    page = _aligned(2 << 20)
    want = os.urandom(100) + bytes(page) + os.urandom(3)
    b.put("m/l/2/0", [want[:100], memoryview(page), want[-3:]])
    assert refused and not b.direct  # refused once, then never asked again
    assert b.get("m/l/2/0") == want  # whole, from the start: the direct attempt's block was overwritten
    assert b.size("m/l/2/0") == len(want)
    assert _no_temp(tmp_path)
    b.put("again", want)
    assert b.get("again") == want


def test_aligned_short_writes_continue_where_they_stopped(tmp_path, monkeypatch):
    direct = _direct_fds(monkeypatch)

    def write(fd, data):
        view = memoryview(data)
        if _is_direct(fd) and view.nbytes > 8192:
            return _REAL_WRITE(fd, view[:8192])  # a short write, of whole blocks
        return _REAL_WRITE(fd, data)

    monkeypatch.setattr(os, "write", write)
    b = LocalFSBackend(tmp_path)
    want = os.urandom(DIRECT_MIN + 12345)
    b.put("k", want)
    if not direct:
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    assert b.direct and b.get("k") == want


def test_a_disk_full_in_a_direct_write_leaves_nothing(tmp_path):
    import subprocess

    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True,
                       check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a 2 MiB tmpfs to fill: {r.stderr.decode().strip()}")
    try:
        from tierstore.errors import TierFullError

        b = LocalFSBackend(mnt)
        with pytest.raises(TierFullError):
            b.put("huge", bytes(_aligned(3 << 20)))
        assert b.get("huge") is None and _no_temp(mnt)
        keep = os.urandom(DIRECT_MIN + 1)
        b.put("fits", keep)
        assert b.get("fits") == keep
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_forked_child_writes_through_its_own_bounce_buffer(tmp_path):
    """The bounce buffer is private memory: a child forked after the parent's first put cannot scribble on it."""
    b = LocalFSBackend(tmp_path)
    odd = os.urandom(DIRECT_MIN + 4097)  # unaligned: all of it goes through the bounce buffer
    b.put("first", odd)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: many puts of other bytes while the parent writes
        try:
            os.close(r)
            for i in range(4):
                b.put(f"child{i}", bytes([i]) * (DIRECT_MIN + 5))
            os.write(w, b"ok")
        finally:
            os._exit(0)
    os.close(w)
    theirs = os.urandom(DIRECT_MIN + 4099)
    for i in range(4):
        b.put(f"parent{i}", theirs)
    assert os.read(r, 2) == b"ok"
    os.waitpid(pid, 0)
    os.close(r)
    for i in range(4):
        assert b.get(f"parent{i}") == theirs
        assert b.get(f"child{i}") == bytes([i]) * (DIRECT_MIN + 5)
    assert b.get("first") == odd


def test_an_io_error_in_a_direct_write_is_typed_leaves_nothing_and_is_not_a_refusal(tmp_path, monkeypatch):
    """EIO mid-write (a failing disk) is the tier failing, not a filesystem without O_DIRECT: the put raises
    TierUnavailableError, its temp file goes, and the next put is written direct again."""
    from tierstore.errors import TierUnavailableError

    fail = [True]

    def write(fd, data):
        if fail[0] and _is_direct(fd):
            fail[0] = False
            raise OSError(errno.EIO, "Input/output error")
        return _REAL_WRITE(fd, data)

    monkeypatch.setattr(os, "write", write)
    b = LocalFSBackend(tmp_path)
    data = os.urandom(DIRECT_MIN * 2)
    with pytest.raises(TierUnavailableError) as ei:
        b.put("k", data)
    if fail[0]:
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == errno.EIO
    assert b.get("k") is None and _no_temp(tmp_path)
    assert b.direct
    fds = _direct_fds(monkeypatch)
    b.put("k", data)
    assert fds and b.get("k") == data
