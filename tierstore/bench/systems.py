"""The System interface every benchmarked checkpointing system implements, and its registry.

Protocol, on every rank, in one process group (the harness barriers between
calls, never while a system's background work runs):

1. ``setup()`` once; it may allocate standing buffers (they count as extra
   host memory).
2. Per round: ``save(step)`` -> timings, then ``restore()`` where
   ``restores`` is true, then ``cleanup()`` (untimed: drops the files or keys
   this save produced).
3. ``teardown()`` once.

``save(step)`` is ``begin(step)`` (blocks until the snapshot is safe from the
next optimizer step: that is the *stall*) then ``finish()`` (blocks until the
background work, if any, is complete). The harness may call ``begin`` and then
run training steps while ``done()`` is false before ``finish()``; that is how
the training slowdown is measured. All times are seconds from the start of
``save``; ``committed_s`` and ``durable_s`` are None where the system has no
such level.

New systems register with ``@register("name")``; tierstore's own systems live
in other modules (:mod:`tierstore.bench.peers`, :mod:`tierstore.bench.tierstore_systems`), which import
this one; the harness imports them (:func:`tierstore.bench.harness.load_builtin`), never this module.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist

from tierstore.bench.workload import Workload, matmul_step

__all__ = [
    "SKIPPED",
    "SYSTEMS",
    "BenchContext",
    "LazySystem",
    "System",
    "SystemUnavailable",
    "register",
]


@dataclass
class BenchContext:
    """What a system gets from the harness.

    Attributes:
        rank: this rank; world: the number of ranks.
        work: the live model state of this rank (restore writes into it).
        shm_dir: a per-run directory under /dev/shm, shared by the ranks.
        disk_dir: a per-run directory on local disk, shared by the ranks.
        pg: a gloo process group reserved for the systems' own collectives
            (the harness barriers on the default group).
        options: free-form options from the command line.
        device: where the state lives (``"cpu"``, or ``"cuda"``: ``bench/gpu_check.sh``).
    """

    rank: int
    world: int
    work: Workload
    shm_dir: str
    disk_dir: str
    pg: Any = None
    options: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"

    @property
    def cuda(self) -> bool:
        return self.device != "cpu"

    def sync(self) -> None:
        """Wait for the device's queued work (a no-op on the CPU): timings end when the bytes moved."""
        if self.cuda:
            torch.cuda.synchronize()

    def sync_stream(self) -> None:
        """Wait for the trainer's stream only (a no-op on the CPU): what a training step itself waits for."""
        if self.cuda:
            torch.cuda.current_stream().synchronize()


class SystemUnavailable(Exception):
    """Raised by ``setup()`` when a system cannot run here; the harness skips it with the reason."""


class System:
    """One checkpointing system under test. Subclasses override the hooks.

    Class attributes:
        name: registry name (set by :func:`register`).
        kind: ``"bound"``, ``"peer"`` or ``"tierstore"`` (ratios use it).
        restores: whether ``restore()`` is measured.
        background: whether ``save`` has work after the stall (else the
            slowdown pass runs the whole save in a side thread).
        describe: one line for the report.
    """

    name: ClassVar[str] = "?"
    kind: ClassVar[str] = "peer"
    restores: ClassVar[bool] = True
    background: ClassVar[bool] = False
    describe: ClassVar[str] = ""

    def __init__(self, ctx: BenchContext) -> None:
        self.ctx = ctx

    def setup(self) -> None:
        """Allocate what the system keeps between saves."""

    def begin(self, step: int) -> dict[str, float]:
        """Start a save; return once the snapshot is safe. May return extra marks (perf_counter times)."""
        raise NotImplementedError

    def done(self) -> bool:
        """Whether the background work of the current save has finished."""
        return True

    def finish(self) -> dict[str, float | None]:
        """Block until the save is complete; return perf_counter times of
        ``complete`` and, where the system has them, ``committed`` and ``durable``."""
        t = time.perf_counter()
        return {"complete": t, "committed": None, "durable": None}

    def save(self, step: int) -> dict[str, float | None]:
        """Save ``step``; return ``stall_s``, ``complete_s``, ``committed_s``, ``durable_s`` (+ marks)."""
        t0 = time.perf_counter()
        marks = self.begin(step)
        t1 = time.perf_counter()
        events = self.finish()
        return timings(t0, t1, marks, events)

    def restore(self) -> None:
        """Load the last saved state back into ``ctx.work`` in place."""

    def verified(self) -> float | None:
        """After :meth:`restore`: block until what it loaded is verified; the ``perf_counter`` time it was.

        ``None``: the system verifies as it copies (or not at all): its restore time is all there is.
        """
        return None

    def extras(self) -> dict[str, Any]:
        """Extra figures for the report (measured once, outside the timed rounds)."""
        return {}

    def shm_bytes(self) -> int | None:
        """Bytes this system holds in /dev/shm now; None if it cannot tell (the harness uses statvfs)."""
        return 0

    def cleanup(self) -> None:
        """Drop the files or keys of the last save (untimed)."""

    def teardown(self) -> None:
        """Release everything."""


