"""Observability: checkpoint figures as Prometheus metrics and one INFO log line per step.

The figures (names as exported; see ``BENCHMARKS.md`` for their definitions):

==========================================  =========  ====================  ===========================================================
metric                                      type       labels                what
==========================================  =========  ====================  ===========================================================
``tierstore_save_stall_seconds``            histogram  model                 time a save blocked training
``tierstore_bytes_written_total``           counter    model, tier, kind     bytes written per tier and kind
``tierstore_commit_latency_seconds``        histogram  model                 ``save()`` to the step committed
``tierstore_migration_lag_steps``           gauge      model                 committed steps newer than the newest durable
``tierstore_migration_lag_seconds``         gauge      model                 commit time of the newest committed minus the newest durable
``tierstore_restore_seconds``               histogram  model, tier           restore time, by the tier read
``tierstore_last_step``                     gauge      model                 newest step recorded here
==========================================  =========  ====================  ===========================================================

``prometheus_client`` is optional: it is imported lazily, and without it
every method is a no-op except the log line (``pip install
'tierstore[metrics]'``).

Protocol (who calls what):

* A trainer (the demo, or any loop around a
  :class:`~tierstore.train.checkpointer.Checkpointer`) calls :meth:`Metrics.record_step`
  once per saved step, :meth:`Metrics.record_restore` after a restore.
* Anything holding a store (the agent, ``tierstore admin``) may call
  :meth:`Metrics.update_migration_lag` with ``store.steps``, periodically.
* A process that wants a scrape endpoint calls :func:`serve` once (the agent
  does it for ``--metrics-port``); it returns the bound port, or ``None``
  without ``prometheus_client``.

Each instance owns a private ``CollectorRegistry`` unless given one, so
several instances (tests) never collide; :func:`default` is the process-wide
instance, registered in ``prometheus_client``'s global registry so
:func:`serve` exposes it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from consistency.steprecords import durable_lag

__all__ = ["Metrics", "StepFigures", "available", "default", "migration_lag", "serve"]

log = logging.getLogger("tierstore.cli.metrics")

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


def _prom() -> Any:
    try:
        import prometheus_client  # lazy: optional dependency (tierstore[metrics])

        return prometheus_client
    except ImportError:
        return None


def available() -> bool:
    """Whether ``prometheus_client`` is installed (metrics are exported)."""
    return _prom() is not None


@dataclass
class StepFigures:
    """What one rank measured for one saved step (seconds and bytes)."""

    model: str
    step: int
    rank: int = 0
    stall_s: float = 0.0
    bytes_by_tier: Mapping[str, int] = field(default_factory=dict)
    bytes_by_kind: Mapping[str, int] = field(default_factory=dict)
    commit_latency_s: float | None = None
    state: str | None = None

    def log_line(self) -> str:
        tiers = " ".join(f"{t}={n}" for t, n in sorted(self.bytes_by_tier.items())) or "-"
        kinds = " ".join(f"{k}={n}" for k, n in sorted(self.bytes_by_kind.items()) if n) or "-"
        commit = f"{self.commit_latency_s * 1e3:.1f}" if self.commit_latency_s is not None else "-"
        return (f"checkpoint model={self.model} step={self.step} rank={self.rank} state={self.state or '-'} "
                f"stall_ms={self.stall_s * 1e3:.2f} commit_ms={commit} bytes[{tiers}] kinds[{kinds}]")


class Metrics:
    """The metric families of one process (or one test), or no-ops without ``prometheus_client``.

    Args:
        registry: a ``prometheus_client.CollectorRegistry``; ``None`` makes a
            private one; ``"global"`` uses ``prometheus_client.REGISTRY``.
        logger: where :meth:`record_step` writes its INFO line.
    """

    def __init__(self, registry: Any = None, *, logger: logging.Logger | None = None) -> None:
        self.log = logger or log
        prom = _prom()
        self.enabled = prom is not None
        self.registry = None
        if prom is None:
            return
        if registry is None:
            registry = prom.CollectorRegistry()
        elif registry == "global":
            registry = prom.REGISTRY
        self.registry = registry
        kw = {"registry": registry}
        self.stall = prom.Histogram("tierstore_save_stall_seconds", "Time a save blocked training", ["model"],
                                    buckets=_BUCKETS, **kw)
        self.bytes = prom.Counter("tierstore_bytes_written", "Bytes written per tier and object kind",
                                  ["model", "tier", "kind"], **kw)
        self.commit = prom.Histogram("tierstore_commit_latency_seconds", "From save() to the step committed",
                                     ["model"], buckets=_BUCKETS, **kw)
        self.lag_steps = prom.Gauge("tierstore_migration_lag_steps", "Committed steps newer than the newest durable one",
                                    ["model"], **kw)
        self.lag_seconds = prom.Gauge("tierstore_migration_lag_seconds",
                                      "Commit time of the newest committed step minus that of the newest durable one", ["model"], **kw)
        self.restore = prom.Histogram("tierstore_restore_seconds", "Restore time by the tier it read from",
                                      ["model", "tier"], buckets=_BUCKETS, **kw)
        self.last_step = prom.Gauge("tierstore_last_step", "Newest step recorded by this process", ["model"], **kw)

    def record_step(self, fig: StepFigures) -> None:
        """Record one saved step and log it at INFO in one line."""
        if self.enabled:
            self.stall.labels(fig.model).observe(fig.stall_s)
            kinds = dict(fig.bytes_by_kind) or {"full": 0}
            kind = next(iter(kinds)) if len(kinds) == 1 else "mixed"
            for tier, n in fig.bytes_by_tier.items():
                self.bytes.labels(fig.model, tier, kind).inc(max(0, int(n)))
            if fig.commit_latency_s is not None:
                self.commit.labels(fig.model).observe(fig.commit_latency_s)
            self.last_step.labels(fig.model).set(fig.step)
        self.log.info("%s", fig.log_line())

    def record_restore(self, model: str, tier: str, seconds: float, step: int | None = None) -> None:
        if self.enabled:
            self.restore.labels(model, tier).observe(seconds)
        self.log.info("restore model=%s step=%s tier=%s seconds=%.3f", model, step, tier, seconds)

    def update_migration_lag(self, steps: Any, model: str) -> tuple[int, float]:
        """Read the lag of ``model`` from the index (see :func:`migration_lag`) and set the gauges.

        ``steps`` is the store's :class:`~consistency.twophase.StepProtocol` (``store.steps``).
        """
        lag, seconds = migration_lag(steps, model)
        if self.enabled:
            self.lag_steps.labels(model).set(lag)
            self.lag_seconds.labels(model).set(seconds)
        return lag, seconds

    def exposition(self) -> bytes:
        """The text exposition of this registry (empty without ``prometheus_client``)."""
        prom = _prom()
        if prom is None or self.registry is None:
            return b""
        return prom.generate_latest(self.registry)


def migration_lag(steps: Any, model: str) -> tuple[int, float]:
    """``(steps, seconds)`` the durable tier lags the memory tiers for ``model``
    (:func:`consistency.steprecords.durable_lag`; ``steps`` is the store's ``StepProtocol``)."""
    lag = durable_lag(steps.records(model), steps.index.server_time())
    return lag.steps, lag.seconds


_DEFAULT: Metrics | None = None
_LOCK = threading.Lock()


def default() -> Metrics:
    """The process-wide :class:`Metrics`, in ``prometheus_client``'s global registry."""
    global _DEFAULT
    with _LOCK:
        if _DEFAULT is None:
            _DEFAULT = Metrics("global" if available() else None)
        return _DEFAULT


def serve(port: int, addr: str = "127.0.0.1") -> int | None:
    """Expose the global registry over HTTP on ``addr:port`` (0: any free port).

    Returns the bound port, or ``None`` (logged) without ``prometheus_client``.
    The agent calls this once for ``--metrics-port``.
    """
    prom = _prom()
    if prom is None:
        log.warning("metrics port %s requested but prometheus_client is not installed "
                    "(pip install 'tierstore[metrics]')", port)
        return None
    default()
    started = prom.start_http_server(port, addr=addr)
    if isinstance(started, tuple):  # prometheus_client >= 0.17 returns (server, thread)
        return int(started[0].server_address[1])
    return port
