"""``torch.distributed.checkpoint`` storage on tierstore: ``dcp.save`` / ``dcp.async_save`` / ``dcp.load``.

Usage (every rank)::

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "sched": scheduler, "data": loader, "train": train_state}
    dcp.save(state, storage_writer=TierStoreWriter(store, "gpt", step=100))
    dcp.load(state, storage_reader=TierStoreReader(store, "gpt"))            # the newest committed step
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

``store`` is a live :class:`~tierstore.store.TierStore`, a
:class:`~tierstore.config.StoreConfig`, or a dict of :func:`tierstore.open`
arguments. Writer and reader pickle as that configuration (never the live
store) and reopen the store lazily where they run, so
``dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)``
works: the checkpoint process opens the same store (same index, same host
tier) once and keeps it for its next saves.

The protocol DCP runs against the writer and reader, call by call, and which
rank does what, is in :mod:`tierstore.interop.dcp_storage` (the reader in
:mod:`tierstore.interop.dcp_reader`); what is stored, in
:mod:`tierstore.interop.dcp_format`.

Where unpickling happens, and that it is restricted: a non-tensor value is
unpickled once by tierstore, in :func:`tierstore.interop.dcp_format.restricted_load`
(``torch.load(weights_only=True)``, allowing ``io.BytesIO``, ``bytes`` and what
the caller allowed). The object it returns is re-serialised with ``torch.save`` and
handed to ``planner.load_bytes``: DCP's default planner unpickles that with
``weights_only=False``, but the bytes are tierstore's own re-serialisation of
an object the restricted loader built, so they name only globals it admitted;
stored bytes never reach a general unpickler.

DCP wraps every error a storage layer raises during a save or load into its
``CheckpointException``, a ``BaseException``. :func:`save`,
:func:`async_save` and :func:`load` here call DCP and raise the typed
:class:`~tierstore.errors.TierStoreError` instead; :func:`save` and
:func:`async_save` also check the whole state dict first
(:func:`validate_state_dict`), before DCP plans anything.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future as ConcurrentFuture
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from tierstore.errors import CheckpointFailedError, InvalidValueError, TierStoreError
from tierstore.interop.dcp_format import check_restricted, metadata_from_json, metadata_to_json
from tierstore.interop.dcp_reader import TierStoreReader
from tierstore.interop.dcp_storage import DATA_LAYER, META_LAYER, TierStoreWriter, check_tensor_props

__all__ = [
    "DATA_LAYER",
    "META_LAYER",
    "TierStoreReader",
    "TierStoreWriter",
    "async_save",
    "load",
    "metadata_from_json",
    "metadata_to_json",
    "save",
    "validate_state_dict",
]


# ------------------------------------------------------------------------------ typed front door


def _to_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


def validate_state_dict(state_dict: Mapping[str, Any], *, safe_globals: Iterable[Any] = ()) -> None:
    """Refuse, before anything is planned or written, what a tierstore DCP save could not round-trip.

    Tensors (plain, DTensor, ShardedTensor) need a dtype the codec stores and a
    dense layout; every other value must come back from ``torch.save`` through
    ``torch.load(weights_only=True)``.

    Raises:
        InvalidValueError: naming the key (``tensor`` field) and, for values, the unsafe globals.
    """
    allowed = tuple(safe_globals)

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, DTensor):
            check_tensor_props(prefix, v.dtype, v.to_local().layout)
        elif isinstance(v, ShardedTensor):
            for s in v.local_shards():
                check_tensor_props(prefix, s.tensor.dtype, s.tensor.layout)
        elif isinstance(v, torch.Tensor):
            check_tensor_props(prefix, v.dtype, v.layout)
        elif isinstance(v, Mapping):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, (list, tuple)) and any(isinstance(x, (torch.Tensor, Mapping, list, tuple)) for x in v):
            for i, x in enumerate(v):
                walk(f"{prefix}.{i}", x)
        else:
            buf = resave_value(prefix, v)
            check_restricted(buf, fqn=prefix, safe_globals=allowed)

    walk("", _to_state_dict(state_dict))  # DCP turns top-level Stateful values into state dicts, and only those


def resave_value(fqn: str, value: Any) -> bytes:
    """``torch.save(value)`` as bytes, as DCP's planner will make them; a value that cannot be pickled is refused."""
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except Exception as e:
        raise InvalidValueError(f"{fqn}: a {type(value).__name__} cannot be saved: {e}", tensor=fqn) from e
    return buf.getvalue()


