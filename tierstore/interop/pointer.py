"""Checkpoint paths a framework recognises, holding a pointer to a tierstore step instead of the tensors.

Frameworks find, list, rotate and resume checkpoints through their file
system: Lightning's ``ModelCheckpoint`` checks ``fs.exists``, lists
``last*.ckpt`` for ``ckpt_path="last"`` and numbers versions by the files it
finds; the Hugging Face Trainer picks ``checkpoint-N`` directories for
``resume_from_checkpoint=True`` and rotates them with ``shutil.rmtree``. The
integrations keep that machinery working unchanged by writing, at the path
the framework chose, a small JSON **pointer** naming the tierstore model and
step that hold the checkpoint::

    {"tierstore_pointer": 1, "model": "lit.last-3fa2b1c4", "step": 7,
     "path": "/abs/path/last.ckpt", "framework": "lightning", "saved_at": 1767225600.0, "info": {...}}

Protocol (the writer): save the step, **wait until it is committed**, then
write the pointer (a temporary file, fsync, rename over the path): a pointer
only ever names a committed step, so a process killed at any moment leaves
the previous pointer or the new one, never one to a step that does not
exist. Readers parse it as JSON only (bounded size, never unpickled).

The pointer also names the store that holds the step (``"store"``: its home,
index URL without credentials, durable URL; :func:`store_of`), so a script
started from another working directory, whose default store would be another
``./.tierstore``, opens the right one (:func:`store_args`).

**Resume from the freshest step that still exists.** A pointer is written
once its step is committed in host memory; a node reboot before that step is
durable (host tier wiped) leaves a pointer whose step no tier can restore,
while older steps are durable. :func:`freshest` answers through the read
path's own :meth:`~tierstore.store.TierStore.resolve` (memory, peer, durable):
a pointer's own step when it still restores, else the newest restorable step
among the pointers of a run (a path's older steps, the run's other
checkpoints), by the global step the framework recorded. Where a framework
asked for "the latest" (Lightning's ``ckpt_path="last"``, the Trainer's
``resume_from_checkpoint=True``) the integrations resume from that step and
log which; an explicit path whose step is gone raises
:class:`~tierstore.errors.CheckpointGoneError` naming the newest that restores.

**A run is one model, a checkpoint is a step of it.** The directory the
framework saves a run's checkpoints in (Lightning's ``dirpath``, the Trainer's
``output_dir``) maps to one model (:func:`model_name` of the directory: the
integration's name, the directory's name and a digest of its absolute path),
and every save is its next step (:func:`next_step`): re-saving a path is an
overwrite for the framework and a new step for tierstore, never a write into
a committed one, and the policies (``differential``, ``layerwise``,
``dedup``) build on the run's previous step whichever path it was saved at.
Which steps stay is the framework's choice, kept as **pins**
(:meth:`consistency.steprecords.StepRecords.pin`, label: the checkpoint's
path): the writer pins the step before it writes the pointer (:func:`pin`),
so a pointer only ever names a pinned step; a pinned step survives every
retention pass (in host memory until it is durable, then in the durable tier
only), so host memory follows the Checkpointer's window (the newest step and
what migrates), not the number of checkpoints ``save_top_k`` or
``save_total_limit`` keep. Removing a checkpoint deletes its pointer, then
its pin (:func:`unpin`), then collects (:func:`retire_older`); a pin whose
pointer is gone from a visible run directory, or names another step, is
dropped at the next save (:func:`unpin_gone`: the framework's rotation, or a
crash between the two, is the evidence). Pins are recorded in the durable
tier too, so an index rebuilt from it keeps them; where a crash left a label
pinning two steps, the next save keeps the one its pointer names.

Pointers written before runs were one model (each path its own model, named
from the path) stay readable; removing one deletes its model, as then.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierstore.errors import CheckpointGoneError, CorruptObjectError, IndexLostError, NoValidCopyError
from tierstore.keys import MAX_NAME_LEN, validate_name

__all__ = ["MAX_POINTER_BYTES", "POINTER_VERSION", "Found", "Pointer", "freshest", "gone", "model_name", "named_store",
           "next_step", "pin", "pinned_by", "read_pointer", "restores", "retire_older", "store_args", "store_of",
           "unpin", "unpin_gone", "write_pointer"]

POINTER_VERSION = 1
MAX_POINTER_BYTES = 1 << 20
_MARK = "tierstore_pointer"
_BAD = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class Pointer:
    """What a pointer file says: the model and committed step holding the checkpoint saved at ``path``."""

    model: str
    step: int
    path: str
    framework: str
    saved_at: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    store: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {_MARK: POINTER_VERSION, "model": self.model, "step": self.step, "path": self.path,
               "framework": self.framework, "saved_at": self.saved_at, "info": self.info}
        if self.store:
            out["store"] = self.store
        return out


def _no_credentials(url: str | None) -> str | None:
    if not url or "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{rest.rsplit('@', 1)[1]}"


def store_of(store: Any) -> dict[str, Any]:
    """What a pointer records of the store holding its step: ``home`` (absolute), ``index`` (the index URL
    without credentials; ``None``: the home's embedded server) and ``durable`` (its URL)."""
    cfg = getattr(store, "config", None)
    if cfg is None:
        return {}
    home = getattr(cfg, "home", None)
    return {"home": os.path.abspath(home) if home else None, "index": _no_credentials(getattr(cfg, "redis_url", None)),
            "durable": _no_credentials(getattr(cfg, "durable_url", None))}


def store_args(pointer: Pointer) -> dict[str, Any]:
    """:func:`tierstore.open` arguments reaching the store ``pointer`` names (credentials come from the
    environment, as for any open); ``{}``: the pointer names none (written before pointers named stores)."""
    s = pointer.store
    if not s.get("home"):
        return {}
    out: dict[str, Any] = {"home": s["home"]}
    if s.get("index"):
        out["redis"] = s["index"]
    if s.get("durable"):
        out["durable"] = s["durable"]
    return out


_STORE_ENV = ("TIERSTORE_HOME", "TIERSTORE_REDIS", "TIERSTORE_DURABLE")


def named_store(ref: Any, pointer: Pointer) -> dict[str, Any] | None:
    """Where ``ref`` (a :class:`~tierstore.interop.store_ref.StoreRef`) is the default store (none given, none
    in the environment: ``./.tierstore`` of the working directory) and ``pointer`` names another store whose
    home exists, the :func:`tierstore.open` arguments of that one; else ``None`` (keep ``ref``)."""
    if ref.live is not None or ref.spec or any(os.environ.get(k) for k in _STORE_ENV):
        return None
    args = store_args(pointer)
    if not args or not os.path.isdir(args["home"]):
        return None
    from tierstore.config import StoreConfig  # lazy: only a pointer naming its store asks

    if os.path.abspath(StoreConfig.from_env().resolved().home) == args["home"]:
        return None
    return args


@dataclass(frozen=True)
class Found:
    """A restorable step: ``model``'s ``step``, saved at ``path`` at the framework's ``global_step``."""

    path: str
    model: str
    step: int
    global_step: int | None


def _global_step(res: Any, fallback: Any) -> int | None:
    from tierstore.train.values import decode  # lazy: the tagged JSON of the save's extra

    try:
        doc = (res.extra.get(0) or res.extra.get("0") or {}).get("state") or {}
        user = decode(doc.get("user"), {}, "extra")
        gs = user.get("global_step") if isinstance(user, dict) else None
    except Exception:  # noqa: BLE001 - an extra this module did not write: the pointer's record stands
        gs = None
    gs = fallback if gs is None else gs
    return gs if isinstance(gs, int) and not isinstance(gs, bool) else None


def restores(store: Any, model: str, step: int | None = None) -> Any:
    """The read path's resolution of ``model``'s ``step`` (its newest restorable step without one), or the
    reason it cannot be restored (a string)."""
    try:
        return store.resolve(model, step=step)
    except (NoValidCopyError, IndexLostError) as e:
        return f"{type(e).__name__}: {e}"


def freshest(store: Any, pointers: list[Pointer]) -> Found | None:
    """The newest restorable step among ``pointers`` (a run's checkpoints), by the read path's own rules: each
    pointer's own step where it still restores (the highest global step first, then the newest save); where
    none does, the newest step a pointer's model still restores (an older re-save of its path, a step of the
    run the window kept), found through the newest pointer of that model. ``None``: none restores."""
    best: tuple[tuple[int, float], Found] | None = None
    for p in pointers:
        res = restores(store, p.model, p.step)
        if isinstance(res, str):
            continue
        gs = _global_step(res, p.info.get("global_step"))
        rank = (gs if gs is not None else -1, p.saved_at)
        if best is None or rank > best[0]:
            best = (rank, Found(p.path, p.model, int(res.step), gs))
    if best is not None:
        return best[1]
    seen: set[str] = set()
    for p in sorted(pointers, key=lambda p: p.saved_at, reverse=True):
        if p.model in seen:  # a run's pointers share one model: its newest step once
            continue
        seen.add(p.model)
        res = restores(store, p.model)
        if isinstance(res, str):
            continue
        found = Found(p.path, p.model, int(res.step), _global_step(res, None))
        gs = found.global_step if found.global_step is not None else -1
        if best is None or (gs, p.saved_at) > best[0]:
            best = ((gs, p.saved_at), found)
    return None if best is None else best[1]


def gone(path: str, pointer: Pointer, reason: str, newest: Found | None, hint: str) -> CheckpointGoneError:
    """The typed error for an explicit checkpoint ``path`` whose step no tier restores; names ``newest``."""
    where = (f"the newest that restores is {newest.path} (global step {newest.global_step}, step {newest.step} of "
             f"{newest.model}): {hint}") if newest is not None else "no checkpoint of this run restores"
    return CheckpointGoneError(
        f"the checkpoint at {path} (step {pointer.step} of {pointer.model}, global step "
        f"{pointer.info.get('global_step')}) cannot be restored ({reason}); {where}", what="checkpoint", path=path,
        model=pointer.model, step=pointer.step, newest=None if newest is None else newest.path,
        newest_global_step=None if newest is None else newest.global_step)


def _clean(text: str) -> str:
    out = _BAD.sub("_", text).strip("._") or "_"
    while ".." in out:
        out = out.replace("..", ".")
    return out


def model_name(prefix: str, path: str | os.PathLike[str]) -> str:
    """The model of ``path`` (a run's checkpoint directory; before runs were one model, a checkpoint's own path):
    ``<prefix>.<stem>-<digest of the absolute path>``.

    Raises:
        InvalidKeyError: ``prefix`` is not a valid model name.
    """
    validate_name(prefix, "model name prefix")
    full = os.path.abspath(os.fspath(path))
    digest = hashlib.blake2s(full.encode(), digest_size=4).hexdigest()
    stem = _clean(Path(full).name.removesuffix(".ckpt"))
    room = MAX_NAME_LEN - len(prefix) - len(digest) - 2
    return validate_name(f"{prefix}.{stem[:max(room, 1)]}-{digest}", "model")


def next_step(store: Any, model: str) -> int:
    """The step number the next save of ``model`` takes: one past every step the index records (0 first)."""
    recorded = [s for s, _ in store.steps.steps(model)]
    return max(recorded) + 1 if recorded else 0


def retire_older(store: Any, model: str) -> bool:
    """After a save committed (or a checkpoint was removed), collect the model's older steps: ``gc`` keeping the
    newest in memory, and the newest durable one in the durable tier until the new step is durable too (so a save
    never leaves the run without a durable copy), and every pinned step (:func:`pin`: the checkpoints the
    framework still holds); a step whose migration is still running is left for the next save. Returns whether
    there was anything older to collect."""
    if len(store.steps.steps(model)) < 2:
        return False
    from consistency.gc import Retention  # lazy: only re-saves collect

    store.gc(model, Retention(keep_last=1), dry_run=False)
    return True


def pin(store: Any, model: str, path: str, step: int) -> None:
    """Keep ``model``'s committed ``step`` while the checkpoint at ``path`` (absolute) names it; the writer calls
    this before it writes the pointer (a pointer only ever names a pinned step)."""
    store.steps.pin(model, path, step)


def pinned_by(pointer: Pointer, path: str) -> bool:
    """Whether ``pointer`` (read at ``path``) is a run's checkpoint kept by a pin (else: written before runs were
    one model, its own model per path)."""
    return pointer.info.get("pin") == os.path.abspath(path)


def unpin(store: Any, model: str, paths: list[str]) -> None:
    """Drop the pins of the checkpoints at ``paths`` (removed); :func:`retire_older` then collects their steps."""
    store.steps.unpin(model, paths)


def unpin_gone(store: Any, model: str, run_dir: str, pointer_file: Any = None) -> list[str]:
    """Drop ``model``'s pins of checkpoints in ``run_dir`` whose pointer is gone or names another step; returns
    their paths. Only on positive evidence: ``run_dir`` is a directory here, and the pointer file
    (``pointer_file(path)``; default: the path itself) does not exist, is not a pointer (the framework wrote its
    own file there) or names another model or step. A pointer that cannot be read keeps its pin. A label that
    pins several steps (an index rebuild after a crash while its pin moved) keeps the one its pointer names."""
    run = os.path.abspath(run_dir)
    if not os.path.isdir(run):
        return []
    drop = []
    for path, steps in sorted(store.steps.pinned(model).items()):
        if os.path.dirname(path) != run:
            continue
        p = pointer_file(path) if pointer_file is not None else path
        try:
            ptr = read_pointer(p)
        except FileNotFoundError:
            ptr = None
        except (OSError, CorruptObjectError):
            continue  # not evidence that it is gone
        if ptr is None or ptr.model != model or ptr.step not in steps:
            drop.append(path)
        elif steps != [ptr.step]:  # an index rebuild kept both steps of a pin a crash left half-moved
            store.steps.pin(model, path, ptr.step)  # the pointer names this one: the others go
    if drop:
        store.steps.unpin(model, drop)
    return drop


def write_pointer(path: str | os.PathLike[str], pointer: Pointer) -> None:
    """Write ``pointer`` at ``path`` atomically (temporary file in the same directory, fsync, rename)."""
    target = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(target) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tierstore-pointer-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(pointer.to_json(), f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # the rename itself survives a crash once the directory is synced
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def read_pointer(path: str | os.PathLike[str]) -> Pointer | None:
    """The pointer at ``path``; ``None`` if the file is not one (a framework's own checkpoint file).

    Raises:
        FileNotFoundError: nothing at ``path``.
        CorruptObjectError: a pointer (it carries the marker) that is malformed.
    """
    p = os.fspath(path)
    with open(p, "rb") as f:
        head = f.read(MAX_POINTER_BYTES + 1)
    if not head.lstrip()[:1] == b"{" or _MARK.encode() not in head[:4096]:
        return None
    if len(head) > MAX_POINTER_BYTES:
        raise CorruptObjectError(f"{p}: a tierstore pointer larger than {MAX_POINTER_BYTES} bytes", key=p)
    try:
        d = json.loads(head)
        if not isinstance(d, dict) or d.get(_MARK) != POINTER_VERSION:
            raise ValueError(f"pointer version {d.get(_MARK) if isinstance(d, dict) else None!r}")
        step = d["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step {step!r}")
        info = d.get("info") or {}
        if not isinstance(info, dict):
            raise ValueError("info must be an object")
        where = d.get("store") or {}
        if not isinstance(where, dict):
            raise ValueError("store must be an object")
        return Pointer(validate_name(d["model"], "model"), step, str(d["path"]), str(d.get("framework", "")),
                       float(d.get("saved_at") or 0.0), info, where)
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptObjectError(f"{p}: malformed tierstore pointer ({e})", key=p) from e
