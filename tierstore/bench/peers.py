"""The bound and the peers: ``copy_``, ``torch.save``, ``torch.distributed.checkpoint`` and, when installed,
torchsnapshot (``Snapshot.take`` / ``async_take``).

Every system here follows :class:`tierstore.bench.systems.System`. Stall is measured
until the snapshot is safe from the next optimizer step, never until a call
merely returns (``dcp.async_save`` with async staging returns early; its stall
ends when the staging future completes).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import xxhash

from tierstore.bench.systems import LazySystem, System, SystemUnavailable, register
from tierstore.bench.workload import dir_bytes

__all__ = [
    "CopyBound",
    "DcpAsync",
    "DcpAsyncStaged",
    "DcpAsyncStagedLazy",
    "DcpSave",
    "TorchSaveDisk",
    "TorchSaveShm",
    "TorchSnapshotAsync",
    "TorchSnapshotTake",
]


def _load_into(work_flat: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    for name, t in work_flat.items():
        src = loaded[name]
        if src is not t:  # a loader that restored in place (torchsnapshot) has nothing left to copy
            t.copy_(src)


@register("copy")
class CopyBound(System):
    """The bound: ``copy_`` of every tensor into pre-allocated tensors; restore copies back.

    On CUDA the pre-allocated tensors are pinned host memory and the copies ``non_blocking``, then
    synchronised: the copy engine's rate, device to host and back.
    """

    kind = "bound"
    describe = "copy_ into pre-allocated tensors (the bound; on CUDA: into pinned host memory)"

    def setup(self) -> None:
        cuda = self.ctx.cuda
        self.snap = {k: (torch.empty(t.shape, dtype=t.dtype, pin_memory=True) if cuda and t.is_cuda
                         else torch.empty_like(t)) for k, t in self.ctx.work.flat.items()}

    def begin(self, step: int) -> dict[str, float]:
        for k, t in self.ctx.work.flat.items():
            self.snap[k].copy_(t, non_blocking=self.ctx.cuda)
        self.ctx.sync()
        return {}

    def finish(self) -> dict[str, float | None]:
        return {"complete": time.perf_counter(), "committed": None, "durable": None}

    def restore(self) -> None:
        for name, t in self.ctx.work.flat.items():
            t.copy_(self.snap[name], non_blocking=self.ctx.cuda)
        self.ctx.sync()

    def extras(self) -> dict[str, Any]:
        """xxh3-128 hashing speed (over the host copy) and copy_ speed over the state, in GiB/s."""
        flat = self.snap
        nbytes = self.ctx.work.nbytes
        views = [t.numpy().data.cast("B") for t in flat.values()]
        t0 = time.perf_counter()
        for v in views:
            xxhash.xxh3_128(v).digest()
        t_hash = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.begin(0)
        t_copy = time.perf_counter() - t0
        gib = nbytes / 2**30
        return {"xxh3_128_gib_s": gib / t_hash, "copy_gib_s": gib / t_copy, "state_bytes": nbytes}

    def teardown(self) -> None:
        self.snap = {}


class _FileSystem(System):
    """Common parts of the systems that write under a directory."""

    root_base = "shm"

    def setup(self) -> None:
        base = self.ctx.shm_dir if self.root_base == "shm" else self.ctx.disk_dir
        self.root = os.path.join(base, self.name)
        os.makedirs(self.root, exist_ok=True)
        self.path = ""

    def shm_bytes(self) -> int | None:
        if self.root_base != "shm":
            return 0
        return dir_bytes(self.root) // self._share()

    def _share(self) -> int:
        return 1

    def cleanup(self) -> None:
        if self.path and os.path.exists(self.path):
            if os.path.isdir(self.path):
                if self.ctx.rank == 0:
                    shutil.rmtree(self.path, ignore_errors=True)
            else:
                os.unlink(self.path)

    def teardown(self) -> None:
        self.cleanup()


@register("torch_save_shm")
class TorchSaveShm(_FileSystem):
    """``torch.save`` of the flat state dict to /dev/shm; restore: ``torch.load(mmap=True, weights_only=True)`` + ``copy_``."""

    describe = "torch.save to /dev/shm"
    fsync = False

    def begin(self, step: int) -> dict[str, float]:
        self.path = os.path.join(self.root, f"step{step}.rank{self.ctx.rank}.pt")
        with open(self.path, "wb") as f:
            torch.save(self.ctx.work.state_dict(), f)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        return {}

    def finish(self) -> dict[str, float | None]:
        t = time.perf_counter()
        if self.fsync:
            return {"complete": t, "committed": t, "durable": t}
        return {"complete": t, "committed": t, "durable": None}

    def shm_bytes(self) -> int | None:
        if self.root_base != "shm" or not os.path.exists(self.path):
            return 0
        return os.stat(self.path).st_blocks * 512

    def restore(self) -> None:
        loaded = torch.load(self.path, mmap=True, weights_only=True)
        _load_into(self.ctx.work.flat, loaded)


@register("torch_save_disk")
class TorchSaveDisk(TorchSaveShm):
    """``torch.save`` to a file on local disk, then ``fsync`` (restore reads through the page cache)."""

    describe = "torch.save to local disk + fsync"
    root_base = "disk"
    fsync = True


class _Dcp(_FileSystem):
    """Common parts of the DCP systems: a ``FileSystemWriter`` per step under /dev/shm."""

    def _share(self) -> int:
        return self.ctx.world

    def _writer(self, step: int) -> dcp.FileSystemWriter:
        self.path = os.path.join(self.root, f"step{step}")
        return dcp.FileSystemWriter(self.path)

    def restore(self) -> None:
        dcp.load(self.ctx.work.state_dict(), checkpoint_id=self.path, process_group=self.ctx.pg)


@register("dcp_save")
class DcpSave(_Dcp):
    """``dcp.save`` with ``FileSystemWriter`` to /dev/shm (blocking); restore is ``dcp.load`` into the live tensors."""

    describe = "dcp.save FileSystemWriter to /dev/shm (restore: dcp.load)"

    def begin(self, step: int) -> dict[str, float]:
        dcp.save(self.ctx.work.state_dict(), storage_writer=self._writer(step), process_group=self.ctx.pg)
        return {}

    def finish(self) -> dict[str, float | None]:
        t = time.perf_counter()
        return {"complete": t, "committed": t, "durable": None}


class _DcpAsyncBase(_Dcp):
    background = True

    def _track(self, fut: Any) -> None:  # a Future, or an AsyncSaveResponse on newer torch
        self._fut = fut
        self._t_done: float | None = None
        self._ev = threading.Event()

        def cb(_f: Future) -> None:
            self._t_done = time.perf_counter()
            self._ev.set()

        fut.add_done_callback(cb)

    def done(self) -> bool:
        return self._ev.is_set()

    def finish(self) -> dict[str, float | None]:
        self._fut.result()
        self._ev.wait()
        t = self._t_done
        return {"complete": t, "committed": t, "durable": None}


@register("dcp_async")
class DcpAsync(_DcpAsyncBase):
    """``dcp.async_save`` with its defaults (blocking staging into fresh CPU copies, thread executor)."""

    describe = "dcp.async_save default (thread)"

    def begin(self, step: int) -> dict[str, float]:
        fut = dcp.async_save(
            self.ctx.work.state_dict(), storage_writer=self._writer(step), process_group=self.ctx.pg
        )
        self._track(fut)
        return {}


@register("dcp_async_staged")
class DcpAsyncStaged(_DcpAsyncBase):
    """``dcp.async_save`` with a reused ``DefaultStager`` doing async staging (the best this torch has on CPU).

    ``StagingOptions(use_pinned_memory=False, use_shared_memory=False,
    use_async_staging=True, use_non_blocking_copy=False)``: pinning and
    non-blocking copies need an accelerator; on CUDA both are on (the
    pinned-memory stager, torchtitan's configuration). The stager caches its
    staging storages across saves. ``async_save`` returns at once (mark
    ``returns_s``); the stall ends when the staging future completes.
    """

    describe = "dcp.async_save, reused DefaultStager, async staging"

    def setup(self) -> None:
        super().setup()
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # lazy: newer torch only
        except ImportError as e:  # older torch
            raise SystemUnavailable(f"torch {torch.__version__} has no DefaultStager: {e}") from e
        cuda = self.ctx.cuda
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=cuda,
            )
        )

    def begin(self, step: int) -> dict[str, float]:
        resp = dcp.async_save(
            self.ctx.work.state_dict(),
            storage_writer=self._writer(step),
            process_group=self.ctx.pg,
            async_stager=self.stager,
        )
        t_ret = time.perf_counter()
        staging = getattr(resp, "staging_completion", None)
        upload = getattr(resp, "upload_completion", resp)
        self._track(upload)
        if staging is not None:
            staging.result()
        return {"returns": t_ret}

    def teardown(self) -> None:
        super().teardown()
        self.stager.close()


@register("dcp_async_staged_lazy")
class DcpAsyncStagedLazy(LazySystem, DcpAsyncStaged):
    """DCP's "zero-overhead" checkpointing (as torchtitan uses it): ``async_save`` with the reused stager and
    async staging, the stand-in forward/backward, then the staging future awaited just before the update."""

    describe = ("dcp.async_save, reused DefaultStager, async staging, staging awaited before the update "
                "(stand-in forward/backward between)")

    def setup(self) -> None:
        super().setup()
        self.setup_window()

    def start(self, step: int) -> None:
        resp = dcp.async_save(
            self.ctx.work.state_dict(),
            storage_writer=self._writer(step),
            process_group=self.ctx.pg,
            async_stager=self.stager,
        )
        self._staging = getattr(resp, "staging_completion", None)
        self._track(getattr(resp, "upload_completion", resp))

    def before_update(self) -> None:
        if self._staging is not None:
            self._staging.result()


class _TorchSnapshot(_FileSystem):
    """Common parts of the torchsnapshot peers: one snapshot directory per step under /dev/shm, every rank's
    tensors under its own name (a ``StateDict`` of the flat state, not replicated), the systems' process group.

    torchsnapshot is optional (``pip install tierstore[bench]`` or ``pip install torchsnapshot``): where it
    cannot be imported, or its take and restore do not run with this torch, :meth:`setup` raises
    :class:`SystemUnavailable` with the reason (the report lists it under Skipped).
    """

    def _share(self) -> int:
        return self.ctx.world

    def setup(self) -> None:
        super().setup()
        try:
            import torchsnapshot  # lazy: optional, only in a rank
        except Exception as e:
            raise SystemUnavailable(f"torchsnapshot is not importable with torch {torch.__version__} "
                                    f"({type(e).__name__}: {e})") from e
        self._ts = torchsnapshot
        self.app_state = {"state": torchsnapshot.StateDict(**self.ctx.work.state_dict())}

    def _path(self, step: int) -> str:
        self.path = os.path.join(self.root, f"step{step}")
        return self.path

    def restore(self) -> None:
        """``Snapshot(path).restore(app_state)``: torchsnapshot reads into the ``StateDict``'s tensors in place
        (the live ones); a value it replaced instead is copied into the live tensor."""
        self._ts.Snapshot(path=self.path, pg=self.ctx.pg).restore(app_state=self.app_state)
        state = self.app_state["state"]
        _load_into(self.ctx.work.flat, dict(state.items()))
        state.update(self.ctx.work.state_dict())


@register("torchsnapshot")
class TorchSnapshotTake(_TorchSnapshot):
    """``torchsnapshot.Snapshot.take`` to /dev/shm (blocking); restore: ``Snapshot.restore`` + ``copy_``."""

    describe = "torchsnapshot Snapshot.take to /dev/shm (restore: Snapshot.restore)"

    def begin(self, step: int) -> dict[str, float]:
        self._ts.Snapshot.take(path=self._path(step), app_state=self.app_state, pg=self.ctx.pg)
        return {}

    def finish(self) -> dict[str, float | None]:
        t = time.perf_counter()
        return {"complete": t, "committed": t, "durable": None}


@register("torchsnapshot_async")
class TorchSnapshotAsync(_TorchSnapshot):
    """``torchsnapshot.Snapshot.async_take``: returns once the state is staged in memory (the stall); the
    write and the snapshot's metadata (committed) follow in the background, ``PendingSnapshot.wait()``."""

    describe = "torchsnapshot Snapshot.async_take to /dev/shm (stall: until staged)"
    background = True

    def begin(self, step: int) -> dict[str, float]:
        self._pending = self._ts.Snapshot.async_take(path=self._path(step), app_state=self.app_state,
                                                     pg=self.ctx.pg)
        return {}

    def done(self) -> bool:
        return bool(self._pending.done())

    def finish(self) -> dict[str, float | None]:
        self._pending.wait()
        t = time.perf_counter()
        return {"complete": t, "committed": t, "durable": None}
