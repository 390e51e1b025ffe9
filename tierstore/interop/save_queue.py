"""The part of a framework's checkpoint saves after the snapshot, in the background: the commit wait, the pin,
the pointer, the collection. One thread runs them in order (a pointer is never written before an older one);
the next call that needs them (the next save, a load, a removal, the end of the run) waits, with a bound, and
raises the first error, typed. Used by the Lightning and Hugging Face integrations.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any

from tierstore.errors import CommitError

__all__ = ["SaveQueue"]


class SaveQueue:
    """Background parts of saves, run on one thread (named ``thread_name``) in the order submitted."""

    def __init__(self, thread_name: str) -> None:
        self._name = thread_name
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
        self._pending.append(self._pool.submit(fn, *args))

    def busy(self) -> bool:
        """Whether a part submitted is still running or queued."""
        return any(not f.done() for f in self._pending)

    def wait(self, bound_s: float) -> None:
        """Wait for every part submitted so far, each at most ``bound_s`` seconds.

        Raises:
            CommitError: a part did not finish within ``bound_s`` (the index or a tier is not answering).
            TierStoreError: the first error a part raised (a ``CommitError`` for a step that did not commit).
        """
        pending, self._pending = self._pending, []
        failed: BaseException | None = None
        for fut in pending:
            try:
                fut.result(timeout=bound_s)
            except FuturesTimeout:
                failed = failed or CommitError(f"a checkpoint save did not finish within {bound_s:.0f} s (the index "
                                               "or a tier is not answering)")
            except BaseException as e:  # noqa: BLE001 - raised once every part was waited for
                failed = failed or e
        if failed is not None:
            raise failed

    def close(self) -> None:
        """Stop the thread once its parts are done (waited for by :meth:`wait`, not here)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
