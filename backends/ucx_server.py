"""What a process that serves peers over UCX (the node agent) does about messages nobody asked for.

A UCX worker keeps what a peer sends without a matching receive: tag
messages in the worker's unexpected queue (an eager message with a copy of
its data, a descriptor of up to a segment, about 8 KiB, per message), stream
bytes in the endpoint's stream queue, and ucxx keeps active messages in a
per-endpoint pool (which it never frees when the endpoint goes). UCX's
memory pools only grow: what a flood made them allocate stays allocated
after the peer left. So such a process must never let any of these queues
fill, rather than empty them now and then. This module holds the calls,
below ucxx's public API, that do it:

* :func:`init_server_context` creates the process's ucxx context without
  UCX's active-message feature: an active message is then dropped by the
  transport as it arrives (UCX warns for each, which is why a server imports
  ucxx with :data:`backends.ucx_util.UCX_SERVER_ENV_DEFAULTS`), never stored.
* :class:`UnexpectedDrain` receives and drops every tag message no receive
  is posted for, and :meth:`UnexpectedDrain.install` makes it run right
  after *every* ``ucp_worker_progress`` of the worker (the unit in which UCX
  reads from its transports), so the unexpected queue never holds more than
  one progress step's worth of messages: at most ``UCX_TCP_MAX_POLL``
  (16) reads of ``UCX_TCP_RX_SEG_SIZE`` (64 KiB) over TCP (measured: at most
  15 messages of 4 KiB, or about 1300 empty ones, per step from one flooding
  peer), 16 FIFO elements over shared memory. A flood faster than the drain
  is held back by the
  transport itself (the agent reads a socket again only once it has
  drained), not buffered.
* :class:`StreamSink` keeps one stream receive posted on an endpoint, so
  stream bytes a peer sends after ucxx's handshake land in one fixed buffer
  and are counted, never queued.

Only for a process whose own receives are all posted before their messages
can arrive (the agent posts each receive before it sends what makes the peer
send, see :func:`backends.ucx_util.post_recv`): anything else in the queue is
taken for junk. Call everything here on the thread that runs the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from backends.ucx_util import import_ucxx

__all__ = ["StreamSink", "UnexpectedDrain", "init_server_context"]

log = logging.getLogger("tierstore.ucx")

_SCRATCH = bytearray(1)  # where drained tag messages are received (truncated): never read
_orphans: list[tuple[Any, ...]] = []  # requests still posted whose owner is gone, with the buffers UCX writes into


def _reap() -> None:
    """Forget the orphaned requests that completed (or were cancelled)."""
    if _orphans:
        _orphans[:] = [o for o in _orphans if not o[0].completed]


def init_server_context() -> str | None:
    """Create this process's ucxx context for serving: tags, streams, RMA and wakeup, no active messages.

    Call inside the event loop that will serve (ucxx binds its progress to
    the loop that creates the context), after ``import_ucxx(server=True)``
    and before any other ucxx call of the process. Returns ``None`` when done, or why the process runs on ucxx's
    default context instead (one existed already, or this ucxx's internals
    differ); active messages are then accepted (and pooled by ucxx), so the
    caller should warn.
    """
    ucxx = import_ucxx(server=True)
    try:
        from ucxx._lib_async import application_context as ac  # lazy: optional dependency

        core = ucxx.core
        if core._ctx is not None:
            return "the process's ucxx context exists already"
        api = ac.ucx_api
        feature = api.Feature
        flags = (feature.TAG, feature.WAKEUP, feature.STREAM, feature.RMA)
    except AttributeError as e:
        return f"this ucxx has other internals ({e})"

    class _Api:  # ucxx's module as ApplicationContext sees it, with the context's features chosen here
        def __getattr__(self, name: str) -> Any:
            return getattr(api, name)

        @staticmethod
        def UCXContext(config_dict: Any = None) -> Any:  # stands in for the class of that name
            return api.UCXContext(config_dict or {}, feature_flags=flags)

    ac.ucx_api = _Api()
    try:
        core._ctx = ac.ApplicationContext()
    finally:
        ac.ucx_api = api
    return None


class UnexpectedDrain:
    """Receives and drops the tag messages that wait in the worker's unexpected queue.

    Each is received, truncated, into a one-byte scratch buffer: an eager
    message's descriptor goes back to UCX's pool at once, a rendezvous
    message's data is never transferred (its sender completes). ``account``
    is called with each message's tag and length, so the caller can charge
    the peer whose session the tag names.

    Args:
        account: called as ``account(tag, length)`` for each message dropped.
        limit: the most messages one :meth:`drain` takes (one progress step holds far fewer).
    """

    def __init__(self, account: Callable[[int, int], None] | None = None, *, limit: int = 1 << 20) -> None:
        import_ucxx()
        from ucxx._lib.arr import Array  # lazy: optional dependency
        from ucxx.types import Tag, TagMask

        self._array = Array
        self._any_tag, self._any_mask = Tag(0), TagMask(0)
        self.account = account
        self.limit = limit
        self.messages = 0
        self.bytes = 0
        self._pending: list[Any] = []  # truncated receives not complete yet (rendezvous), with their buffers
        self._worker: Any = None

    def drain(self) -> tuple[int, int]:
        """Drop every message in the unexpected queue now; return (messages, bytes) dropped."""
        worker = self._worker
        if worker is None:
            worker = self._worker = import_ucxx().core._get_ctx().worker
        if self._pending:
            self._pending = [p for p in self._pending if not p[0].completed]
        _reap()
        n = nbytes = 0
        account = self.account
        while n < self.limit:
            probe = worker.tag_probe(self._any_tag, self._any_mask, remove=True)
            if not probe.matched:
                break
            n += 1
            nbytes += probe.length
            arr = self._array(_SCRATCH)
            req = worker.tag_recv_with_handle(arr, probe)
            if not req.completed:
                self._pending.append((req, arr))  # UCX writes through arr's pointer until it completes
            if account is not None:
                account(probe.sender_tag.value, probe.length)
        self.messages += n
        self.bytes += nbytes
        return n, nbytes

    @property
    def pending(self) -> int:
        """Truncated receives still running (rendezvous messages whose sender has not been answered yet)."""
        return len(self._pending)

    def install(self, loop: asyncio.AbstractEventLoop, after: Callable[[], object] | None = None, *,
                rounds: int = 16) -> str | None:
        """Drain after every ``ucp_worker_progress`` that ucxx's progress of ``loop`` makes.

        ucxx's blocking and polling progress modes call the worker's
        ``progress()`` (which loops ``ucp_worker_progress`` until nothing
        happens); it is replaced by at most ``rounds`` single steps, each
        followed by :meth:`drain`, then ucxx's cancellation of the requests
        of closed endpoints, a last drain and ``after`` (the agent polls its
        stream sinks there: once per call, not per step, as their cost grows
        with the connections). A call that used all its rounds returns with
        work left; ucxx's loop calls again after one pass of the event loop
        (the worker refuses to arm while events are pending), so the
        agent's coroutines run during a flood. Returns ``None`` when
        installed, or why not (ucxx's progress thread mode, other
        internals): the caller should then drain on a timer.
        """
        ucxx = import_ucxx()
        try:
            from ucxx._lib_async import application_context as ac  # lazy: optional dependency

            ucxx.core._get_ctx().continuous_ucx_progress(loop)
            task = ac.ProgressTasks[loop]
            worker = task.worker
        except (AttributeError, KeyError) as e:
            return f"this ucxx has other internals ({type(e).__name__}: {e})"
        if isinstance(worker, _DrainingWorker):
            return None
        if not hasattr(worker, "progress_once") or type(task).__name__ not in ("BlockingMode", "PollingMode"):
            return (f"ucxx progresses in {type(task).__name__} (UCXPY_PROGRESS_MODE=blocking or polling drains "
                    "on every progress step)")
        task.worker = _DrainingWorker(worker, self.drain, after, rounds)
        return None


class _DrainingWorker:
    """ucxx's worker as its progress task sees it: ``progress()`` drains after each step (see ``install``)."""

    def __init__(self, worker: Any, drain: Callable[[], object], after: Callable[[], object] | None,
                 rounds: int) -> None:
        self._worker = worker
        self._drain = drain
        self._after = after
        self._rounds = max(1, rounds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._worker, name)

    def _settle(self, *, last: bool) -> None:
        try:
            self._drain()
            if last and self._after is not None:
                self._after()
        except Exception:  # never let accounting stop the worker's progress
            log.exception("draining after a progress step failed")

    def progress(self) -> bool:
        worker = self._worker
        busy = False
        for _ in range(self._rounds):
            if not worker.progress_once():
                break
            busy = True
            self._settle(last=False)
        # requests of endpoints closed since (ucxx's own progress() does this after its loop); their
        # completions run in the next step
        if worker.cancel_inflight_requests():
            worker.progress_once()
        self._settle(last=True)
        return busy


