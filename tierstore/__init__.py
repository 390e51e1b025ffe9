"""tierstore: a tiered, versioned key-value checkpoint store for distributed LLM training.

Quick start::

    import tierstore, torch
    store = tierstore.open()                      # embedded default, no set-up
    key = tierstore.ShardKey("gpt", "block0", step=10, rank=0)
    store.put(key, {"w": torch.randn(4, 4)})
    shard = store.get(key)

Heavy modules are imported lazily, so ``import tierstore`` stays cheap and the
leaf modules (:mod:`tierstore.errors`, :mod:`tierstore.keys`) can be used by
every layer without import cycles.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from tierstore.errors import *  # noqa: F401,F403
from tierstore.errors import __all__ as _errors_all
from tierstore.keys import ShardKey

__version__ = "0.1.0"

_LAZY = {
    "open": ("tierstore.connect", "open"),
    "TierStore": ("tierstore.store", "TierStore"),
    "StoreConfig": ("tierstore.config", "StoreConfig"),
    "Shard": ("tierstore.codec", "Shard"),
    "Checkpointer": ("tierstore.train.checkpointer", "Checkpointer"),
}

__all__ = ["ShardKey", "__version__", *_errors_all, *_LAZY]


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'tierstore' has no attribute {name!r}") from None
    value = getattr(import_module(module), attr)
    globals()[name] = value
    return value
