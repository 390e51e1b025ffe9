"""The one conformance suite every backend inherits (fsspec ``tests/abstract`` style).

Usage::

    class TestMyBackend(BackendConformance):
        @pytest.fixture
        def backend(self, tmp_path):
            b = MyBackend(tmp_path)
            yield b
            b.close()

The ``backend`` fixture must be function-scoped and yield a fresh, empty
backend. Class attributes a subclass may override:

* ``big_object_bytes``: the size of the "large object" round trip (~20 MiB).
* ``concurrent_create_once_checked``: set ``False`` (with a reason in
  ``concurrent_create_once_skip_reason``) where the *test server*, not the
  backend, cannot make create-once atomic (moto checks If-None-Match
  non-atomically).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from backends.base import Backend
from tierstore.errors import InvalidKeyError, InvalidValueError, KeyExistsError, TierStoreError

__all__ = ["INVALID_NAMES", "BackendConformance"]

INVALID_NAMES = [
    "",
    "../x",
    "a/../b",
    "..",
    "/abs",
    "a//b",
    "a/./b",
    ".",
    "a/",
    "a\x00b",
    "a\nb",
    "a\x7fb",
    "a b",
    "x" * 2000,
    "é",
]


def _payload(n: int, seed: int = 0) -> bytes:
    """Deterministic, non-constant bytes (catches offset and ordering bugs)."""
    if n == 0:
        return b""
    block = bytes((i * 31 + seed * 7 + (i >> 8)) & 0xFF for i in range(4099))
    reps = n // len(block) + 1
    return (block * reps)[:n]


def _as_bytes(data) -> bytes:
    assert data is not None
    assert isinstance(data, (bytes, bytearray, memoryview)), type(data)
    return bytes(data)


class BackendConformance:
    """Behaviour every :class:`~backends.base.Backend` must show."""

    big_object_bytes = 20 * 1024 * 1024 + 12345
    concurrent_create_once_checked = True
    concurrent_create_once_skip_reason = ""

    @pytest.fixture
    def backend(self) -> Backend:  # pragma: no cover - overridden
        raise NotImplementedError("a conformance subclass must provide a `backend` fixture")

    # -- capabilities --------------------------------------------------------------
    def test_capabilities_declared(self, backend):
        assert backend.tier in ("device", "host", "peer", "durable")
        assert backend.survives in ("step", "process", "node", "cluster")
        for attr in ("zero_copy_get", "reservable", "atomic_create_once", "local_reads", "ranged_get"):
            assert isinstance(getattr(type(backend), attr), bool)

    def test_starts_empty(self, backend):
        assert list(backend.list()) == []

    # -- round trips ---------------------------------------------------------------
    @pytest.mark.parametrize(
        "data",
        [
            b"hello",
            bytearray(b"a bytearray"),
            memoryview(b"a memoryview"),
            memoryview(b"xxsliced viewyy")[2:-2],
            b"",
            [b"part1-", bytearray(b"part2-"), memoryview(b"part3")],
            [b"", b"abc", b"", b"def", b""],
            [],
        ],
        ids=["bytes", "bytearray", "memoryview", "sliced-view", "empty", "list", "zero-byte-parts", "empty-list"],
    )
    def test_put_get_roundtrip(self, backend, data):
        expected = b"".join(bytes(p) for p in data) if isinstance(data, list) else bytes(data)
        backend.put("obj/one", data)
        assert _as_bytes(backend.get("obj/one")) == expected
        assert backend.size("obj/one") == len(expected)
        assert backend.exists("obj/one")

    def test_non_byte_memoryview_is_flattened(self, backend):
        import array

        arr = array.array("i", [1, 2, 3, 4])
        backend.put("ints", memoryview(arr))
        assert _as_bytes(backend.get("ints")) == arr.tobytes()

    def test_big_object(self, backend):
        data = _payload(self.big_object_bytes, seed=3)
        mid = len(data) // 3
        backend.put("big/obj", [data[:mid], memoryview(data)[mid:]])
        got = backend.get("big/obj")
        assert len(got) == len(data)
        assert _as_bytes(got) == data

    def test_overwrite(self, backend):
        backend.put("k", b"first version, longer")
        backend.put("k", b"second")
        assert _as_bytes(backend.get("k")) == b"second"
        assert backend.size("k") == 6
        assert list(backend.list()) == ["k"]

    def test_put_does_not_alias_caller_buffer(self, backend):
        buf = bytearray(b"original")
        backend.put("alias", buf)
        buf[:] = b"mutated!"
        assert _as_bytes(backend.get("alias")) == b"original"

    # -- ranged reads --------------------------------------------------------------
    def test_get_range_is_a_slice(self, backend):
        data = _payload(300_001, seed=5)
        backend.put("r/obj", data)
        n = len(data)
        for off, length in [(0, 1), (0, n), (1, 64), (4095, 4099), (n - 16, 16), (n - 1, 1), (123_456, 100_000),
                            (0, 0), (n, 0), (n - 10, 100), (n, 5), (n + 1000, 3)]:
            assert _as_bytes(backend.get_range("r/obj", off, length)) == data[off : off + length], (off, length)
        backend.put("r/empty", b"")
        assert _as_bytes(backend.get_range("r/empty", 0, 10)) == b""

    def test_get_range_sees_the_current_object(self, backend):
        backend.put("r/k", b"first version")
        backend.put("r/k", b"second")
        assert _as_bytes(backend.get_range("r/k", 1, 100)) == b"econd"
        backend.delete("r/k")
        assert backend.get_range("r/k", 0, 4) is None

    def test_get_range_miss_and_bad_ranges(self, backend):
        assert backend.get_range("no/such/object", 0, 10) is None
        backend.put("r/x", b"abc")
        for off, length in [(-1, 2), (0, -1), (1.5, 2), (0, None), (True, 1)]:
            with pytest.raises(InvalidValueError):
                backend.get_range("r/x", off, length)

    def test_tail_is_the_last_bytes(self, backend):
        """``tail`` (a trailer check) reads the object's last bytes: all of it where it is shorter, ``None``
        where there is none, and after an overwrite or a delete it sees the current object."""
        data = _payload(300_001, seed=7)
        backend.put("t/obj", data)
        for n in (16, 1, 0, 4096, 300_001, 400_000):
            assert _as_bytes(backend.tail("t/obj", n)) == (data[-n:] if n else b""), n
        backend.put("t/obj", b"second")
        assert _as_bytes(backend.tail("t/obj", 3)) == b"ond"
        assert _as_bytes(backend.tail("t/obj", 100)) == b"second"
        backend.delete("t/obj")
        assert backend.tail("t/obj", 16) is None
        assert backend.tail("no/such/object", 16) is None

    # -- misses --------------------------------------------------------------------
    def test_get_miss_is_none(self, backend):
        assert backend.get("no/such/object") is None
        assert backend.size("no/such/object") is None
        assert backend.exists("no/such/object") is False

    def test_delete(self, backend):
        backend.put("d/x", b"1")
        assert backend.delete("d/x") is True
        assert backend.get("d/x") is None
        assert backend.exists("d/x") is False
        assert backend.delete("d/x") is False
        assert backend.delete("never/was") is False
        assert list(backend.list()) == []

    # -- list ----------------------------------------------------------------------
    def test_list_prefix(self, backend):
        names = ["m/l1/10/0", "m/l1/10/1", "m/l1/9/0", "m/l2/10/0", "m2/x", "n", "m/l10/1/0"]
        for i, n in enumerate(names):
            backend.put(n, b"%d" % i)
        assert list(backend.list()) == sorted(names)
        assert list(backend.list("m/")) == sorted(n for n in names if n.startswith("m/"))
        assert list(backend.list("m/l1")) == ["m/l1/10/0", "m/l1/10/1", "m/l1/9/0", "m/l10/1/0"]
        assert list(backend.list("m/l1/")) == ["m/l1/10/0", "m/l1/10/1", "m/l1/9/0"]
        assert list(backend.list("m/l1/10/1")) == ["m/l1/10/1"]
        assert list(backend.list("zzz")) == []
        assert list(backend.list("m//")) == []
        assert list(backend.list("../")) == []

    # -- create once ---------------------------------------------------------------
    def test_if_absent_creates_once(self, backend):
        backend.put("once", b"first", if_absent=True)
        with pytest.raises(KeyExistsError) as ei:
            backend.put("once", b"second", if_absent=True)
        assert isinstance(ei.value, FileExistsError)
        assert _as_bytes(backend.get("once")) == b"first"
        backend.put("once", b"third")  # a plain put still overwrites
        assert _as_bytes(backend.get("once")) == b"third"

    def test_if_absent_after_delete(self, backend):
        backend.put("re", b"1", if_absent=True)
        backend.delete("re")
        backend.put("re", b"2", if_absent=True)
        assert _as_bytes(backend.get("re")) == b"2"

    def test_concurrent_if_absent_exactly_one_wins(self, backend):
        if not self.concurrent_create_once_checked:
            pytest.skip(self.concurrent_create_once_skip_reason)
        n = 8
        barrier = threading.Barrier(n)
        results: list[object] = [None] * n

        def attempt(i: int) -> None:
            barrier.wait()
            try:
                backend.put("race", b"writer-%d" % i, if_absent=True)
                results[i] = "won"
            except KeyExistsError:
                results[i] = "lost"
            except Exception as e:  # noqa: BLE001 - reported below
                results[i] = e

        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results.count("won") == 1, results
        assert results.count("lost") == n - 1, results
        winner = results.index("won")
        assert _as_bytes(backend.get("race")) == b"writer-%d" % winner

    # -- validation ----------------------------------------------------------------
    @pytest.mark.parametrize("name", INVALID_NAMES, ids=lambda n: repr(n)[:20])
    def test_invalid_names_rejected(self, backend, name):
        with pytest.raises(InvalidKeyError):
            backend.put(name, b"x")
        with pytest.raises(InvalidKeyError):
            backend.get(name)
        with pytest.raises(InvalidKeyError):
            backend.delete(name)
        with pytest.raises(InvalidKeyError):
            backend.exists(name)
        with pytest.raises(InvalidKeyError):
            backend.get_range(name, 0, 1)

    def test_non_str_name_rejected(self, backend):
        with pytest.raises(InvalidKeyError):
            backend.put(123, b"x")  # type: ignore[arg-type]

    @pytest.mark.parametrize("data", ["a str", 42, None, [b"ok", "not bytes"], {"a": b"b"}])
    def test_non_bytes_rejected(self, backend, data):
        with pytest.raises(InvalidValueError):
            backend.put("bad/value", data)
        assert backend.get("bad/value") is None

    def test_errors_are_tierstore_errors(self, backend):
        with pytest.raises(TierStoreError):
            backend.put("../x", b"")

    # -- batches -------------------------------------------------------------------
    def test_many(self, backend):
        items = [(f"batch/{i}", _payload(100 + i, seed=i)) for i in range(10)]
        backend.put_many(items)
        got = backend.get_many([n for n, _ in items] + ["batch/missing"])
        assert got["batch/missing"] is None
        for n, d in items:
            assert _as_bytes(got[n]) == d
        assert backend.delete_many([n for n, _ in items[:4]] + ["batch/missing"]) == 4
        assert list(backend.list("batch/")) == sorted(n for n, _ in items[4:])

    # -- concurrency ---------------------------------------------------------------
    def test_concurrent_distinct_writers(self, backend):
        def work(i: int) -> None:
            for j in range(5):
                name = f"conc/{i}/{j}"
                backend.put(name, _payload(1000 + i * 10 + j, seed=i + j))
                assert _as_bytes(backend.get(name)) == _payload(1000 + i * 10 + j, seed=i + j)

        with ThreadPoolExecutor(8) as ex:
            list(ex.map(work, range(8)))
        assert len(list(backend.list("conc/"))) == 40

    def test_concurrent_overwrites_are_atomic(self, backend):
        versions = [bytes([v]) * (200_000 + v) for v in range(4)]
        stop = threading.Event()
        bad: list[int] = []

        def reader() -> None:
            while not stop.is_set():
                d = backend.get("atomic")
                if d is not None and bytes(d) not in versions:
                    bad.append(len(d))

        t = threading.Thread(target=reader)
        t.start()
        try:
            for _ in range(3):
                for v in versions:
                    backend.put("atomic", v)
        finally:
            stop.set()
            t.join()
        assert bad == []

    # -- lifecycle -----------------------------------------------------------------
    def test_close_idempotent(self, backend):
        backend.put("c", b"1")
        backend.close()
        backend.close()

    def test_context_manager(self, backend):
        with backend as b:
            assert b is backend

    def test_used_bytes(self, backend):
        used = backend.used_bytes()
        if used is None:
            pytest.skip(f"{type(backend).__name__} does not report used_bytes")
        backend.put("u/1", b"x" * 1000)
        assert backend.used_bytes() >= used + 1000

    # -- reservations --------------------------------------------------------------
    def _need_reservable(self, backend) -> None:
        if not type(backend).reservable:
            pytest.skip(f"{type(backend).__name__} is not reservable")

    def test_reserve_not_supported_raises(self, backend):
        if type(backend).reservable:
            pytest.skip("reservable backend")
        with pytest.raises(NotImplementedError):
            backend.reserve("r", 10)

    def test_reserve_commit(self, backend):
        self._need_reservable(backend)
        r = backend.reserve("res/a", 11)
        assert len(r.buffer) == 11 and not r.buffer.readonly
        r.buffer[:] = b"hello world"
        assert backend.get("res/a") is None
        assert not backend.exists("res/a")
        assert list(backend.list("res/")) == []
        r.commit()
        assert _as_bytes(backend.get("res/a")) == b"hello world"

    def test_reserve_abort_frees(self, backend):
        self._need_reservable(backend)
        before = backend.used_bytes()
        r = backend.reserve("res/b", 4096)
        r.buffer[:4] = b"abcd"
        r.abort()
        r.abort()
        assert backend.get("res/b") is None
        assert backend.used_bytes() == before

    def test_reserve_context_aborts_on_error(self, backend):
        self._need_reservable(backend)
        with pytest.raises(RuntimeError), backend.reserve("res/c", 8) as r:
            r.buffer[:] = b"12345678"
            raise RuntimeError("boom")
        assert backend.get("res/c") is None

    def test_reserve_commit_if_absent(self, backend):
        self._need_reservable(backend)
        backend.put("res/d", b"old")
        r = backend.reserve("res/d", 3)
        r.buffer[:] = b"new"
        with pytest.raises(KeyExistsError):
            r.commit(if_absent=True)
        r.abort()
        assert _as_bytes(backend.get("res/d")) == b"old"

    def test_reserve_invalid_name(self, backend):
        self._need_reservable(backend)
        with pytest.raises(InvalidKeyError):
            backend.reserve("../r", 1)

