"""The one exception tree of tierstore.

Every error tierstore raises derives from :class:`TierStoreError`, which is an
ordinary :class:`Exception` (never ``BaseException``), so ``except Exception``
sees it. A built-in is inherited too only where the meaning matches. Errors
carry structured fields (``key``, ``tier``, ``rank``, ...) beside the message.

This module imports nothing of the project, so every layer may use it.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AccessDeniedError",
    "AuthenticationError",
    "CheckpointFailedError",
    "CheckpointGoneError",
    "CheckpointNotFoundError",
    "CommitError",
    "ConfigError",
    "CorruptObjectError",
    "DurableTimeoutError",
    "FencedError",
    "IncompleteStepError",
    "IndexLostError",
    "InvalidKeyError",
    "InvalidValueError",
    "KeyExistsError",
    "ManifestError",
    "MigrationError",
    "MissingDependencyError",
    "ModelInUseError",
    "NoValidCopyError",
    "ObjectNotFoundError",
    "PeerNoValidCopyError",
    "PeerRestoreError",
    "PeerRestoreMismatchError",
    "ProtocolError",
    "ReplicaAckError",
    "RestoreMismatchError",
    "RestoreVerifyError",
    "ServerStoppedError",
    "SnapshotChangedError",
    "StepAbortedError",
    "StepBusyError",
    "StepCommittedError",
    "TierFullError",
    "TierStoreError",
    "TierUnavailableError",
    "UnknownError",
    "WaitTimeoutError",
]


class TierStoreError(Exception):
    """Root of every error tierstore raises.

    Keyword fields given to the constructor (``key=``, ``tier=``, ``rank=``,
    ...) are kept as attributes and listed in ``fields``.
    """

    def __init__(self, message: str = "", **fields: Any) -> None:
        super().__init__(message)
        self.fields = fields
        for name, value in fields.items():
            setattr(self, name, value)


class InvalidKeyError(TierStoreError, ValueError):
    """A key or one of its fields is malformed; ``field`` names which."""


class InvalidValueError(TierStoreError, TypeError):
    """A value handed to the store is not what the call takes (a non-tensor, ...)."""


class ConfigError(TierStoreError, ValueError):
    """A configuration value or URL is invalid."""


class MissingDependencyError(TierStoreError, ImportError):
    """An optional dependency is not installed; the message gives the install hint."""


class CorruptObjectError(TierStoreError):
    """Stored bytes are truncated, corrupted or not a tierstore object."""


class KeyExistsError(TierStoreError, FileExistsError):
    """A create-once write found the key already present."""


class TierFullError(TierStoreError):
    """A tier has no room for an object within its budget, even after eviction."""


class TierUnavailableError(TierStoreError, ConnectionError):
    """A tier's server or medium cannot be reached (after retries)."""


class AccessDeniedError(TierStoreError, PermissionError):
    """The server refused the credentials or the permission for this request."""


class AuthenticationError(TierStoreError, PermissionError):
    """A peer presented a missing or wrong authentication token."""


class NoValidCopyError(TierStoreError):
    """No tier holds a copy of an object (or a step) that passes its checksum.

    ``evidence`` is ``"lost"`` when every tier that should hold a copy answered a miss or a bad checksum
    (positive evidence that it is gone), ``"unknown"`` when some tier did not answer (``unreachable``
    names them): the copy there may be intact. A resolve also gives ``lost``, the steps judged lost.
    """

    evidence: str = "unknown"
    lost: frozenset[int] | set[int] = frozenset()


class FencedError(TierStoreError):
    """A write or vote carries an epoch older than the job's current epoch."""


class CommitError(TierStoreError):
    """The two-phase commit of a step failed or could not be decided."""


class StepAbortedError(CommitError):
    """The step was aborted (a negative vote, a timeout or a fenced rank)."""


class StepBusyError(CommitError):
    """Another writer's attempt holds the step: a step has one writer at a time.

    Raised to a second writer of a step that an attempt of another writer is
    still saving (before it writes anything), and to the writes and votes of an
    attempt that no longer holds its step (it timed out or was aborted, and a
    new attempt took the step over). Fields where known: ``model``, ``step``,
    ``attempt`` (the attempt holding the step), ``world`` (its voters),
    ``age_s`` (seconds since it began) and ``expires_in_s`` (seconds until its
    timeout lets a new attempt take the step; ``None``: it never times out);
    for a leased attempt (:mod:`consistency.attempts`) ``lease_s`` and
    ``lapses_in_s`` (seconds until its lease lapses unless its writer renews it).
    """


class SnapshotChangedError(StepAbortedError):
    """A lazy snapshot's tensor changed in place between ``save()`` and its copy (not by the optimizer's update).

    The step was voted down, never committed with the changed values; ``tensors`` names them (shard names,
    ``param/<name>``), ``layers`` their layers, ``step`` the step. The Checkpointer copies them at ``save()``
    from then on, so the next save commits the state of its ``save()``.
    """


class IncompleteStepError(StepAbortedError):
    """The deciding vote found that the step reads something the index does not hold: it is aborted, never
    recorded committed (committed means restorable).

    A delta's base, a ref's target or an inherited layer version that was deleted (a forced ``admin delete``,
    an operator's ``DEL``), a replay step's required step that is gone, or a layer of the declared layout with
    no version to restore. ``reason`` says which (the step's record keeps it too); ``model``, ``step``. A
    Checkpointer that meets it writes full objects from its next save on.
    """


class StepCommittedError(CommitError):
    """The step is already committed: a committed step is immutable, it cannot be saved (or written) again.

    ``model`` and ``step`` name it; ``key`` names the object where a write was refused.
    """


