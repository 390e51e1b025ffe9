"""``torch``, imported on first use, so the index, the tiers and the admin commands run without it.

Importing torch costs seconds; ``tierstore admin``, ``tierstore server`` and a
store that only moves bytes (verify, gc, migration) never touch a tensor. Data
path modules that need torch for tensors write::

    from typing import TYPE_CHECKING
    if TYPE_CHECKING:
        import torch
    else:
        from tierstore.lazytorch import torch

``torch`` is then a stand-in module: its first attribute access imports the
real torch and copies its namespace in, so every later lookup is an ordinary
module attribute lookup (no per-call cost). :class:`LazyMapping` does the same
for a table built from torch (``codec.DTYPES``).
"""

from __future__ import annotations

import importlib
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

__all__ = ["LazyMapping", "loaded", "torch"]

K = TypeVar("K")
V = TypeVar("V")


class _LazyModule(types.ModuleType):
    """A module that imports ``name`` on first attribute access and then mirrors it."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__dict__["_lazy_real"] = None
        self.__dict__["_lazy_lock"] = threading.Lock()

    def _lazy_load(self) -> types.ModuleType:
        real = self.__dict__["_lazy_real"]
        if real is None:
            with self.__dict__["_lazy_lock"]:
                real = self.__dict__["_lazy_real"]
                if real is None:
                    real = importlib.import_module(self.__name__)
                    self.__dict__.update({k: v for k, v in real.__dict__.items() if not k.startswith("_lazy_")})
                    self.__dict__["_lazy_real"] = real
        return real

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_lazy_"):
            raise AttributeError(attr)
        return getattr(self._lazy_load(), attr)

    def __dir__(self) -> list[str]:
        return dir(self._lazy_load())

    def __repr__(self) -> str:
        state = "loaded" if self.__dict__["_lazy_real"] is not None else "not loaded yet"
        return f"<lazy module {self.__name__!r} ({state})>"


torch: Any = _LazyModule("torch")


def loaded() -> bool:
    """Whether something has used :data:`torch` yet (and so imported it)."""
    return torch.__dict__["_lazy_real"] is not None


class LazyMapping(Mapping[K, V], Generic[K, V]):
    """A read-only mapping built by ``build()`` on first use (a table made from torch)."""

    def __init__(self, build: Callable[[], Mapping[K, V]]) -> None:
        self._build = build
        self._table: Mapping[K, V] | None = None

    def _get(self) -> Mapping[K, V]:
        table = self._table
        if table is None:
            table = self._table = dict(self._build())
        return table

    def __getitem__(self, key: K) -> V:
        return self._get()[key]

    def get(self, key: K, default: Any = None) -> Any:
        return self._get().get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._get()

    def __iter__(self) -> Iterator[K]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __repr__(self) -> str:
        return repr(self._get()) if self._table is not None else "<LazyMapping (not built yet)>"
