"""The index client: the connection, replica-acknowledged writes, key names, error translation.

:class:`IndexClient` is the base of :class:`consistency.index.Index` (which adds
models and epochs, and object records through :class:`consistency.objects.ObjectIndex`):
it holds the redis-py client (package-private to ``consistency/``), builds the
keys of the schema documented in :mod:`consistency.index`, and runs Lua
scripts, acknowledged by the replicas when the index is replicated (see
:mod:`consistency.cluster`).

Errors from redis-py are translated here (:func:`translate_redis_errors`) into
:class:`TierUnavailableError` (server gone), :class:`AccessDeniedError` (AUTH),
:class:`FencedError`, :class:`StepCommittedError` and :class:`StepBusyError` (script refusals).

**The bound of one call** (issue 28: every wait ends). Each command has the
socket timeout ``socket_timeout`` (``StoreConfig.index_timeout_s``, raised to
``replica_timeout_s`` + 5 s where replicas acknowledge), connecting too.
redis-py's default retries (ten, with jittered exponential backoff) are
replaced by :func:`retry_policy`: a command that *timed out* is never sent
again by the client (a Lua script may have run: a resend is not idempotent),
and one whose connection broke (reset, refused: a restarted server) is sent
once more, at once. So a call to an index that stopped answering (a
partition, a stopped process) fails with :class:`TierUnavailableError` after
one socket timeout, and one to a server that went away after at most two
connect attempts; whether to try again is the caller's retry policy
(:class:`backends.retry.RetryPolicy`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from consistency.cluster import CLUSTER_SCHEMES, acked, connect, replica_count
from tierstore.errors import (
    AccessDeniedError,
    ConfigError,
    FencedError,
    StepBusyError,
    StepCommittedError,
    TierStoreError,
    TierUnavailableError,
)
from tierstore.keys import ShardKey

__all__ = ["MODELS", "IndexClient", "redact_url", "retry_policy", "translate_redis_errors"]

_FENCED = "TSFENCED"
_COMMITTED = "TSCOMMITTED"
_BUSY = "TSBUSY"
MODELS = "ts:models"


def retry_policy() -> Retry:
    """The client's retries: one immediate resend after a broken connection, none after a timeout."""
    return Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (safe to log)."""
    p = urlparse(url)
    if p.password:
        netloc = p.netloc.replace(f":{p.password}@", ":***@")
        return p._replace(netloc=netloc).geturl()
    return url


@contextmanager
def translate_redis_errors(what: str, url: str = "") -> Iterator[None]:
    """Translate redis-py errors into tierstore's tree, keeping the cause."""
    try:
        yield
    except TierStoreError:
        raise  # already translated (the client connects lazily, inside another operation's translation)
    except redis.exceptions.AuthenticationError as e:
        raise AccessDeniedError(f"{what}: the index server refused the credentials", url=redact_url(url)) from e
    except redis.exceptions.NoPermissionError as e:
        raise AccessDeniedError(f"{what}: no permission on the index server: {e}", url=redact_url(url)) from e
    except redis.exceptions.ResponseError as e:
        msg = str(e)
        if msg.startswith(_FENCED):
            current = int(msg.split()[1]) if len(msg.split()) > 1 else None
            raise FencedError(f"{what}: rejected, the job's epoch is now {current}", epoch=current) from e
        if msg.startswith(_COMMITTED):
            raise StepCommittedError(f"{what}: {msg.split(' ', 1)[1]} (a committed step is immutable)") from e
        if msg.startswith(_BUSY):
            raise StepBusyError(f"{what}: {msg.split(' ', 1)[1]} (a step has one writer at a time)") from e
        if "NOAUTH" in msg or "WRONGPASS" in msg:
            raise AccessDeniedError(f"{what}: the index server needs valid credentials", url=redact_url(url)) from e
        raise TierUnavailableError(f"{what}: the index server answered an error: {e}", url=redact_url(url)) from e
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError,
            redis.exceptions.RedisClusterException) as e:
        raise TierUnavailableError(
            f"{what}: the index server at {redact_url(url)} cannot be reached ({e})", url=redact_url(url)
        ) from e



def _s(v: bytes | str | None) -> str:
    if v is None:
        return ""
    return v.decode() if isinstance(v, bytes) else v


