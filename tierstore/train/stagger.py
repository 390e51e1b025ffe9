"""Smoothed checkpoint I/O (LayerCheck): stagger forced saves and bases across layers and ranks.

Without staggering, every layer saved at the same step (the first save, a
restore) is forced again at the same later steps (the staleness bound), and
every layer's base of a differential or replay chain falls on the same steps:
periodic I/O bursts. Here each layer gets a *slot* (an offset in
``0 .. period-1``); its periodic work falls on steps ``s`` with
``(s - slot) % period == 0``, so the bytes of one period spread over its steps.

Pure functions, no state. How the policies call them (per save, per layer):

* slots, once, from the layer sizes in bytes (sorted layer names, the order
  every rank uses): ``slots = balanced_slots(sizes, period)``;
* LayerCheck's staleness bound (``period = max_staleness``): the layer is due
  when ``forced_save(step, last_saved, slots[i], period)`` or its relative
  change exceeds ``tau``. The bound still holds (never more than ``period``
  steps between saves). :class:`~tierstore.train.policies.LayerwiseTracker` applies
  the slot only once half the bound has passed since the layer's last save,
  so staggering adds few saves (and little extra staleness at a restore). All ranks of a layer must save it at the same step,
  so use ``rank=0`` (no rank shift) for layerwise;
* a base of a differential or replay chain: ``is_base_step(step, slot)`` with
  ``slot = shifted(slots[i], rank, period, world)`` (ranks' chains are
  independent, so ranks are shifted too), or whenever the chain limit forces one.

``offset`` is the simple closed form; ``balanced_slots`` is better when layer
sizes differ (largest first, each into the least-loaded slot).
"""

from __future__ import annotations

from collections.abc import Sequence

from tierstore.errors import ConfigError

__all__ = ["balanced_slots", "forced_save", "is_base_step", "offset", "shifted", "slot_loads"]


def _check_period(period: int) -> None:
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ConfigError(f"period must be an int >= 1, got {period!r}", field="period")


def offset(layer_index: int, rank: int, period: int, n_layers: int) -> int:
    """``(layer_index * period // n_layers + rank) % period``: layers evenly over the period."""
    _check_period(period)
    if n_layers < 1 or not 0 <= layer_index < n_layers:
        raise ConfigError(f"layer_index {layer_index} is outside 0..{n_layers - 1}", field="layer_index")
    return (layer_index * period // n_layers + rank) % period


def balanced_slots(sizes: Sequence[int], period: int) -> list[int]:
    """A slot per layer so that the bytes per slot are balanced (greedy LPT).

    Layers largest first (index order on ties) go to the slot with the fewest
    bytes so far (lowest slot on ties). Deterministic: every rank computes
    the same slots from the same sizes. The largest slot is at most
    ``mean + max(sizes)``.
    """
    _check_period(period)
    load = [0] * period
    slots = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        s = min(range(period), key=lambda k: (load[k], k))
        slots[i] = s
        load[s] += sizes[i]
    return slots


def shifted(slot: int, rank: int, period: int, world: int = 1) -> int:
    """Shift a layer's slot for ``rank``: ranks spread evenly over the period."""
    _check_period(period)
    return (slot + rank * period // max(1, world)) % period


def is_base_step(step: int, slot: int, period: int) -> bool:
    """Whether ``step`` is a periodic base step of the layer in ``slot``."""
    _check_period(period)
    return (step - slot) % period == 0


def forced_save(step: int, last_saved: int | None, slot: int, period: int, *, stagger_first: bool = False) -> bool:
    """Whether the staleness bound forces a save of the layer at ``step``.

    True when the layer was never saved (with ``stagger_first``: only at its
    slot, so the very first saves are spread too; the job is restorable once
    every layer has been saved), when ``period`` steps have passed since
    ``last_saved`` (the hard bound), or at the layer's slot unless it was
    saved at this very step. Saves then stay on their slots, and the gap
    between two saves never exceeds ``period``.
    """
    _check_period(period)
    if last_saved is None:
        return is_base_step(step, slot, period) if stagger_first else True
    if step == last_saved:
        return False
    return step - last_saved >= period or is_base_step(step, slot, period)


def slot_loads(sizes: Sequence[int], slots: Sequence[int], period: int) -> list[int]:
    """Bytes falling on each slot."""
    load = [0] * period
    for n, s in zip(sizes, slots):
        load[s] += n
    return load
