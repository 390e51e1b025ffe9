"""Holding Python's cyclic garbage collector off while a save copies: the one owner of that policy.

A save of a model of a thousand parameters allocates some 30,000 small
container objects (keys, plans, views, records) on the training thread. Each
allocation counts towards the collector's thresholds, so such a save ran
about 45 young and 4 middle collections, and a full one every third save. A
full collection walks every object of the process: about 390,000 once torch
and tierstore are imported, more in a real trainer. Measured on the
Checkpointer at 1,000 parameters (0.25 GiB, eager): 262 ms per ``save()``
with the collector running, 142 ms with it held off for the call
(docs/benchmarks.md, "Garbage collections inside a save").

:func:`held` disables the automatic collector for the duration of a block and
enables it again after, if it was enabled when the first holder came in. The
objects the block allocates are reference-counted as usual; only cycles wait,
for at most the block's duration, and the collector's next automatic pass
(at the next allocation past its threshold) finds them. Holds nest and may
come from several threads at once: the collector comes back when the last
holder leaves. A program that calls ``gc.disable()`` itself while a hold is
in force has it undone when the hold ends; one that disabled it before keeps
it disabled. A child forked while a hold is in force (by another thread)
holds nothing: it starts with the collector as it was before the hold, and a
fresh lock. Megatron-LM's ``--manual-gc`` takes the same view of automatic
collections during the latency-critical part of a step.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["held"]

_lock = threading.Lock()
_holders = 0
_ours = False  # the collector was enabled when the first holder came in: the last one enables it again


def _after_fork_in_child() -> None:
    """The holders were threads of the parent: none of them will leave in the child."""
    global _lock, _holders, _ours
    _lock = threading.Lock()
    if _holders and _ours:
        gc.enable()
    _holders, _ours = 0, False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextmanager
def held(enabled: bool = True) -> Iterator[None]:
    """Hold the cyclic collector off for the block (a no-op with ``enabled`` false)."""
    global _holders, _ours
    if not enabled:
        yield
        return
    with _lock:
        if _holders == 0:
            _ours = gc.isenabled()
            if _ours:
                gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _ours:
                _ours = False
                gc.enable()
