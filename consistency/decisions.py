"""A process's ear on a model's decisions: the ``ts:{model}:decided`` channel, shared by its threads.

Who calls what: :class:`~consistency.twophase.StepProtocol` keeps one
:class:`DecisionListener` per model (created on the first vote or wait, so it
is subscribed *before* the vote is sent). The VOTE script answers a vote with
the step's state and its attempt's start time; a vote left ``preparing``
notes that start time here (:meth:`DecisionListener.expect`), and
:meth:`StepProtocol.wait` then waits for the decision of exactly that attempt
(:meth:`DecisionListener.await_decision`) without reading the state again:
one round trip per vote, then one pushed message. A decision names its
attempt (``"<step> <state> <started>"``), so the decision of an older attempt
of the same step number (aborted, then begun again by a newer epoch; or
dropped and begun again) is never taken for this one.

One thread at a time reads the subscription; the others wait on a condition
and are woken by each message it records. Decisions are kept for the last
:data:`KEEP` (step, attempt) pairs.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from typing import Any

from consistency.client import _s, translate_redis_errors

__all__ = ["KEEP", "DecisionListener"]

KEEP = 4096
DECIDED = ("committed", "aborted", "durable")


class DecisionListener:
    """The decisions of one model, heard on its ``decided`` channel (see the module docstring)."""

    def __init__(self, index: Any, channel: str, what: str) -> None:
        self._url = index.url
        self._what = what
        with translate_redis_errors(f"subscribe to the decisions of {what}", self._url):
            self._p = index._r.pubsub()
            self._p.subscribe(channel)
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline:  # confirmed before any vote is sent: no decision is missed
                msg = self._p.get_message(timeout=max(0.0, deadline - time.monotonic()))
                if msg is not None and msg.get("type") == "subscribe":
                    break
            self._p.ignore_subscribe_messages = True
        self._cond = threading.Condition()
        self._reading = False
        self._seen: OrderedDict[tuple[int, str], str] = OrderedDict()
        self._expected: OrderedDict[tuple[str, int], str] = OrderedDict()
        self.broken = False

    def expect(self, model: str, step: int, started: str) -> None:
        """Note that a vote left ``step`` preparing in the attempt that started at ``started``."""
        with self._cond:
            self._expected[(model, step)] = started
            while len(self._expected) > KEEP:
                self._expected.popitem(last=False)

    def expected(self, model: str, step: int) -> str | None:
        """The attempt a vote of this process left ``step`` preparing in (``None``: no vote heard of)."""
        with self._cond:
            return self._expected.get((model, step))

    def heard(self, step: int, started: str) -> str | None:
        """The decision of ``step``'s attempt ``started`` heard so far, what has arrived read (``None``: none yet)."""
        with self._cond:
            if not self._reading:
                while True:
                    msg = self._read(0.0)
                    if msg is None:
                        break
                    self._record(msg)
            return self._seen.get((step, started))

    def await_decision(self, step: int, started: str, timeout: float) -> str | None:
        """The decision of ``step``'s attempt ``started`` if it comes within ``timeout`` seconds, else ``None``.

        Raises:
            TierUnavailableError: the subscription broke (the listener is then ``broken``: make a new one).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                got = self._seen.get((step, started))
                if got is not None:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                if self._reading:
                    self._cond.wait(left)
                    continue
                self._reading = True
                self._cond.release()
                try:
                    msg = self._read(left)
                finally:
                    self._cond.acquire()
                    self._reading = False
                    self._cond.notify_all()
                if msg is not None:
                    self._record(msg)

    def _read(self, timeout: float) -> Any:
        try:
            with translate_redis_errors(f"decisions of {self._what}", self._url):
                return self._p.get_message(timeout=timeout)
        except BaseException:
            self.broken = True
            raise

    def _record(self, msg: dict) -> None:
        parts = _s(msg.get("data")).split()
        if len(parts) == 3 and parts[0].isdigit() and parts[1] in DECIDED:
            self._seen[(int(parts[0]), parts[2])] = parts[1]
            while len(self._seen) > KEEP:
                self._seen.popitem(last=False)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing a broken subscription
            self._p.close()