def timings(
    t0: float, t1: float, marks: dict[str, float], events: dict[str, float | None]
) -> dict[str, float | None]:
    """Turn perf_counter times into seconds from ``t0``."""

    def rel(v: float | None) -> float | None:
        return None if v is None else max(0.0, v - t0)

    out: dict[str, float | None] = {
        "stall_s": t1 - t0,
        "complete_s": rel(events.get("complete")),
        "committed_s": rel(events.get("committed")),
        "durable_s": rel(events.get("durable")),
    }
    for k, v in marks.items():
        out[f"{k}_s"] = rel(v)
    return out


class LazySystem(System):
    """A system whose save overlaps the next forward/backward (lazy snapshot, "zero-overhead" checkpointing).

    ``save(step)`` runs what a training loop does between two updates:
    ``start(step)`` (the save call; returns early), the stand-in
    forward/backward (``fwd_bwd_steps`` matmul steps of ``matmul_n``, agreed
    across ranks in :meth:`setup_window`), then ``before_update()`` (blocks
    until the snapshot is safe from the update). The *stall* is every moment
    the trainer is blocked: the time in ``start`` plus the time in
    ``before_update``. Marks: ``returns`` (``start`` done), ``fwd_bwd`` (the
    stand-in step's seconds, slowed by the copy running beside it) and
    ``update_wait``. In the slowdown pass ``begin`` is ``start`` alone: the
    training steps then run while the copy and the rest run. On CUDA the
    stand-in runs on the GPU, and the trainer's stream (not the device) is
    synchronised after it and after ``before_update()``: copies on a side
    stream overlap the stand-in, and a copy the update's stream was ordered
    after (an event, no host block) counts in the wait, as it would delay the
    real update.
    """

    background = True
    fwd_bwd_steps = 0

    def setup_window(self) -> None:
        """Calibrate the stand-in forward/backward to ``options["fwd_bwd_s"]`` seconds idle (same count on every rank)."""
        seconds = float(self.ctx.options.get("fwd_bwd_s", 0.5))
        n = int(self.ctx.options.get("matmul_n", 512))
        for _ in range(3):
            matmul_step(n)
        one = statistics.median(matmul_step(n) for _ in range(15))
        count = torch.tensor([max(1, round(seconds / max(one, 1e-6)))], dtype=torch.int64)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.ctx.pg)
        self.fwd_bwd_steps = int(count.item())
        self.matmul_n = n

    def start(self, step: int) -> None:
        """The save call of the training loop (returns before the snapshot is safe)."""
        raise NotImplementedError

    def before_update(self) -> None:
        """Block until the snapshot is safe from the next optimizer update."""
        raise NotImplementedError

    def begin(self, step: int) -> dict[str, float]:
        self.start(step)
        return {}

    def save(self, step: int) -> dict[str, float | None]:
        t0 = time.perf_counter()
        self.start(step)
        t_ret = time.perf_counter()
        for _ in range(self.fwd_bwd_steps):
            matmul_step(self.matmul_n)
        self.ctx.sync_stream()
        t_fb = time.perf_counter()
        self.before_update()
        self.ctx.sync_stream()  # the update's stream: it waits for the copies it was ordered after
        t_safe = time.perf_counter()
        events = self.finish()
        out = timings(t0, t_ret, {}, events)
        out["stall_s"] = (t_ret - t0) + (t_safe - t_fb)
        out["returns_s"] = t_ret - t0
        out["fwd_bwd_s"] = t_fb - t_ret
        out["update_wait_s"] = t_safe - t_fb
        return out

    def extras(self) -> dict[str, Any]:
        return {"fwd_bwd_steps": self.fwd_bwd_steps, "fwd_bwd_target_s": self.ctx.options.get("fwd_bwd_s")}


SYSTEMS: dict[str, type[System]] = {}
SKIPPED: dict[str, str] = {}

S = TypeVar("S", bound=type[System])


def register(name: str) -> Callable[[S], S]:
    """Class decorator: add a System to :data:`SYSTEMS` under ``name``."""

    def deco(cls: S) -> S:
        cls.name = name
        SYSTEMS[name] = cls
        return cls

    return deco


def barrier() -> None:
    """Barrier on the default group (a no-op without one)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
