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
    "CommitError",
    "ConfigError",
    "CorruptObjectError",
    "FencedError",
    "InvalidKeyError",
    "InvalidValueError",
    "KeyExistsError",
    "ManifestError",
    "MigrationError",
    "MissingDependencyError",
    "NoValidCopyError",
    "ProtocolError",
    "RestoreMismatchError",
    "StepAbortedError",
    "TierFullError",
    "TierStoreError",
    "TierUnavailableError",
    "UnknownError",
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
    """No tier holds a copy of an object that passes its checksum."""


class FencedError(TierStoreError):
    """A write or vote carries an epoch older than the job's current epoch."""


class CommitError(TierStoreError):
    """The two-phase commit of a step failed or could not be decided."""


class StepAbortedError(CommitError):
    """The step was aborted (a negative vote, a timeout or a fenced rank)."""


class ManifestError(TierStoreError, ValueError):
    """A manifest is malformed, inconsistent or of an unknown schema version."""


class RestoreMismatchError(TierStoreError, ValueError):
    """Stored tensors do not fit the restore target (shape, dtype, missing layer)."""


class ProtocolError(TierStoreError):
    """A peer sent a malformed, oversized or unknown request or reply."""


class MigrationError(TierUnavailableError):
    """Objects could not be migrated to the durable tier; ``failures`` lists (key, error)."""


class UnknownError(TierStoreError, LookupError):
    """The model, step or key asked about is not in the index (``what`` names it)."""
