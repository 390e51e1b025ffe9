"""tierstore's systems, added to the registry when ``tierstore.store.open`` is importable.

``tierstore_host``: the save copies every layer once, straight into its
host-tier shared-memory object (``store.snapshot``: the stall), then a
background thread seals (xxh3-128), publishes and indexes each shard keyed
``bench/<layer>/<step>/<rank>`` (``store.finish_async``: the store's sealing
thread, at its background priority); it is *committed* when the last one is.
Segments are pre-allocated in setup and recycled after each round's cleanup,
as the Checkpointer does. Restore gets every shard back into
the live tensors at the copy's speed (``store.get_many_deferred(keys, outs=...)``:
one index round trip, the checksums hashed beside the copies on a thread of
their own); its ``verified`` mark is when every checksum matched (what the
first optimizer update waits for after a Checkpointer's restore). The
store is opened with ``home`` in the run's disk directory, ``host_root`` in its
/dev/shm directory and ``durable="none"`` unless ``options["tierstore_open"]``
says otherwise; rank 0 opens first, and stops the embedded server it started at
teardown. Where tierstore cannot be imported or opened,
the system is skipped and the reason lands in :data:`tierstore.bench.systems.SKIPPED`.

``tierstore_device`` (CUDA only): as ``tierstore_host`` with the device tier
on: the snapshot lands in reused GPU buffers, drained into the host tier by
the sealing thread; restore is the rollback from device memory.

On CUDA (``tierstore bench --device cuda``, ``bench/gpu_check.sh``) the host
tier's segments are page-locked (``pin_host_bytes``); ``tierstore_host``
copies device to host synchronously into them; ``tierstore_lazy`` enqueues the
copies on a side stream after ``save()`` (:mod:`tierstore.store.copies`).

``tierstore_lazy``: the trainer-facing path, lazily: a
:class:`~tierstore.train.checkpointer.Checkpointer` with ``lazy=True`` (exact
policy, ``keep_last=1``, host tier pre-allocated for two generations) over the
workload seen as a module (its parameters) and an AdamW optimizer (its
state), sharing the workload's tensors. ``save(step)`` returns once the step
is begun; the stand-in forward/backward runs while the copy does; the
optimizer's ``step()`` (no gradients: only its pre-hooks run) blocks until
the copy is done (:class:`~tierstore.bench.systems.LazySystem`). It is
*committed* when ``ckpt.wait()`` returns. Restore is not measured here (the
Checkpointer's restore goes through ``load_state_dict``; ``tierstore_host``
measures the host tier's).
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tierstore.bench.systems import SKIPPED, LazySystem, System, SystemUnavailable, barrier, register
from tierstore.embedded import stop_server
from tierstore.keys import ShardKey
from tierstore.train.checkpointer import Checkpointer
from tierstore.train.policies import exact

__all__ = ["TierstoreDevice", "TierstoreHost", "TierstoreLazy", "shard_tensors"]

MODEL = "bench"


def shard_tensors(shard: Any) -> Mapping[str, torch.Tensor]:
    """The tensors of what ``store.get`` returned (a mapping, or an object with ``.tensors``)."""
    if isinstance(shard, Mapping):
        return shard
    tensors = getattr(shard, "tensors", None)
    if isinstance(tensors, Mapping):
        return tensors
    raise TypeError(f"cannot find tensors in {type(shard).__name__}")


_open: Any
try:
    from tierstore.connect import open as _open
except Exception as e:  # noqa: BLE001 - any import failure means: skip, with the reason
    _open = None
    SKIPPED["tierstore_host"] = f"tierstore.open is not importable ({type(e).__name__}: {e})"


if _open is not None:

    @register("tierstore_host")
    class TierstoreHost(System):
        """Snapshot straight into the host tier, then seal and publish per layer in a background thread."""

        kind = "tierstore"
        background = True
        describe = "tierstore: snapshot straight into host-tier shared memory, seal+publish in background"

        def setup(self) -> None:
            self._open_store()
            try:
                self._get_out = "out" in inspect.signature(self.store.get).parameters
            except (TypeError, ValueError):
                self._get_out = False
            self.staging = dict(self.ctx.work.layers)  # snapshots go straight into the host tier
            self.keys: list[Any] = []
            self._pending: list[Any] = []

            sizes = [self.store.snapshot_nbytes(group) for group in self.staging.values()]
            self.store.host.preallocate(sizes)  # pre-faulted segments, reused after each round's cleanup
            self._thread: threading.Thread | None = None

        def _open_store(self) -> None:
            self._key = ShardKey
            given = self.ctx.options.get("tierstore_open")
            kwargs = dict(given or self.default_open_kwargs())
            self._own_home = None if given else kwargs["home"]
            err: BaseException | None = None
            # Rank 0 opens first (it may start the embedded server the ranks share).
            if self.ctx.rank != 0:
                barrier()
            try:
                self.store = _open(**kwargs)
            except Exception as e:  # noqa: BLE001
                err = e
            finally:
                if self.ctx.rank == 0:
                    barrier()
            if err is not None:
                raise SystemUnavailable(f"tierstore.open({kwargs}) failed: {type(err).__name__}: {err}") from err

        def default_open_kwargs(self) -> dict[str, Any]:
            """The embedded default, host tier only, everything inside the run's directories
            (removed after the run; the embedded server is stopped in :meth:`teardown`)."""
            return {
                "home": os.path.join(self.ctx.disk_dir, "tierstore"),
                "host_root": os.path.join(self.ctx.shm_dir, "tierstore-host"),
                "durable": "none",
                "device_tier": "off",  # straight into the host tier (page-locked on CUDA); tierstore_device stages
            }

        def _layer(self, layer: str) -> str:
            return layer.split(".", 1)[1] if "." in layer else layer

        def begin(self, step: int) -> dict[str, float]:
            self.keys = [
                self._key(MODEL, self._layer(layer), step, self.ctx.rank) for layer in self.staging
            ]
            # the stall: one copy of each layer straight into its shared-memory object (snapshot_many: with the
            # cyclic garbage collector held off for the loop, as a Checkpointer's save holds it)
            self._pending = self.store.snapshot_many([(key, group, None)
                                                      for key, group in zip(self.keys, self.staging.values())])
            self._t_done: float | None = None
            self._err: BaseException | None = None
            self._ev = threading.Event()
            finish_async = getattr(self.store, "finish_async", None)
            if finish_async is not None:  # the store's own sealing thread, at its background priority
                fut = finish_async(self._pending)
                fut.add_done_callback(self._sealed)
            else:
                self._thread = threading.Thread(target=self._put_all, name="bench-tierstore-put", daemon=True)
                self._thread.start()
            return {}

        def _sealed(self, fut: Any) -> None:
            self._t_done = time.perf_counter()
            self._err = fut.exception()
            self._ev.set()

        def _put_all(self) -> None:
            try:
                for pending in self._pending:
                    pending.finish()  # checksum, publish, index
                self._t_done = time.perf_counter()
            except BaseException as e:  # noqa: BLE001 - re-raised in finish()
                self._err = e
            finally:
                self._ev.set()

        def done(self) -> bool:
            return self._ev.is_set()

        def finish(self) -> dict[str, float | None]:
            self._ev.wait()
            if self._thread is not None:
                self._thread.join()
                self._thread = None
            if self._err is not None:
                raise self._err
            return {"complete": self._t_done, "committed": self._t_done, "durable": None}

        def restore(self) -> None:
            groups = list(self.ctx.work.layers.values())
            deferred = getattr(self.store, "get_many_deferred", None)
            if deferred is not None:  # copied at the copy's speed, each shard's checksum verified beside it
                shards, self._verification = deferred(self.keys, outs=groups)
                for key, got in zip(self.keys, shards):
                    if got is None:
                        raise RuntimeError(f"tierstore lost shard {key}")
                return
            get_many = getattr(self.store, "get_many", None)
            if get_many is not None:  # one index round trip for every shard, each verified as it is copied
                for key, got in zip(self.keys, get_many(self.keys, outs=groups)):
                    if got is None:
                        raise RuntimeError(f"tierstore lost shard {key}")
                return
            for key, group in zip(self.keys, groups):
                if self._get_out:
                    if self.store.get(key, out=group) is None:
                        raise RuntimeError(f"tierstore lost shard {key}")
                    continue
                shard = self.store.get(key)
                if shard is None:
                    raise RuntimeError(f"tierstore lost shard {key}")
                got = shard_tensors(shard)
                for k, t in group.items():
                    t.copy_(got[k])

        def verified(self) -> float | None:
            """Block until the last restore's copies verified; when they had (``None``: verified as copied)."""
            v, self._verification = getattr(self, "_verification", None), None
            if v is None:
                return None
            failures = v.wait()
            if failures:
                raise RuntimeError(f"tierstore restore: {len(failures)} copies failed verification: {failures[0]}")
            return v.t_done

        def shm_bytes(self) -> int | None:
            return None

        def cleanup(self) -> None:
            for key in self.keys:
                try:
                    self.store.delete(key)
                except Exception:  # noqa: BLE001, S110 - best effort, untimed
                    pass

        def teardown(self) -> None:
            try:
                self.cleanup()
                close = getattr(self.store, "close", None)
                if close is not None:
                    close()
            finally:
                self.staging = {}
                barrier()
                if self.ctx.rank == 0 and self._own_home is not None:
                    stop_server(self._own_home)

    @register("tierstore_device")
    class TierstoreDevice(TierstoreHost):
        """With the device tier: the snapshot is a device-to-device copy into reused GPU buffers (two sets
        per layer: extra GPU memory), drained into the host tier in the background; restore is the
        rollback from those buffers. CUDA only."""

        describe = ("tierstore with the device tier: snapshot into reused GPU buffers, drained into the host "
                    "tier in background; restore from device memory")

        def setup(self) -> None:
            if not self.ctx.cuda:
                raise SystemUnavailable("the device tier stages CUDA tensors: run with --device cuda")
            super().setup()

        def default_open_kwargs(self) -> dict[str, Any]:
            return {
                "home": os.path.join(self.ctx.disk_dir, "tierstore-device"),
                "host_root": os.path.join(self.ctx.shm_dir, "tierstore-device-host"),
                "durable": "none",
                "device_tier": "cuda",
            }

    def _as_module(layers: Mapping[str, Mapping[str, torch.Tensor]]) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The workload as a module (one submodule per layer, its ``param``, ``param1``, ...) and AdamW holding
        their state.

        Parameters and optimizer state share the workload's tensors: what the harness changes, they see.
        """
        root = nn.Module()
        params = []
        for name, group in layers.items():
            sub = nn.Module()
            for pname in [n for n in group if n.startswith("param")]:
                tag = pname[len("param"):]
                p = nn.Parameter(group[pname], requires_grad=True)
                sub.register_parameter(pname, p)
                params.append((p, {k: group[k + tag] for k in ("step", "exp_avg", "exp_avg_sq")}))
            root.add_module(name.split(".", 1)[-1], sub)
        opt = torch.optim.AdamW([p for p, _ in params], lr=1e-3)
        for p, state in params:
            opt.state[p] = state
        return root, opt

    @register("tierstore_lazy")
    class TierstoreLazy(LazySystem, TierstoreHost):
        """The Checkpointer with ``lazy=True``: the copy overlaps the stand-in forward/backward."""

        restores = False
        describe = ("tierstore Checkpointer(lazy=True): save() returns, the copy into host-tier shared memory "
                    "overlaps the stand-in forward/backward, optimizer.step()'s pre-hook waits for it")

        def setup(self) -> None:
            self._open_store()
            self.keys = []
            self.module, self.opt = _as_module(self.ctx.work.layers)
            self.ckpt = Checkpointer(self.store, MODEL + "-lazy", state={"model": self.module, "optim": self.opt},
                                     policy=exact(), group=self.ctx.pg, keep_last=1, lazy=True,
                                     layer_fn=lambda n: n.split(".", 1)[0])
            self.setup_window()

        def default_open_kwargs(self) -> dict[str, Any]:
            """As ``tierstore_host``'s, in directories of its own (its embedded server is its own to stop)."""
            return {
                "home": os.path.join(self.ctx.disk_dir, "tierstore-lazy"),
                "host_root": os.path.join(self.ctx.shm_dir, "tierstore-lazy-host"),
                "durable": "none",
                "device_tier": "off",
            }

        def start(self, step: int) -> None:
            self.ckpt.save(step)

        def before_update(self) -> None:
            self.opt.step()  # no gradients: the update changes nothing, its pre-hooks run (the gate)

        def done(self) -> bool:
            return not self.ckpt.saving

        def finish(self) -> dict[str, float | None]:
            state = self.ckpt.wait()
            if state != "committed":
                raise RuntimeError(f"tierstore_lazy: the step was {state}")
            t = time.perf_counter()
            return {"complete": t, "committed": t, "durable": None}

        def cleanup(self) -> None:
            """Nothing: the Checkpointer's retention (``keep_last=1``) recycles the older versions."""

        def extras(self) -> dict[str, Any]:
            return {**LazySystem.extras(self), "stats": self.ckpt.stats.as_dict()}

        def teardown(self) -> None:
            try:
                self.ckpt.close()
            finally:
                TierstoreHost.teardown(self)
