"""Savings that pay: per layer, write deltas only where they save bytes worth the CPU they cost.

A differential policy (:func:`~tierstore.train.policies.differential`) writes
XOR deltas between bases. Whether a delta pays depends on how the layer moves:
a slowly moving layer (fine-tuning at a low learning rate) changes only the
low mantissa bits, so its byte-shuffled delta compresses to half or less
(zstd beside lz4, chosen per object by :func:`tierstore.codec.compression.choose`);
a layer whose state moves fast (AdamW's first moment, training from scratch)
gives a delta that barely compresses, and then the delta costs the CPU of the
XOR, the sampling and the compression for nothing, plus a longer chain to
apply on restore. :class:`Payoff` measures each layer and decides.

Measured per staged write of a layer (thread CPU seconds of the writer, from
the XOR to the published object): for deltas, ``ratio`` = bytes stored /
bytes of the full layer and ``cpu``; for full objects, ``cpu`` alone. A delta
*pays* when ``ratio <= rule.max_ratio`` and its extra CPU (the delta's minus a
full write's of the same layer: the XOR, the sampling and the compression) is
at most ``rule.max_cpu_ms_per_mb`` milliseconds per MB saved (all over
exponential averages, so one odd step does not flip the decision).

Per layer, a small state machine (pure logic, no store, no clock of its own)::

    probe --(delta measured, pays)--> delta --(average stops paying)--> full
      ^                                                                   |
      +------(after `revisit` full saves of the layer: one probe)---------+

* ``probe`` / ``delta``: the layer is staged and written by
  :func:`~tierstore.train.writing.write_layer` (a delta where the
  :class:`~tierstore.train.policies.DiffTracker` allows one: bases and chain
  limits are unchanged).
* ``full``: the layer is written as a full object straight into the host tier,
  like :func:`~tierstore.train.policies.exact` (no staging copy, no base kept),
  until ``revisit`` of its saves have passed; then one save is staged to give
  the next one a base, and the next one is a delta again: a probe. A probe
  that does not pay doubles the layer's ``revisit`` (up to ``rule.max_revisit``);
  one that pays resets it.

Protocol (the Checkpointer and ``write_layer`` call, on their threads)::

    pay = Payoff(PayoffRule())
    pay.direct(layer)            # at snapshot: True -> write a full object directly, skip staging
    pay.record(layer, kind, raw_bytes, stored_bytes, cpu_s)   # after each staged write of the layer
    pay.report()                 # per layer: mode, ratio, cpu, counts (for benchmarks and logs)

``direct`` and ``record`` for one layer are never concurrent: a save's
snapshot runs after the previous save's background writes drained.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tierstore.errors import ConfigError

__all__ = ["LayerPayoff", "Payoff", "PayoffRule"]

_MB = 1 << 20


@dataclass(frozen=True)
class PayoffRule:
    """When a layer's deltas pay.

    Attributes:
        max_ratio: a delta pays only if it stores at most this fraction of
            the full layer's bytes (averaged).
        max_cpu_ms_per_mb: and only if its CPU beyond a full write's (XOR +
            compression) is at most this many milliseconds per MB it saves (averaged). The
            default, 20 ms/MB, accepts a delta that halves the bytes at the
            encode speed measured here (~3 ms per MB of layer) and refuses one
            that saves a few percent.
        revisit: full saves of a layer before a delta is tried again.
        max_revisit: the most ``revisit`` grows to after probes that did not pay.
        alpha: weight of the newest measurement in the exponential averages.
    """

    max_ratio: float = 0.7
    max_cpu_ms_per_mb: float = 20.0
    revisit: int = 16
    max_revisit: int = 128
    alpha: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.max_ratio <= 1.0:
            raise ConfigError(f"max_ratio must be in (0, 1], got {self.max_ratio}", field="max_ratio")
        if self.max_cpu_ms_per_mb <= 0:
            raise ConfigError(f"max_cpu_ms_per_mb must be > 0, got {self.max_cpu_ms_per_mb}",
                              field="max_cpu_ms_per_mb")
        if self.revisit < 1 or self.max_revisit < self.revisit:
            raise ConfigError(f"need 1 <= revisit <= max_revisit, got {self.revisit}, {self.max_revisit}",
                              field="revisit")
        if not 0.0 < self.alpha <= 1.0:
            raise ConfigError(f"alpha must be in (0, 1], got {self.alpha}", field="alpha")

    def pays(self, ratio: float, cpu_s: float, raw_bytes: int, full_cpu_s: float = 0.0) -> bool:
        """Whether a delta storing ``ratio`` of ``raw_bytes`` for ``cpu_s`` pays (a full write costs ``full_cpu_s``)."""
        if ratio > self.max_ratio:
            return False
        saved_mb = (1.0 - ratio) * raw_bytes / _MB
        return saved_mb > 0 and 1e3 * max(0.0, cpu_s - full_cpu_s) <= self.max_cpu_ms_per_mb * saved_mb


@dataclass
class LayerPayoff:
    """What is known of one layer (see :class:`Payoff`)."""

    mode: str = "probe"  # "probe" | "delta" | "full"
    ratio: float | None = None  # averaged stored / raw of its deltas
    cpu_s: float | None = None  # averaged writer CPU seconds of its deltas
    full_cpu_s: float = 0.0  # averaged writer CPU seconds of its staged full objects
    raw_bytes: int = 0
    revisit: int = 0
    fulls_left: int = 0  # full saves before the next probe
    was_full: bool = False  # it was in "full" mode once (a probe is then a revisit)
    deltas: int = 0
    fulls: int = 0
    direct: int = 0
    switches: list[str] = field(default_factory=list)


class Payoff:
    """Per-layer delta-or-full decisions from measured compression and CPU time (module docstring)."""

    def __init__(self, rule: PayoffRule | None = None) -> None:
        self.rule = rule or PayoffRule()
        self._layers: dict[str, LayerPayoff] = {}

    def _get(self, layer: str) -> LayerPayoff:
        st = self._layers.get(layer)
        if st is None:
            st = self._layers[layer] = LayerPayoff(revisit=self.rule.revisit)
        return st

    def mode(self, layer: str) -> str:
        """``"probe"``, ``"delta"`` or ``"full"``."""
        return self._get(layer).mode

    def direct(self, layer: str) -> bool:
        """At snapshot: whether this save of ``layer`` is a full object written directly (not staged).

        Counts the save. The save before a probe returns ``False`` (it is
        staged, so the tracker keeps it as the probe's base) and turns the
        layer to ``probe``.
        """
        st = self._get(layer)
        if st.mode != "full":
            return False
        if st.fulls_left > 1:
            st.fulls_left -= 1
            st.direct += 1
            return True
        st.mode, st.fulls_left = "probe", 0
        st.switches.append("probe")
        return False

    def record(self, layer: str, kind: str, raw_bytes: int, stored_bytes: int, cpu_s: float) -> None:
        """After a staged write of ``layer``: what it stored (``kind`` "full" or "delta") and its CPU time."""
        st = self._get(layer)
        if kind != "delta":
            a = self.rule.alpha if st.fulls else 1.0
            st.full_cpu_s = a * cpu_s + (1 - a) * st.full_cpu_s
            st.fulls += 1
            return
        st.deltas += 1
        st.raw_bytes = raw_bytes
        ratio = stored_bytes / raw_bytes if raw_bytes else 1.0
        a = self.rule.alpha
        if st.mode != "probe" and st.ratio is not None and st.cpu_s is not None:  # a probe starts afresh
            ratio, cpu_s = a * ratio + (1 - a) * st.ratio, a * cpu_s + (1 - a) * st.cpu_s
        st.ratio, st.cpu_s = ratio, cpu_s
        pays = self.rule.pays(ratio, cpu_s, raw_bytes, st.full_cpu_s)
        if pays:
            if st.mode == "probe":
                st.revisit = self.rule.revisit
            if st.mode != "delta":
                st.switches.append("delta")
            st.mode = "delta"
            return
        if st.mode == "probe" and st.was_full:  # a revisit that did not pay: wait longer before the next
            st.revisit = min(self.rule.max_revisit, 2 * st.revisit)
        st.mode, st.fulls_left, st.was_full = "full", st.revisit, True
        st.switches.append("full")

    def forget(self, layer: str | None = None) -> None:
        """Forget the measurements (of one layer, or all): the next delta is a probe."""
        if layer is None:
            self._layers.clear()
        else:
            self._layers.pop(layer, None)

    def report(self) -> dict[str, dict[str, Any]]:
        """Per layer: mode, averaged ratio and CPU ms, and how many saves went which way."""
        return {
            ln: {
                "mode": st.mode,
                "ratio": None if st.ratio is None else round(st.ratio, 4),
                "cpu_ms": None if st.cpu_s is None else round(1e3 * st.cpu_s, 3),
                "full_cpu_ms": round(1e3 * st.full_cpu_s, 3),
                "deltas": st.deltas,
                "staged_fulls": st.fulls,
                "direct_fulls": st.direct,
                "revisit": st.revisit,
                "switches": len(st.switches),
            }
            for ln, st in sorted(self._layers.items())
        }
