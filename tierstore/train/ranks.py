"""Who the ranks are, which incarnation of the job they belong to, and whether they all save.

One :class:`Ranks` per Checkpointer holds:

* **rank and world size**: the arguments, else ``torch.distributed`` when
  initialised, else the launcher's ``RANK``/``WORLD_SIZE`` (:func:`rank_from_env`,
  the one place that reads them), else 0 and 1;
* **the group** for the Checkpointer's own collectives: with
  ``torch.distributed`` up and more than one rank, ``group`` or a gloo group
  made by ``dist.new_group`` in the constructor (itself a collective: every
  rank constructs its Checkpointer). ``world_size=1`` is **rank-local**: no
  group, no collective, whatever ``torch.distributed`` says, so one rank can
  save alone (Lightning's rank-0-only ``save_checkpoint``, ``is_global_zero``).
  A group the constructor made is this object's: :meth:`close` (the
  Checkpointer's ``close``) destroys it, so a Checkpointer rebuilt between
  saves (Lightning's, when the state's objects change) does not leak one
  group (its sockets) per rebuild. A group the caller gave is never destroyed;
* **the incarnation**: a token and the model's epoch as seen at construction
  (``base``), agreed by a broadcast from rank 0 at construction. Writers
  :meth:`join` the incarnation's epoch (``StepProtocol.join_epoch``): the
  first rank to join raises the model's epoch and the others get the same
  one, with no collective, so writes and votes of any older incarnation are
  fenced. Without ``torch.distributed`` and with one rank the token is local;
  with several ranks it comes from torchrun (``TORCHELASTIC_RUN_ID`` and
  ``TORCHELASTIC_RESTART_COUNT``); with neither there is no epoch (no fencing),
  and a warning says so;
* **verdicts**: :meth:`gather` gives every rank each rank's ``(rank, value,
  reason)`` (a restore's agreement, :mod:`tierstore.train.restoring`);
* **progress**: each rank records the step it began saving
  (``StepProtocol.note_progress``); :meth:`missing` names the ranks of this
  incarnation that have not begun a step, and :meth:`await_ranks` waits for
  them for at most ``grace`` seconds before a collective, raising
  :class:`~tierstore.errors.CommitError` with ``missing_ranks`` instead of
  hanging in the collective.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tierstore.errors import CommitError

__all__ = ["Ranks", "rank_from_env"]

log = logging.getLogger(__name__)


def rank_from_env(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(RANK, WORLD_SIZE)`` from ``env`` (default ``os.environ``), else ``(0, 1)``."""
    env = os.environ if env is None else env
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))


