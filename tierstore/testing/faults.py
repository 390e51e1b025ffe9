"""Fault injection for tests and opt-in chaos runs: wrappers, never hooks in library code.

A :class:`FaultPlan` holds rules ``point:kind:probability``; wrappers consult it
at named points and inject the fault:

=================  ===========================================================
point              where
=================  ===========================================================
``backend.put``    :meth:`FaultyBackend.put` and a reservation's ``commit``
``backend.get``    :meth:`FaultyBackend.get`
``backend.delete`` :meth:`FaultyBackend.delete`
``index.script``   Redis calls through :class:`FaultyRedis` (scripts and commands)
``ucx.send``       ``send`` of a :class:`FaultyEndpoint` (the peer tier's UCX endpoint)
``ucx.recv``       ``recv`` of a :class:`FaultyEndpoint`
``migration``      one object's migration to the durable tier (wrapped migrator step)
``commit``         a vote, the step's commit point (wrapped :meth:`TierStore.vote`)
=================  ===========================================================

A backend point may name a tier: ``backend.put@durable`` fires only there.

Kinds: ``exception`` (a typed :class:`TierUnavailableError` naming the point,
tier and key), ``timeout`` (sleep ``delay_s``, then the same error: a hang cut
short by a deadline), ``kill`` (SIGKILL this process), ``partial`` (write a
prefix, then fail; at ``commit``: the vote lands but the caller sees an error,
the ambiguous outcome), ``corrupt`` (flip one byte of what is written or read,
silently), ``slow`` (sleep ``delay_s``, then go on), ``hang`` (block until the
plan is armed again, a stuck mount that recovers, or at most ``delay_s``, then
go on).

Deterministic by seed: whether call *n* at a point fires is a hash of
``(seed, point, n)``, not a shared random stream, so threads at other points do
not change the sequence.

Protocol: tests build a plan and call :func:`install` on a store (it swaps the
store's tiers, index client, migrator and vote for wrapped ones), or wrap one
backend with :class:`FaultyBackend`. Chaos runs (the demo, ``bench/soak.py``)
call :func:`plan_from_env`, which alone reads ``TIERSTORE_FAULTS`` and
``TIERSTORE_FAULTS_SEED``; no library constructor reads them.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis
import xxhash

from backends.base import Backend, Buffer, Reservation, as_buffers
from backends.peer import PeerBackend
from tierstore.errors import ConfigError, TierUnavailableError

__all__ = [
    "KINDS",
    "POINTS",
    "FaultPlan",
    "FaultRule",
    "FaultyBackend",
    "FaultyEndpoint",
    "FaultyRedis",
    "FaultyReservation",
    "InjectedFault",
    "install",
    "parse_rules",
    "plan_from_env",
]

POINTS = ("backend.put", "backend.get", "backend.delete", "index.script", "ucx.send", "ucx.recv",
          "migration", "commit")
KINDS = ("exception", "timeout", "kill", "partial", "corrupt", "slow", "hang")


class InjectedFault(TierUnavailableError):
    """The error an ``exception``/``timeout``/``partial`` fault raises (a :class:`TierUnavailableError`)."""


@dataclass(frozen=True)
class FaultRule:
    """One rule: fire ``kind`` at ``point`` (``@tier`` optional) with ``probability``.

    Attributes:
        after: skip the first ``after`` matching calls.
        limit: fire at most this many times (``None``: no limit).
        delay_s: sleep of ``timeout`` and ``slow``; the most a ``hang`` blocks.
    """

    point: str
    kind: str
    probability: float = 1.0
    after: int = 0
    limit: int | None = None
    delay_s: float = 0.05

    def __post_init__(self) -> None:
        base = self.point.split("@", 1)[0]
        if base not in POINTS:
            raise ConfigError(f"unknown fault point {self.point!r}; known: {', '.join(POINTS)}", field="point")
        if self.kind not in KINDS:
            raise ConfigError(f"unknown fault kind {self.kind!r}; known: {', '.join(KINDS)}", field="kind")
        if not 0.0 <= self.probability <= 1.0:
            raise ConfigError(f"fault probability must be in [0, 1], got {self.probability}", field="probability")

    def matches(self, point: str, tier: str | None) -> bool:
        base, _, want = self.point.partition("@")
        return base == point and (not want or want == tier)


class FaultPlan:
    """Rules plus the deterministic decision of which call fires; thread-safe.

    Args:
        rules: the rules, checked in order; the first that fires wins.
        seed: makes the sequence of fired calls reproducible.
        sleep: the sleep of ``timeout``/``slow`` (tests may inject a fake).

    Attributes:
        calls: calls seen per point (``point@tier``).
        fired: faults injected per ``(point@tier, kind)``.
    """

    def __init__(self, rules: Sequence[FaultRule] = (), *, seed: int = 0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rules = list(rules)
        self.seed = int(seed)
        self.sleep = sleep
        self.calls: Counter[str] = Counter()
        self.fired: Counter[tuple[str, str]] = Counter()
        self._rule_hits: Counter[int] = Counter()
        self._rule_seen: Counter[int] = Counter()
        self._lock = threading.Lock()
        self._release = threading.Event()  # set (and replaced) by arm(): what a hang waits for
        self.enabled = True

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No fault fires inside this block (checking invariants, cleaning up)."""
        prev, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = prev

    def _draw(self, point: str, n: int) -> float:
        return xxhash.xxh64_intdigest(f"{self.seed}:{point}:{n}".encode()) / 2.0**64

    def decide(self, point: str, tier: str | None = None) -> FaultRule | None:
        """Count this call at ``point`` and return the rule that fires for it, if any."""
        where = f"{point}@{tier}" if tier else point
        with self._lock:
            n = self.calls[where]
            self.calls[where] += 1
            if not self.enabled:
                return None
            for i, rule in enumerate(self.rules):
                if not rule.matches(point, tier):
                    continue
                seen = self._rule_seen[i]
                self._rule_seen[i] += 1
                if seen < rule.after or (rule.limit is not None and self._rule_hits[i] >= rule.limit):
                    continue
                if rule.probability >= 1.0 or self._draw(f"{i}:{where}", n) < rule.probability:
                    self._rule_hits[i] += 1
                    self.fired[(where, rule.kind)] += 1
                    return rule
        return None

    def error(self, rule: FaultRule, point: str, tier: str | None, key: str, what: str = "") -> InjectedFault:
        where = f"{point} ({tier} tier)" if tier else point
        return InjectedFault(f"injected {rule.kind} fault at {where} for {key!r}{what}",
                             point=point, tier=tier, key=key, kind=rule.kind)

    def act(self, rule: FaultRule, point: str, tier: str | None, key: str) -> None:
        """Carry out the kinds that need no data: kill, exception, timeout, slow."""
        if rule.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if rule.kind in ("timeout", "slow"):
            self.sleep(rule.delay_s)
        if rule.kind == "hang":
            self._release.wait(rule.delay_s)
        if rule.kind == "exception":
            raise self.error(rule, point, tier, key)
        if rule.kind == "timeout":
            raise self.error(rule, point, tier, key, f" (no answer after {rule.delay_s}s)")

    def arm(self, *rules: FaultRule) -> None:
        """Replace the rules (and their counters) from now on: how a chaos run injects the next fault. The calls
        a ``hang`` blocks go on."""
        with self._lock:
            self.rules = list(rules)
            self._rule_hits.clear()
            self._rule_seen.clear()
            released, self._release = self._release, threading.Event()
        released.set()

    def total_fired(self) -> int:
        return sum(self.fired.values())


