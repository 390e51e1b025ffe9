"""Backends by URL scheme: a lazy registry (fsspec ``known_implementations`` style).

``open_backend(url, **options)`` imports the module that implements the URL's
scheme only when first asked, so ``import backends`` stays cheap and an
optional dependency (boto3, ucxx, torch) is needed only by the tier that uses it.

Protocol for a registered class: if it defines a classmethod
``from_url(url, **options)``, that builds the backend; otherwise the class is
called as ``cls(<url without "scheme://">, **options)``.

Built in:

===========  =====================================  ====================================
scheme       class                                  URL
===========  =====================================  ====================================
``file``     ``backends.localfs:LocalFSBackend``    ``file:///abs/dir`` or a bare path
``s3``       ``backends.s3:S3Backend``              ``s3://bucket/prefix``
``mem``      ``backends.memory:MemoryBackend``      ``mem://`` (a new, private instance)
``shm``      ``backends.host:HostBackend``          ``shm://<root dir>``
``peer``     ``backends.peer:PeerBackend``          ``peer://host:port``
``device``   ``backends.device:DeviceBackend``      ``device://`` (``device://cuda:0``)
===========  =====================================  ====================================
"""

from __future__ import annotations

import importlib
import re
import threading
from typing import Any
from urllib.parse import unquote, urlsplit

from tierstore.errors import ConfigError, MissingDependencyError

__all__ = ["backend_class", "known_backends", "open_backend", "register_backend"]

_KNOWN: dict[str, dict[str, str]] = {
    "file": {"class": "backends.localfs:LocalFSBackend", "hint": "part of tierstore"},
    "s3": {"class": "backends.s3:S3Backend", "hint": "pip install boto3 tenacity"},
    "mem": {"class": "backends.memory:MemoryBackend", "hint": "part of tierstore"},
    "shm": {"class": "backends.host:HostBackend", "hint": "pip install 'redis[hiredis]'"},
    "peer": {"class": "backends.peer:PeerBackend", "hint": "pip install 'tierstore[ucx]' (ucxx-cu12)"},
    "device": {"class": "backends.device:DeviceBackend", "hint": "pip install torch"},
}
_LOCK = threading.Lock()
_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def register_backend(scheme: str, target: str, *, hint: str = "", clobber: bool = False) -> None:
    """Register ``"module:Class"`` for ``scheme://`` URLs (imported on first use).

    Raises:
        ConfigError: a malformed scheme or target, or ``scheme`` taken (unless ``clobber``).
    """
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme or ""):
        raise ConfigError(f"invalid URL scheme {scheme!r}", field="scheme")
    if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", target or ""):
        raise ConfigError(f"backend target must be 'module:Class', got {target!r}", field="target")
    with _LOCK:
        if scheme in _KNOWN and not clobber and _KNOWN[scheme]["class"] != target:
            raise ConfigError(f"URL scheme {scheme!r} is already registered to {_KNOWN[scheme]['class']}",
                              field="scheme")
        _KNOWN[scheme] = {"class": target, "hint": hint or f"install the package providing {target}"}


def known_backends() -> dict[str, str]:
    """``{scheme: "module:Class"}`` of every registered scheme."""
    with _LOCK:
        return {k: v["class"] for k, v in _KNOWN.items()}


def _split(url: str) -> tuple[str, str]:
    """``(scheme, rest)``; a bare path is ``("file", path)``."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"a backend URL must be a non-empty str, got {url!r}", field="url")
    m = _SCHEME_RE.match(url)
    if not m:
        if ":" in url.split("/", 1)[0] and not url.startswith((".", "/")):
            raise ConfigError(f"malformed backend URL {url!r} (expected scheme://...)", field="url")
        return "file", url
    return m.group(1).lower(), url[m.end():]


def backend_class(scheme: str) -> type:
    """Import and return the class registered for ``scheme``.

    Raises:
        ConfigError: unknown scheme, or the registered module/class does not exist.
        MissingDependencyError: the module needs a package that is not installed.
    """
    with _LOCK:
        entry = _KNOWN.get(scheme)
    if entry is None:
        raise ConfigError(
            f"unknown backend URL scheme {scheme!r}; known: {', '.join(sorted(known_backends()))}",
            field="scheme",
        )
    module_name, _, class_name = entry["class"].partition(":")
    try:
        module = importlib.import_module(module_name)
    except MissingDependencyError:
        raise
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ConfigError(f"backend module {module_name!r} for {scheme}:// is not available: {e}",
                              field="scheme") from e
        raise MissingDependencyError(
            f"the {scheme}:// backend needs {e.name!r}, which is not installed: {entry['hint']}",
            scheme=scheme, package=e.name,
        ) from e
    except ImportError as e:
        raise MissingDependencyError(f"the {scheme}:// backend failed to import ({e}): {entry['hint']}",
                                     scheme=scheme) from e
    try:
        return getattr(module, class_name)
    except AttributeError as e:
        raise ConfigError(f"{module_name} has no class {class_name!r} for {scheme}://", field="scheme") from e


def open_backend(url: str, **options: Any) -> Any:
    """Open the backend a URL names, passing ``options`` to its constructor.

    Examples::

        open_backend("/var/lib/tierstore/durable")             # LocalFSBackend
        open_backend("file:///var/lib/tierstore/durable", fsync=False)
        open_backend("s3://bucket/ckpt", endpoint_url="http://127.0.0.1:9000")
        open_backend("mem://")

    Raises:
        ConfigError: unknown scheme or malformed URL.
        MissingDependencyError: the scheme's optional dependency is missing (with an install hint).
    """
    scheme, rest = _split(url)
    cls = backend_class(scheme)
    if scheme == "file":
        return cls(_file_path(url, rest), **options)
    if scheme == "mem":
        if rest.strip("/"):
            raise ConfigError(f"mem:// takes no path, got {url!r}", field="url")
        return cls(**options)
    from_url = getattr(cls, "from_url", None)
    if callable(from_url):
        return from_url(url, **options)
    return cls(rest, **options)


def _file_path(url: str, rest: str) -> str:
    if url == rest:  # a bare path
        return url
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ConfigError(f"file:// URLs must name a local path, got host {parts.netloc!r}", field="url")
    path = unquote(parts.path)
    if not path:
        raise ConfigError(f"file:// URL without a path: {url!r}", field="url")
    return path
