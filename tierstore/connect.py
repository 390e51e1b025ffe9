"""``tierstore.open()``: build a :class:`~tierstore.store.TierStore` from URLs and config."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from backends import open_backend
from backends.base import Backend
from backends.host import HostBackend
from backends.peer import PeerBackend
from consistency.index import Index
from consistency.nodes import discovery
from tierstore.config import StoreConfig
from tierstore.embedded import ensure_server
from tierstore.errors import ConfigError
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


def open(
    home: str | os.PathLike | None = None,
    *,
    redis: str | None = None,
    durable: str | None = None,
    config: StoreConfig | None = None,
    **options: Any,
) -> TierStore:
    """Open a store: the embedded default with no arguments, or the given services.

    Args:
        home: data directory of the embedded default (``$TIERSTORE_HOME``, else ``./.tierstore``).
        redis: index URL (``redis://``, ``rediss://``, ``unix://``); default: the embedded server.
        durable: ``file://dir``, ``s3://bucket/prefix`` or ``"none"``; default ``home/durable``.
        config: a full :class:`StoreConfig` (explicit arguments still win).
        **options: other :class:`StoreConfig` fields (``host_capacity_bytes``, ``peer_replicas``, ...).

    Raises:
        ConfigError: a bad URL or option. TierUnavailableError: a service cannot be reached.
        AccessDeniedError: the index server refused the credentials.
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
        url = ensure_server(cfg.home)
    index = Index(url, password=cfg.redis_password)
    try:
        index.ping()
        if cfg.host_root is None:  # resolved() always derives one
            raise ConfigError("no host tier directory", field="host_root")
        host = HostBackend(cfg.host_root, capacity_bytes=cfg.host_capacity_bytes, pool_bytes=cfg.host_pool_bytes,
                           pool_segments=cfg.host_pool_segments)
        dur: Backend | None = None
        if cfg.durable_url and cfg.durable_url.lower() != "none":
            extra = {"endpoint_url": cfg.s3_endpoint_url} if cfg.durable_url.startswith("s3://") else {}
            dur = open_backend(cfg.durable_url, **extra)
        peer = _peer_backend(cfg, index)
    except BaseException:
        index.close()
        raise
    return TierStore(cfg, index, host, dur, peer=peer)
