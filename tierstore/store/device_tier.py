"""The store's device tier: snapshots land in reused device buffers, drain to the host tier, serve rollbacks.

Protocol (who calls what, in which order):

1. :meth:`~tierstore.store.writing.WritePath.snapshot` (the trainer's thread)
   calls :meth:`DeviceTier.stage` for a full, uncompressed object, after the
   tensors were validated. If every tensor lives on the tier's device, they
   are copied into the reused buffers of the key's series (model, layer,
   rank; :class:`backends.device.DeviceBackend`, two buffer sets per series):
   on CUDA a device-to-device copy on a side stream, after which the caller's
   stream is fenced (it waits for the copy without blocking the host, so the
   trainer may change its tensors at once, as with a host snapshot). ``None``
   (another device, no free buffer set, no room) sends the object down the
   host path, unchanged.
2. ``PendingObject.finish()`` (any thread: ``finish_async``'s background
   thread, the checkpointer's writer) drains it: waits for the copy, reserves
   the host tier and writes the object from the device buffers, then seals,
   publishes and indexes it as any host snapshot
   (:class:`~tierstore.store.writing.WritePath`). On success it calls
   :meth:`DeviceTier.published` (the device copy is the one the index names);
   on a failure or an abort, :meth:`StagedCopy.release`.
3. :meth:`~tierstore.store.reading.ReadPath._get` calls :meth:`DeviceTier.read`
   before the tiers: a failed step's rollback (a restore of the newest
   committed step, still in device memory) copies from the device buffers,
   not from shared memory. ``None``: read the tiers as before.

Validity: the device copy is read only while (a) the index's record of the
key names the very copy drained from it (its physical name, unique to one
write, and the checksum of the host copy written from these buffers), and
(b) its buffers were not reused: they are pinned while read, and a later
snapshot of the series never takes the newest snapshot's set, nor a pinned
one. Device memory is not re-hashed on a read: a host or durable copy is
what a restore after a lost process reads, and those are verified.

Modes (``StoreConfig.device_tier``): ``"auto"``/``"cuda"`` stage objects whose
tensors live on one CUDA device, on that device (small CPU tensors beside
them, such as an optimizer's ``step`` scalars, are copied in too); ``"cuda:N"``
on device N only; ``"cpu"`` stages CPU tensors in this process's memory (the same code
path without a GPU: an extra copy, for tests); ``"off"`` builds no tier.

Memory bound: two buffer sets per series, each the size of its largest
object, within ``device_capacity_bytes`` per device (``None``: a quarter of a
CUDA device's memory, and at most half of what was free when the first object
was staged on it; unbounded on ``"cpu"``). A snapshot that does not fit takes
the host path. Buffers stay allocated until the store closes.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from consistency.index import ObjectRecord
from tierstore import codec
from tierstore.errors import InvalidKeyError, RestoreMismatchError, TierFullError
from tierstore.keys import ShardKey

if TYPE_CHECKING:
    import torch

    from backends.device import DeviceBackend, DeviceSnapshot

__all__ = ["DeviceTier", "StagedCopy"]

log = logging.getLogger(__name__)

_BUFFERS_PER_SERIES = 2  # the newest copy (a rollback source) and the one being made


@dataclass(eq=False)
class StagedCopy:
    """One object's tensors copied into device buffers, waiting to be drained into the host tier."""

    key: ShardKey
    snap: DeviceSnapshot

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return self.snap.tensors

    def wait(self) -> None:
        """Block until the device copy has finished (a no-op on ``"cpu"``)."""
        self.snap.wait()

    def release(self) -> None:
        """The drain is over (or failed): the buffers may be reused once a newer snapshot exists. Idempotent."""
        self.snap.release()


@dataclass(eq=False)
class _Published:
    key: ShardKey
    checksum: str
    metadata: dict
    snap: DeviceSnapshot


def _series(key: ShardKey) -> str:
    """The buffer sets a key's objects reuse from step to step: one per (model, layer, rank)."""
    return f"{key.model}/{key.layer}/{key.rank}"


