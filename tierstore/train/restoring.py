"""Restores at the copy's speed: copy into the state first, verify the checksums beside it, gate the update.

A restore used to hash every copy before (or while) copying it: the hash sat
on the critical path (1.3x a plain copy from the host tier, on the CPU). Here
the bytes are loaded into the modules and optimizers first, at the copy's
speed, while a thread hashes the very copies read (:mod:`tierstore.store.deferred`);
nothing permanent happens to the state before every copy verified.

Protocol (:meth:`~tierstore.train.checkpointer.Checkpointer.restore`, every rank):

1. *resolve* with ``verify="trailer"``: the step is chosen by the index and
   the copies' trailers (the copies read are hashed whole in step 3, not
   twice); the ranks agree on the step (``all_reduce(MIN)``), as before.
2. *read and load*: module layers (parameters, buffers, optimizer state)
   through :class:`~tierstore.store.deferred.DeferredReads` with
   ``copy=False`` (tensors alias the host-tier copies; no hashing, no extra
   memory), then loaded (``load_state_dict``: one copy each). The ``_state``
   layer (data position, RNG, the save's ``extra``, handed to the caller as
   they are) is read through the verified path. The verification starts
   hashing the first copy as soon as it is read.
3. *settle* (:meth:`PendingRestore.settle`): with ``verify="before_return"``
   before ``restore()`` returns; with ``"before_update"`` before the first
   ``optimizer.step()`` of any optimizer in the state (the update gate's hold,
   :class:`~tierstore.train.lazy.UpdateGate`), :meth:`Checkpointer.before_update`
   or ``save()``, whichever comes first. Every rank learns whether a copy of
   any rank failed (``all_reduce(MIN)``, collective: all ranks act alike).
4. *on a failure*: every rank restores again through the verified path
   (resolve hashing the copies in local tiers; each copy verified in the pass
   that copies it; a bad copy falls back to the next tier, a step without a
   valid copy to an older step: as a restore always did), after dropping the
   copies that failed from their tier (a checksum mismatch is proof; so a
   process restarted after the error does not meet them again), so the state no
   longer holds the bad bytes; then ``"before_update"`` raises
   :class:`~tierstore.errors.RestoreVerifyError` from the gate, refusing the
   update (the forward/backward that ran on the bad bytes is void: run the
   step again), and ``"before_return"`` returns the second restore's result
   (``ckpt.report.reason`` says why). If the second restore fails too, its
   error is raised by every later update and save until a restore succeeds:
   the bad bytes never reach an update or a checkpoint.

Defaults: ``verify=None`` is ``"before_update"`` for a writer's restore of a
state with an optimizer (an update is what makes the bytes permanent: they
are trained on and saved; the first forward/backward overlaps the hashing),
and, for ``read_only`` restores and states without an optimizer (an evaluator
reads the parameters with no update to hold back), ``"before_return"`` where
the modules are on a GPU and ``"in_pass"`` on the CPU (each copy hashed as it
is copied, the verified path: faster there than hashing after the copy).
A replay restore replays through the optimizer and verifies as it reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, MutableMapping
from typing import Any

import torch

from tierstore.errors import ConfigError, RestoreVerifyError, TierStoreError
from tierstore.keys import ShardKey
from tierstore.store.deferred import DeferredReads, Failure, Verification
from tierstore.train.gather import read_shards
from tierstore.train.view import STATE_LAYER

__all__ = ["IN_PASS", "VERIFY_MODES", "PendingRestore", "read_unverified", "refuse_until_restored", "verify_mode"]

log = logging.getLogger(__name__)

VERIFY_MODES = ("before_update", "before_return")
IN_PASS = "in_pass"  # the verified path: a copy is hashed as it is copied (the second restore after a failure)


def verify_mode(verify: str | None, read_only: bool, state: MutableMapping[str, Any]) -> str:
    """The mode a restore verifies in; see the module docstring for the default.

    Raises:
        ConfigError: an unknown ``verify``.
    """
    if verify is None:
        has_optimizer = any(isinstance(v, torch.optim.Optimizer) for v in state.values())
        if has_optimizer and not read_only:
            return "before_update"
        # nothing to hold back: on the CPU, hashing each copy as it is copied is faster than hashing after
        # (measured: 1.98x against 2.42x the copy bound); with CUDA tensors the hashing runs beside the copy
        return "before_return" if _on_cuda(state) else IN_PASS
    if verify not in (*VERIFY_MODES, IN_PASS):
        raise ConfigError(f"verify must be one of {(*VERIFY_MODES, IN_PASS)} (or None), got {verify!r}",
                          field="verify")
    return verify


def _on_cuda(state: MutableMapping[str, Any]) -> bool:
    for v in state.values():
        if isinstance(v, torch.nn.Module):
            return any(p.is_cuda for p in v.parameters())
    return False


def read_unverified(ck: Any, res: Any, layers: Iterable[str], *, eager: bool = False) -> tuple[dict[str, Any],
                                                                                             Verification]:
    """This rank's shards of ``res``: module layers aliasing their copies unhashed, ``_state`` verified.

    ``eager``: hash beside the loading (``"before_return"``: the verdict is awaited at once) rather than after
    it (``"before_update"``: the hashing overlaps the first forward/backward).
    """
    reads = DeferredReads(ck.store, copy=False, eager=eager)

    def get(key: ShardKey) -> Any:
        return ck.store.get(key) if key.layer == STATE_LAYER else reads.get(key)

    try:
        shards = read_shards(ck.store, ck.model, res, ck._src(res.world_size), layers, get=get)
    finally:
        v = reads.close()
    return shards, v


def _describe(failures: list[Failure]) -> str:
    shown = "; ".join(f"{f.key} ({f.tier} tier): {f.reason}" for f in failures[:3])
    return shown + (f"; and {len(failures) - 3} more" if len(failures) > 3 else "")


class PendingRestore:
    """A restore whose copies are still being hashed; see the module docstring.

    Args:
        ck: the Checkpointer (its ranks, gate, report and ``restore``).
        verification: the copies' :class:`~tierstore.store.deferred.Verification`.
        step, read_only, only: the restore's arguments (a second restore repeats them).
        t0: when the restore began (``perf_counter``), for ``report.verified_s``.
    """

    def __init__(self, ck: Any, verification: Verification, step: int | None, read_only: bool,
                 only: Iterable[str] | None, t0: float) -> None:
        self.ck = ck
        self.verification = verification
        self.step, self.read_only = step, read_only
        self.only = list(only) if only is not None else None
        self.t0 = t0
        self.failures: list[Failure] = []

    def settle(self) -> Any:
        """Wait for the hashing; agree across ranks; on a failure restore again, verified. Collective.

        Returns the second restore's result, or ``None`` when every copy of every rank verified.
        """
        ck = self.ck
        if ck._restoring is self:
            ck._restoring = None
        self.failures = self.verification.wait()
        ck.report.verified_s = time.perf_counter() - self.t0
        if ck.ranks.all_min(0 if self.failures else 1) == 1:
            return None
        mine = _describe(self.failures) if self.failures else "a copy of another rank"
        self.verification.drop_bad_copies(ck.store)  # proof: they never fail a read (or a restart) again
        log.warning("restore of %s: %s failed verification after it was loaded; restoring again with every copy "
                    "verified first", ck.model, mine)
        again = ck.restore(self.step, read_only=self.read_only, only=self.only, verify=IN_PASS)
        why = f"copies loaded by the restore failed verification ({mine}): restored again, verified first"
        ck.report.reason = f"{why}; {ck.report.reason}" if ck.report.reason else why
        ck.report.fell_back = True
        return again

    def before_update(self) -> None:
        """The update gate's hold: settle; refuse the update (raise) if the state had to be restored again."""
        ck = self.ck
        try:
            again = self.settle()
        except TierStoreError as e:
            refuse_until_restored(ck, e)
            raise
        if again is not None:
            keys = [str(f.key) for f in self.failures]
            raise RestoreVerifyError(
                f"{ck.model}: the restore's copies failed verification before the first update "
                f"({_describe(self.failures) if self.failures else 'on another rank'}); the state was restored "
                f"again with every copy verified (step {again.step}) and this update refused: run the step again",
                keys=keys, step=again.step, model=ck.model)

    def abandon(self) -> None:
        """The state is replaced (another restore) or the Checkpointer closes: let the hashing finish."""
        try:
            failures = self.verification.wait()
        except Exception as e:  # noqa: BLE001 - nothing depends on it any more
            log.debug("abandoned verification: %r", e)
            return
        if failures:
            log.warning("restore of %s (not used for an update): %s", self.ck.model, _describe(failures))


def refuse_until_restored(ck: Any, err: BaseException) -> None:
    """Every later update and save raises ``err`` until a restore succeeds (the state may hold bad bytes)."""

    def refuse() -> None:
        ck._gate.hold(refuse)
        raise err

    ck._gate.hold(refuse)
