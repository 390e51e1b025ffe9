"""Background threads run at a lower CPU priority than the trainer.

The store's background work (migration to the durable tier, replication to
peers, sealing and publishing snapshots handed to :meth:`TierStore.finish_async`)
competes with the training loop for the same cores; on a node where the ranks
already use every core, it must yield to them. Each such thread lowers its own
priority once, when it starts, by ``StoreConfig.background_nice``.

Linux sets a nice value per thread (``setpriority(PRIO_PROCESS, tid, ...)``
with the thread's native id), so the trainer's threads keep theirs. Elsewhere
the call would renice the whole process, so it is skipped. Raising a priority
back needs privileges, so a thread is only ever made nicer.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

__all__ = ["lower_priority", "thread_nice"]

log = logging.getLogger(__name__)

_MAX_NICE = 19


def thread_nice(native_id: int | None = None) -> int | None:
    """The nice value of a thread of this process (default: the calling one); ``None`` off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id() if native_id is None else native_id)


def lower_priority(increment: int) -> int | None:
    """Make the calling thread ``increment`` nicer (at most 19); return its nice value, ``None`` if unchanged.

    Only the calling thread changes (Linux); threads it starts later inherit
    the value. Errors are logged, never raised: priority is an optimisation.
    """
    if increment <= 0 or not sys.platform.startswith("linux"):
        return None
    tid = threading.get_native_id()
    try:
        target = min(_MAX_NICE, os.getpriority(os.PRIO_PROCESS, tid) + increment)
        os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError as e:
        log.debug("could not lower the priority of thread %s: %s", tid, e)
        return None
    return target
