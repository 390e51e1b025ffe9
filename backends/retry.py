"""How a tier that did not answer is asked again: one policy for every caller.

A :class:`~tierstore.errors.TierUnavailableError` (the tier or the index
unreachable, a throttled request, a timeout) says nothing about the data: a
blip. Migration, the read path, restore's verification and the commit
protocol's own calls ask again with exponential backoff before they give up;
what they conclude after the last try is "unknown", never "lost". The policy
comes from :class:`~tierstore.config.StoreConfig` (``migration_retries``,
``migration_backoff_s``, ``migration_backoff_max_s``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from tierstore.errors import TierUnavailableError

__all__ = ["RetryPolicy"]

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` more tries after the first, waiting ``backoff_s * 2**i`` (at most ``backoff_max_s``)."""

    retries: int = 5
    backoff_s: float = 0.05
    backoff_max_s: float = 5.0
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False, repr=False)

    def delays(self) -> Iterator[float]:
        """The pause before each retry, in order."""
        for attempt in range(self.retries):
            yield min(self.backoff_max_s, self.backoff_s * (2 ** attempt))

    def call(self, fn: Callable[[], T], *, on_retry: Callable[[int, float, Exception], None] | None = None) -> T:
        """``fn()``, asked again after each :class:`TierUnavailableError` while retries are left (then the
        last error is raised). ``on_retry(attempt, delay, error)`` is told of each retry."""
        delays = self.delays()
        attempt = 0
        while True:
            try:
                return fn()
            except TierUnavailableError as e:
                delay = next(delays, None)
                if delay is None:
                    raise
                attempt += 1
                if on_retry is not None:
                    on_retry(attempt, delay, e)
                self.sleep(delay)