class IndexLostError(TierStoreError):
    """The index has no record of a model whose durable tier holds its steps: the index was lost.

    Starting fresh would write over the durable history; run ``tierstore admin
    rebuild-index MODEL --yes`` (or open the store with ``rebuild_index_on_loss``).
    ``model`` names it; ``durable_steps`` lists the durable manifests found. Also raised when the index
    still knows the model but lost some of its records (an evicting server, a failover that dropped writes,
    a deleted key): ``missing_steps`` then lists the durable steps it has no record of.
    """


class ReplicaAckError(CommitError):
    """The index's primary applied a state change, but too few replicas acknowledged it in time.

    Not acknowledged means not committed: the primary has the change, a
    replica may not, and a failover to that replica may lose it. Fields:
    ``wanted`` and ``acked`` (replica counts), ``timeout_s``, and ``state``:
    what the primary answered (``"committed"`` for a deciding vote), which a
    caller must not act on. Asking again (``wait``) once a replica is back
    acknowledges it, or, after a failover, answers what survived.
    """


class ManifestError(TierStoreError, ValueError):
    """A manifest is malformed, inconsistent or of an unknown schema version."""


class RestoreMismatchError(TierStoreError, ValueError):
    """Stored tensors do not fit the restore target (shape, dtype, missing layer)."""


class RestoreVerifyError(CorruptObjectError):
    """A copy loaded into the state by a restore failed its checksum once verified, after the restore returned.

    Raised before any optimizer update used it (by the first ``optimizer.step()`` after the restore, or the
    next ``save()``); by then the state was restored again with every copy verified first, so it no longer
    holds the bad bytes. ``keys``: the objects whose copy failed; ``step``: the step now loaded (the restore's
    fallback: another tier's copy of the same step, or an older step).
    """


class ProtocolError(TierStoreError):
    """A peer sent a malformed, oversized or unknown request or reply."""


class MigrationError(TierUnavailableError):
    """Objects could not be migrated to the durable tier; ``failures`` lists (key, error)."""


class UnknownError(TierStoreError, LookupError):
    """The model, step or key asked about is not in the index (``what`` names it)."""


class CheckpointNotFoundError(UnknownError, FileNotFoundError):
    """A framework's checkpoint path (a Lightning ``.ckpt``, a Trainer ``checkpoint-N`` directory) holds no
    checkpoint tierstore saved: never saved, removed, or its step is gone from the store. ``path`` names it."""


class CheckpointGoneError(CheckpointNotFoundError):
    """A framework's checkpoint path names a step no tier can restore any more (its host copy was lost before it
    was durable: a node reboot right after the save). ``path`` names it; ``newest`` is the newest checkpoint that
    still restores (a path, or ``None``: none does) and ``newest_global_step`` its global step."""


class ObjectNotFoundError(UnknownError, KeyError):
    """``store[key]`` found no object under ``key`` (``key`` names it); ``store.get(key)`` returns ``None`` instead."""

    def __str__(self) -> str:  # KeyError would print the message quoted, as a repr
        return str(self.args[0]) if self.args else ""


class ModelInUseError(TierStoreError):
    """A model cannot be deleted: a writer of it looks live (``reason`` says why); ``model`` names it.

    Stop the job first, or force the delete (``tierstore admin delete MODEL --yes --force``).
    """


class CheckpointFailedError(TierStoreError):
    """A ``torch.distributed.checkpoint`` save or load failed on some rank for a reason outside tierstore.

    Raised by :mod:`tierstore.interop.dcp`'s ``save``/``async_save``/``load`` in place of DCP's
    ``CheckpointException`` (a ``BaseException``); ``failures`` maps each failed rank to its error.
    """


class WaitTimeoutError(TierStoreError, TimeoutError):
    """A bounded wait ran out (issue 28: every wait ends): ``what`` names what it waited for, ``waited_s`` how
    long, and the field of its bound (``bound``: a :class:`~tierstore.config.StoreConfig` field or argument)."""


class DurableTimeoutError(WaitTimeoutError):
    """The durable tier made no progress within the wait's bound: ``tier`` names the tier, ``steps`` the
    ``(model, step)`` still memory-only (``model``/``step`` the one waited for, where one was), ``stalled`` what
    the migration is blocked in (e.g. ``"put to the durable tier"``) and for how long."""


class PeerRestoreError(TierStoreError):
    """A restore every rank abandoned because another rank's part of it failed; this rank's own part was fine.

    Raised on the ranks that read and validated their part when some other rank could not (the failing ranks
    raise their own error), before any rank changed its state: all ranks restore the same step or all raise.
    ``failed_ranks`` names them, ``reasons`` maps each to its error (``"<type>: <message>"``), ``step`` is the
    step they tried, ``model`` the model. Where every failing rank's error is of one kind, the error raised here
    is that kind too (:class:`PeerNoValidCopyError`, :class:`PeerRestoreMismatchError`), so a caller that handles
    it on the failing rank handles it alike on every rank.
    """


class PeerNoValidCopyError(PeerRestoreError, NoValidCopyError):
    """:class:`PeerRestoreError` where every failing rank found no valid copy (:class:`NoValidCopyError`)."""


class PeerRestoreMismatchError(PeerRestoreError, RestoreMismatchError):
    """:class:`PeerRestoreError` where every failing rank's state did not fit (:class:`RestoreMismatchError`)."""


class ServerStoppedError(TierUnavailableError):
    """A read-only tool found the embedded index server of a home stopped and did not start it (it creates
    nothing). ``home`` names the home, ``start`` the command that starts its server
    (``tierstore server start --home HOME``); ``tierstore admin --start-server`` starts it instead."""
