"""What peers send the node agent unasked: dropped at once, charged to the peer where it can be traced, logged.

Protocol: :class:`tierstore.agent.server.Agent` creates one :class:`Unasked`,
calls :meth:`Unasked.start` once its listener exists, :meth:`departed` when
a connection ends and :meth:`stop` on shutdown; each connection opens its
stream sink with :meth:`open_sink` and closes it with :meth:`close_sink`.
:meth:`start` installs the drain of UCX's unexpected queue after every
progress step of the worker (:meth:`backends.ucx_server.UnexpectedDrain.install`;
the sinks are polled after each ``progress()``, at most 16 steps) and a
timer task that drains and polls again every ``sweep_interval_s`` (the only
drain where ucxx runs its own progress thread) and reports every
``report_interval_s``.

Tracing: a tag message's tag carries a session's tag base
(:func:`backends.agent_protocol.session_base`); when that session is live
the message is charged to its connection (:meth:`Connection.charge
<tierstore.agent.conn.Connection.charge>`), which closes itself past
``max_peer_unexpected_bytes``. A tag under no live session's base cannot be
traced to a sender (UCX's tag matching is per worker and tells only the tag
and the length): it is dropped and counted as ``untraced_messages``; the
bound on those is the drain's, one progress step's worth at a time.

Returning memory: UCX and ucxx free what a flood or a departed connection
held into the C heap, which keeps it (RSS stays up) until trimmed; the first
report tick without drops after drops or departures hands the heap's free
pages back (glibc's ``malloc_trim``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from backends import agent_protocol as P
from backends.ucx_server import StreamSink, UnexpectedDrain
from tierstore.agent.base import AgentHost, log

__all__ = ["UNEXPECTED_MESSAGE_COST", "Unasked", "trim_heap"]

#: what one unexpected tag message costs its peer's budget besides its length (UCX's descriptor and bookkeeping)
UNEXPECTED_MESSAGE_COST = 256

STATS = ("dropped_messages", "dropped_bytes", "untraced_messages", "stream_bytes", "abusive_closed")


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere nothing)."""
    try:
        import ctypes  # lazy: only after a flood or departures

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Unasked:
    """The agent's drain, accounting and reports of what peers send unasked (see the module docstring).

    Counters live in the agent's ``stats`` (:data:`STATS`).
    """

    def __init__(self, agent: AgentHost) -> None:
        self.agent = agent
        self.config = agent.config
        for name in STATS:
            agent.stats.setdefault(name, 0)
        self.drain: UnexpectedDrain | None = None
        self._sinks: set[StreamSink] = set()
        self.on_every_step = False  # the drain runs after every progress step (not only on the timer)
        self._task: asyncio.Task | None = None
        self._reported = {name: 0 for name in STATS}
        self._reported_at = time.monotonic()
        self._freed = False  # memory may have been freed since the heap was last trimmed

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.drain = UnexpectedDrain(self.charge_tag)
        why = self.drain.install(loop, self.poll_sinks)
        self.on_every_step = why is None
        if why is not None:
            log.warning("unexpected tag messages are dropped every %ss only, not after every progress step: %s",
                        self.config.sweep_interval_s, why)
        self._reported_at = time.monotonic()
        self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def departed(self) -> None:
        """A connection ended: what it held may be back in the heap."""
        self._freed = True

    def charge_tag(self, tag: int, length: int) -> None:
        """One dropped tag message: charge the session its tag names, if one is live."""
        stats = self.agent.stats
        stats["dropped_messages"] += 1
        stats["dropped_bytes"] += length
        self._freed = True
        conn = self.agent.session(P.session_base(tag))
        if conn is None:
            stats["untraced_messages"] += 1
        else:
            conn.charge(length + UNEXPECTED_MESSAGE_COST, "tag messages no receive was posted for")

    def open_sink(self, ep: Any, on_data: Callable[[int], None]) -> StreamSink:
        """A :class:`~backends.ucx_server.StreamSink` on ``ep``, polled until :meth:`close_sink`."""
        sink = StreamSink(ep, on_data)
        self._sinks.add(sink)
        return sink

    def close_sink(self, sink: StreamSink) -> None:
        self._sinks.discard(sink)
        sink.close()

    def poll_sinks(self) -> None:
        for sink in tuple(self._sinks):  # a poll may close its connection, and with it the sink
            sink.poll()

    async def _run(self) -> None:
        sweep = self.config.sweep_interval_s
        period = min(sweep, self.config.report_interval_s) if sweep > 0 else self.config.report_interval_s
        while True:
            await asyncio.sleep(period)
            if sweep > 0 and self.drain is not None:
                self.drain.drain()
                self.poll_sinks()
            self.report()

    def report(self, now: float | None = None) -> None:
        """Log what was dropped since the last report (once per ``report_interval_s`` at most); trim when quiet.

        ``now``: the ``time.monotonic()`` reading to use (tests pass their own clock).
        """
        now = time.monotonic() if now is None else now
        if now - self._reported_at < self.config.report_interval_s:
            return
        stats = self.agent.stats
        new = {name: stats[name] - self._reported[name] for name in STATS}
        if new["dropped_messages"] or new["stream_bytes"]:
            log.warning("dropped %d tag messages (%d bytes; %d under no live session's tags, which cannot be traced "
                        "to a peer) and %d stream bytes nobody asked for in the last %.0fs; %d connections closed "
                        "for it", new["dropped_messages"], new["dropped_bytes"], new["untraced_messages"],
                        new["stream_bytes"], now - self._reported_at, new["abusive_closed"])
        elif self._freed:
            self._freed = False
            trim_heap()
        self._reported = {name: stats[name] for name in STATS}
        self._reported_at = now