def flip_byte(data: Any, seed: int) -> bytes:
    """A copy of ``data`` with one byte (chosen by ``seed``) inverted; empty data stays empty."""
    buf = bytearray(data)
    if buf:
        buf[seed % len(buf)] ^= 0xFF
    return bytes(buf)


# -- backends --------------------------------------------------------------------------------


class FaultyReservation(Reservation):
    """A reservation whose ``commit`` is the ``backend.put`` point of a reservable tier."""

    def __init__(self, inner: Reservation, backend: FaultyBackend) -> None:
        self._inner = inner
        self._backend = backend
        self.name = inner.name
        self.buffer = inner.buffer

    def commit(self, *, if_absent: bool = False) -> None:
        b = self._backend
        rule = b.plan.decide("backend.put", b.tier)
        if rule is not None:
            if rule.kind == "corrupt" and len(self.buffer):
                self.buffer[b.plan.seed % len(self.buffer)] ^= 0xFF
            elif rule.kind == "partial":
                n = len(self.buffer)
                self.buffer[n // 2:] = bytes(n - n // 2)  # a torn write: the tail never reached the medium
                self._inner.commit(if_absent=if_absent)
                raise b.plan.error(rule, "backend.put", b.tier, self.name, " (torn write)")
            else:
                try:
                    b.plan.act(rule, "backend.put", b.tier, self.name)
                except BaseException:
                    self._inner.abort()
                    raise
        self._inner.commit(if_absent=if_absent)

    def abort(self) -> None:
        self._inner.abort()


class FaultyBackend(Backend):
    """``inner`` with faults from ``plan`` at ``backend.put/get/delete``; same tier, same capabilities.

    ``partial`` on ``put`` stores the first half of the object, then raises (a
    torn write on a medium without atomic publish); ``corrupt`` stores (put) or
    returns (get) a copy with one byte flipped.
    """

    def __init__(self, inner: Backend, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan
        self.tier = inner.tier  # type: ignore[misc]
        self.survives = inner.survives  # type: ignore[misc]
        self.zero_copy_get = inner.zero_copy_get  # type: ignore[misc]
        self.reservable = inner.reservable  # type: ignore[misc]
        self.atomic_create_once = inner.atomic_create_once  # type: ignore[misc]
        self.local_reads = inner.local_reads  # type: ignore[misc]
        self.ranged_get = inner.ranged_get  # type: ignore[misc]

    def __getattr__(self, name: str) -> Any:  # backend extras (root, drain_pool, cleanup_temp, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def put(self, name: str, data: Buffer | Sequence[Buffer], *, if_absent: bool = False) -> None:
        rule = self.plan.decide("backend.put", self.tier)
        if rule is None:
            return self.inner.put(name, data, if_absent=if_absent)
        if rule.kind in ("corrupt", "partial"):
            blob = b"".join(bytes(p) for p in as_buffers(data))
            if rule.kind == "corrupt":
                return self.inner.put(name, flip_byte(blob, self.plan.seed), if_absent=if_absent)
            self.inner.put(name, blob[: len(blob) // 2], if_absent=if_absent)
            raise self.plan.error(rule, "backend.put", self.tier, name, " (torn write)")
        self.plan.act(rule, "backend.put", self.tier, name)
        return self.inner.put(name, data, if_absent=if_absent)

    def get(self, name: str) -> bytes | memoryview | None:
        rule = self.plan.decide("backend.get", self.tier)
        if rule is None:
            return self.inner.get(name)
        if rule.kind in ("corrupt", "partial"):
            data = self.inner.get(name)
            if data is None:
                return None
            out = flip_byte(data, self.plan.seed) if rule.kind == "corrupt" else bytes(data[: len(data) // 2])
            if isinstance(data, memoryview):
                data.release()
            return out
        self.plan.act(rule, "backend.get", self.tier, name)
        return self.inner.get(name)

    def get_range(self, name: str, offset: int, length: int) -> bytes | memoryview | None:
        """As ``inner``'s, with the faults of ``backend.get`` (``corrupt`` flips a byte of the range)."""
        rule = self.plan.decide("backend.get", self.tier)
        if rule is None:
            return self.inner.get_range(name, offset, length)
        if rule.kind in ("corrupt", "partial"):
            data = self.inner.get_range(name, offset, length)
            if data is None or not len(data):
                return data
            return flip_byte(data, self.plan.seed) if rule.kind == "corrupt" else bytes(data[: len(data) // 2])
        self.plan.act(rule, "backend.get", self.tier, name)
        return self.inner.get_range(name, offset, length)

    def delete(self, name: str) -> bool:
        rule = self.plan.decide("backend.delete", self.tier)
        if rule is not None and rule.kind not in ("corrupt", "partial"):
            self.plan.act(rule, "backend.delete", self.tier, name)
        return self.inner.delete(name)

    def exists(self, name: str) -> bool:
        return self.inner.exists(name)

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.inner.list(prefix)

    def size(self, name: str) -> int | None:
        return self.inner.size(name)

    def used_bytes(self) -> int | None:
        return self.inner.used_bytes()

    def reserve(self, name: str, nbytes: int) -> Reservation:
        return FaultyReservation(self.inner.reserve(name, nbytes), self)

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"<FaultyBackend {self.inner!r}>"


# -- the index client --------------------------------------------------------------------------


class FaultyRedis(redis.Redis):
    """A redis-py client sharing ``inner``'s connection pool, with faults at ``index.script``.

    Every command (scripts included: ``EVALSHA``) and every pipeline
    ``execute`` consults the plan. ``partial`` runs the command, then raises
    (the server applied it; the caller cannot know); ``corrupt`` is not
    meaningful for commands and is treated as ``exception``.
    """

    def __init__(self, inner: redis.Redis, plan: FaultPlan) -> None:
        self.__dict__.update(inner.__dict__)
        self._faults = plan
        # the pool is ``inner``'s: a redis-py client closes its pool when it is closed or garbage-collected (every
        # connection, in use or not). So ``inner`` lives as long as this wrapper (its collection closed the pool
        # under the wrapper's commands: a connection mid-handshake lost its socket), and the wrapper never closes it
        self._inner = inner
        self.auto_close_connection_pool = False

    def _fault(self, what: str, run: Callable[[], Any]) -> Any:
        rule = self._faults.decide("index.script")
        if rule is None:
            return run()
        if rule.kind == "partial":
            run()
            raise self._faults.error(rule, "index.script", "index", what, " (applied, reply lost)")
        if rule.kind == "corrupt":
            rule = FaultRule(rule.point, "exception")
        self._faults.act(rule, "index.script", "index", what)
        return run()

    def execute_command(self, *args: Any, **options: Any) -> Any:
        return self._fault(str(args[0]) if args else "?", lambda: redis.Redis.execute_command(self, *args, **options))

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = redis.Redis.pipeline(self, transaction, shard_hint)
        run = pipe.execute
        pipe.execute = lambda raise_on_error=True: self._fault(  # type: ignore[method-assign]
            "pipeline", lambda: run(raise_on_error))
        return pipe


# -- UCX endpoints -----------------------------------------------------------------------------


class FaultyEndpoint:
    """A UCX endpoint (``ucxx``) with faults at ``ucx.send`` / ``ucx.recv``; other attributes pass through.

    ``corrupt`` flips a byte of what is sent (a copy) or of what was received
    (in place); ``partial`` sends/receives and then raises.
    """

    def __init__(self, inner: Any, plan: FaultPlan) -> None:
        self._inner = inner
        self._plan = plan

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def send(self, buf: Any, *args: Any, **kw: Any) -> Any:
        rule = self._plan.decide("ucx.send", "peer")
        if rule is not None and rule.kind == "corrupt":
            buf = bytearray(flip_byte(memoryview(buf).cast("B"), self._plan.seed))
        elif rule is not None and rule.kind != "partial":
            self._plan.act(rule, "ucx.send", "peer", "endpoint")
        out = await self._inner.send(buf, *args, **kw)
        if rule is not None and rule.kind == "partial":
            raise self._plan.error(rule, "ucx.send", "peer", "endpoint")
        return out

    async def recv(self, buf: Any, *args: Any, **kw: Any) -> Any:
        rule = self._plan.decide("ucx.recv", "peer")
        if rule is not None and rule.kind not in ("corrupt", "partial"):
            self._plan.act(rule, "ucx.recv", "peer", "endpoint")
        out = await self._inner.recv(buf, *args, **kw)
        if rule is not None and rule.kind == "corrupt":
            mv = memoryview(buf).cast("B")
            if len(mv):
                mv[self._plan.seed % len(mv)] ^= 0xFF
        elif rule is not None and rule.kind == "partial":
            raise self._plan.error(rule, "ucx.recv", "peer", "endpoint")
        return out


class _FaultyUCXX:
    """A stand-in for the ``ucxx`` module whose ``create_endpoint`` returns :class:`FaultyEndpoint`."""

    def __init__(self, inner: Any, plan: FaultPlan) -> None:
        self._inner = inner
        self._plan = plan

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def create_endpoint(self, *args: Any, **kw: Any) -> FaultyEndpoint:
        return FaultyEndpoint(await self._inner.create_endpoint(*args, **kw), self._plan)

    async def create_endpoint_from_worker_address(self, *args: Any, **kw: Any) -> FaultyEndpoint:
        return FaultyEndpoint(await self._inner.create_endpoint_from_worker_address(*args, **kw), self._plan)


# -- install -----------------------------------------------------------------------------------


def install(store: Any, plan: FaultPlan) -> FaultPlan:
    """Swap ``store``'s tiers, index client, migrator and vote for faulty wrappers; return ``plan``.

    After this the store behaves as before except where the plan fires. The
    peer tier's UCX endpoints are wrapped too (``ucx.send``/``ucx.recv``).
    Install once per store, before it is used from other threads.
    """
    def wrap(b: Backend) -> Backend:
        if isinstance(b, FaultyBackend):
            return b
        if isinstance(b, PeerBackend):
            b.wrap_transport(lambda ucxx: _FaultyUCXX(ucxx, plan))
        return FaultyBackend(b, plan)

    def before_migrate(key: Any) -> None:
        rule = plan.decide("migration", "durable")
        if rule is not None:
            if rule.kind in ("corrupt", "partial"):
                rule = FaultRule(rule.point, "exception")
            plan.act(rule, "migration", "durable", str(key))

    store.rewire(tier=wrap, index=lambda index: index.wrapped(lambda client: FaultyRedis(client, plan)),
                 before_migrate=before_migrate)
    vote = store.vote

    def faulty_vote(model: str, step: int, rank: int, objects: list, **kw: Any) -> str:
        rule = plan.decide("commit")
        what = f"{model} step {step} rank {rank}"
        if rule is None:
            return vote(model, step, rank, objects, **kw)
        if rule.kind == "partial":
            vote(model, step, rank, objects, **kw)
            raise plan.error(rule, "commit", None, what, " (vote applied, reply lost)")
        if rule.kind == "corrupt":
            rule = FaultRule(rule.point, "exception")
        plan.act(rule, "commit", None, what)
        return vote(model, step, rank, objects, **kw)

    store.vote = faulty_vote
    return plan


# -- the opt-in environment layer --------------------------------------------------------------


def parse_rules(text: str) -> list[FaultRule]:
    """Parse ``"point:kind:probability[,...]"`` (probability optional, default 1).

    Raises:
        ConfigError: naming the malformed entry.
    """
    rules = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        parts = entry.split(":")
        if len(parts) not in (2, 3):
            raise ConfigError(f"fault rule {entry!r} is not point:kind[:probability]", field="TIERSTORE_FAULTS")
        try:
            prob = float(parts[2]) if len(parts) == 3 else 1.0
        except ValueError as e:
            raise ConfigError(f"fault rule {entry!r}: bad probability", field="TIERSTORE_FAULTS") from e
        rules.append(FaultRule(parts[0], parts[1], prob))
    return rules


def plan_from_env(environ: Mapping[str, str] | None = None) -> FaultPlan | None:
    """The plan of ``TIERSTORE_FAULTS`` / ``TIERSTORE_FAULTS_SEED``, or ``None`` when unset.

    The only place these variables are read; call it from a demo or soak, never a library constructor.
    """
    env = os.environ if environ is None else environ
    text = env.get("TIERSTORE_FAULTS", "").strip()
    if not text:
        return None
    try:
        seed = int(env.get("TIERSTORE_FAULTS_SEED", "0") or 0)
    except ValueError as e:
        raise ConfigError("TIERSTORE_FAULTS_SEED must be an integer", field="TIERSTORE_FAULTS_SEED") from e
    return FaultPlan(parse_rules(text), seed=seed)