def _typed(e: CheckpointException, what: str) -> TierStoreError:
    """The first rank's typed error, or a :class:`CheckpointFailedError`, for DCP's BaseException."""
    failures = {rank: exc for rank, (exc, _tb) in sorted(e.failures.items())}
    for exc in failures.values():
        if isinstance(exc, TierStoreError):
            exc.fields["failed_ranks"] = sorted(failures)
            exc.failed_ranks = sorted(failures)  # type: ignore[attr-defined]
            return exc
    first = next(iter(failures.values()), None)
    return CheckpointFailedError(f"DCP {what} failed on ranks {sorted(failures)}: {first!r}",
                                 failures=failures, failed_ranks=sorted(failures))


def _call(what: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except CheckpointException as e:
        raise _typed(e, what) from e


def save(state_dict: dict[str, Any], writer: TierStoreWriter, **kwargs: Any) -> Metadata:
    """``dcp.save`` with the state dict checked first and typed errors (never DCP's BaseException).

    Args:
        state_dict: as for ``dcp.save`` (Stateful values are turned into their state dicts once).
        writer: the :class:`TierStoreWriter`.
        **kwargs: ``process_group``, ``no_dist``, ``planner``, ``use_collectives``, ... for ``dcp.save``.

    Raises:
        TierStoreError: what a rank raised (``failed_ranks`` lists them), or :class:`CheckpointFailedError`.
    """
    sd = _to_state_dict(state_dict)
    validate_state_dict(sd, safe_globals=writer.safe_globals)
    return _call("save", lambda: dcp.save(sd, storage_writer=writer, **kwargs))


def async_save(state_dict: dict[str, Any], writer: TierStoreWriter, **kwargs: Any) -> ConcurrentFuture:
    """``dcp.async_save`` with the state dict checked first; the returned future raises typed errors.

    Returns the upload future (``AsyncSaveResponse.upload_completion`` when DCP returns a response).
    """
    sd = _to_state_dict(state_dict)
    validate_state_dict(sd, safe_globals=writer.safe_globals)
    res = _call("async_save", lambda: dcp.async_save(sd, storage_writer=writer, **kwargs))
    inner = getattr(res, "upload_completion", res)
    out: ConcurrentFuture = ConcurrentFuture()

    def done(f: ConcurrentFuture) -> None:
        try:
            out.set_result(f.result())
        except CheckpointException as e:
            out.set_exception(_typed(e, "async_save"))
        except BaseException as e:  # noqa: BLE001  # handed to the caller through the future
            out.set_exception(e)

    inner.add_done_callback(done)
    return out


def load(state_dict: dict[str, Any], reader: TierStoreReader, **kwargs: Any) -> None:
    """``dcp.load`` with typed errors (never DCP's BaseException); loads in place as ``dcp.load`` does.

    Raises:
        TierStoreError: e.g. :class:`UnknownError`, :class:`CommitError` (the step is not committed),
            :class:`StepAbortedError`, :class:`NoValidCopyError`; else :class:`CheckpointFailedError`.
    """
    reader.metadata_error = None
    try:
        dcp.load(state_dict, storage_reader=reader, **kwargs)
    except CheckpointException as e:
        typed = _typed(e, "load")
        if isinstance(typed, CheckpointFailedError) and reader.metadata_error is not None:
            typed = reader.metadata_error  # DCP turned it into "metadata is None" after its rank-local fallback
        raise typed from e
