"""tierstore: a tiered, versioned key-value checkpoint store for distributed LLM training.

Quick start::

    import tierstore, torch
    store = tierstore.open()                      # embedded default, no set-up
    key = tierstore.ShardKey("gpt", "block0", step=10, rank=0)
    store.put(key, {"w": torch.randn(4, 4)})
    shard = store.get(key)                        # a read-only mapping: shard["w"], shard.metadata
    store.get(missing)                            # None, as dict.get
    store[missing]                                # raises ObjectNotFoundError (a KeyError)

Heavy modules (torch, redis, boto3) are imported lazily on first use of a name
that needs them, so ``import tierstore`` stays cheap for the command line and
the leaf modules (:mod:`tierstore.errors`, :mod:`tierstore.keys`) can be used
by every layer without import cycles.

Layout: the data path lives here at the top level; :mod:`tierstore.train` is
what a trainer touches; :mod:`tierstore.interop` the adapters (DCP, export/import);
:mod:`tierstore.cli` the processes (never imported by
the library); :mod:`tierstore.testing` fault injection and the demo's model.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from tierstore.errors import (
    AccessDeniedError,
    AuthenticationError,
    CheckpointFailedError,
    CheckpointGoneError,
    CheckpointNotFoundError,
    CommitError,
    ConfigError,
    CorruptObjectError,
    FencedError,
    IncompleteStepError,
    IndexLostError,
    InvalidKeyError,
    InvalidValueError,
    KeyExistsError,
    ManifestError,
    MigrationError,
    MissingDependencyError,
    ModelInUseError,
    NoValidCopyError,
    ObjectNotFoundError,
    ProtocolError,
    RestoreMismatchError,
    RestoreVerifyError,
    SnapshotChangedError,
    StepAbortedError,
    StepBusyError,
    StepCommittedError,
    TierFullError,
    TierStoreError,
    TierUnavailableError,
    UnknownError,
)
from tierstore.keys import ShardKey

__version__ = "0.1.0"

_LAZY = {
    "open": ("tierstore.connect", "open"),
    "TierStore": ("tierstore.store", "TierStore"),
    "StoreConfig": ("tierstore.config", "StoreConfig"),
    "Shard": ("tierstore.codec", "Shard"),
    "Checkpointer": ("tierstore.train.checkpointer", "Checkpointer"),
    "ObjectRecord": ("consistency.index", "ObjectRecord"),
}

__all__ = [
    "AccessDeniedError",
    "AuthenticationError",
    "CheckpointFailedError",
    "CheckpointGoneError",
    "CheckpointNotFoundError",
    "Checkpointer",
    "CommitError",
    "ConfigError",
    "CorruptObjectError",
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
    "ObjectRecord",
    "ProtocolError",
    "RestoreMismatchError",
    "RestoreVerifyError",
    "Shard",
    "ShardKey",
    "SnapshotChangedError",
    "StepAbortedError",
    "StepBusyError",
    "StepCommittedError",
    "StoreConfig",
    "TierFullError",
    "TierStore",
    "TierStoreError",
    "TierUnavailableError",
    "UnknownError",
    "__version__",
    "open",
]


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'tierstore' has no attribute {name!r}") from None
    value = getattr(import_module(module), attr)
    globals()[name] = value
    return value
