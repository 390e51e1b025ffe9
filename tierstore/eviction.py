"""Host-tier eviction: free shared memory by dropping host copies whose durable copy verifies.

Called by :meth:`tierstore.store.TierStore.evict_host` when a reservation does
not fit (and by operators). Never drops the only copy of anything (the durable
copy must verify first), nor a copy of a model's newest committed step; the
index stops naming the host tier for a copy before the copy goes.
"""

from __future__ import annotations

from backends.base import Backend
from backends.host import HostBackend
from consistency.index import Index, ObjectRecord
from consistency.twophase import StepProtocol
from tierstore import codec
from tierstore.errors import TierFullError, TierStoreError
from tierstore.keys import ShardKey

__all__ = ["evict_host"]


def _durable_copy_valid(durable: Backend | None, rec: ObjectRecord) -> bool:
    """Whether the durable tier's copy of ``rec`` is there and matches the index's checksum."""
    try:
        blob = durable.get(rec.name) if durable is not None else None
        return blob is not None and codec.verify(blob) == rec.checksum
    except TierStoreError:
        return False


def evict_host(host: HostBackend, durable: Backend | None, index: Index, steps: StepProtocol, nbytes: int) -> int:
    """Free at least ``nbytes`` in the host tier, oldest copies first; return the bytes freed.

    Raises:
        TierFullError: not enough can be freed without dropping a last copy.
    """
    freed = 0
    candidates: list[tuple[float, ShardKey, ObjectRecord]] = []
    durable_tier = durable.tier if durable is not None else None
    for model in index.models():
        committed = [s for s, st in steps.steps(model) if st in ("committed", "durable")]
        newest = committed[-1] if committed else None
        keys = [k for k in index.list_objects(model) if k.step != newest]
        for key, rec in zip(keys, index.get_objects(keys)):
            if rec and host.tier in rec.tiers and durable_tier in rec.tiers:
                candidates.append((rec.created, key, rec))
    for _created, key, rec in sorted(candidates, key=lambda c: c[0]):
        if freed >= nbytes:
            break
        if not _durable_copy_valid(durable, rec):
            continue  # the index says durable, but that copy does not verify: the host copy is the last good one
        if index.remove_tier(key, host.tier, name=rec.name) and host.delete(rec.name):
            freed += rec.size
    freed += host.drain_pool()
    if freed < nbytes:
        raise TierFullError(
            f"host tier full: only {freed} of {nbytes} bytes could be freed without dropping the last copy "
            "of a committed version; raise the host budget or let migration catch up",
            tier="host", needed=nbytes, freed=freed,
        )
    return freed