class Ranks:
    """Rank discovery, the incarnation's epoch and rank progress; see the module docstring.

    Args:
        store: the open store (its ``steps`` protocol is used).
        model: the model name.
        rank, world_size: override the discovery.
        group: the gloo group for collectives (default: a new one, destroyed by :meth:`close`; one given
            here is never destroyed).
        timeout: seconds a collective of the new group may take.
        grace: seconds to wait for ranks that have not begun a step.
    """

    def __init__(self, store: Any, model: str, rank: int | None = None, world_size: int | None = None,
                 group: Any = None, *, timeout: float = 120.0, grace: float = 30.0,
                 env: Mapping[str, str] | None = None) -> None:
        self.store = store
        self.model = model
        self.grace = grace
        dist_on = dist.is_available() and dist.is_initialized()
        env_rank, env_world = rank_from_env(env) if not dist_on else (0, 1)
        self.rank = rank if rank is not None else (dist.get_rank() if dist_on else env_rank)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if dist_on else env_world)
        self.group = None
        self._owned: Any = None  # the group the constructor made (close destroys it); never the caller's
        if dist_on and dist.get_world_size() > 1 and self.world_size > 1:  # world_size 1: rank-local, no collective
            if group is None:
                self.group = self._owned = dist.new_group(backend="gloo",
                                                          timeout=timedelta(seconds=max(timeout, 30.0)))
            else:
                self.group = group
        self.token: str | None
        self.base: int
        if self.group is not None:
            t = torch.zeros(2, dtype=torch.int64)
            try:
                if dist.get_rank(self.group) == 0:
                    t[0], t[1] = secrets.randbits(62), store.index.epoch(model)
                dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
            except BaseException:
                self.close()
                raise
            self.token, self.base = f"{int(t[0]):x}", int(t[1])
        elif self.world_size == 1:
            self.token, self.base = f"{secrets.randbits(62):x}", store.index.epoch(model)
        else:
            e = os.environ if env is None else env
            run = e.get("TORCHELASTIC_RUN_ID")
            self.token = f"{run}:{e.get('TORCHELASTIC_RESTART_COUNT', '0')}" if run else None
            self.base = -1
            if self.token is None:
                log.warning("%s: %d ranks without torch.distributed or torchrun: no epoch, zombies are not fenced",
                            model, self.world_size)

    def close(self) -> None:
        """Destroy the group the constructor made (``torch.distributed.destroy_process_group``); idempotent.

        Local and bounded: destroying a gloo group other than the default one sends nothing to the other
        ranks and waits for none of its work (a collective still in flight fails by its own timeout), and no
        hook is ever registered on this group, so nothing is waited for. A group the caller gave is left
        alone; so is one ``torch.distributed`` no longer knows (the default group, and with it every group,
        was destroyed first). Never raises: a failure is logged. Collectives after it fail.
        """
        pg, self._owned = self._owned, None
        if pg is None or not dist.is_initialized():
            return
        try:
            dist.destroy_process_group(pg)
        except ValueError:  # not a live group any more (destroyed with the default group, or by its holder)
            log.debug("%s: the Checkpointer's gloo group was already destroyed", self.model)
        except Exception as e:  # noqa: BLE001 - a release that failed must not fail the close
            log.warning("%s: destroying the Checkpointer's gloo group failed: %s: %s", self.model,
                        type(e).__name__, e)

    @property
    def owns_group(self) -> bool:
        """The group is one the constructor made and :meth:`close` has not destroyed yet."""
        return self._owned is not None

    # ---- epochs -------------------------------------------------------------------------------
    def join(self) -> int | None:
        """The incarnation's epoch, raising the model's on the first join (``None``: no fencing).

        Raises:
            FencedError: a newer incarnation took over.
        """
        if self.token is None:
            return None
        return self.store.steps.join_epoch(self.model, self.token, self.base)

    # ---- collectives --------------------------------------------------------------------------
    def all_min(self, value: int) -> int:
        """The minimum of ``value`` over the group (``value`` itself without one). Collective."""
        if self.group is None:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t[0])

    def all_max_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place elementwise maximum of ``t`` over the group. Collective."""
        if self.group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def gather(self, value: int, reason: str = "") -> list[tuple[int, int, str]]:
        """Every rank's ``(rank, value, reason)``, in the group's order (this rank's alone without one). Collective.

        One ``all_gather`` of three integers per rank; a second one of the reasons' UTF-8 bytes (each padded to
        the longest) only where some rank gave a reason, so a verdict every rank passed costs one small
        collective. Nothing is pickled.
        """
        raw = reason.encode("utf-8", "replace")
        if self.group is None:
            return [(self.rank, value, reason)]
        n = dist.get_world_size(self.group)
        head = torch.tensor([value, self.rank, len(raw)], dtype=torch.int64)
        heads = [torch.empty_like(head) for _ in range(n)]
        dist.all_gather(heads, head, group=self.group)
        longest = max(int(h[2]) for h in heads)
        texts = [""] * n
        if longest:
            buf = torch.zeros(longest, dtype=torch.uint8)
            if raw:
                buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            bufs = [torch.empty_like(buf) for _ in range(n)]
            dist.all_gather(bufs, buf, group=self.group)
            texts = [b[:int(h[2])].numpy().tobytes().decode("utf-8", "replace") for h, b in zip(heads, bufs)]
        return [(int(h[1]), int(h[0]), t) for h, t in zip(heads, texts)]

    # ---- progress -----------------------------------------------------------------------------
    def note(self, step: int, epoch: int | None) -> None:
        """Record that this rank began saving ``step``."""
        if self.world_size > 1:
            self.store.steps.note_progress(self.model, self.rank, step, epoch)

    def missing(self, step: int, epoch: int | None) -> dict[int, int | None]:
        """Ranks of incarnation ``epoch`` that have not begun saving ``step``: rank -> last step begun."""
        if self.world_size == 1:
            return {}
        prog = self.store.steps.progress(self.model)
        ep = -1 if epoch is None else epoch
        out: dict[int, int | None] = {}
        for r in range(self.world_size):
            if r == self.rank:
                continue
            e, s = prog.get(r, (None, None))
            if e != ep or s is None or s < step:
                out[r] = s if e == ep else None
        return out

    def missing_error(self, step: int, missing: Mapping[int, int | None], waited: float) -> CommitError:
        ranks = sorted(missing)
        last = ", ".join(f"rank {r}: {'none' if s is None else f'step {s}'}" for r, s in sorted(missing.items()))
        return CommitError(
            f"step {step} of {self.model}: rank(s) {ranks} did not call save({step}) within {waited:.1f}s "
            f"(last step begun: {last}); every rank must call save() with the same steps",
            model=self.model, step=step, missing_ranks=ranks,
        )

    def await_ranks(self, step: int, epoch: int | None, since: float,
                    sleep: Any = time.sleep) -> None:
        """Wait until every rank began ``step`` (before a collective), at most ``grace`` seconds after ``since``.

        Raises:
            CommitError: ``missing_ranks`` had not begun the step by then.
        """
        if self.group is None:
            return
        delay = 0.0005
        while True:
            missing = self.missing(step, epoch)
            if not missing:
                return
            waited = time.monotonic() - since
            if waited >= self.grace:
                raise self.missing_error(step, missing, waited)
            sleep(min(delay, self.grace - waited))
            delay = min(delay * 2, 0.02)