class StreamSink:
    """One stream receive kept posted on an endpoint: stream bytes land in one buffer and are counted.

    ucxx exchanges its peer information over the stream API when an
    endpoint is created; after that the agent's protocol never uses streams,
    so every stream byte is junk. Without a posted receive UCX would queue
    it per endpoint. :meth:`poll` (called after each ``progress()`` of the
    worker, at most 16 steps of at most 64 KiB per socket over TCP) takes
    completed receives, counts their bytes and posts the next, up to 64 at
    a time; ``on_data`` is called with the count. :meth:`close` stops
    counting (aborting the endpoint cancels the receive).

    Args:
        ep: the ``ucxx`` endpoint (its ``_ep`` posts the receive).
        on_data: called as ``on_data(nbytes)`` for each buffer filled.
        size: the buffer's size.
    """

    def __init__(self, ep: Any, on_data: Callable[[int], None], *, size: int = 16 << 10) -> None:
        from ucxx._lib.arr import Array  # lazy: optional dependency

        self._ep = ep
        self._on_data = on_data
        self._buf = bytearray(size)
        self._arr = Array(self._buf)
        self.bytes = 0
        self._req: Any = None
        self._post()

    def _post(self) -> None:
        inner = self._ep._ep
        self._req = None if inner is None else inner.stream_recv(self._arr)

    def poll(self) -> None:
        """Count every filled buffer (each posts the next; queued bytes complete it at once)."""
        for _ in range(64):
            req = self._req
            if req is None or not req.completed:
                return
            try:
                req.check_error()
            except Exception:  # noqa: BLE001 - cancelled or the endpoint failed: the connection is going
                self._req = None
                return
            self.bytes += len(self._buf)
            self._on_data(len(self._buf))
            if self._req is None:  # on_data closed it
                return
            self._post()

    def close(self) -> None:
        """Stop counting; the buffer lives on until UCX is done with the receive (aborting the endpoint cancels it)."""
        req, self._req = self._req, None
        if req is not None and not req.completed:
            _orphans.append((req, self._arr, self._buf))
