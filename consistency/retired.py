"""Copies of superseded steps, kept until a newer durable step makes them unneeded.

A committed step that a resumed job supersedes (it judged the step lost, see
:meth:`consistency.steprecords.StepRecords.supersede`) may have been judged
wrongly: its copies are not deleted then. Their records move out of the
object index into the model's *retired* set (so the new attempt of the step
can record its own copies under the same keys without touching them), and
the superseded durable manifest moves to its own name
(:func:`consistency.manifest.superseded_manifest_name`). Garbage collection
deletes them once the live line has a durable step newer than theirs
(:func:`consistency.gc.retire`): a wrong judgement costs space, not data.

Schema (``m`` the model)::

    ts:{m}:retired   HASH   physical name -> JSON {"key", "step", "tiers", "size", "what"}

``what`` is ``"object"`` (a copy in the tiers of ``tiers``) or ``"manifest"``
(a superseded durable manifest in the durable tier).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from consistency.client import _s, translate_redis_errors
from consistency.objects import ObjectIndex
from consistency.scripts import BYRANK
from tierstore.keys import ShardKey

__all__ = ["RetiredCopy", "RetiredIndex"]

# Move records of one step into the retired set, each only while it names the copy given. KEYS: objs,
# retired, byrank, obj... ARGV: step, then per obj key: objname, name. Returns how many moved.
_RETIRE = BYRANK + """
local moved = 0
for i = 4, #KEYS do
  local objname, name = ARGV[2 * (i - 3)], ARGV[2 * (i - 3) + 1]
  if redis.call('HGET', KEYS[i], 'name') == name then
    local tiers = {}
    for _, f in ipairs(redis.call('HKEYS', KEYS[i])) do
      if string.sub(f, 1, 2) == 't:' then table.insert(tiers, string.sub(f, 3)) end
    end
    local size = tonumber(redis.call('HGET', KEYS[i], 'size') or '0')
    redis.call('HSET', KEYS[2], name, cjson.encode({key = objname, step = tonumber(ARGV[1]), tiers = tiers,
                                                    size = size, what = 'object'}))
    redis.call('DEL', KEYS[i])
    redis.call('ZREM', KEYS[1], objname)
    redis.call('ZREM', KEYS[3], byrank(objname))
    moved = moved + 1
  end
end
return moved
"""


@dataclass(frozen=True)
class RetiredCopy:
    """A copy kept after its step was superseded (see the module docstring)."""

    name: str
    step: int
    what: str  # "object" or "manifest"
    key: ShardKey | None = None
    tiers: tuple[str, ...] = ()
    size: int = 0


class RetiredIndex(ObjectIndex):
    """The retired set of each model (part of :class:`consistency.index.Index`)."""

    @cached_property
    def _retire(self) -> Any:
        return self._r.register_script(_RETIRE)

    def retire_copies(self, model: str, step: int, copies: list[tuple[ShardKey, str]]) -> int:
        """Move the records of ``copies`` (key, physical name) of ``step`` into the retired set, each only
        while its record still names that copy. Returns how many moved."""
        if not copies:
            return 0
        keys = [self._k(model, "objs"), self._k(model, "retired"), self._k(model, "byrank")]
        args: list[Any] = [step]
        for key, name in copies:
            keys.append(self._k(model, "obj", self._objname(key)))
            args += [self._objname(key), name]
        with translate_redis_errors(f"retire copies of step {step} of {model}", self.url):
            return int(self._retire(keys=keys, args=args))

    def add_retired(self, model: str, copy: RetiredCopy) -> None:
        """Record a retired copy that has no object record (a superseded durable manifest)."""
        doc = {"key": None, "step": copy.step, "tiers": list(copy.tiers), "size": copy.size, "what": copy.what}
        with translate_redis_errors(f"retire {copy.name}", self.url):
            self._r.hset(self._k(model, "retired"), copy.name, json.dumps(doc))

    def retired(self, model: str) -> list[RetiredCopy]:
        """Every retired copy of ``model``, by step."""
        with translate_redis_errors(f"retired copies of {model}", self.url):
            rows = self._r.hgetall(self._k(model, "retired"))
        out = []
        for name, raw in rows.items():
            try:
                d = json.loads(_s(raw))
                key = d.get("key")
                out.append(RetiredCopy(_s(name), int(d["step"]), str(d.get("what") or "object"),
                                       ShardKey(model, *_parse_objname(key)) if key else None,
                                       tuple(d.get("tiers") or ()), int(d.get("size") or 0)))
            except (ValueError, KeyError, TypeError):  # a malformed entry is left for an operator
                continue
        return sorted(out, key=lambda c: (c.step, c.name))

    def forget_retired(self, model: str, names: list[str]) -> None:
        """Drop entries of the retired set (their copies were deleted)."""
        if not names:
            return
        with translate_redis_errors(f"forget retired copies of {model}", self.url):
            self._r.hdel(self._k(model, "retired"), *names)


def _parse_objname(objname: str) -> tuple[str, int, int]:
    layer, step, rank = objname.split("/")
    return layer, int(step), int(rank)
