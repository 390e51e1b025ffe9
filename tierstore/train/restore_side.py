"""The Checkpointer's restore side: resolve the step every rank agrees on, read, load, verify.

:class:`RestoreSide` is a mixin of :class:`~tierstore.train.checkpointer.Checkpointer`
(which owns the state, ranks, gate and policies it uses). ``restore()``
joins the incarnation's epoch (a writer's), resolves the step every rank can
restore (``all_reduce(MIN)``), reads this rank's shards and loads them into
the state; how the copies are verified (beside the load, before the first
update or before returning) is :mod:`tierstore.train.restoring`'s. The first
save after a restore that fell back judges the committed steps it passed, all
together (:meth:`RestoreSide._begin`): those proven lost are superseded
together and their numbers saved again; the others stand, and the saves of
their numbers (and of the steps they read) are skipped with a warning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, MutableMapping
from typing import TYPE_CHECKING, Any

import torch

from consistency.closure import readers_of
from tierstore import gchold
from tierstore.errors import NoValidCopyError, StepCommittedError, TierStoreError
from tierstore.keys import ShardKey
from tierstore.train.imported import adopt_import, import_seeds
from tierstore.train.reshard import read_for_restore
from tierstore.train.restoring import (
    IN_PASS,
    CopiesLost,
    PendingRestore,
    agreed_step,
    hash_eagerly,
    prepare_agreed,
    read_unverified,
    refuse_until_restored,
    verify_mode,
    weights_of,
)
from tierstore.train.view import STATE_LAYER, Restored, RestoreReport

__all__ = ["RestoreSide"]

log = logging.getLogger(__name__)


def _tensors(stateful: Any) -> list[Any]:
    """The tensors a module or optimizer holds (its parameters, buffers and optimizer state)."""
    if isinstance(stateful, torch.nn.Module):
        return [*stateful.parameters(), *stateful.buffers()]
    if isinstance(stateful, torch.optim.Optimizer):
        return [t for st in stateful.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return []


class RestoreSide:
    """The restore half of the Checkpointer (a mixin; the Checkpointer owns what it uses)."""

    store: Any
    model: str
    state: MutableMapping[str, Any]
    view: Any
    policy: Any
    ranks: Any
    rank: int
    world_size: int
    epoch: int | None
    report: RestoreReport
    plan: Any  # tierstore.train.saveplan.SavePlan
    _gate: Any
    _restoring: PendingRestore | None
    _manifests: dict[int, dict]
    _written: dict[int, dict[ShardKey, Any]]
    _passed: set[int]
    _standing: dict[int, str]
    _unproven: dict[int, str]
    _lost: dict[int, str]
    _seeds: dict[str, Any]
    hold_gc: bool

    if TYPE_CHECKING:  # provided by the Checkpointer
        def _drain(self) -> str | None: ...
        def _reset_trackers(self) -> None: ...
        def _optimizers(self) -> list[torch.optim.Optimizer]: ...

    def _src(self, world: int) -> int:
        return self.rank if self.rank < world else self.rank % world

    def read(self, res: Any, layers: Iterable[str] | None = None, only: Iterable[str] | None = None, *,
             aliased: bool = False) -> dict[str, tuple[dict[str, torch.Tensor], dict]]:
        """This rank's shards of a resolution (``layer -> (tensors, metadata)``), refs of parts resolved, each
        layer shaped for this rank's state: read whole where its layout matches the saved one, else resharded
        (:mod:`tierstore.train.reshard`); every copy verified as it is read.

        ``aliased``: the module layers read whole alias the copies read, each verified whole first
        (:meth:`~tierstore.store.reading.ReadPath.get_aliased`): for a restore, whose load copies them into
        the state and drops them; never for tensors handed to a user."""
        def get(key: ShardKey, rec: Any) -> Any:
            return self.store.get(key) if key.layer == STATE_LAYER else self.store.get_aliased(key, rec=rec)

        got = read_for_restore(self.store, self.model, res, self.view, self.rank, self._src(res.world_size),
                               res.layers if layers is None else layers, only, get if aliased else None)
        self.report.resharded = sorted({*self.report.resharded, *got.resharded})
        self.report.bytes_read += got.bytes_read + got.whole_bytes
        self.report.bad_copies += got.bad_copies
        return got.shards

    def _same_layout(self, res: Any) -> bool:
        """Whether this rank's state is laid out as the step was saved (same world, no sharded tensor): its
        copies can be read whole and verified beside the load; otherwise they are resharded."""
        from torch.distributed.tensor import DTensor  # lazy: the restore alone needs it

        if res.world_size != self.world_size:
            return False
        return not any(isinstance(t, DTensor) for v in self.state.values() if hasattr(v, "state_dict")
                       for t in _tensors(v))

    def doc(self, res: Any) -> dict[str, Any]:
        """This rank's JSON document of a resolution's step."""
        src = self._src(res.world_size)
        extra = res.extra.get(src) or res.extra.get(str(src)) or {}
        return extra.get("state") or {}

    def restore(self, step: int | None = None, *, read_only: bool = False,
                only: Iterable[str] | None = None, verify: str | None = None,
                weights_only: bool = False) -> Restored:
        """Load the newest consistent state (or committed ``step``) in place: ``(step, extra)``.

        A writer's restore (the default) first joins the job incarnation's
        epoch, so writes of a previous incarnation are fenced, and the next
        save continues from it; every rank calls it. ``read_only=True`` takes
        no epoch and writes nothing: an evaluator can read while the trainer
        runs. ``only`` loads a subset of the state's keys (``["model"]``:
        weights only); entries of the checkpoint not loaded are skipped.
        ``weights_only=True`` loads the modules alone (of ``only``, where
        given): optimizers, schedulers and every other entry are left as they
        are, so a checkpoint of another optimizer restores its weights.
        Returns ``(None, None)`` when nothing of this model is committed
        (and ``step`` is not given). ``ckpt.report`` tells more.

        The copies are loaded at the copy's speed and their checksums verified
        beside it (:mod:`tierstore.train.restoring`): ``verify="before_update"``
        holds the first ``optimizer.step()`` (or ``save()``) back until every
        copy verified, and raises :class:`~tierstore.errors.RestoreVerifyError`
        there, refusing the update, if one failed (the state is then restored
        again, verified first); ``"before_return"`` verifies before returning
        (and returns the second restore's result if a copy failed). Default:
        ``"before_update"`` for a writer's restore with an optimizer in the
        state, ``"before_return"`` for ``read_only`` and optimizer-less states.

        Another world size or sharding is not a mismatch: each rank reads the
        parts of the saved shards its own shard holds (:mod:`tierstore.train.reshard`),
        each chunk verified as it is read.

        Raises:
            RestoreMismatchError: the stored state does not fit (missing entry,
                layer or tensor, a global shape or dtype, a placement that
                cannot be resharded, another optimizer type or param-group
                structure); modules and optimizers are unchanged.
            PeerRestoreError: another rank's part failed (all ranks raise,
                none changed its state; :mod:`tierstore.train.restoring`).
            NoValidCopyError: ``step`` is not committed, or a needed object
                has no valid copy in any tier.
            ConfigError: an unknown ``verify``.
        """
        with gchold.held(self.hold_gc):  # thousands of small objects: no collections midway (tierstore.gchold)
            t_agree = time.perf_counter()
            only = weights_of(self.state, only) if weights_only else only
            mode = verify_mode(verify, read_only, self.state, self.world_size)
            if verify is None and mode != "before_update":  # the default depends on this node's cores (and GPU): every
                # rank verifies alike (the deferred and in-pass restores run different collectives), in the pass if any
                # rank would (collective; every rank of a state of the same kind takes this branch)
                mode = "before_return" if self.ranks.all_min(int(mode == "before_return")) else IN_PASS
            self._drain()
            self._abandon_restore()
            if not read_only:
                self.epoch = self.ranks.join()
            committed = [s for s, st in self.store.steps.steps(self.model) if st in ("committed", "durable")]
            self.report = RestoreReport(newest=committed[-1] if committed else None, read_only=read_only)
            self.report.phases["agree"] = time.perf_counter() - t_agree
            self._seeds: dict[str, Any] = {}
            self.report.verify = IN_PASS if self.plan.restores_itself else mode
            pending = None
            if self.plan.restores_itself:
                got = Restored(*self.plan.restore(step, read_only=read_only, only=only))
            else:
                got, pending = self._restore(step, only, mode, read_only)
            if not read_only:
                self._reset_trackers()
                self.plan.seed(self._seeds)  # an imported base: the first saves are deltas against it
                self.plan.continue_from(got.step, self.report.base_step)
            self.report.step, self.report.epoch = got.step, self.epoch
            self._manifests.clear()  # a step of an older incarnation may have been superseded
            self._written.clear()
            self._passed = ({s for s in committed if s > got.step}
                            if not read_only and step is None and got.step is not None else set())
            self._standing = {}
            self._lost = {}
            self.report.fell_back = got.step != self.report.newest if got.step is not None else False
            if pending is not None:
                if mode == "before_update":
                    self._restoring = pending
                    self._gate.watch(self._optimizers())  # optimizers put in the state since the constructor
                    self._gate.hold(pending.before_update)
                else:
                    try:
                        again = pending.settle()
                    except TierStoreError as e:
                        refuse_until_restored(self, e)
                        raise
                    if again is not None:
                        return again
            return got

    def _abandon_restore(self) -> None:
        """Drop the hold of a restore still verifying (the state is about to be replaced, or closed)."""
        self._gate.hold(None)
        pending, self._restoring = self._restoring, None
        if pending is not None:
            pending.abandon()

    def _restore(self, step: int | None, only: Iterable[str] | None, mode: str,
                 read_only: bool, thorough: bool = False) -> tuple[Restored, PendingRestore | None]:
        """Resolve, read and load (:mod:`tierstore.train.restoring`); the copies' verification, unless in pass.

        The step is chosen by the copies' trailers (every copy read is hashed whole by the read or the
        verification; hashing each in the resolve too read it twice), unless ``thorough``: in pass, a copy
        that fails in every tier makes every rank resolve again with each copy hashed (``thorough``), which
        passes over a step whose copies do not verify, as a restore always did."""
        t0 = time.perf_counter()
        phases = self.report.phases
        deferred = mode != IN_PASS
        res = self._agreed_resolution(step, verify=None if thorough else "trailer")
        phases["resolve"] = phases.get("resolve", 0.0) + time.perf_counter() - t0
        if res is None:  # nothing committed yet: a fresh job
            return Restored(None, None), None
        t_read = time.perf_counter()
        doc, only = adopt_import(self.state, self.doc(res), only)  # an imported base: its one module, nothing else
        layers = self.view.layers_for(res.layers, doc, only)
        if deferred and self.ranks.all_min(int(self._same_layout(res))) == 0:  # resharded (on any rank): verified as read
            log.info("restore of %s: step %d was saved by %d rank(s) in another layout: resharding, verified as "
                     "read", self.model, res.step, res.world_size)
            return self._restore(step, only, IN_PASS, read_only)
        if deferred:
            try:
                shards, v = read_unverified(self, res, layers, eager=hash_eagerly(mode, self.world_size))
                failed: Exception | None = None
            except Exception as e:  # noqa: BLE001 - a read that failed (no valid trailer) is read again, verified
                shards, v, failed = {}, None, e
            # a step saved sharded (DTensor placements in its objects) at this world size, into plain modules:
            # its copies are resharded (the target side alone cannot tell)
            sharded = any(meta.get("dist") for _t, meta in shards.values() if isinstance(meta, dict))
            verdict = self.ranks.all_min(0 if failed else 1 if sharded else 2)  # collective: every rank agrees
            if verdict == 1:
                log.info("restore of %s: step %d was saved sharded by %d rank(s): resharding, verified as read",
                         self.model, res.step, res.world_size)
                return self._restore(step, only, IN_PASS, read_only)
            if verdict == 0:  # every rank reads again, verified
                log.warning("restore of %s: %s; reading again with every copy verified first", self.model,
                            failed or "another rank could not read its copies")
                return self._restore(step, only, IN_PASS, read_only, thorough=True)
        else:
            v = None
        t_load = time.perf_counter()
        if deferred:
            phases["read"] = phases.get("read", 0.0) + t_load - t_read
        pending = PendingRestore(self, v, step, read_only, only, t0) if v is not None else None
        try:  # every rank read and validated its part before any loads (collective)
            shards, plan = prepare_agreed(self, res, (lambda: shards) if deferred else (lambda: self.read(
                res, layers, only, aliased=True)), doc, only, lost_retry=not (deferred or thorough))
            self.view.apply(plan)
        except CopiesLost as e:  # in pass, every rank alike: nothing was loaded
            log.warning("restore of %s: step %d: %s; resolving again with every copy verified", self.model,
                        res.step, e.error)
            return self._restore(step, only, IN_PASS, read_only, thorough=True)
        except BaseException:
            if pending is not None:
                pending.abandon()
            raise
        if not deferred:  # read inside prepare_agreed: read and load are one part here
            phases["read+load"] = phases.get("read+load", 0.0) + time.perf_counter() - t_load
        else:
            phases["load"] = phases.get("load", 0.0) + time.perf_counter() - t_load
        whole = {ln: v_ for ln, v_ in shards.items() if ln not in self.report.resharded}
        self._seeds = import_seeds(doc, res, whole, self.rank, self.world_size) if self.plan.imports_bases else {}
        self.report.base_s = time.perf_counter() - t0
        return Restored(res.step, plan.get("user")), pending

    def _agreed_resolution(self, step: int | None, verify: str | None = None) -> Any:
        """The step every rank restores (collective in a group). Each rank checks its share of the copies,
        those of the saved ranks ``s % world == rank`` (:mod:`tierstore.readpath`: together the ranks check
        every copy once), and resolves the newest step whose share verifies; they take the oldest of those;
        a rank that resolved a newer one resolves again at or below it, and so on until every rank resolved
        the same step: every share of it verified. So a rank that cannot read the newest step (a node lost
        with its copies) never resumes from another step than the others. ``None``: nothing committed."""
        kw: dict[str, Any] = {"verify": verify} if verify else {}
        if self.ranks.group is not None and self.world_size > 1:  # shares only where the ranks agree after
            kw["part"] = (self.rank, self.world_size)
        at_most: int | None = None
        res = None
        while True:  # each turn one collective; the agreed step only falls, so it ends
            err: NoValidCopyError | None = None
            if res is None or res.step != at_most:
                try:
                    res = self.store.resolve(self.model, max_staleness=self.policy.max_staleness, step=step,
                                             **kw, **({} if at_most is None else {"at_most": at_most}))
                    mine = res.step
                except NoValidCopyError as e:
                    res = None
                    fresh = step is None and at_most is None and "reason" not in e.fields
                    mine, err = (-1, None) if fresh else (-2, e)
            agreed, alike = agreed_step(self, mine, err, step)  # collective, with ``step`` too: every rank agrees
            if err is not None:
                raise err
            if agreed == -2:
                raise NoValidCopyError(f"{self.model}: another rank found no committed step it can restore",
                                       model=self.model, reason="another rank could not resolve")
            if agreed == -1:
                if mine != -1:  # a step committed between this rank's resolve and another's
                    raise NoValidCopyError(f"{self.model}: the ranks saw different committed steps; restore again",
                                           model=self.model, reason="ranks disagree")
                return None
            if alike:
                return res
            if at_most is None and agreed != mine:  # said once, at the first turn
                log.warning("restore of %s: rank %d resolved step %d, another rank only step %d: all restore "
                            "step %d or older", self.model, self.rank, mine, agreed, agreed)
            at_most = agreed

    def _begin(self, step: int, layout: dict[str, Any]) -> bool:
        """Begin ``step``; ``False``: the save is skipped (nothing is written), with a warning saying until when.

        The committed steps newer than the one this incarnation restored (its restore fell back past them) are
        judged at its first save, all together and by every rank together (:meth:`_judge_passed`): those with
        positive evidence that they are lost (a copy one needs is missing or bad in every tier that should hold
        it) are superseded together (kept aside, see :meth:`consistency.steprecords.StepRecords.supersede`), so
        none of them pins another's copies; the others *stand* (they verify, or some tier did not answer: a step
        is never replaced on a guess). A save of a standing step's number, or of a step whose copies a standing
        step reads (:func:`consistency.closure.readers_of`), is skipped; every other save is written, a lost
        step's number as a new attempt.
        """
        if self._passed or self._lost:
            self._judge_passed()
        standing = {t: w for t, w in self._standing.items() if t >= step}
        self._standing = standing
        try:
            # standing steps are agreed by every rank (_judge_passed), so every rank takes this collective or none
            readers = self._readers(step) if standing else []
            if standing and int(self.ranks.all_max_(torch.tensor([max(readers, default=-1)]))[0]) >= 0:
                until = max(readers or list(standing))
                log.warning("step %d of %s: the committed step(s) %s of an earlier incarnation read its copies and "
                            "were not proven lost (%s): this save of step %d is skipped, as are the saves of the "
                            "steps they read, until step %d; saves are written again after it", step, self.model,
                            readers or "(on another rank)", "; ".join(sorted({standing[t] for t in readers}))
                            or "kept", step, until)
                return False
            self.store.begin_step(self.model, step, self.world_size, layout=layout, epoch=self.epoch)
            return True
        except StepCommittedError:
            if step not in standing or self.epoch is None:
                raise
            log.warning("step %d of %s is committed by an earlier incarnation and was not proven lost (%s): it is "
                        "kept, and this save of step %d is skipped; saves are written again from step %d on",
                        step, self.model, standing[step], step, step + 1)
            return False
        # a standing step stays listed until the saves pass it (``t >= step`` above): a save of its number that
        # failed for another reason (the index did not answer) and is retried is skipped again, not refused

    def _judge_passed(self) -> None:
        """Judge every passed step at once (collective): supersede those proven lost, together; the rest stand.

        The verdicts are agreed once (the one collective); the supersedes are carried out newest first and a
        step leaves ``_lost`` only once its supersede returned, so a supersede that fails (the index stopped
        answering half-way) fails this save, typed, and the next save carries out the rest, with no new
        collective: no lost step is left committed for its number's save to hit (``StepCommittedError``)."""
        if self._passed:
            passed = sorted(self._passed)
            whys = [self._judge(s) for s in passed]
            lost = self.ranks.all_max_(torch.tensor([1 if w is not None else 0 for w in whys], dtype=torch.int32))
            self._passed = set()
            for s, why, flag in zip(passed, whys, lost.tolist()):
                if flag:
                    self._lost[s] = why or "another rank found it lost"
                else:
                    self._standing[s] = self._unproven.pop(s, "it verifies")
        for s in sorted(self._lost, reverse=True):
            why = self._lost[s]
            was = self.store.steps.supersede(
                self.model, s, epoch=self.epoch,
                reason=f"lost ({why[:300]}): incarnation {self.epoch} resumed from step {self.report.step}; "
                       "saved again (its copies are kept until a newer durable step)")
            del self._lost[s]
            self._manifests.pop(s, None)  # retention must read the new attempt's manifest
            self._written.pop(s, None)
            if was in ("committed", "durable"):
                log.warning("step %d of %s was %s but is lost: saved again (superseded with the other lost "
                            "steps; %s)", s, self.model, was, why)

    def _readers(self, step: int) -> list[int]:
        """The standing committed steps newer than ``step`` whose restore reads copies of ``step``
        (:func:`consistency.closure.readers_of`): while they stand, ``step``'s copies are pinned."""
        manifests = {t: self.store.steps.manifest(self.model, t) for t in self._standing if t > step}
        return readers_of(step, manifests)

    def _judge(self, step: int) -> str | None:
        """Why committed ``step`` is lost, with positive evidence; ``None`` if it verifies or nothing is known
        (a tier did not answer: said in ``_unproven``)."""
        proven = self.plan.proven_lost(step)  # its replay diverged or lost an entry
        if proven is not None:
            return proven
        try:
            self.store.resolve(self.model, max_staleness=self.policy.max_staleness, step=step)
            return None
        except NoValidCopyError as e:
            if step in e.lost:
                return str(e.fields.get("reason") or e)
            self._unproven[step] = str(e.fields.get("reason") or e)
            return None
        except TierStoreError as e:
            self._unproven[step] = f"{type(e).__name__}: {e}"
            return None
