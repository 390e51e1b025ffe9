"""Object records in the index: what is stored, where its copies are, and what may replace it.

:class:`ObjectIndex` is the object half of :class:`consistency.index.Index`
(keys ``ts:{m}:objs`` and ``ts:{m}:obj:<layer>/<step>/<rank>``, see the schema
in :mod:`consistency.index`): the store records an object after writing it
(:meth:`ObjectIndex.record_object`), migration and eviction add and remove
tiers, the commit pins what a committed manifest reads, and garbage
collection deletes records. :class:`ObjectRecord` is the one descriptor of an
object across the project.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import redis

from consistency.client import MODELS, IndexClient, _s, translate_redis_errors
from consistency.scripts import BYRANK, OWNER_CHECK, READERS
from tierstore.errors import InvalidValueError, TierStoreError
from tierstore.keys import ShardKey, object_name, validate_name

__all__ = ["KINDS", "ObjectIndex", "ObjectRecord"]

KINDS = ("full", "delta", "ref")

# Record an object and its placement: refuse a stale epoch, refuse to replace the record of a key of a
# committed step or of one a committed manifest that still stands reads (pinned, see READERS): committed keys are
# create-once; and refuse a
# write for a step another writer's attempt holds (see CLAIM in consistency.scripts). The copy of a record
# replaced in a superseded step, or one a superseded step read, is moved to the retired set (consistency.retired),
# not returned. The rank listing and the mark of links are kept with it (BYRANK). KEYS: epoch, objs, obj, step (the
# key's step record), retired, byrank, xlinks. ARGV: epoch, objname, step, kind, size, checksum, base, target,
# created, name, restore ("1": re-recording what a durable manifest proves), attempt token ('' for none), tier... Returns the
# physical name of the copy the old record named ('' if none, '=' if that is the same copy).
_RECORD = OWNER_CHECK + READERS + BYRANK + """
local superseded_reader = false
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local ep = tonumber(ARGV[1])
if ep >= 0 and ep < cur then return redis.error_reply('TSFENCED ' .. cur) end
local old = ''
if redis.call('EXISTS', KEYS[3]) == 1 then
  old = redis.call('HGET', KEYS[3], 'name') or ''
  if old == '' then old = '-' end
end
if ARGV[11] ~= '1' then
  local st = redis.call('HGET', KEYS[4], 'state')
  if st == 'committed' or st == 'durable' then
    return redis.error_reply('TSCOMMITTED step ' .. ARGV[3] .. ' is ' .. st .. ': ' .. ARGV[2] .. ' cannot be written again')
  end
  local reader, aside = readers(KEYS[3], KEYS[4])
  if reader then
    return redis.error_reply('TSCOMMITTED ' .. ARGV[2] .. ' is read by committed step ' .. reader)
  end
  superseded_reader = aside
  local refused = check_owner(KEYS[4], ARGV[12], ARGV[2] .. ' cannot be written')
  if refused then return refused end
