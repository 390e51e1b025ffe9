"""MemoryBackend: the conformance suite plus its capacity bound."""

from __future__ import annotations

import pytest

from backends.memory import MemoryBackend
from tests.conformance import BackendConformance
from tierstore.errors import TierFullError


class TestMemoryConformance(BackendConformance):
    @pytest.fixture
    def backend(self):
        b = MemoryBackend()
        yield b
        b.close()


def test_capacity_bound():
    b = MemoryBackend(capacity_bytes=100)
    b.put("a", b"x" * 60)
    with pytest.raises(TierFullError) as ei:
        b.put("b", b"y" * 50)
    assert ei.value.key == "b" and ei.value.capacity == 100
    b.put("a", b"z" * 90)  # replacing frees the old bytes first
    assert b.used_bytes() == 90
    with pytest.raises(TierFullError):
        b.reserve("r", 20)
    b.delete("a")
    r = b.reserve("r", 100)
    with pytest.raises(TierFullError):
        b.put("c", b"1")
    r.commit()
    assert b.used_bytes() == 100


def test_get_is_zero_copy():
    b = MemoryBackend()
    b.put("k", b"abc")
    assert b.get("k") is b.get("k")


# -- the registry (backends/__init__.py): pure logic, tested here ------------------------


def test_registry_builtin_schemes(tmp_path):
    from backends import known_backends, open_backend
    from backends.localfs import LocalFSBackend

    assert {"file", "s3", "mem", "shm", "peer", "device"} <= set(known_backends())
    assert isinstance(open_backend("mem://"), MemoryBackend)
    assert open_backend("mem://", capacity_bytes=5).capacity_bytes == 5
    b = open_backend(f"file://{tmp_path}/a b", fsync=False)
    assert isinstance(b, LocalFSBackend) and str(b.root) == f"{tmp_path}/a b" and b.fsync is False
    b = open_backend("file://" + (tmp_path / "c%20d").as_posix())
    assert str(b.root) == f"{tmp_path}/c d"
    assert isinstance(open_backend(str(tmp_path / "bare")), LocalFSBackend)


def test_registry_s3_url(monkeypatch):
    from backends import open_backend

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    b = open_backend("s3://my-bucket/ckpt/run", endpoint_url="http://127.0.0.1:1", region_name="us-east-1")
    assert (type(b).__name__, b.bucket, b.prefix) == ("S3Backend", "my-bucket", "ckpt/run")
    b.close()


def test_registry_errors():
    from backends import backend_class, open_backend, register_backend
    from tierstore.errors import ConfigError, MissingDependencyError

    with pytest.raises(ConfigError, match="unknown backend URL scheme 'nope'"):
        open_backend("nope://x")
    with pytest.raises(ConfigError):
        open_backend("")
    with pytest.raises(ConfigError):
        open_backend("file://otherhost/x")
    with pytest.raises(ConfigError):
        open_backend("mem://something")
    with pytest.raises(ConfigError):
        register_backend("Bad Scheme", "x:Y")
    with pytest.raises(ConfigError):
        register_backend("ok", "not-a-target")
    with pytest.raises(ConfigError, match="already registered"):
        register_backend("s3", "elsewhere:S3")
    # a module that is not there at all is a configuration error ...
    register_backend("ghost", "backends.no_such_module_xyz:Ghost")
    with pytest.raises(ConfigError, match="not available"):
        backend_class("ghost")
    # ... a dependency the module imports that is missing gets an install hint
    with pytest.raises(MissingDependencyError, match="pip install zzz"):
        _import_missing_dep()


def _import_missing_dep():
    import sys

    from backends import backend_class

    sys.modules.pop("tests._fake_needs_dep", None)
    # a loader-less module that fails like a real one with a missing dependency
    import importlib.abc
    import importlib.util

    class _Loader(importlib.abc.Loader):
        def create_module(self, spec):
            return None

        def exec_module(self, module):
            import zzz_not_installed_pkg  # noqa: F401

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "tests._fake_needs_dep":
                return importlib.util.spec_from_loader(name, _Loader())
            return None

    finder = _Finder()
    sys.meta_path.insert(0, finder)
    try:
        from backends import register_backend

        register_backend("needsdep2", "tests._fake_needs_dep:Cls", hint="pip install zzz")
        return backend_class("needsdep2")
    finally:
        sys.meta_path.remove(finder)


def test_registry_extension():
    from backends import open_backend, register_backend

    register_backend("mem2", "tests.test_backend_memory:RestMemory")
    # no from_url: the class is called with the rest of the URL
    assert open_backend("mem2:///some/dir", capacity_bytes=3).rest == "/some/dir"
    register_backend("mem3", "tests.test_backend_memory:UrlMemory")
    b = open_backend("mem3://cap/7")
    assert isinstance(b, UrlMemory) and b.capacity_bytes == 7


class UrlMemory(MemoryBackend):
    @classmethod
    def from_url(cls, url: str, **options):
        return cls(capacity_bytes=int(url.rsplit("/", 1)[1]), **options)


class RestMemory(MemoryBackend):
    def __init__(self, rest: str, **options):
        super().__init__(**options)
        self.rest = rest