class DeviceTier:
    """Device buffers of one store; see the module docstring.

    Args:
        mode: ``"auto"``, ``"cuda"``, ``"cuda:N"`` or ``"cpu"``.
        capacity_bytes: per device; ``None``: a quarter of a CUDA device's memory, unbounded on CPU.
    """

    def __init__(self, mode: str, capacity_bytes: int | None = None) -> None:
        self.mode = mode
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._backends: dict[str, DeviceBackend] = {}
        self._published: dict[str, _Published] = {}  # physical name -> the device copy it was drained from
        self.staged = 0  # snapshots staged in device buffers
        self.fallbacks = 0  # snapshots on the tier's device sent down the host path (no buffer set free, no room)
        self.reads = 0  # reads served from device buffers
        self._closed = False

    @classmethod
    def from_mode(cls, mode: str, capacity_bytes: int | None = None) -> DeviceTier | None:
        """The tier for ``StoreConfig.device_tier``; ``None`` for ``"off"``. Builds no buffer yet."""
        return None if mode == "off" else cls(mode, capacity_bytes)

    # -- staging -------------------------------------------------------------------
    def _device_of(self, tensors: Mapping[str, Any]) -> str | None:
        """The device this tier stages ``tensors`` on, or ``None`` (the host path).

        ``"cpu"``: every tensor is on the CPU. The CUDA modes: the tensors live
        on one CUDA device (of the mode's index, for ``"cuda:N"``), except CPU
        tensors of at most as many bytes as those (an optimizer's ``step``
        scalars beside a layer's parameters: copied to the device buffers
        synchronously, as the host path would copy them).
        """
        cuda = None
        cuda_bytes = cpu_bytes = 0
        for t in tensors.values():
            d = t.device
            if d.type == "cpu":
                cpu_bytes += t.numel() * t.element_size()
            elif d.type == "cuda" and (cuda is None or d == cuda):
                cuda = d
                cuda_bytes += t.numel() * t.element_size()
            else:
                return None  # another device, or two CUDA devices
        if self.mode == "cpu":
            return "cpu" if cuda is None and tensors else None
        if cuda is None or cpu_bytes > cuda_bytes:
            return None
        if self.mode.startswith("cuda:") and cuda.index != int(self.mode[5:]):
            return None
        return str(cuda)

    def _backend(self, device: str) -> DeviceBackend:
        from backends.device import DeviceBackend  # lazy: it imports torch, which the admin commands run without

        with self._lock:
            b = self._backends.get(device)
            if b is None:
                capacity = self.capacity_bytes
                if capacity is None and device != "cpu":
                    import torch  # lazy: only a CUDA tensor gets here, so torch is loaded already

                    free, total = torch.cuda.mem_get_info(torch.device(device))
                    capacity = min(total // 4, free // 2)  # what the trainer had not taken by its first save
                b = DeviceBackend(device, capacity_bytes=capacity, buffers_per_name=_BUFFERS_PER_SERIES,
                                  wait_timeout_s=0.0)
                self._backends[device] = b
            return b

    def stage(self, key: ShardKey, tensors: Mapping[str, torch.Tensor]) -> StagedCopy | None:
        """Copy ``tensors`` into the device buffers of ``key``'s series; ``None``: take the host path.

        Blocks only for the copy on CPU, for enqueueing it on CUDA (the
        caller's stream then waits for it: the tensors may change at once).
        """
        if self._closed:
            return None
        device = self._device_of(tensors)
        if device is None:
            return None
        backend = self._backend(device)
        try:
            snap = backend.snapshot(_series(key), tensors)
        except (TierFullError, InvalidKeyError) as e:
            with self._lock:
                self.fallbacks += 1
            log.debug("%s: not staged in the device tier (%s); host path", key, e)
            return None
        snap.fence()
        with self._lock:
            self.staged += 1
        return StagedCopy(key, snap)

    def published(self, staged: StagedCopy, name: str, checksum: str, metadata: dict) -> None:
        """Record that the copy ``name`` of ``staged.key`` (with ``checksum``) was drained from ``staged``."""
        with self._lock:
            for n, p in list(self._published.items()):  # forget copies whose buffers were reused
                if not p.snap.intact:
                    del self._published[n]
            self._published[name] = _Published(staged.key, checksum, metadata, staged.snap)
        staged.release()

    # -- reading -------------------------------------------------------------------
    def read(self, key: ShardKey, rec: ObjectRecord,
             out: Mapping[str, torch.Tensor] | None) -> codec.Shard | None:
        """The object ``rec`` names, from the device buffers it was drained from; ``None`` if they do not hold it.

        Tensors named in ``out`` are copied into it (all shapes and dtypes are
        checked first: a mismatch copies nothing); the others come back as new
        CPU tensors, as from the host tier.

        Raises:
            RestoreMismatchError: an ``out`` tensor does not fit (nothing was copied).
        """
        with self._lock:
            p = self._published.get(rec.name)
        if p is None or p.key != key or p.checksum != rec.checksum:
            return None
        if not p.snap.pin():
            with self._lock:
                self._published.pop(rec.name, None)
            return None
        try:
            result = _copy_out(p.snap, out)
        finally:
            p.snap.unpin()
        with self._lock:
            self.reads += 1
        return codec.Shard(result, copy.deepcopy(p.metadata))

    def close(self) -> None:
        """Free every buffer. Idempotent."""
        with self._lock:
            self._closed = True
            backends, self._backends = list(self._backends.values()), {}
            self._published.clear()
        for b in backends:
            b.close()


def _copy_out(snap: DeviceSnapshot, out: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    import torch  # lazy: a snapshot exists, so torch is loaded already

    stored = snap.tensors
    targets = dict(out) if out is not None else {}
    for name, t in targets.items():  # every check before any copy, as the codec does
        src = stored.get(name)
        if src is None:
            raise RestoreMismatchError(f"restore target {name!r} is not in the stored object", name=name)
        if not isinstance(t, torch.Tensor):
            raise RestoreMismatchError(f"restore target {name!r} is not a tensor", name=name)
        if t.dtype != src.dtype or t.shape != src.shape:
            raise RestoreMismatchError(
                f"tensor {name!r}: stored {src.dtype}{list(src.shape)}, target {t.dtype}{list(t.shape)}",
                name=name, stored_shape=tuple(src.shape),
            )
    snap.wait()
    result: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, src in stored.items():
            target = targets.get(name)
            result[name] = target.copy_(src) if target is not None else src.to("cpu", copy=True)
    device = next(iter(stored.values())).device if stored else None
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)  # every copy out of the buffers is done before they may be reused
    return result
