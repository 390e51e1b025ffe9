"""A picklable handle to a store: its configuration crosses process boundaries, the live store does not.

Used by the DCP writer and reader (:mod:`tierstore.interop.dcp_storage`), which
DCP's process-based ``async_save`` pickles into its checkpoint process.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Mapping
from typing import Any

from tierstore.config import StoreConfig
from tierstore.connect import open as open_store
from tierstore.errors import InvalidValueError, TierStoreError
from tierstore.store import TierStore

__all__ = ["StoreRef"]

log = logging.getLogger(__name__)

_OPENED: dict[Any, TierStore] = {}
_OPENED_LOCK = threading.Lock()


def _close_opened() -> None:
    with _OPENED_LOCK:
        stores = list(_OPENED.values())
        _OPENED.clear()
    for s in stores:
        try:
            s.close()
        except TierStoreError as e:
            log.warning("closing a store the DCP adapter opened: %s", e)


atexit.register(_close_opened)


class StoreRef:
    """How to reach a store: the live one where it was given, else opened once per process from its config.

    Pickles as the configuration only (a :class:`StoreConfig`, or a dict of
    :func:`tierstore.open` arguments), never the live store with its threads
    and connections; :meth:`get` in another process opens the store there,
    once per configuration, and keeps it open until that process exits.
    """

    def __init__(self, store: TierStore | StoreConfig | Mapping[str, Any] | None) -> None:
        self.live: TierStore | None = None
        self.spec: StoreConfig | dict[str, Any]
        if isinstance(store, TierStore):
            self.live, self.spec = store, store.config
        elif isinstance(store, StoreConfig):
            self.spec = store
        elif store is None or isinstance(store, Mapping):
            self.spec = dict(store or {})
        else:
            raise InvalidValueError(
                f"store must be a TierStore, a StoreConfig or a dict of tierstore.open() arguments, "
                f"got {type(store).__name__}")

    def get(self) -> TierStore:
        if self.live is not None:
            return self.live
        key = self.spec if isinstance(self.spec, StoreConfig) else tuple(sorted(
            (k, repr(v)) for k, v in self.spec.items()))
        with _OPENED_LOCK:
            store = _OPENED.get(key)
            if store is None:
                spec = self.spec
                store = open_store(config=spec) if isinstance(spec, StoreConfig) else open_store(**spec)
                _OPENED[key] = store
            self.live = store
            return store

    def __getstate__(self) -> dict:
        return {"spec": self.spec}  # configuration crosses the process boundary, never the live store

    def __setstate__(self, state: dict) -> None:
        self.live, self.spec = None, state["spec"]