end
local pins = {}
local fields = redis.call('HGETALL', KEYS[3])
for i = 1, #fields, 2 do
  local f = fields[i]
  if f == 'pinned' or string.sub(f, 1, 4) == 'pin:' then pins[#pins + 1] = f; pins[#pins + 1] = fields[i + 1] end
end
if old == ARGV[10] then old = '=' end
if old ~= '' and old ~= '=' and old ~= '-' and (superseded_reader or redis.call('HEXISTS', KEYS[4], 'superseded') == 1) then
  -- the copy of a superseded attempt: kept aside (consistency.retired), never handed back for deletion
  local tiers = {}
  for _, f in ipairs(redis.call('HKEYS', KEYS[3])) do
    if string.sub(f, 1, 2) == 't:' then table.insert(tiers, string.sub(f, 3)) end
  end
  redis.call('HSET', KEYS[5], old, cjson.encode({key = ARGV[2], step = tonumber(ARGV[3]), tiers = tiers,
             size = tonumber(redis.call('HGET', KEYS[3], 'size') or '0'), what = 'object'}))
  old = ''
end
local was = redis.call('HGET', KEYS[3], 'kind')
redis.call('DEL', KEYS[3])
redis.call('ZADD', KEYS[2], tonumber(ARGV[3]), ARGV[2])
redis.call('ZADD', KEYS[6], 0, byrank(ARGV[2]))
local prefix = string.sub(KEYS[3], 1, #KEYS[3] - #ARGV[2])
local model = string.match(KEYS[1], '^ts:{(.*)}:epoch$')
-- a ref replacing a copy that was not one: a delta recorded on that copy now rests on a ref
if not links_local(prefix, model, ARGV[2], ARGV[3], ARGV[4], ARGV[7], ARGV[8])
    or (ARGV[4] == 'ref' and was and was ~= 'ref') then
  redis.call('SET', KEYS[7], '1')
end
redis.call('HSET', KEYS[3], 'kind', ARGV[4], 'size', ARGV[5], 'checksum', ARGV[6], 'base', ARGV[7],
           'target', ARGV[8], 'epoch', ARGV[1], 'created', ARGV[9], 'name', ARGV[10])
if old == '=' and #pins > 0 then redis.call('HSET', KEYS[3], unpack(pins)) end
for i = 13, #ARGV do redis.call('HSET', KEYS[3], 't:' .. ARGV[i], '1') end
return old
"""

# Several records in one call, in order, each exactly as _RECORD would record it alone, stopping at the first
# it refuses (those before it stay recorded: a script's writes before an error reply are kept, as n calls of
# _RECORD would have left them). KEYS: epoch, objs, retired, byrank, xlinks (the model's, shared), then per record
# its obj and step (_RECORD's others). ARGV: n, then per record its count of
# arguments and _RECORD's arguments. Returns {'ok', old...} or {'err', reply, old...} (the olds of those recorded).
_RECORD_MANY = "local function record_one(KEYS, ARGV)\n" + _RECORD + """
end
local n = tonumber(ARGV[1])
local out = {}
local a = 2
for i = 0, n - 1 do
  local c = tonumber(ARGV[a])
  local args = {}
  for j = 1, c do args[j] = ARGV[a + j] end
  a = a + c + 1
  local r = record_one({KEYS[1], KEYS[2], KEYS[6 + 2 * i], KEYS[7 + 2 * i], KEYS[3], KEYS[4], KEYS[5]}, args)
  if type(r) == 'table' and r.err then return {'err', r.err, unpack(out)} end
  out[#out + 1] = r
end
return {'ok', unpack(out)}
"""

# Set (ARGV[3] == '1') or clear a tier flag of a record, only while the record names the copy ARGV[2]
# (a copy of a replaced record must not be credited to the live one). KEYS: obj. ARGV: tier, name, set.
_TIER = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local name = redis.call('HGET', KEYS[1], 'name') or ''
if ARGV[2] ~= '' and name ~= '' and name ~= ARGV[2] then return 0 end
if ARGV[3] == '1' then redis.call('HSET', KEYS[1], 't:' .. ARGV[1], '1')
else redis.call('HDEL', KEYS[1], 't:' .. ARGV[1]) end
return 1
"""

# Set one field of an existing record. KEYS: obj. ARGV: field, value.
_ANNOTATE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# Pin existing records: attempt ARGV[2] of committed step ARGV[1] reads them (one "pin:<step>" field per
# reader, see READERS). KEYS: obj...
_PIN = """
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('HSETNX', KEYS[i], 'pinned', ARGV[1])
    redis.call('HSET', KEYS[i], 'pin:' .. ARGV[1], ARGV[2])
  end
end
return #KEYS
"""

# Delete records (and their members of objs and byrank) of one model, each only while it names the copy asked for
# ('': whatever it names). KEYS: objs, byrank, obj_1..obj_n. ARGV: objname_1, name_1, ..., objname_n, name_n.
# Returns a list: 1 where that record was deleted.
_DELETE_MANY = BYRANK + """
local out = {}
for i = 3, #KEYS do
  local objname, want = ARGV[2 * i - 5], ARGV[2 * i - 4]
  local keep = false
  if want ~= '' then
    local name = redis.call('HGET', KEYS[i], 'name') or ''
    keep = redis.call('EXISTS', KEYS[i]) == 1 and name ~= '' and name ~= want
  end
  if keep then
    out[#out + 1] = 0
  else
    redis.call('ZREM', KEYS[1], objname)
    redis.call('ZREM', KEYS[2], byrank(objname))
    out[#out + 1] = redis.call('DEL', KEYS[i])
  end
end
return out
"""
_DELETE_BATCH = 256  # records per _DELETE_MANY script

# One rank's objects: {xlinks, member...} from byrank while it holds as many members as objs, else {'stale'}.
# KEYS: objs, byrank, xlinks. ARGV: min, max (ZRANGEBYLEX).
_LIST_RANK = """
if redis.call('ZCARD', KEYS[1]) ~= redis.call('ZCARD', KEYS[2]) then return {'stale'} end
local out = {redis.call('GET', KEYS[3]) or '0'}
for _, m in ipairs(redis.call('ZRANGEBYLEX', KEYS[2], ARGV[1], ARGV[2])) do out[#out + 1] = m end
return out
"""

# Rebuild byrank from objs, and the xlinks mark from every record (an index written before byrank existed, or
# one another version of tierstore wrote to). KEYS: objs, byrank, xlinks. ARGV: the model's key prefix
# ("ts:{m}:obj:"), the model.
_BYRANK_REBUILD = BYRANK + """
redis.call('DEL', KEYS[2])
local mark = false
local names = redis.call('ZRANGE', KEYS[1], 0, -1)
for _, n in ipairs(names) do
  redis.call('ZADD', KEYS[2], 0, byrank(n))
  if not mark then
    local h = redis.call('HMGET', ARGV[1] .. n, 'kind', 'base', 'target')
    local step = string.match(n, '/([^/]+)/[^/]+$')
    if h[1] and not links_local(ARGV[1], ARGV[2], n, step, h[1], h[2], h[3]) then mark = true end
  end
end
if mark then redis.call('SET', KEYS[3], '1') end
return #names
"""


@dataclass(frozen=True)
class ObjectRecord:
    """One stored object: what the index records of it, what a put returns, what a vote carries.

    The one descriptor of an object across the project (the store returns it,
    votes and manifests carry its JSON, the read path resolves to it).
    ``tiers`` are the tiers recorded as holding a copy; ``name`` is the
    physical name of that copy in every tier (:func:`tierstore.keys.object_name`:
    the key plus a tag unique to the write; the plain key for copies written
    before tags).
    """

    key: ShardKey
    kind: str
    size: int
    checksum: str
    base: ShardKey | None = None
    target: ShardKey | None = None
    epoch: int = 0
    created: float = 0.0
    tiers: frozenset[str] = field(default_factory=frozenset)
    name: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", str(self.key))

    def to_json(self) -> dict[str, Any]:
        """The entry a vote and a manifest carry (see :mod:`consistency.manifest`)."""
        return {
            "key": str(self.key),
            "kind": self.kind,
            "size": self.size,
            "checksum": self.checksum,
            "base": str(self.base) if self.base else None,
            "target": str(self.target) if self.target else None,
            "epoch": self.epoch,
            "tiers": sorted(self.tiers),
            "name": self.name,
        }

    @classmethod
    def from_json(cls, o: dict[str, Any]) -> ObjectRecord:
        """The record of a manifest entry (validated by :func:`consistency.manifest.parse_manifest`)."""
        return cls(
            key=ShardKey.parse(o["key"]),
            kind=o["kind"],
            size=int(o["size"]),
            checksum=o["checksum"],
            base=ShardKey.parse(o["base"]) if o.get("base") else None,
            target=ShardKey.parse(o["target"]) if o.get("target") else None,
            epoch=int(o.get("epoch") or 0),
            tiers=frozenset(o.get("tiers") or ()),
            name=o.get("name") or "",
        )



class ObjectIndex(IndexClient):
    """Object records and their placement (the object operations of :class:`consistency.index.Index`)."""

    @cached_property
    def _record(self) -> Any:
        return self._r.register_script(_RECORD)

    @cached_property
    def _record_many(self) -> Any:
        return self._r.register_script(_RECORD_MANY)

    @cached_property
    def _tier(self) -> Any:
        return self._r.register_script(_TIER)

    @cached_property
    def _delete_many(self) -> Any:
        return self._r.register_script(_DELETE_MANY)

    @cached_property
    def _list_rank(self) -> Any:
        return self._r.register_script(_LIST_RANK)

    @cached_property
    def _byrank_rebuild(self) -> Any:
        return self._r.register_script(_BYRANK_REBUILD)

    @cached_property
    def _pin(self) -> Any:
        return self._r.register_script(_PIN)

    @cached_property
    def _annotate(self) -> Any:
        return self._r.register_script(_ANNOTATE)


    def record_object(
        self,
        key: ShardKey,
        *,
        kind: str,
        size: int,
        checksum: str,
        tiers: list[str],
        base: ShardKey | None = None,
        target: ShardKey | None = None,
        epoch: int | None = None,
        name: str | None = None,
        restore: bool = False,
        attempt: str | None = None,
    ) -> str | None:
        """Record an object, the physical ``name`` of its copy and the tiers holding it.

        Refused with :class:`FencedError` if ``epoch`` is stale, with
        :class:`StepCommittedError` if the key's step is committed or a committed
        manifest reads the key (committed keys are create-once; ``restore``,
        for an index rebuild, re-records what a durable manifest proves), and
        with :class:`StepBusyError` if the key's step is held by another
        writer's attempt than ``attempt`` (the token of
        :meth:`~consistency.attempts.Attempts.claim`; ``None``: the step must
        not be held by any).

        Returns:
            the physical name of the copy the replaced record named, when it is
            another copy (the caller deletes it: nothing committed reads it), else ``None``.
        """
        m = key.model
        name = name or str(key)
        with translate_redis_errors(f"record {key}", self.url):
            if m not in self._listed:  # ts:models lives outside the model's slot: one SADD per model and client
                self._r.sadd(MODELS, m)
                self._listed.add(m)
            old = _s(self._record(
                keys=[self._k(m, "epoch"), self._k(m, "objs"), self._k(m, "obj", self._objname(key)),
                      self._k(m, "step", key.step), self._k(m, "retired"), self._k(m, "byrank"),
                      self._k(m, "xlinks")],
                args=[
                    -1 if epoch is None else epoch,
                    self._objname(key),
                    key.step,
                    kind,
                    size,
                    checksum,
                    str(base) if base else "",
                    str(target) if target else "",
                    repr(time.time()),
                    name,
                    "1" if restore else "0",
                    attempt or "",
                    *tiers,
                ],
            ))
        if old in ("", "="):
            return None
        return str(key) if old == "-" else old

    def record_objects(self, entries: list[dict[str, Any]]) -> tuple[list[str | None], TierStoreError | None]:
        """Record several objects of one model in one round trip, in order, each as :meth:`record_object`
        would (``entries``: its keyword arguments, ``key`` included), stopping at the first it refuses.

        Returns:
            ``(olds, refused)``: :meth:`record_object`'s return for each object recorded (a prefix of
            ``entries``), and the typed error of the first one refused (:class:`FencedError`,
            :class:`StepCommittedError`, :class:`StepBusyError`; ``None``: every one was recorded). Those
            after it are not recorded. An error of the call itself (the index unreachable) is raised:
            which of them were recorded is then unknown, as for one :meth:`record_object`.
        """
        if not entries:
            return [], None
        models = {e["key"].model for e in entries}
        if len(models) != 1:
            raise InvalidValueError(f"record_objects records one model's objects at a time, got {sorted(models)}")
        m = entries[0]["key"].model
        keys = [self._k(m, "epoch"), self._k(m, "objs"), self._k(m, "retired"), self._k(m, "byrank"),
                self._k(m, "xlinks")]
        args: list[Any] = [len(entries)]
        for entry in entries:
            key = entry["key"]
            base, target = entry.get("base"), entry.get("target")
            epoch, attempt = entry.get("epoch"), entry.get("attempt")
            keys += [self._k(m, "obj", self._objname(key)), self._k(m, "step", key.step)]
            one = [-1 if epoch is None else epoch, self._objname(key), key.step, entry["kind"], entry["size"],
                   entry["checksum"], str(base) if base else "", str(target) if target else "",
                   repr(time.time()), entry.get("name") or str(key), "1" if entry.get("restore") else "0",
                   attempt or "", *entry["tiers"]]
            args += [len(one), *one]
        what = f"record {entries[0]['key']} and {len(entries) - 1} more"
        with translate_redis_errors(what, self.url):
            if m not in self._listed:
                self._r.sadd(MODELS, m)
                self._listed.add(m)
            reply = [_s(v) for v in self._record_many(keys=keys, args=args)]
        status, rest = reply[0], reply[1:]
        refused: TierStoreError | None = None
        if status == "err":
            msg, rest = rest[0], rest[1:]
            failed = entries[len(rest)]["key"]
            try:
                with translate_redis_errors(f"record {failed}", self.url):
                    raise redis.exceptions.ResponseError(msg)
            except TierStoreError as e:
                refused = e
        olds: list[str | None] = []
        for entry, old in zip(entries, rest):
            olds.append(None if old in ("", "=") else str(entry["key"]) if old == "-" else old)
        return olds, refused

    def add_tier(self, key: ShardKey, tier: str, *, name: str | None = None) -> bool:
        """Record that ``tier`` holds the copy ``name`` (default: whatever copy the record names).

        Returns whether the record (still) names that copy and was updated.
        """
        with translate_redis_errors(f"add tier {tier} to {key}", self.url):
            return bool(self._tier(keys=[self._k(key.model, "obj", self._objname(key))], args=[tier, name or "", "1"]))

    def remove_tier(self, key: ShardKey, tier: str, *, name: str | None = None) -> bool:
        with translate_redis_errors(f"remove tier {tier} from {key}", self.url):
            return bool(self._tier(keys=[self._k(key.model, "obj", self._objname(key))], args=[tier, name or "", "0"]))

    def set_object_field(self, key: ShardKey, field_name: str, value: str) -> None:
        """Annotate the record of ``key`` (if it exists: never creates one)."""
        with translate_redis_errors(f"annotate {key}", self.url):
            self._annotate(keys=[self._k(key.model, "obj", self._objname(key))], args=[field_name, value])

    def get_object(self, key: ShardKey) -> ObjectRecord | None:
        with translate_redis_errors(f"read record of {key}", self.url):
            h = self._r.hgetall(self._k(key.model, "obj", self._objname(key)))
        return self._parse_record(key, h) if h else None

    def get_objects(self, keys: list[ShardKey]) -> list[ObjectRecord | None]:
        with translate_redis_errors("read records", self.url):
            pipe = self._r.pipeline(transaction=False)
            for key in keys:
                pipe.hgetall(self._k(key.model, "obj", self._objname(key)))
            rows = pipe.execute()
        return [self._parse_record(k, h) if h else None for k, h in zip(keys, rows)]

    @staticmethod
    def _parse_record(key: ShardKey, h: dict) -> ObjectRecord:
        d = {_s(k): _s(v) for k, v in h.items()}
        return ObjectRecord(
            key=key,
            kind=d.get("kind", "full"),
            size=int(d.get("size") or 0),
            checksum=d.get("checksum", ""),
            base=ShardKey.parse(d["base"]) if d.get("base") else None,
            target=ShardKey.parse(d["target"]) if d.get("target") else None,
            epoch=int(d.get("epoch") or 0),
            created=float(d.get("created") or 0.0),
            tiers=frozenset(k[2:] for k in d if k.startswith("t:")),
            name=d.get("name") or object_name(key),
        )

    def delete_object(self, key: ShardKey, *, name: str | None = None) -> bool:
        """Delete the record of ``key``; with ``name``, only while it names that copy. Returns whether it went."""
        return self.delete_objects([(key, name)])[0]

    def delete_objects(self, items: Sequence[tuple[ShardKey, str | None]]) -> list[bool]:
        """:meth:`delete_object` of each ``(key, name)``, in order, a script per model and up to
        ``_DELETE_BATCH`` records (one round trip each, not one per record). Returns whether each went."""
        out: list[bool] = [False] * len(items)
        by_model: dict[str, list[int]] = {}
        for i, (key, _name) in enumerate(items):
            by_model.setdefault(key.model, []).append(i)
        with translate_redis_errors(f"delete {len(items)} records", self.url):
            for model, idx in by_model.items():  # one model's keys share a slot
                for lo in range(0, len(idx), _DELETE_BATCH):
                    part = idx[lo:lo + _DELETE_BATCH]
                    keys, args = [self._k(model, "objs"), self._k(model, "byrank")], []
                    for i in part:
                        key, name = items[i]
                        objname = self._objname(key)
                        keys.append(self._k(model, "obj", objname))
                        args += [objname, name or ""]
                    for i, went in zip(part, self._delete_many(keys=keys, args=args)):
                        out[i] = bool(went)
        return out

    def pin_objects(self, keys: list[ShardKey], step: int, attempt: int = 1) -> None:
        """Mark records as read by ``attempt`` of committed ``step`` (they cannot be replaced while it stands;
        see :meth:`record_object` and ``READERS`` in :mod:`consistency.scripts`)."""
        if not keys:
            return
        by_model: dict[str, list[str]] = {}
        for key in keys:
            by_model.setdefault(key.model, []).append(self._k(key.model, "obj", self._objname(key)))
        with translate_redis_errors("pin records", self.url):
            for okeys in by_model.values():  # one model's keys share a slot
                self._pin(keys=okeys, args=[step, attempt])

    def list_objects(
        self, model: str, layer: str | None = None, step: int | None = None, rank: int | None = None
    ) -> list[ShardKey]:
        """Keys recorded for ``model``, filtered; sorted by (layer, step, rank)."""
        validate_name(model, "model")
        with translate_redis_errors(f"list objects of {model}", self.url):
            if step is None:
                names = self._r.zrange(self._k(model, "objs"), 0, -1)
            else:
                names = self._r.zrangebyscore(self._k(model, "objs"), step, step)
        out = []
        for n in names:
            lay, st, rk = _s(n).split("/")  # type: ignore[arg-type]
            if layer is not None and lay != layer:
                continue
            if rank is not None and int(rk) != rank:
                continue
            out.append(ShardKey(model, lay, int(st), int(rk)))
        return sorted(out, key=lambda k: (k.layer, k.step, k.rank))

    def links_rank_local(self, model: str) -> bool:
        """Whether no record of ``model`` has marked it as linking across ranks (read-only; see
        :meth:`list_rank_objects`: the Checkpointer's retention then reads one rank's objects)."""
        validate_name(model, "model")
        with translate_redis_errors(f"read the links mark of {model}", self.url):
            return _s(self._r.get(self._k(model, "xlinks"))) != "1"

    def list_rank_objects(self, model: str, rank: int) -> tuple[list[ShardKey], bool]:
        """The keys of ``rank``'s objects of ``model`` (sorted as :meth:`list_objects`), read from the rank
        listing (``ts:{m}:byrank``) in one round trip whatever the world size, and whether every link recorded
        for ``model`` is *rank-local*: a ref names an object of its own step, a delta one of its own rank that
        is not a ref.

        Where they are, an object of another rank reaches one of ``rank``'s only through a ref within a step,
        so retention may protect what the steps in flight read from ``rank``'s own objects of those steps (see
        :func:`consistency.gc.plan_retention`). A record linking otherwise marks the model for good (the mark
        is never cleared: the cost is a listing of every rank's objects, never a deleted object).

        A rank listing that does not hold as many members as the model's (an index written before it existed,
        or by another version) is rebuilt from it first, with the mark, in one script.
        """
        validate_name(model, "model")
        keys = [self._k(model, "objs"), self._k(model, "byrank"), self._k(model, "xlinks")]
        lo, hi = f"[{rank}/", f"({rank}0"  # "<rank>/..." sorts below "<rank>0": ord("/") + 1 == ord("0")
        with translate_redis_errors(f"list rank {rank}'s objects of {model}", self.url):
            reply = [_s(v) for v in self._list_rank(keys=keys, args=[lo, hi])]
            if reply == ["stale"]:
                self._byrank_rebuild(keys=keys, args=[self._k(model, "obj", ""), model])
                reply = [_s(v) for v in self._list_rank(keys=keys, args=[lo, hi])]
        if reply == ["stale"]:  # written to between the two scripts, by a writer that keeps no rank listing
            return [k for k in self.list_objects(model) if k.rank == rank], False
        out = []
        for n in reply[1:]:
            _rk, lay, st, rk = n.split("/")  # type: ignore[union-attr]
            out.append(ShardKey(model, lay, int(st), int(rk)))
        return sorted(out, key=lambda k: (k.layer, k.step, k.rank)), reply[0] != "1"
