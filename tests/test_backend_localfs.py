"""LocalFSBackend: the conformance suite, crash safety, disk full, access denied."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from backends.localfs import TEMP_MARK, LocalFSBackend
from tests import _warm
from tests.conformance import BackendConformance
from tierstore.errors import AccessDeniedError, InvalidKeyError, TierFullError


class TestLocalFSConformance(BackendConformance):
    @pytest.fixture
    def backend(self, tmp_path):
        b = LocalFSBackend(tmp_path / "store")
        yield b
        b.close()


def test_layout_is_readable(tmp_path):
    b = LocalFSBackend(tmp_path, fsync=False)
    b.put("gpt/block0/10/0", b"abc")
    assert (tmp_path / "gpt" / "block0" / "10" / "0").read_bytes() == b"abc"
    assert b.url == tmp_path.as_uri()


def test_leftover_temp_file_ignored_and_cleaned(tmp_path):
    b = LocalFSBackend(tmp_path)
    b.put("m/l/1/0", b"real")
    # what a writer killed between write and rename leaves behind
    stale = tmp_path / "m" / "l" / "1" / f".tmp{TEMP_MARK}0{TEMP_MARK}deadbeef"
    stale.write_bytes(b"partial")
    fresh = tmp_path / "m" / f".tmp{TEMP_MARK}x{TEMP_MARK}cafe"
    fresh.write_bytes(b"in flight")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    assert list(b.list()) == ["m/l/1/0"]
    assert b.used_bytes() == 4
    assert b.cleanup_temp(max_age_s=3600) == 1
    assert not stale.exists() and fresh.exists()
    assert b.cleanup_temp(max_age_s=0) == 1
    assert not fresh.exists()
    assert b.get("m/l/1/0") == b"real"


def test_crashed_writer_leaves_old_object_intact(tmp_path):
    """A process killed mid-put (after its temp write) never exposes partial data."""
    b = LocalFSBackend(tmp_path)
    b.put("k", b"old")
    code = (
        "import os, sys\n"
        "from backends.localfs import LocalFSBackend\n"
        "import backends.localfs as m\n"
        "b = LocalFSBackend(sys.argv[1])\n"
        "m.os.replace = lambda *a: os._exit(9)\n"  # die right before publishing
        "b.put('k', b'new' * 1000)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=os.getcwd(), timeout=60, check=False)
    assert r.returncode == 9
    assert b.get("k") == b"old"
    assert list(b.list()) == ["k"]
    assert b.cleanup_temp(max_age_s=0) == 1


def test_foreign_files_not_listed(tmp_path):
    b = LocalFSBackend(tmp_path)
    (tmp_path / "bad name").write_bytes(b"x")
    b.put("good", b"y")
    assert list(b.list()) == ["good"]


def test_name_collides_with_directory(tmp_path):
    b = LocalFSBackend(tmp_path)
    b.put("a/b", b"1")
    with pytest.raises(InvalidKeyError):
        b.put("a", b"2")
    assert b.get("a") is None
    assert b.delete("a") is False
    with pytest.raises(InvalidKeyError):
        b.put("a/b/c", b"3")
    assert b.get("a/b") == b"1"


def test_delete_prunes_empty_dirs(tmp_path):
    b = LocalFSBackend(tmp_path)
    b.put("x/y/z", b"1")
    b.put("x/w", b"2")
    assert b.delete("x/y/z")
    assert not (tmp_path / "x" / "y").exists()
    assert (tmp_path / "x").is_dir()
    assert tmp_path.is_dir()


def test_if_absent_across_processes(tmp_path):
    """os.link publishing is atomic across processes, not only threads."""
    code = (
        "import sys\n"
        "from backends.localfs import LocalFSBackend\n"
        "from tierstore.errors import KeyExistsError\n"
        "b = LocalFSBackend(sys.argv[1])\n"
        "won = 0\n"
        "for i in range(200):\n"
        "    try:\n"
        "        b.put(f'k/{i}', sys.argv[2].encode(), if_absent=True); won += 1\n"
        "    except KeyExistsError:\n"
        "        pass\n"
        "print(won)\n"
    )
    procs = [
        _warm.popen([sys.executable, "-c", code, str(tmp_path), f"p{j}"], stdout=subprocess.PIPE, cwd=os.getcwd())
        for j in range(2)
    ]
    wins = [int(p.communicate(timeout=120)[0]) for p in procs]
    assert sum(wins) == 200
    b = LocalFSBackend(tmp_path)
    assert len(list(b.list("k/"))) == 200


@pytest.mark.skipif(os.geteuid() == 0, reason="root bypasses file permissions")
def test_access_denied(tmp_path):
    ro = tmp_path / "ro"
    b = LocalFSBackend(ro)
    os.chmod(ro, 0o500)
    try:
        with pytest.raises(AccessDeniedError) as ei:
            b.put("x", b"1")
        assert isinstance(ei.value.__cause__, PermissionError)
    finally:
        os.chmod(ro, 0o700)


def test_access_denied_read_only_fs(tmp_path):
    """EROFS (a read-only bind mount) is an access error, not a crash."""
    mnt = tmp_path / "romnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(mnt)], capture_output=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {r.stderr.decode().strip()}")
    try:
        b = LocalFSBackend(mnt)
        with pytest.raises(AccessDeniedError) as ei:
            b.put("x", b"1")
        assert isinstance(ei.value.__cause__, OSError)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_disk_full(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs to simulate a full disk: {r.stderr.decode().strip()}")
    try:
        b = LocalFSBackend(mnt)
        b.put("small", b"x" * 1000)
        with pytest.raises(TierFullError) as ei:
            b.put("huge", b"y" * (4 * 1024 * 1024))
        assert ei.value.key == "huge"
        assert isinstance(ei.value.__cause__, OSError)
        # the failed put left nothing behind, and the tier still works
        assert b.get("huge") is None
        assert not [p for p in os.listdir(mnt) if TEMP_MARK in p]
        assert b.get("small") == b"x" * 1000
        b.put("small2", b"z" * 1000)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