class IndexClient:
    """The connection to the index server (see :class:`consistency.index.Index` for the arguments).

    Thread-safe (redis-py pools connections). The raw client is
    package-private to ``consistency/``; it connects on first use (a server
    that is not up yet fails the first operation, typed, not the constructor).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        password: str | None = None,
        client: redis.Redis | RedisCluster | None = None,
        socket_timeout: float = 10.0,
        ssl_ca_certs: str | None = None,
        replicas: int | None = None,
        replica_timeout_s: float = 2.0,
    ) -> None:
        self.url = url or ""
        if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0):
            raise ConfigError(f"replicas must be a non-negative int or None, got {replicas!r}")
        if not replica_timeout_s > 0:
            raise ConfigError(f"replica_timeout_s must be positive, got {replica_timeout_s!r}")
        self._replicas = replicas
        self.replica_timeout_s = float(replica_timeout_s)
        self._lock = threading.Lock()
        self._listed: set[str] = set()  # models this instance added to ts:models
        self._client = client
        self._kwargs: dict[str, Any] = {}
        if client is None:
            if not url:
                raise ConfigError("the index needs a URL (redis://, rediss://, unix://) or a client")
            scheme = urlparse(url).scheme
            if scheme not in ("redis", "rediss", "unix", *CLUSTER_SCHEMES):
                raise ConfigError(f"unsupported index URL scheme {scheme!r} in {redact_url(url)}")
            timeout = max(socket_timeout, replica_timeout_s + 5.0)
            kwargs: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout,
                                      "retry": retry_policy(), "health_check_interval": 30}
            if password is not None:
                kwargs["password"] = password
            if scheme.startswith("rediss") and ssl_ca_certs:
                kwargs["ssl_ca_certs"] = ssl_ca_certs
            self._kwargs = kwargs

    @property
    def _r(self) -> Any:
        """The redis-py client (``Redis`` or ``RedisCluster``), connected on first use."""
        c = self._client
        if c is None:
            with self._lock:
                if self._client is None:
                    with translate_redis_errors("connect to the index", self.url):
                        self._client = connect(self.url, self._kwargs)
                c = self._client
        return c

    @property
    def is_cluster(self) -> bool:
        """Whether the index is a Redis Cluster."""
        return isinstance(self._r, RedisCluster)

    @property
    def replicas(self) -> int:
        """Replica acknowledgements each state change waits for (auto-detected on first use if not given)."""
        if self._replicas is None:
            with translate_redis_errors("count the index's replicas", self.url):
                self._replicas = min(1, replica_count(self._r))
        return self._replicas

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    # -- replica-acknowledged writes (see consistency.cluster) ------------------------
    def run_script(self, script: Any, keys: Sequence[str], args: Sequence[Any], *, ack: bool = True,
                   what: str = "index write") -> Any:
        """Run a registered Lua script over ``keys`` (all of one model); with ``ack``, on a replicated
        index, return only once the replicas acknowledged it and everything it read.

        Raises:
            ReplicaAckError: too few replicas acknowledged in time (the primary has it; not acknowledged).
            redis.exceptions.RedisError: as the script does (callers translate).
        """
        if not ack or self.replicas == 0:
            return script(keys=list(keys), args=list(args))
        out = acked(self._r, keys[0], self._sync_key(keys[0]),
                    lambda p: p.evalsha(script.sha, len(keys), *keys, *args), replicas=self.replicas,
                    timeout_s=self.replica_timeout_s, what=what, scripts=(script,))
        if isinstance(out[0], Exception):
            raise out[0]
        return out[0]

    def sync(self, model: str, what: str = "acknowledge") -> None:
        """Return once the replicas have every write ``model``'s primary applied so far (no-op unreplicated).

        Raises:
            ReplicaAckError: too few replicas acknowledged within the timeout.
            TierUnavailableError: the index cannot be reached.
        """
        if self.replicas == 0:
            return
        with translate_redis_errors(f"{what} ({model})", self.url):
            acked(self._r, self._k(model, "sync"), self._k(model, "sync"), lambda p: None, replicas=self.replicas,
                  timeout_s=self.replica_timeout_s, what=f"{what} ({model})")

    @staticmethod
    def _sync_key(key: str) -> str:
        """The sync counter of the model whose key (``ts:{model}:...``) is given."""
        return key[: key.index("}") + 1] + ":sync"

    # -- keys (package-private: the schema above) ------------------------------------
    @staticmethod
    def _k(model: str, *parts: object) -> str:
        return ":".join([f"ts:{{{model}}}", *map(str, parts)])

    @staticmethod
    def _objname(key: ShardKey) -> str:
        return f"{key.layer}/{key.step}/{key.rank}"

    def ping(self) -> None:
        with translate_redis_errors("ping", self.url):
            self._r.ping()

    def server_time(self) -> float:
        """The index server's clock (``TIME``), in seconds since the epoch."""
        with translate_redis_errors("read server time", self.url):
            sec, usec = self._r.time()
        return sec + usec / 1e6
