"""Configuration: one frozen dataclass, passed explicitly, with one env layer.

Explicit arguments win over ``TIERSTORE_*`` environment variables, which win
over defaults. The environment is read only in :meth:`StoreConfig.from_env`.

=============================  ===============================================
variable                       field
=============================  ===============================================
``TIERSTORE_HOME``             ``home`` (data directory; default ``./.tierstore``)
``TIERSTORE_REDIS``            ``redis_url`` (``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://``)
``TIERSTORE_REDIS_PASSWORD``   ``redis_password``
``TIERSTORE_INDEX_REPLICAS``   ``index_replicas`` (``auto`` or an integer)
``TIERSTORE_ACK_TIMEOUT``      ``index_ack_timeout_s`` (seconds)
``TIERSTORE_DURABLE``          ``durable_url`` (``file://...``, ``s3://bucket/prefix``, ``none``)
``TIERSTORE_S3_ENDPOINT``      ``s3_endpoint_url``
``TIERSTORE_HOST_ROOT``        ``host_root`` (shared-memory directory of the host tier)
``TIERSTORE_HOST_CAPACITY``    ``host_capacity_bytes``
``TIERSTORE_NODE``             ``node_id``
``TIERSTORE_PEER_REPLICAS``    ``peer_replicas``
``TIERSTORE_PEER_SECRET_FILE`` ``peer_secret_file``
``TIERSTORE_SHM_DIR``          ``shm_dir`` (where derived host roots go; default ``/dev/shm``)
``TIERSTORE_REBUILD_INDEX``    ``rebuild_index_on_loss`` (``1``/``true``: rebuild a lost index)
``TIERSTORE_BACKGROUND_NICE``  ``background_nice``
``TIERSTORE_DEVICE_TIER``      ``device_tier`` (``auto``, ``off``, ``cpu``, ``cuda``, ``cuda:N``)
``TIERSTORE_DEVICE_CAPACITY``  ``device_capacity_bytes``
=============================  ===============================================
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from backends.retry import RetryPolicy
from tierstore.errors import ConfigError

__all__ = ["StoreConfig"]

_ENV = {
    "home": "TIERSTORE_HOME",
    "redis_url": "TIERSTORE_REDIS",
    "redis_password": "TIERSTORE_REDIS_PASSWORD",
    "index_replicas": "TIERSTORE_INDEX_REPLICAS",
    "index_ack_timeout_s": "TIERSTORE_ACK_TIMEOUT",
    "durable_url": "TIERSTORE_DURABLE",
    "s3_endpoint_url": "TIERSTORE_S3_ENDPOINT",
    "host_root": "TIERSTORE_HOST_ROOT",
    "host_capacity_bytes": "TIERSTORE_HOST_CAPACITY",
    "node_id": "TIERSTORE_NODE",
    "peer_replicas": "TIERSTORE_PEER_REPLICAS",
    "peer_secret_file": "TIERSTORE_PEER_SECRET_FILE",
    "shm_dir": "TIERSTORE_SHM_DIR",
    "rebuild_index_on_loss": "TIERSTORE_REBUILD_INDEX",
    "background_nice": "TIERSTORE_BACKGROUND_NICE",
    "device_tier": "TIERSTORE_DEVICE_TIER",
    "device_capacity_bytes": "TIERSTORE_DEVICE_CAPACITY",
    "pin_host_bytes": "TIERSTORE_PIN_HOST_BYTES",
}
_VERIFY = ("auto", "full", "trailer")
_DEVICE_TIERS = ("auto", "off", "cpu", "cuda")


@dataclass(frozen=True)
class StoreConfig:
    """How a :class:`~tierstore.store.TierStore` is put together.

    Memory bound: the host tier holds at most ``host_capacity_bytes`` of
    shared memory (objects, reservations and the reuse pool together; the pool
    alone at most ``host_pool_bytes``). Migration to the durable tier reads
    objects from the host tier in place, so it adds at most
    ``migration_workers`` x the S3 backend's part buffers, not a copy of the
    state.

    Attributes:
        home: data directory of the embedded default (index server, durable dir).
        redis_url: the index; ``None`` starts the embedded server in ``home``.
        redis_password: AUTH password (never logged).
        index_replicas: replicas of the index that must acknowledge (``WAIT``)
            every state change of the commit protocol (begin, vote, durable,
            new epoch) before it is reported; a shortfall raises
            :class:`~tierstore.errors.ReplicaAckError` and the change is not
            acknowledged. ``None`` (auto): 1 when the index is replicated (a
            cluster whose every primary has a replica online, or a server with
            a connected replica), else 0 (the embedded server, a single server).
        index_ack_timeout_s: how long a state change waits for those acknowledgements.
        durable_url: ``file://dir`` or ``s3://bucket/prefix``; ``None`` means
            ``home/durable``; ``"none"`` disables the durable tier.
        s3_endpoint_url: for S3-compatible servers (moto, MinIO).
        host_root: the host tier's shared-memory directory; ``None`` derives
            one in ``/dev/shm`` from ``home`` and ``node_id``.
        host_capacity_bytes: host tier budget; ``None`` is unbounded.
        host_pool_bytes: freed segments kept for reuse (fast snapshots), node-wide.
        host_pool_segments: at most this many freed segments wait in the pool
            (node-wide), and mappings of at most four times as many segments are
            kept per process (so a checkpoint of thousands of layers reuses its
            segments and their mappings); neither holds a file descriptor.
        node_id: this node's name (agents, peer placement).
        migrate: migrate every put to the durable tier in the background.
        migration_queue: at most this many objects wait for migration; a put
            blocks when the queue is full (back-pressure, bounded memory).
        migration_workers: threads migrating to the durable tier.
        max_delta_chain: longest delta chain a read follows.
        peer_replicas: replicas of every object in other nodes' host tiers
            (through their agents, found in the index); 0 disables the peer tier.
        shm_dir: the shared-memory directory in which a derived ``host_root`` is made.
        peer_secret_file: the agents' shared secret (needed with peer_replicas).
        durable_every: objects of every K-th step go to the durable tier (full
            objects always do); 0 sends only full objects.
        migration_retries: retries after a transient failure (a tier or the index
            unreachable), with exponential backoff from ``migration_backoff_s`` up to
            ``migration_backoff_max_s`` (:attr:`retry`): of one object's migration
            (then its step is recorded as staying in memory only), of a read or a
            restore's verification (then the copy is unknown, never lost), of the
            commit protocol's calls to the durable tier.
        rebuild_index_on_loss: when the index has no record of a model whose
            durable tier holds its manifests (a lost index), rebuild it from the
            durable tier instead of raising :class:`~tierstore.errors.IndexLostError`.
        restore_verify: how ``resolve`` verifies the objects it chose: ``"auto"``
            hashes copies in tiers read locally (host, a local durable directory)
            and compares the stored trailer with the index's checksum in remote
            ones (S3, peers); ``"full"`` hashes every copy; ``"trailer"`` reads
            only trailers.
        background_nice: the store's background threads (migration,
            replication, :meth:`~tierstore.store.TierStore.finish_async`) run this
            much nicer than the thread that opened the store (Linux, per thread;
            0 keeps the trainer's priority). Default 10: on a node whose ranks use
            every core, the trainer gets ~90% of a contended core.
        device_tier: where snapshots land first (:mod:`tierstore.store.device_tier`):
            ``"auto"`` (default) puts a full object whose tensors all live on
            one CUDA device into reused buffers on that device, drained to the
            host tier in ``finish()``, and reads it back from there while it is
            the copy the index records (a rollback); objects of CPU tensors, and
            every object on a machine without CUDA, take the host path as with
            ``"off"``. ``"cuda"``/``"cuda:N"``: likewise, on that device only.
            ``"cpu"``: the same tier for CPU tensors, in this process's memory
            (the drain and rollback logic without a GPU; an extra copy).
        device_capacity_bytes: the device tier's buffers at most (two sets per
            layer and rank: the newest copy and the one being made); ``None``:
            a quarter of a CUDA device's memory and at most half of what is free
            at the first snapshot staged there; unbounded on ``"cpu"``. A
            snapshot that does not fit takes the host path.
        pin_host_bytes: host-tier segments a CUDA process writes into are
            page-locked (``cudaHostRegister``) once and stay so while reused,
            up to this many bytes per process (:mod:`backends.pinning`), so
            device-to-host copies into them run at the copy engine's rate;
            past it (or where registration fails) copies are pageable.
            ``None`` (default): a quarter of the machine's memory; 0: never.
            Nothing is page-locked in a process that saves no CUDA tensor.
        index_timeout_s: the bound of one index call (issue 28: every wait ends): the socket
            timeout of each command (raised past ``index_ack_timeout_s`` + 5 s when replicas must
            acknowledge); a command that timed out is never sent again by the client (a script may have
            run), one whose connection broke is retried once, at once; so an index that stopped
            answering fails each call with :class:`~tierstore.errors.TierUnavailableError` within about
            this bound (twice it at most), and the caller's retry policy (``migration_retries``) decides.
        durable_stall_s: a migration to the durable tier that has not finished an object after this many
            seconds is reported stalled: a warning naming the tier, step and what it is blocked in
            (``TierStore.durable_stalled()``). ``None``: never reported.
        flush_timeout_s: the bound of :meth:`~tierstore.store.TierStore.flush` (and the default of
            ``Checkpointer.wait(durable=True)``'s): past it, :class:`~tierstore.errors.DurableTimeoutError`
            names the steps still memory-only. ``None``: unbounded.
        close_timeout_s: the bound of :meth:`~tierstore.store.TierStore.close` in all: the wait for the
            background work (migration, replication, ``finish_async``); past it close returns anyway,
            with a warning naming the steps that stay memory-only (also its return value and
            ``TierStore.memory_only_at_close``). ``None``: unbounded.
        lazy_check: how a lazy save (``Checkpointer(..., lazy=True)``) checks that
            what it copied is what ``save()`` saw, for writes the version counter
            does not see (``p.data``, a numpy view, ``untyped_storage()``;
            :mod:`tierstore.train.lazy`): ``"sample"`` (default) compares
            ``lazy_check_samples`` elements per tensor, ``"full"`` an xxh3-128
            digest of every byte (certain, costs about one more copy at
            ``save()``), ``"off"`` only the version counters.
        lazy_check_samples: elements per tensor ``"sample"`` compares (default 64).
        publish_batch: at most this many host-tier objects of one model are recorded in the index by
            one call when :meth:`~tierstore.store.TierStore.finish_async` or
            :meth:`~tierstore.store.TierStore.finish_many` finishes several (default 64; 1: one call
            per object, as ``PendingObject.finish()``); the outcome is the one finishing them one by
            one gives. A batch is one script on the index server: larger ones hold it longer.
        table_cache: how many parsed object tables (each at most 16 KiB) the codec keeps, least
            recently used out, so a restore that reads the same layouts again skips their JSON parse
            and checks (default 1024; 0: parse every time). Process-wide: the store opened last sets it
            (:func:`tierstore.codec.head.set_table_cache_max`).
        hold_gc: hold Python's cyclic garbage collector off while a call copies many objects on the
            caller's thread (:meth:`~tierstore.store.TierStore.snapshot_many`,
            :meth:`~tierstore.store.TierStore.get_many` and ``get_many_deferred``; a Checkpointer's
            ``save()`` and ``restore()``), and give it back after, if it ran before
            (:mod:`tierstore.gchold`). Default ``True``.
    """

    home: str = ".tierstore"
    redis_url: str | None = None
    redis_password: str | None = None
    index_replicas: int | None = None
    index_ack_timeout_s: float = 2.0
    durable_url: str | None = None
    s3_endpoint_url: str | None = None
    host_root: str | None = None
    host_capacity_bytes: int | None = None
    host_pool_bytes: int = 8 << 30
    host_pool_segments: int = 4096
    node_id: str = ""
    migrate: bool = True
    migration_queue: int = 1024
    migration_workers: int = 1
    max_delta_chain: int = 64
    peer_replicas: int = 0
    peer_secret_file: str | None = None
    durable_every: int = 1
    shm_dir: str = "/dev/shm"
    migration_retries: int = 5
    migration_backoff_s: float = 0.05
    migration_backoff_max_s: float = 5.0
    rebuild_index_on_loss: bool = False
    restore_verify: str = "auto"
    background_nice: int = 10
    device_tier: str = "auto"
    device_capacity_bytes: int | None = None
    pin_host_bytes: int | None = None
    index_timeout_s: float = 10.0
    durable_stall_s: float | None = 10.0
    flush_timeout_s: float | None = 600.0
    close_timeout_s: float | None = 30.0
    lazy_check: str = "sample"
    lazy_check_samples: int = 64
    publish_batch: int = 64
    table_cache: int = 1024
    hold_gc: bool = True

    @property
    def retry(self) -> RetryPolicy:
        """How a tier that did not answer is asked again (migration, reads, restore, the commit protocol)."""
        return RetryPolicy(self.migration_retries, self.migration_backoff_s, self.migration_backoff_max_s)

    def __post_init__(self) -> None:
        if self.host_capacity_bytes is not None and self.host_capacity_bytes <= 0:
            raise ConfigError("host_capacity_bytes must be positive")
        if self.index_replicas is not None and self.index_replicas < 0:
            raise ConfigError("index_replicas must be >= 0 (or None: auto)", field="index_replicas")
        if not self.index_ack_timeout_s > 0:
            raise ConfigError("index_ack_timeout_s must be positive", field="index_ack_timeout_s")
        if self.migration_queue <= 0 or self.migration_workers <= 0:
            raise ConfigError("migration_queue and migration_workers must be positive")
        if self.migration_retries < 0 or self.migration_backoff_s < 0 or self.migration_backoff_max_s < 0:
            raise ConfigError("migration_retries and the migration backoffs must be >= 0")
        if self.max_delta_chain < 0:
            raise ConfigError("max_delta_chain must be >= 0", field="max_delta_chain")
        if self.restore_verify not in _VERIFY:
            raise ConfigError(f"restore_verify must be one of {_VERIFY}, got {self.restore_verify!r}",
                              field="restore_verify")
        if not 0 <= self.background_nice <= 19:
            raise ConfigError(f"background_nice must be within 0..19, got {self.background_nice}")
        if self.host_pool_segments < 0:
            raise ConfigError("host_pool_segments must be >= 0")
        tier = self.device_tier
        if not (tier in _DEVICE_TIERS or (tier.startswith("cuda:") and tier[5:].isdigit())):
            raise ConfigError(f"device_tier must be one of {_DEVICE_TIERS} or 'cuda:N', got {tier!r}",
                              field="device_tier")
        if self.device_capacity_bytes is not None and self.device_capacity_bytes <= 0:
            raise ConfigError("device_capacity_bytes must be positive", field="device_capacity_bytes")
        if not self.index_timeout_s > 0:
            raise ConfigError("index_timeout_s must be positive", field="index_timeout_s")
        for name in ("durable_stall_s", "flush_timeout_s", "close_timeout_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ConfigError(f"{name} must be positive (or None: unbounded)", field=name)
        if self.pin_host_bytes is not None and self.pin_host_bytes < 0:
            raise ConfigError("pin_host_bytes must be >= 0 (or None: auto)", field="pin_host_bytes")
        if self.lazy_check not in ("sample", "full", "off"):  # tierstore.train.lazy.CHECKS
            raise ConfigError(f"lazy_check must be 'sample', 'full' or 'off', got {self.lazy_check!r}",
                              field="lazy_check")
        if isinstance(self.publish_batch, bool) or not isinstance(self.publish_batch, int) or self.publish_batch < 1:
            raise ConfigError(f"publish_batch must be a positive int, got {self.publish_batch!r}",
                              field="publish_batch")
        if isinstance(self.table_cache, bool) or not isinstance(self.table_cache, int) or self.table_cache < 0:
            raise ConfigError(f"table_cache must be an int >= 0, got {self.table_cache!r}", field="table_cache")
        if isinstance(self.lazy_check_samples, bool) or not isinstance(self.lazy_check_samples, int) \
                or self.lazy_check_samples < 1:
            raise ConfigError(f"lazy_check_samples must be a positive int, got {self.lazy_check_samples!r}",
                              field="lazy_check_samples")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **explicit: Any) -> StoreConfig:
        """Defaults, overridden by ``TIERSTORE_*`` variables, overridden by ``explicit``."""
        env = os.environ if environ is None else environ
        known = {f.name for f in fields(cls)}
        unknown = set(explicit) - known
        if unknown:
            raise ConfigError(f"unknown configuration fields: {', '.join(sorted(unknown))}")
        values: dict[str, Any] = {}
        for name, var in _ENV.items():
            if var in env and env[var] != "":
                values[name] = env[var]
        if str(values.get("index_replicas", "")).lower() == "auto":
            del values["index_replicas"]
        if "index_ack_timeout_s" in values:
            try:
                values["index_ack_timeout_s"] = float(values["index_ack_timeout_s"])
            except ValueError as e:
                raise ConfigError(f"{_ENV['index_ack_timeout_s']} must be a number: {e}") from e
        for name in ("host_capacity_bytes", "peer_replicas", "index_replicas", "background_nice",
                     "device_capacity_bytes", "pin_host_bytes"):
            if name in values:
                try:
                    values[name] = int(values[name])
                except ValueError as e:
                    raise ConfigError(f"{_ENV[name]} must be an integer: {e}") from e
        if "rebuild_index_on_loss" in values:
            text = str(values["rebuild_index_on_loss"]).strip().lower()
            if text not in ("1", "true", "yes", "0", "false", "no"):
                raise ConfigError(f"{_ENV['rebuild_index_on_loss']} must be 1/true/yes or 0/false/no, got {text!r}")
            values["rebuild_index_on_loss"] = text in ("1", "true", "yes")
        values.update({k: v for k, v in explicit.items() if v is not None})
        return cls(**values)

    def resolved(self) -> StoreConfig:
        """A copy with derived defaults filled in (absolute home, node id, host root)."""
        home = str(Path(self.home).resolve())
        node = self.node_id or socket.gethostname().split(".")[0] or "node"
        host_root = self.host_root
        if host_root is None:
            digest = hashlib.sha256(home.encode()).hexdigest()[:12]
            base = self.shm_dir if os.path.isdir(self.shm_dir) else os.path.join(home, "shm")
            host_root = os.path.join(base, f"tierstore-{digest}", node)
        durable = self.durable_url
        if durable is None:
            durable = "file://" + os.path.join(home, "durable")
        return replace(self, home=home, node_id=node, host_root=host_root, durable_url=durable)
