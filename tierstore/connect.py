"""``tierstore.open()``: build a :class:`~tierstore.store.TierStore` from URLs and config.

Lifecycle of the host tier's reuse pool: the store holds its host tier
(:class:`tierstore.home.HostUsers`) from ``open()`` to ``close()``. The store
that opens a host tier nobody else holds frees the pool's segments left by
earlier processes (nobody maps them); the last store to close it frees the
pool too. So a finished job leaves its objects in shared memory, not the
free segments it kept for reuse.

``open(..., create=False)`` is the open of the admin commands: it creates
nothing. A home without an index is an error, a missing host tier or local
durable directory reads as an empty tier, and an existing host tier is
neither held nor has its pool freed (the trainers using it decide that).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

from backends import open_backend
from backends.base import Backend, Buffer, Reservation
from backends.host import HostBackend
from backends.peer import PeerBackend
from consistency.index import Index
from consistency.nodes import discovery
from tierstore.config import StoreConfig
from tierstore.embedded import ensure_server
from tierstore.errors import ConfigError, TierUnavailableError, UnknownError
from tierstore.home import HostUsers, is_index_dir
from tierstore.store import TierStore

__all__ = ["open"]


def _peer_backend(cfg: StoreConfig, index: Index) -> Backend | None:
    if cfg.peer_replicas <= 0:
        return None
    if not cfg.peer_secret_file:
        raise ConfigError("peer_replicas needs peer_secret_file (the agents' shared secret)", field="peer_secret_file")
    try:
        secret = Path(cfg.peer_secret_file).read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"cannot read the peer secret file {cfg.peer_secret_file}: {e}") from e
    return PeerBackend(discovery(index), secret=secret, replication=cfg.peer_replicas,
                       local_node_id=cfg.node_id)


class _HeldHost(HostBackend):
    """The host tier of an open store: holds the tier while open, frees the pool when last to close."""

    def __init__(self, root: str, **kw: Any) -> None:
        super().__init__(root, **kw)
        self._users = HostUsers(root)
        if self._users.acquire():  # no one else holds it: the pool's segments are nobody's
            self.drain_pool()

    def close(self) -> None:
        super().close()
        if self._users.held and self._users.release():  # the last holder: nobody will reuse the pool
            self.drain_pool()


class _MissingTier(Backend):
    """A tier directory that does not exist, opened read-only: it holds nothing (and creates nothing)."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def _refuse(self) -> TierUnavailableError:
        return TierUnavailableError(f"the {self.tier} tier {self.root} does not exist (opened read-only)",
                                    tier=self.tier)

    def put(self, name: str, data: Buffer | Sequence[Buffer], *, if_absent: bool = False) -> None:
        raise self._refuse()

    def reserve(self, name: str, nbytes: int) -> Reservation:
        raise self._refuse()

    def get(self, name: str) -> bytes | None:
        return None

    def delete(self, name: str) -> bool:
        return False

    def exists(self, name: str) -> bool:
        return False

    def list(self, prefix: str = "") -> Iterator[str]:
        return iter(())

    def drain_pool(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"<missing {self.tier} tier {self.root}>"


class _MissingHost(_MissingTier):
    tier = "host"


class _MissingDurable(_MissingTier):
    tier = "durable"


def _durable_dir(url: str) -> str | None:
    return url[len("file://"):] if url.startswith("file://") else None


def open(
    home: str | os.PathLike | None = None,
    *,
    redis: str | None = None,
    durable: str | None = None,
    config: StoreConfig | None = None,
    create: bool = True,
    **options: Any,
) -> TierStore:
    """Open a store: the embedded default with no arguments, or the given services.

    Args:
        home: data directory of the embedded default (``$TIERSTORE_HOME``, else ``./.tierstore``).
        redis: index URL (``redis://``, ``rediss://``, ``unix://``; a seed of any Redis Cluster node is
            detected, ``redis+cluster://`` forces a cluster); default: the embedded server.
        durable: ``file://dir``, ``s3://bucket/prefix`` or ``"none"``; default ``home/durable``.
        config: a full :class:`StoreConfig` (explicit arguments still win).
        create: with ``False``, create nothing (no home, server start only for an existing index,
            no host tier or durable directory): what read-only tools want.
        **options: other :class:`StoreConfig` fields (``host_capacity_bytes``, ``peer_replicas``, ...).

    Raises:
        ConfigError: a bad URL or option. TierUnavailableError: a service cannot be reached.
        AccessDeniedError: the index server refused the credentials.
        UnknownError: ``create=False`` and the embedded home has no index (``what="home"``).
    """
    explicit = dict(options, home=str(home) if home is not None else None, redis_url=redis, durable_url=durable)
    if config is not None:
        base = {f: getattr(config, f) for f in config.__dataclass_fields__}
        base.update({k: v for k, v in explicit.items() if v is not None})
        cfg = StoreConfig(**base).resolved()
    else:
        cfg = StoreConfig.from_env(**explicit).resolved()
    url = cfg.redis_url
    if url is None:
        if not create and not is_index_dir(Path(cfg.home) / "index"):
            raise UnknownError(f"no tierstore home at {cfg.home} (it holds no index)", what="home", home=cfg.home)
        url = ensure_server(cfg.home)
    index = Index(url, password=cfg.redis_password, replicas=cfg.index_replicas,
                  replica_timeout_s=cfg.index_ack_timeout_s, socket_timeout=cfg.index_timeout_s)
    host: HostBackend | None = None
    try:
        index.ping()
        if cfg.host_root is None:  # resolved() always derives one
            raise ConfigError("no host tier directory", field="host_root")
        if create:
            host = _HeldHost(cfg.host_root, capacity_bytes=cfg.host_capacity_bytes, pool_bytes=cfg.host_pool_bytes,
                             pool_segments=cfg.host_pool_segments, pin_bytes=cfg.pin_host_bytes)
        elif Path(cfg.host_root).is_dir():  # a read-only tool neither holds the tier nor frees its pool
            host = HostBackend(cfg.host_root, capacity_bytes=cfg.host_capacity_bytes, pool_bytes=cfg.host_pool_bytes,
                             pool_segments=cfg.host_pool_segments)
        else:
            host = cast(HostBackend, _MissingHost(cfg.host_root))
        dur: Backend | None = None
        if cfg.durable_url and cfg.durable_url.lower() != "none":
            local = _durable_dir(cfg.durable_url)
            if not create and local is not None and not Path(local).is_dir():
                dur = _MissingDurable(local)
            else:
                extra = {"endpoint_url": cfg.s3_endpoint_url} if cfg.durable_url.startswith("s3://") else {}
                dur = open_backend(cfg.durable_url, **extra)
        peer = _peer_backend(cfg, index)
    except BaseException:
        if host is not None:
            host.close()
        index.close()
        raise
    return TierStore(cfg, index, host, dur, peer=peer)
