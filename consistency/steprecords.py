"""Step records in the index: listing them, dropping them, restoring one from a durable manifest, events.

:class:`StepRecords` is the record-keeping part of
:class:`consistency.twophase.StepProtocol`: ``tierstore admin steps`` and the
metrics read :meth:`StepRecords.records`; garbage collection calls
:meth:`StepRecords.drop_steps` and :meth:`StepRecords.delete_durable_manifests`
(durable manifests first, then objects, then records); an index rebuild calls
:meth:`StepRecords.restore_durable` per durable manifest, after recording its objects.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from consistency.index import translate_redis_errors
from consistency.manifest import (
    complete_entries,
    durable_manifest_name,
    durable_pin_label_prefix,
    durable_pin_name,
    durable_pin_record,
    manifest_objects,
    superseded_manifest_name,
)
from consistency.retired import RetiredCopy
from consistency.stepbase import SerialJob, StepBase, _f, _s
from tierstore.errors import InvalidKeyError, KeyExistsError, TierStoreError
from tierstore.keys import ShardKey, validate_name

__all__ = ["DurableLag", "EventSubscription", "StepRecord", "StepRecords", "durable_lag"]

log = logging.getLogger(__name__)


def _pin_steps(value: object) -> list[int]:
    """The steps of one field of the index's ``pins`` hash: ``"B"``, or ``"B,A,..."`` where an index rebuild
    found several durable records of the label (the first is the label's step, the others kept besides)."""
    return [int(x) for x in _s(value).split(",") if x.strip()]


@dataclass(frozen=True)
class StepRecord:
    """What the index records of one step (see :meth:`StepProtocol.records`)."""

    step: int
    state: str
    world: int = 0
    epoch: int = 0
    votes: int = 0
    started: float | None = None
    decided: float | None = None
    durable_at: float | None = None
    reason: str | None = None
    rebuilt: bool = False
    attempt: int = 1
    memory_only: str | None = None
    migrated: int = 0  # ranks whose objects reached the durable tier

    @property
    def commit_latency_s(self) -> float | None:
        """Seconds from the step's begin to its decision (``None`` while undecided)."""
        if self.started is None or self.decided is None:
            return None
        return self.decided - self.started


@dataclass(frozen=True)
class DurableLag:
    """How far the durable tier is behind the memory tiers (see :func:`durable_lag`).

    Attributes:
        newest_committed / newest_durable: step numbers (``None``: there is none).
        steps: committed steps newer than the newest durable one (what a node loss now would cost, in saves).
        seconds: commit time of the newest committed step minus that of the newest durable one (with none
            durable: since the oldest committed step); 0 when the newest committed step is durable.
    """

    newest_committed: int | None
    newest_durable: int | None
    steps: int
    seconds: float


def durable_lag(records: list[StepRecord], now: float) -> DurableLag:
    """The durable lag of one model's ``records`` (every recorded step), at server time ``now``."""
    committed = [r for r in records if r.state in ("committed", "durable")]
    if not committed:
        return DurableLag(None, None, 0, 0.0)
    durable = [r for r in committed if r.state == "durable"]
    newest = committed[-1]
    if not durable:
        first = committed[0].decided or now
        return DurableLag(newest.step, None, len(committed), max(0.0, now - first))
    last = durable[-1]
    behind = [r for r in committed if r.step > last.step]
    seconds = (newest.decided or now) - (last.decided or now) if behind else 0.0
    return DurableLag(newest.step, last.step, len(behind), max(0.0, seconds))


class EventSubscription:
    """A subscription to a model's step events: ``(step, state)`` each time a step is decided or durable.

    Get one from :meth:`StepProtocol.subscribe`; :meth:`close` it when done.
    """

    def __init__(self, pubsub: Any, url: str, model: str) -> None:
        self._p = pubsub
        self._url = url
        self._model = model

    def get(self, timeout: float) -> tuple[int, str] | None:
        """The next event within ``timeout`` seconds, else ``None``."""
        with translate_redis_errors(f"events of {self._model}", self._url):
            msg = self._p.get_message(timeout=timeout)
        if msg is None:
            return None
        parts = _s(msg.get("data")).split()
        if len(parts) != 2 or not parts[0].isdigit():
            return None
        return int(parts[0]), parts[1]

    def close(self) -> None:
        self._p.close()


class StepRecords(StepBase):
    """Listing, dropping and restoring step records; event subscriptions (part of ``StepProtocol``)."""

    def steps(self, model: str) -> list[tuple[int, str]]:
        """All recorded steps of ``model`` with their states, oldest first."""
        k = self.index._k
        with translate_redis_errors(f"steps of {model}", self.index.url):
            steps = [int(_s(s)) for s in self.index._r.zrange(k(model, "steps"), 0, -1)]
            pipe = self.index._r.pipeline(transaction=False)
            for s in steps:
                pipe.hget(k(model, "step", s), "state")
            states = pipe.execute()
        return [(s, _s(st)) for s, st in zip(steps, states)]

    def records(self, model: str, steps: Iterable[int] | None = None) -> list[StepRecord]:
        """The index's records of ``steps`` (default: every recorded step), in the given order."""
        k = self.index._k
        steps = [s for s, _ in self.steps(model)] if steps is None else list(steps)
        with translate_redis_errors(f"step records of {model}", self.index.url):
            pipe = self.index._r.pipeline(transaction=False)
            for s in steps:
                pipe.hgetall(k(model, "step", s))
                pipe.hlen(k(model, "votes", s))
            rows = pipe.execute()
        out = []
        for i, step in enumerate(steps):
            h = {_s(a): _s(b) for a, b in rows[2 * i].items()}
            out.append(StepRecord(
                step=step, state=h.get("state", ""), world=int(h.get("world") or 0), epoch=int(h.get("epoch") or 0),
                votes=int(rows[2 * i + 1]), started=_f(h.get("started")), decided=_f(h.get("decided")),
                durable_at=_f(h.get("durable_at")), reason=h.get("reason") or None, rebuilt=bool(h.get("rebuilt")),
                attempt=int(h.get("attempt") or 1), memory_only=h.get("memory_only") or None,
                migrated=int(h.get("nmigrated") or 0),
            ))
        return out

    def drop_steps(self, model: str, steps: Iterable[int], *, keep_aborted_state: bool = True) -> list[int]:
        """Delete the records of ``steps`` (manifest, votes, step record) from the index.

        With ``keep_aborted_state`` an aborted step keeps its record (a
        tombstone: a late vote of it cannot re-open it); otherwise every
        record goes and the step number can be begun again. Objects and
        durable manifests are the caller's (garbage collection deletes them
        first). Returns the steps whose step record this call deleted (of
        ranks dropping the same step at once, one gets it).
        """
        k = self.index._k
        steps = sorted(set(steps))
        if not steps:
            return []
        states = dict(self.steps(model)) if keep_aborted_state else {}
        with translate_redis_errors(f"drop steps of {model}", self.index.url):
            pipe = self.index._r.pipeline(transaction=False)
            at: dict[int, int] = {}  # step -> the position of its step record's DEL in the replies
            n = 0
            for s in steps:
                pipe.delete(k(model, "manifest", s))  # one key per DEL: a cluster pipeline refuses multi-key DEL
                pipe.delete(k(model, "votes", s))
                pipe.delete(k(model, "vinfo", s))
                n += 3
                if states.get(s) != "aborted":
                    pipe.delete(k(model, "step", s))
                    pipe.zrem(k(model, "steps"), s)
                    at[s] = n
                    n += 2
            replies = pipe.execute()
        return [s for s, i in at.items() if replies[i]]

    def drop_aborted(self, model: str, attempts: dict[int, int], *, tombstones: Iterable[int] = ()) -> list[int]:
        """Delete the manifest, votes and vote info of aborted steps (``attempts``: step -> the attempt that was
        aborted), and the record itself (the tombstone) of those in ``tombstones``; each only while that attempt
        is still the step's and aborted (a newer incarnation that began the number again keeps its records).
        One script per step (atomic), not waiting for replicas (a record left behind is dropped by the next pass). Returns the steps whose record went."""
        gone = set(tombstones)
        steps = sorted(attempts)
        if not steps:
            return []
        with translate_redis_errors(f"drop aborted steps of {model}", self.index.url):
            replies = [self.index.run_script(
                self._drop_aborted, [ks["step"], ks["steps"], ks["manifest"], ks["votes"], ks["vinfo"]],
                [s, attempts[s], "1" if s in gone else "0"], ack=False, what=f"drop aborted step {s} of {model}")
                for s, ks in ((s, self._keys(model, s)) for s in steps)]
        return [s for s, r in zip(steps, replies) if int(r) == 2]

    def note_retention(self, model: str, retired: Iterable[int], *, memory: Iterable[int],
                       durable: Iterable[int], keep_last: int | None, time_s: float) -> None:
        """Record a retention pass that retired ``retired`` (committed steps whose records it dropped: what
        :meth:`drop_steps` returned, so a step that several ranks retire at once counts once), so
        ``tierstore admin steps`` can say how many steps were committed and why only some are listed.

        One hash per model (``retention``): ``retired`` counts every step retired so far; ``newest_retired``,
        ``memory`` / ``durable`` (the steps each window kept), ``keep_last`` and ``at`` describe the last pass
        that retired one. Removed with the model (``delete``), rebuilt as absent (an index rebuild counts
        nothing retired before it).
        """
        retired = sorted(set(retired))
        if not retired:
            return
        key = self.index._k(model, "retention")
        with translate_redis_errors(f"note retention of {model}", self.index.url):
            pipe = self.index._r.pipeline(transaction=False)
            pipe.hincrby(key, "retired", len(retired))
            pipe.hset(key, mapping={"newest_retired": retired[-1], "memory": json.dumps(sorted(memory)),
                                    "durable": json.dumps(sorted(durable)), "at": f"{time_s:.3f}",
                                    "keep_last": "" if keep_last is None else keep_last})
            pipe.execute()

    def retention_note(self, model: str) -> dict[str, Any] | None:
        """The record :meth:`note_retention` keeps (``None``: no pass retired a step of ``model``)."""
        with translate_redis_errors(f"read retention of {model}", self.index.url):
            h = {_s(a): _s(b) for a, b in self.index._r.hgetall(self.index._k(model, "retention")).items()}
        if not h:
            return None
        return {"retired": int(h.get("retired") or 0), "newest_retired": int(h.get("newest_retired") or -1),
                "memory": json.loads(h.get("memory") or "[]"), "durable": json.loads(h.get("durable") or "[]"),
                "keep_last": int(h["keep_last"]) if h.get("keep_last") else None, "at": _f(h.get("at"))}

    def pin(self, model: str, label: str, step: int) -> None:
        """Keep committed ``step`` of ``model`` through every retention pass while ``label`` names it (a pin:
        one per label, so pinning a label again moves it to the new step). For the framework integrations: a
        checkpoint path (``label``) that Lightning's top-k or the Trainer's ``save_total_limit`` still holds
        keeps the step it names, whatever the memory window (:func:`consistency.gc.plan_retention`: in memory
        until it is durable, then in the durable tier). Acknowledged by the index's replicas before it returns
        (a failover cannot lose the pin while the step it keeps is collected).

        One hash per model in the index (``pins``: label -> step), removed with the model. With a durable
        tier, the pin is recorded there too, so an index rebuild restores it
        (:func:`consistency.rebuild.rebuild_index`): one small create-once record per ``(label, step)``
        (:func:`consistency.manifest.durable_pin_name`), the new one written before the label's superseded
        ones are deleted (a crash in between leaves both: a rebuild keeps both, which is safe). The index pin
        is set first and stands whatever the durable tier answers: a record that cannot be written (after the
        retries) is logged as a warning and counted (:attr:`durable_pin_failures`,
        :attr:`last_durable_pin_failure`), not raised: the pin already keeps the step while the index lives,
        and raising would fail a save whose step is committed and kept (the integrations pin from their
        save path), for a record only an index rebuild reads. One writer per label (rank 0).

        **Bounded.** The record's write (and the deletes of the label's superseded records) runs on the pin
        records' own thread, one job at a time in the order of the pins and unpins, and ``pin`` waits for it at
        most ``pin_record_timeout_s`` seconds (the protocol's attribute, default 30 s): past it (a durable
        tier that hangs) it returns, with the warning and the count. The record is still written when the tier
        answers, before any later pin's or unpin's records change (a failure then is logged, not counted
        again); a pin made while an earlier record still waits for the tier does not wait (it is queued behind
        it, warned about and counted at once).

        Raises:
            InvalidKeyError: an empty ``label``; CommitError: a malformed ``step``.
            ReplicaAckError: too few replicas acknowledged the pin in time.
        """
        self._check(model, step)
        if not isinstance(label, str) or not label:
            raise InvalidKeyError(f"a pin's label must be a non-empty string, got {label!r}", field="label")
        with translate_redis_errors(f"pin step {step} of {model}", self.index.url):
            self.index._r.hset(self.index._k(model, "pins"), label, step)
        self.index.sync(model, f"pin step {step} of {model}")  # the index pin first: it is what keeps the step
        if self.durable is not None:
            self._pin_record_job(f"the durable record of pin {label!r} -> step {step} of {model}",
                                 lambda report: self._record_pin(model, label, step, report))

    def _pin_record_job(self, what: str, work: Callable[[Callable[[str, Exception], None]], None], *,
                        done: str = "written") -> None:
        """Run ``work(report)`` on the pin records' thread, in order; wait for it at most ``pin_record_timeout_s``.

        What ``work`` reports (or raises) is counted once it ends, if that came before the deadline; past the
        deadline the wait itself is what is counted, and what the job meets later is only logged."""
        met: list[tuple[str, Exception]] = []

        def run(job: SerialJob) -> None:
            try:
                work(lambda msg, err: met.append((msg, err)))
            except Exception as e:  # noqa: BLE001 - a pin never fails past the index pin for its record
                met.append((f"{what}: the durable tier's record failed", e))
            first = job.settle()
            for msg, err in met:
                if first:
                    self._pin_record_failed(msg, err)
                else:
                    log.warning("%s (after the pin stopped waiting for it): %s", msg, err)

        limit = max(0.0, float(self.pin_record_timeout_s))
        behind = self._pin_records.stalled(limit)  # an earlier job outlived its deadline: this one waits behind it
        job = self._pin_records.submit(run)
        if job.done.wait(0.0 if behind else limit) or not job.settle():
            job.done.wait()  # it ended first (done, or about to be): what it met is counted by then
            return
        why = (f"queued behind an earlier durable pin record the durable tier has not answered for {limit:g} s"
               if behind else f"the durable tier did not answer within {limit:g} s")
        self._pin_record_failed(f"{what} was not {done} ({why}; it is {done} when the tier answers)", None)

    def _record_pin(self, model: str, label: str, step: int, report: Callable[[str, Exception], None]) -> None:
        """Write the durable record of the pin ``label`` -> ``step``, then delete the label's other records."""
        durable = self.durable
        if durable is None:
            return
        name = durable_pin_name(model, label, step)
        body = durable_pin_record(model, label, step)

        def put() -> None:
            try:
                durable.put(name, body, if_absent=True)
            except KeyExistsError:
                pass  # already recorded: the name is the label and the step, the body follows from them

        try:
            self.retry.call(put)
        except TierStoreError as e:  # the superseded records stay: they keep more, never less
            report(f"the durable record of pin {label!r} -> step {step} of {model} was not "
                   f"written (an index rebuild now would not restore it)", e)
            return
        self._drop_pin_records(model, label, keep=name, report=report)

    def _drop_pin_records(self, model: str, label: str, *, keep: str | None = None,
                          report: Callable[[str, Exception], None] | None = None) -> None:
        """Delete the durable records of ``label`` of ``model`` but ``keep``."""
        durable = self.durable
        if durable is None:
            return
        def delete(name: str) -> Callable[[], bool]:
            return lambda: durable.delete(name)

        try:
            names = self.retry.call(lambda: list(durable.list(durable_pin_label_prefix(model, label))))
            for n in names:
                if n != keep:
                    self.retry.call(delete(n))
        except TierStoreError as e:  # a record left behind keeps its step after a rebuild: safe
            (report or self._pin_record_failed)(f"superseded durable pin records of {label!r} of {model} were not "
                                                f"deleted (an index rebuild now would keep their steps pinned too)", e)

    def _pin_record_failed(self, what: str, e: Exception | None) -> None:
        with self._pin_failures_lock:
            self.durable_pin_failures += 1
            self.last_durable_pin_failure = what if e is None else f"{what}: {e}"
        if e is None:
            log.warning("%s", what)
        else:
            log.warning("%s: %s", what, e)

    def unpin(self, model: str, labels: Iterable[str]) -> None:
        """Remove the pins ``labels`` of ``model`` (:meth:`pin`), in the index, then their durable records;
        the steps they kept go at the next retention pass that no longer keeps them otherwise. A label that
        pins nothing is ignored. A durable record that cannot be deleted is warned about and counted
        (:attr:`durable_pin_failures`): only an index rebuild would bring its pin back. The deletes run after
        the records of earlier pins, bounded as :meth:`pin`'s record is (``pin_record_timeout_s``)."""
        labels = sorted(set(labels))
        if not labels:
            return
        with translate_redis_errors(f"unpin steps of {model}", self.index.url):
            self.index._r.hdel(self.index._k(model, "pins"), *labels)
        if self.durable is None:
            return

        def drop(report: Callable[[str, Exception], None]) -> None:
            for label in labels:
                self._drop_pin_records(model, label, report=report)

        self._pin_record_job(f"the durable pin records of {len(labels)} unpinned label(s) of {model}", drop,
                             done="deleted")

    def pins(self, model: str) -> dict[str, int]:
        """``model``'s pins: label -> the step it keeps (:meth:`pin`; see :meth:`pinned` for every step)."""
        return {label: steps[0] for label, steps in self.pinned(model).items() if steps}

    def pinned(self, model: str) -> dict[str, list[int]]:
        """``model``'s pins: label -> every step it keeps, its own first (an index rebuild that found several
        durable records of a label, a crash while the pin moved, keeps them all until the label is pinned
        again or unpinned)."""
        with translate_redis_errors(f"read the pins of {model}", self.index.url):
            h = self.index._r.hgetall(self.index._k(model, "pins"))
        return {_s(a): _pin_steps(b) for a, b in h.items()}

    def pinned_steps(self, model: str) -> set[int]:
        """Every step a pin of ``model`` keeps (what retention keeps for the pins)."""
        return {s for steps in self.pinned(model).values() for s in steps}

    def restore_pins(self, model: str, found: dict[str, list[int]]) -> int:
        """Record the pins an index rebuild found in the durable tier (``found``: label -> the durable steps
        of its records), beside the pin the index may still hold of each label (its step stays first; the
        newest found step is first otherwise). Returns how many ``(label, step)`` pins were restored."""
        current = self.pinned(model)
        mapping: dict[str, str] = {}
        n = 0
        for label, steps in sorted(found.items()):
            want = sorted(set(steps), reverse=True)
            n += len(want)
            merged = list(dict.fromkeys([*current.get(label, []), *want]))
            mapping[label] = ",".join(map(str, merged))
        if not mapping:
            return 0
        with translate_redis_errors(f"restore the pins of {model}", self.index.url):
            self.index._r.hset(self.index._k(model, "pins"), mapping=mapping)
        self.index.sync(model, f"restore the pins of {model}")
        return n

    def supersede(self, model: str, step: int, *, epoch: int, reason: str) -> str:
        """Record committed ``step`` aborted, with ``reason``, so incarnation ``epoch`` can save it again.

        For a step an older incarnation committed that this one judged lost when it restored (every tier
        that should hold one of its copies answered a miss or a bad checksum): without this, resuming
        from the older step could never save that step number again. Nothing of it is deleted: its
        durable manifest is copied to its superseded name first, then the step is recorded aborted (it is
        no longer reported committed or durable), then the original durable manifest goes (an index rebuild
        must not resurrect it) and its copies' records move to the model's retired set (a record the new
        attempt replaces first goes there too: see ``_RECORD``); garbage collection deletes them once the
        live line has a newer durable step (:mod:`consistency.retired`). A step of ``epoch`` itself, or one
        no longer committed, is left alone. Returns the state before the call.

        Raises:
            FencedError: ``epoch`` is older than the job's.
        """
        self._check(model, step)
        ks = self._keys(model, step)
        (rec,) = self.records(model, [step])
        sets_aside = rec.state in ("committed", "durable") and rec.epoch < epoch and epoch >= self.index.epoch(model)
        manifest = self.manifest(model, step) if sets_aside else None
        if sets_aside:
            self._copy_aside(model, step, rec)
        out = _s(self._run(f"supersede step {step} of {model}", self._supersede, [ks["epoch"], ks["step"]],
                           [epoch, reason[:1000], ks["events"], step]))
        if sets_aside and out in ("committed", "durable"):
            durable = self.durable
            if durable is not None:
                self.retry.call(lambda: durable.delete(durable_manifest_name(model, step)))
            if manifest is not None:
                own = [(ShardKey.parse(o["key"]), o.get("name") or o["key"]) for o in manifest_objects(manifest)]
                self.index.retire_copies(model, step, [(k, n) for k, n in own if k.step == step])
        return out

    def _copy_aside(self, model: str, step: int, rec: StepRecord) -> None:
        """Copy a step being superseded's durable manifest to its superseded name (kept, never restored)."""
        durable = self.durable
        if durable is None:
            return
        raw = self.retry.call(lambda: durable.get(durable_manifest_name(model, step)))
        if raw is None:
            return
        aside = superseded_manifest_name(model, step, rec.attempt)
        data = bytes(raw)

        def put_aside() -> None:
            try:
                durable.put(aside, data, if_absent=True)
            except KeyExistsError:
                pass  # another rank set it aside first

        self.retry.call(put_aside)
        self.index.add_retired(model, RetiredCopy(aside, step, "manifest", tiers=(durable.tier,), size=len(data)))

    def delete_durable_manifests(self, model: str, steps: Iterable[int]) -> None:
        """Delete the durable manifests of ``steps`` (first, before their objects: an index rebuild
        must never resurrect a step whose objects are going)."""
        if self.durable is None:
            return
        for s in sorted(set(steps)):
            self.durable.delete(durable_manifest_name(model, s))

    def restore_durable(self, model: str, manifest: dict) -> None:
        """Record a step from its durable manifest as ``durable`` (index rebuild), replacing what was there.

        The objects are the caller's to record first (:meth:`Index.record_object`);
        the entries of older steps it reads are pinned here.
        """
        step = manifest["step"]
        ks = self._keys(model, step)
        committed = manifest.get("committed_at", 0.0)
        index_copy = {k: v for k, v in manifest.items() if k != "durable"}
        with translate_redis_errors(f"rebuild step {step} of {model}", self.index.url):
            pipe = self.index._r.pipeline(transaction=True)
            pipe.delete(ks["step"], ks["votes"], ks["vinfo"])
            pipe.hset(ks["step"], mapping={
                "state": "durable", "world": manifest["world"], "epoch": manifest.get("epoch", 0),
                "started": committed, "decided": committed, "durable_at": committed,
                "layout": json.dumps(manifest.get("layout")), "timeout": 0, "nmigrated": manifest["world"],
                "rebuilt": 1, "attempt": manifest.get("attempt") or 1,
            })
            pipe.zadd(ks["steps"], {str(step): step})
            pipe.set(ks["manifest"], json.dumps(index_copy, separators=(",", ":")))
            pipe.execute()
        own = {o["key"] for o in manifest_objects(manifest)}
        self.index.pin_objects([ShardKey.parse(o["key"]) for o in complete_entries(manifest) if o["key"] not in own],
                               step, int(manifest.get("attempt") or 1))
        self.index.register_model(model)

    def record_unrebuildable(self, model: str, step: int, reason: str) -> bool:
        """Record ``step``, whose durable manifest an index rebuild could not use (it does not parse, or objects
        of its complete set are missing), as ``aborted`` with ``reason``, where the index has no record of it:
        the rebuild's verdict is kept (``tierstore admin steps`` shows why), and the check for an index that
        lost records (:meth:`consistency.epochs.EpochLog.check_records`) does not take the step for a lost one
        again. A step the index does record is left as it is. Returns whether it was recorded."""
        ks = self._keys(model, step)
        with translate_redis_errors(f"record step {step} of {model} unrebuildable", self.index.url):
            if not self.index._r.hsetnx(ks["step"], "state", "aborted"):
                return False
            pipe = self.index._r.pipeline(transaction=True)
            pipe.hset(ks["step"], mapping={"reason": f"not rebuilt: {reason}"[:500], "epoch": 0, "world": 0,
                                           "timeout": 0, "rebuilt": 1, "attempt": 1})
            pipe.zadd(ks["steps"], {str(step): step})
            pipe.execute()
        self.index.register_model(model)
        return True

    def subscribe(self, model: str) -> EventSubscription:
        """Subscribe to ``model``'s step events (the caller closes the subscription)."""
        validate_name(model, "model")
        with translate_redis_errors(f"subscribe to events of {model}", self.index.url):
            p = self.index._r.pubsub(ignore_subscribe_messages=True)
            p.subscribe(self._keys(model, 0)["events"])
        return EventSubscription(p, self.index.url, model)
