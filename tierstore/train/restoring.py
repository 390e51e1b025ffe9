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
   memory), then loaded: one copy each, into the modules' tensors
   (``load_state_dict``) and the optimizer's own state tensors where it holds
   them (:meth:`~tierstore.train.layers.StateMap.apply`). The ``_state``
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
   (``in_pass``: each copy hashed whole before its tensors are read; a bad
   copy falls back to the next tier; a copy bad in every tier makes every rank
   resolve again with every copy hashed, which passes over that step to an
   older one: as a restore always did), after dropping the
   copies that failed from their tier (a checksum mismatch is proof; so a
   process restarted after the error does not meet them again), so the state no
   longer holds the bad bytes; then ``"before_update"`` raises
   :class:`~tierstore.errors.RestoreVerifyError` from the gate, refusing the
   update (the forward/backward that ran on the bad bytes is void: run the
   step again), and ``"before_return"`` returns the second restore's result
   (``ckpt.report.reason`` says why). If the second restore fails too, its
   error is raised by every later update and save until a restore succeeds:
   the bad bytes never reach an update or a checkpoint.

Agreement (every mode, :func:`prepare_agreed`, :func:`agreed_step`): all ranks restore the same step or all
raise. Each rank's own verdict on its part (the step it resolved; its copies read, in the verified modes, and
the state validated, :meth:`~tierstore.train.view.StateView.prepare`) is gathered by every rank
(:meth:`~tierstore.train.ranks.Ranks.gather`: its error's type and message, no pickle) before any rank loads
anything into its state. Where a rank failed, it raises its own error and every other rank raises
:class:`~tierstore.errors.PeerRestoreError` naming the failed ranks and why
(:class:`~tierstore.errors.PeerNoValidCopyError` / :class:`~tierstore.errors.PeerRestoreMismatchError` where
every failure was of that kind); no rank's state changed. The deferred modes' verdict on the hashing
(:meth:`PendingRestore.settle`) is agreed the same way (``all_reduce(MIN)``) before any rank acts on it.

Defaults: ``verify=None`` is ``"before_update"`` for a writer's restore of a
state with an optimizer (an update is what makes the bytes permanent: they
are trained on and saved; the first forward/backward overlaps the hashing),
and, for ``read_only`` restores and states without an optimizer (an evaluator
reads the parameters with no update to hold back), ``"before_return"`` where
the modules are on a GPU or a core per local rank is free (:func:`core_free`),
else ``"in_pass"`` (each copy hashed as it is copied, the verified path: faster
than hashing after the copy where the ranks use every core). Where a core is
free, the hashing of every deferred mode starts with the first copy, on it.
A replay restore replays through the optimizer and verifies as it reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

import torch

from tierstore.errors import (
    ConfigError,
    NoValidCopyError,
    PeerNoValidCopyError,
    PeerRestoreError,
    PeerRestoreMismatchError,
    RestoreMismatchError,
    RestoreVerifyError,
    TierStoreError,
)
from tierstore.keys import ShardKey
from tierstore.store.deferred import DeferredReads, Failure, Verification, cores_per_local_rank
from tierstore.train.gather import read_shards
from tierstore.train.reshard import adapt_document
from tierstore.train.view import STATE_LAYER

__all__ = ["IN_PASS", "VERIFY_MODES", "CopiesLost", "PendingRestore", "agree", "agreed_step", "core_free",
           "hash_eagerly", "prepare_agreed", "read_unverified", "refuse_until_restored", "verify_mode", "weights_of"]

log = logging.getLogger(__name__)

VERIFY_MODES = ("before_update", "before_return")
# the verified path (the second restore after a failure, resharding restores): the step is chosen by the copies'
# trailers, each copy read is hashed whole before its tensors alias it (ReadPath.get_aliased) or as ranges of it
# are read; a copy bad in every tier: CopiesLost, and every rank resolves again hashing every copy
IN_PASS = "in_pass"


def core_free(world_size: int) -> bool:
    """Whether this node has a core per local rank beyond the ranks' own (CPUs this process may run on, at least
    twice ``LOCAL_WORLD_SIZE``, or ``world_size`` where that is not set): the checksums of a restore's copies are
    then hashed on it from the first copy on, beside the copies, instead of after them."""
    return cores_per_local_rank(world_size) >= 2


def hash_eagerly(mode: str, world_size: int) -> bool:
    """Whether a deferred restore in ``mode`` hashes its copies from the first on (beside the loading) rather
    than after them: with ``"before_return"`` (its verdict is awaited at once), or where a core is free."""
    return mode == "before_return" or core_free(world_size)


def verify_mode(verify: str | None, read_only: bool, state: MutableMapping[str, Any], world_size: int = 1) -> str:
    """The mode a restore verifies in; see the module docstring for the default.

    Raises:
        ConfigError: an unknown ``verify``.
    """
    if verify is None:
        has_optimizer = any(isinstance(v, torch.optim.Optimizer) for v in state.values())
        if has_optimizer and not read_only:
            return "before_update"
        # nothing to hold back: with CUDA tensors, or a core free, the hashing runs beside the copies; on a CPU
        # node whose cores the ranks all use, hashing each copy as it is copied is faster than hashing after
        # (measured: 1.98x against 2.42x the copy bound)
        return "before_return" if _on_cuda(state) or core_free(world_size) else IN_PASS
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

    ``eager``: hash beside the loading (``"before_return"``, whose verdict is awaited at once, and any mode
    where a core is free: :func:`core_free`) rather than after it (``"before_update"`` on a node whose cores the
    ranks all use: the hashing overlaps the first forward/backward, the copies come first).
    """
    reads = DeferredReads(ck.store, copy=False, eager=eager)
    src = ck._src(res.world_size)
    layers = list(layers)
    wanted = set(layers) - {STATE_LAYER}
    keys = [info.key for (ln, r), info in res.objects.items() if r == src and ln in wanted]
    records = dict(zip(keys, ck.store.index.get_objects(keys)))  # one round trip for every object read

    def get(key: ShardKey) -> Any:
        return ck.store.get(key) if key.layer == STATE_LAYER else reads.get(key, rec=records.get(key))

    try:
        shards = read_shards(ck.store, ck.model, res, src, layers, get=get)
    finally:
        v = reads.close()
    return shards, v


# a rank's verdict on its part of a restore, as gathered (the kind decides the class the other ranks raise)
_OK, _LOST, _MISMATCH, _OTHER = 0, 1, 2, 3


def _kind(err: BaseException | None) -> int:
    if err is None:
        return _OK
    if isinstance(err, NoValidCopyError):
        return _LOST
    return _MISMATCH if isinstance(err, RestoreMismatchError) else _OTHER


def _reason(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _peer_error(ck: Any, step: int | None, failed: list[tuple[int, int, str]]) -> PeerRestoreError:
    kinds = {k for _r, k, _w in failed}
    cls = (PeerNoValidCopyError if kinds == {_LOST} else PeerRestoreMismatchError if kinds == {_MISMATCH}
           else PeerRestoreError)
    ranks = [r for r, _k, _w in failed]
    said = "; ".join(f"rank {r}: {w}" for r, _k, w in failed)
    at = f"step {step}" if step is not None else "the newest committed step"
    fields: dict[str, Any] = {}
    if cls is PeerRestoreMismatchError:
        fields = {"layer": None, "tensor": None}
    return cls(f"restore of {ck.model} ({at}) abandoned by every rank: rank(s) {ranks} could not restore their "
               f"part ({said}); this rank's part (rank {ck.rank}) was fine, and no rank loaded any of it",
               model=ck.model, step=step, failed_ranks=ranks, reason=f"rank(s) {ranks} failed: {said}",
               reasons={r: w for r, _k, w in failed}, **fields)


class CopiesLost(Exception):
    """Every rank whose part of a read failed found no valid copy (agreed: raised on every rank alike).

    Raised by :func:`agree` with ``lost_retry`` instead of the ranks' errors (``error``: what this rank would
    have raised): a restore whose step was chosen by the copies' trailers alone reads its copies verified, and
    where one fails in every tier it resolves again with every copy hashed, which then passes over that step
    as a restore always did.
    """

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def agree(ck: Any, err: BaseException | None, step: int | None, *, lost_retry: bool = False) -> None:
    """Every rank's verdict on its part of a restore: return where every rank's is good, else raise. Collective.

    Every rank calls it once its own verdict is known (``err``: what its part raised, ``None``: it succeeded)
    and before it changes anything: a failing rank raises ``err``, every other rank a
    :class:`~tierstore.errors.PeerRestoreError` naming the failed ranks and their errors. With ``lost_retry``,
    where every failure was a :class:`~tierstore.errors.NoValidCopyError`, every rank raises
    :class:`CopiesLost` instead (the gathered verdicts are the same on every rank, so is the choice).
    """
    verdicts = ck.ranks.gather(_kind(err), "" if err is None else _reason(err))
    failed = [(r, k, w) for r, k, w in verdicts if k != _OK]
    if not failed:
        return
    if lost_retry and all(k == _LOST for _r, k, _w in failed):
        raise CopiesLost(err if err is not None else _peer_error(ck, step, failed))
    if err is not None:
        raise err
    raise _peer_error(ck, step, failed)


def agreed_step(ck: Any, mine: int, err: BaseException | None, step: int | None) -> tuple[int, bool]:
    """The step every rank restores: the oldest each resolved (``mine``; ``-1``: nothing committed, ``-2``: it
    could not resolve, raising ``err``), and whether every rank resolved that one. Collective, with ``step``
    given too (each rank resolved that step).

    Raises:
        PeerRestoreError: (on the ranks that resolved) another rank could not resolve; the kind of its error.
    """
    verdicts = ck.ranks.gather(mine, "" if err is None else _reason(err))
    failed = [(r, _LOST, w) for r, v, w in verdicts if v == -2]  # a resolve fails with NoValidCopyError
    if failed and err is None:
        raise _peer_error(ck, step, failed)
    oldest = min(v for _r, v, _w in verdicts)
    return oldest, all(v == oldest for _r, v, _w in verdicts)


def prepare_agreed(ck: Any, res: Any, shards: Callable[[], dict[str, Any]], doc: dict[str, Any],
                   only: Iterable[str] | None, *, lost_retry: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's shards (``shards()``: read, or already read) and its validated plan, once every rank's are.

    Collective (:func:`agree`, ``lost_retry`` as there): nothing is loaded on any rank unless every rank read
    and validated its part.
    """
    err: Exception | None = None
    got: dict[str, Any] = {}
    plan: dict[str, Any] = {}
    try:
        got = shards()
        plan = ck.view.prepare(got, adapt_document(doc, res, ck.view, only), only)
    except Exception as e:  # noqa: BLE001 - every failure of this rank's part is voted, then raised here
        err = e
    agree(ck, err, res.step, lost_retry=lost_retry)
    return got, plan


def weights_of(state: MutableMapping[str, Any], only: Iterable[str] | None) -> list[str]:
    """The keys a ``weights_only`` restore loads: the modules of the state (of ``only``, where given).

    Raises:
        ConfigError: ``only`` names no module.
    """
    asked = list(state) if only is None else list(only)
    keys = [k for k in asked if isinstance(state.get(k), torch.nn.Module)]
    if not keys:
        raise ConfigError(f"weights_only: no module among the keys restored ({asked})", field="weights_only")
    return keys


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
