"""The Lua scripts of the two-phase commit (run atomically in the index server).

Every script touches only keys of one model (one hash tag, so one Redis
Cluster slot). Time is the server's ``TIME`` unless the caller passes its own
clock as the last ARGV. Loaded by :class:`consistency.twophase.StepProtocol`.
"""

from __future__ import annotations

from consistency.manifest import MANIFEST_VERSION

__all__ = ["BEGIN", "BYRANK", "CLAIM", "DURABLE", "EXPIRE", "JOIN_EPOCH", "MEMORY_ONLY", "MIGRATED",
           "OWNER_CHECK", "READERS", "RENEW", "SUPERSEDE", "VOTE"]

# Time is the server's (TIME) unless the caller injects its own clock: every script takes "now" as its
# last ARGV, a negative value meaning "ask the server".
_NOW = """
local now = tonumber(ARGV[#ARGV])
if now == nil or now < 0 then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1e6 end
"""
_FENCE = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local ep = tonumber(ARGV[1])
if ep >= 0 and ep < cur then return redis.error_reply('TSFENCED ' .. cur) end
"""
# At the start of a write (BEGIN, CLAIM; after their check for a lost index, which an epoch key would hide): a
# writer's epoch newer than the model's (the model's epoch went with a forced delete, or with the index) raises
# it, so the next incarnation joins above every writer of the model's steps: it fences that writer and can
# supersede that writer's lost steps (an epoch that went back would leave them immutable to it). Not in
# MIGRATED: a late migration of a deleted model must not recreate its epoch.
_RAISE = """
if ep > cur then redis.call('SET', KEYS[1], ep) end
"""
# Create the step, or start a new attempt of it when a newer epoch begins a step an older epoch left
# preparing or aborted (its votes are dropped: they belong to a fenced incarnation). A committed step is
# immutable: BEGIN refuses it (TSCOMMITTED); a vote of it is answered with its state. A vote never opens a
# new attempt of an aborted step (a late vote of the old attempt must not count in a new one).
# KEYS: epoch, step, steps, votes, -, vinfo. ARGV: epoch, step, world, layout_json, timeout_s.
_OPEN = """
local function open_step(is_begin)
  local st = redis.call('HGET', KEYS[2], 'state')
  local sep = tonumber(redis.call('HGET', KEYS[2], 'epoch') or '-1')
  if st == 'committed' or st == 'durable' then
    if is_begin then
      return redis.error_reply('TSCOMMITTED step ' .. ARGV[2] .. ' is ' .. st .. ': it cannot be saved again')
    end
    return st
  end
  local renew = (st == 'preparing' and sep >= 0 and ep > sep) or (st == 'aborted' and is_begin and ep >= 0 and ep > sep)
  if st and not renew then return st end
  if tonumber(ARGV[3]) < 1 then return redis.error_reply('TSNOSTEP step ' .. ARGV[2] .. ' was never begun') end
  local attempt = 1
  if st then attempt = tonumber(redis.call('HGET', KEYS[2], 'attempt') or '1') + 1 end
  redis.call('DEL', KEYS[2], KEYS[4], KEYS[6])
  redis.call('HSET', KEYS[2], 'state', 'preparing', 'world', ARGV[3], 'epoch', ARGV[1], 'started', now,
             'layout', ARGV[4], 'timeout', ARGV[5], 'nmigrated', 0, 'attempt', attempt)
  redis.call('ZADD', KEYS[3], tonumber(ARGV[2]), ARGV[2])
  return 'preparing'
end
"""

# The commit point's bookkeeping: what a restore of the step reads besides its own objects, so the manifest
# records the complete set (retention by manifests is then right for every policy):
# - inherited: for each layer of the declared layout that no rank saved at this step, the entries of the
#   version the previous committed step P resolved it to (P's own or inherited entries; same world only),
#   else the layer is listed in "missing";
# - deps: every delta base and ref target those entries reach, transitively (from P's complete set, else the
#   index's records);
# - requires: for a replay log step (layout.replay == "log"), P and the steps P requires (the replay reads
#   their manifests).
# Every inherited and dep record is pinned (a committed manifest reads it: it can no longer be replaced).
# ARGV: see VOTE; PREFIX is the model's key prefix ("ts:{m}:").
_COMPLETE = """
local function jstr(v) if v == nil or v == cjson.null or v == '' then return 'null' end return cjson.encode(v) end
local function jint(v) return string.format('%d', tonumber(v) or 0) end
local function jtiers(t)
  if type(t) ~= 'table' or #t == 0 then return '[]' end
  local parts = {}
  for i, x in ipairs(t) do parts[i] = cjson.encode(x) end
  return '[' .. table.concat(parts, ',') .. ']'
end
local function entry_json(o)
  return '{"key":' .. cjson.encode(o.key) .. ',"kind":' .. jstr(o.kind) .. ',"size":' .. jint(o.size) ..
    ',"checksum":' .. jstr(o.checksum) .. ',"base":' .. jstr(o.base) .. ',"target":' .. jstr(o.target) ..
    ',"epoch":' .. jint(o.epoch) .. ',"tiers":' .. jtiers(o.tiers) .. ',"name":' .. jstr(o.name) .. '}'
end
local function layer_of(k) return string.match(k, '^[^/]+/([^/]+)/') end
local function objkey(k)
  local l, s, r = string.match(k, '^[^/]+/([^/]+)/([^/]+)/([^/]+)$')
  return PREFIX .. 'obj:' .. l .. '/' .. s .. '/' .. r
end
local function record_entry(k)
  local h = redis.call('HGETALL', objkey(k))
  if #h == 0 then return nil end
  local t = {}
  for i = 1, #h, 2 do t[h[i]] = h[i + 1] end
  local tiers = {}
  for f, _ in pairs(t) do if string.sub(f, 1, 2) == 't:' then tiers[#tiers + 1] = string.sub(f, 3) end end
  table.sort(tiers)
  local name = t.name
  if name == nil or name == '' then name = k end
  return {key = k, kind = t.kind, size = t.size, checksum = t.checksum, base = t.base, target = t.target,
          epoch = t.epoch, tiers = tiers, name = name}
end

-- infos: each vote's summary (see consistency.twophase.vote_summary): lines "l:<layer>" (a layer it saved),
-- "r:<key>" (a delta base or ref target of an older step), "o:<key>" (an own object of an older step).
local function complete_set(step, world, layout_json, infos)
  local own_layers, refs, seen = {}, {}, {}
  for _, info in ipairs(infos) do
    for tok in string.gmatch(info, '[^\\n]+') do
      local kind, val = string.sub(tok, 1, 1), string.sub(tok, 3)
      if kind == 'l' then own_layers[val] = true
      elseif kind == 'r' then refs[#refs + 1] = val
      elseif kind == 'o' then seen[val] = true end
    end
  end
  local layout = cjson.decode(layout_json)
  local has_layers = type(layout) == 'table' and type(layout.layers) == 'table'
  local replay = type(layout) == 'table' and layout.replay == 'log'
  -- the previous committed manifest is read (and decoded: the costly part at scale) only when needed
  local need = replay or #refs > 0
  if has_layers and not need then
    for _, l in ipairs(layout.layers) do
      if type(l) == 'string' and not own_layers[l] then need = true; break end
    end
  end
  local prev, pm = nil, nil
  if need then
    local cands = redis.call('ZREVRANGEBYSCORE', PREFIX .. 'steps', '(' .. step, '-inf', 'LIMIT', 0, 1024)
    for _, s in ipairs(cands) do
      local st = redis.call('HGET', PREFIX .. 'step:' .. s, 'state')
      if st == 'committed' or st == 'durable' then
        local raw = redis.call('GET', PREFIX .. 'manifest:' .. s)
        if raw then prev = s; pm = cjson.decode(raw) end
        break
      end
    end
  end
  local pset, players = {}, {}
  if pm then
    local function add(o, inherit)
      pset[o.key] = o
      if inherit then
        local l = layer_of(o.key)
        players[l] = players[l] or {}
        table.insert(players[l], o)
      end
    end
    local ranks = {}
    for r, _ in pairs(pm.ranks) do ranks[#ranks + 1] = tonumber(r) end
    table.sort(ranks)
    for _, r in ipairs(ranks) do
      for _, o in ipairs(pm.ranks[tostring(r)].objects) do add(o, true) end
    end
    if type(pm.inherited) == 'table' then for _, o in ipairs(pm.inherited) do add(o, true) end end
    if type(pm.deps) == 'table' then for _, o in ipairs(pm.deps) do add(o, false) end end
  end
  local inherited, missing, requires = {}, {}, {}
  if has_layers then
    for _, l in ipairs(layout.layers) do
      if type(l) == 'string' and not own_layers[l] then
        if pm and tonumber(pm.world) == world and players[l] then
          for _, o in ipairs(players[l]) do inherited[#inherited + 1] = o end
        else
          missing[#missing + 1] = l
        end
      end
    end
  end
  if replay and pm then
    if type(pm.requires) == 'table' then for _, s in ipairs(pm.requires) do requires[#requires + 1] = s end end
    requires[#requires + 1] = tonumber(prev)
  end
  local todo, deps = {}, {}
  local own_older = {}
  for k, _ in pairs(seen) do own_older[k] = true end
  for _, o in ipairs(inherited) do seen[o.key] = true end
  local function push_ref(ref)
    -- a link into this step itself is another rank's own object, not a dep
    if type(ref) == 'string' and ref ~= '' and not seen[ref]
        and (tonumber(string.match(ref, '^[^/]+/[^/]+/([^/]+)/')) or step) < tonumber(step) then
      seen[ref] = true; todo[#todo + 1] = ref
    end
  end
  local function push(o) push_ref(o.base or ''); push_ref(o.target or '') end
  for _, ref in ipairs(refs) do push_ref(ref) end
  for _, o in ipairs(inherited) do push(o) end
  -- what the step reads must be in the index now, else no restore can rebuild it: refused (see VOTE)
  local absent = {}
  local function present(k) return redis.call('EXISTS', objkey(k)) == 1 end
  for k, _ in pairs(own_older) do if not present(k) then absent[#absent + 1] = k end end
  for _, o in ipairs(inherited) do if not present(o.key) then absent[#absent + 1] = o.key end end
  local n = 0
  while #todo > 0 and n < 1000000 do
    n = n + 1
    local k = table.remove(todo)
    local o = pset[k] or record_entry(k)
    if o and pset[k] and not present(k) then o = nil end
    if o then deps[#deps + 1] = o; push(o) else absent[#absent + 1] = k end
  end
  if replay and not pm then absent[#absent + 1] = 'a replay base (no earlier committed step)' end
  for _, s in ipairs(requires) do
    local st = redis.call('HGET', PREFIX .. 'step:' .. s, 'state')
    if (st ~= 'committed' and st ~= 'durable') or redis.call('EXISTS', PREFIX .. 'manifest:' .. s) == 0 then
      absent[#absent + 1] = 'step ' .. s
    end
  end
  if #absent > 0 or #missing > 0 then
    table.sort(absent)
    local why = {}
    if #absent > 0 then
      why[#why + 1] = 'it reads ' .. table.concat(absent, ', ', 1, math.min(#absent, 8)) ..
        (#absent > 8 and (' and ' .. (#absent - 8) .. ' more') or '') .. ', which the index does not hold'
    end
    if #missing > 0 then
      why[#why + 1] = 'layer(s) ' .. table.concat(missing, ', ', 1, math.min(#missing, 8)) ..
        ' have no version to restore (not saved at this step nor at an earlier committed one of this world)'
    end
    return nil, table.concat(why, '; ')
  end
  table.sort(deps, function(a, b) return a.key < b.key end)
  local pins = {}
  for _, o in ipairs(inherited) do pins[#pins + 1] = o.key end
  for _, o in ipairs(deps) do pins[#pins + 1] = o.key end
  for _, k in ipairs(pins) do
    local ok = objkey(k)
    if redis.call('EXISTS', ok) == 1 then
      redis.call('HSETNX', ok, 'pinned', step)
      redis.call('HSET', ok, 'pin:' .. step, redis.call('HGET', PREFIX .. 'step:' .. step, 'attempt') or '1')
    end
  end
  local parts = {}
  for i, o in ipairs(inherited) do parts[i] = entry_json(o) end
  local out = ',"inherited":[' .. table.concat(parts, ',') .. ']'
  parts = {}
  for i, o in ipairs(deps) do parts[i] = entry_json(o) end
  out = out .. ',"deps":[' .. table.concat(parts, ',') .. ']'
  parts = {}
  for i, s in ipairs(requires) do parts[i] = jint(s) end
  out = out .. ',"requires":[' .. table.concat(parts, ',') .. ']'
  parts = {}
  for i, l in ipairs(missing) do parts[i] = cjson.encode(l) end
  return out .. ',"missing":[' .. table.concat(parts, ',') .. ']', nil
end
"""

# KEYS: epoch, step, steps, votes, objs, vinfo; ARGV: epoch, step, world, layout_json, timeout_s, check, now. With
# check = '1', a model the index holds no record of (no epoch, step or object) is answered 'unknown' and nothing
# is created: the caller first makes sure the index did not lose it (see consistency.epochs).
BEGIN = _FENCE + _NOW + _OPEN + """
if ARGV[6] == '1' and redis.call('EXISTS', KEYS[1], KEYS[3], KEYS[5]) == 0 then return 'unknown' end
""" + _RAISE + """
return open_step(true)
"""

# Begin a step for one writer only (see consistency.attempts): the attempt is owned by the writer's token,
# and only writes and votes carrying it count (see OWNER_CHECK). A step preparing under another token is refused
# ({'busy', ...}, nothing changed) unless it is past its own timeout, or its lease lapsed (a lease > 0 not renewed
# (RENEW) for longer than the lease: its writer is dead), or of an older epoch than the caller's
# (then it is recorded aborted, with why, and its decision published); an aborted step is begun again. Either
# way the new attempt is the old one's number + 1. A committed step is immutable (TSCOMMITTED).
# KEYS: epoch, step, steps, votes, objs, vinfo; ARGV: epoch, step, world, layout_json, timeout_s, check, token,
# events channel, decided channel, lease_s (0: none), now. With check = '1', a model the index holds no record of
# is answered {'unknown'}, as BEGIN does. Returns {'preparing', attempt, previous reason, previous state} (reason
# and state '' for a first attempt or a repeated claim of the same token, which renews the lease) or
# {'busy', attempt, world, age_s, timeout_s, lease_s, seconds since its last renewal}.
CLAIM = _FENCE + _NOW + """
if ARGV[6] == '1' and redis.call('EXISTS', KEYS[1], KEYS[3], KEYS[5]) == 0 then return {'unknown'} end
""" + _RAISE + """
local h = redis.call('HMGET', KEYS[2], 'state', 'owner', 'attempt', 'started', 'timeout', 'epoch', 'reason', 'world',
                    'lease', 'renewed')
local st, owner, attempt = h[1], h[2] or '', tonumber(h[3] or '1') or 1
if st == 'committed' or st == 'durable' then
  return redis.error_reply('TSCOMMITTED step ' .. ARGV[2] .. ' is ' .. st .. ': it cannot be saved again')
end
local why, was = '', ''
if st == 'preparing' then
  if owner == ARGV[7] then
    redis.call('HSET', KEYS[2], 'renewed', now)
    return {'preparing', tostring(attempt), '', ''}
  end
  local started = tonumber(h[4] or '0') or 0
  local timeout = tonumber(h[5] or '0') or 0
  local sep = tonumber(h[6] or '-1') or -1
  local lease = tonumber(h[9] or '0') or 0
  local quiet = now - (tonumber(h[10] or h[4] or '0') or 0)
  local age = now - started
  if timeout > 0 and age > timeout then
    why = 'timed out'
    was = string.format('timed out: it began %.1f s before, its timeout is %g s', age, timeout)
  elseif lease > 0 and quiet > lease then
    why = 'lease lapsed'
    was = string.format('lease lapsed: its writer last renewed it %.1f s before, its lease is %g s', quiet, lease)
  elseif ep >= 0 and sep >= 0 and ep > sep then
    why = 'fenced by epoch ' .. ARGV[1]
    was = 'fenced: it is of epoch ' .. sep .. ', the new writer of epoch ' .. ARGV[1]
  else
    return {'busy', tostring(attempt), h[8] or '0', string.format('%.3f', age), string.format('%g', timeout),
            string.format('%g', lease), string.format('%.3f', quiet)}
  end
  redis.call('HSET', KEYS[2], 'state', 'aborted', 'decided', now, 'reason', why)
  redis.call('PUBLISH', ARGV[8], ARGV[2] .. ' aborted')
  redis.call('PUBLISH', ARGV[9], ARGV[2] .. ' aborted ' .. (h[4] or ''))
  st = 'aborted'
elseif st == 'aborted' then
  was = h[7] or 'aborted'
end
local n = 1
if st then n = attempt + 1 end
redis.call('DEL', KEYS[2], KEYS[4], KEYS[6])
redis.call('HSET', KEYS[2], 'state', 'preparing', 'world', ARGV[3], 'epoch', ARGV[1], 'started', now,
           'layout', ARGV[4], 'timeout', ARGV[5], 'nmigrated', 0, 'attempt', n, 'owner', ARGV[7],
           'lease', ARGV[10], 'renewed', now)
redis.call('ZADD', KEYS[3], tonumber(ARGV[2]), ARGV[2])
return {'preparing', tostring(n), was, st or ''}
"""

# Renew the lease of a claimed step's attempt (see CLAIM): only its owner's token, only while it is preparing
# and not past its timeout. KEYS: step; ARGV: token, now. Returns {state ('expired': past its timeout), lease}.
RENEW = _NOW + """
local h = redis.call('HMGET', KEYS[1], 'state', 'owner', 'started', 'timeout', 'lease')
if h[1] ~= 'preparing' or (h[2] or '') ~= ARGV[1] then return {h[1] or '', ''} end
local timeout = tonumber(h[4] or '0') or 0
if timeout > 0 and now - (tonumber(h[3] or '0') or 0) > timeout then return {'expired', ''} end
redis.call('HSET', KEYS[1], 'renewed', now)
return {'preparing', h[5] or ''}
"""

# A write or vote counts only for the attempt that holds its step: one carrying a token (see CLAIM) only while
# the step's attempt is that token's, and one without only while the step is not preparing under a token.
# STEPKEY: the step's record; TOKEN: the caller's token ('' for none); WHAT: what is refused.
OWNER_CHECK = """
local function check_owner(stepkey, token, what)
  local h = redis.call('HMGET', stepkey, 'state', 'owner', 'attempt')
  local owner = h[2] or ''
  if owner == token or (token == '' and h[1] ~= 'preparing') then return nil end
  if not h[1] then
    return redis.error_reply('TSBUSY ' .. what .. ': the step has no attempt of this writer (none is recorded)')
  end
  return redis.error_reply('TSBUSY ' .. what .. ': the step is held by attempt ' .. (h[3] or '1') ..
    ' of another writer')
end
"""

# Who still reads an object: each committed manifest that reads a record pins it with a field "pin:<step>" whose
# value is the reading attempt (records pinned before there was one such field per reader name their first reader
# in "pinned"). A reader counts while that attempt of its step is committed or durable; a reader retired by retention (no record) or aborted no longer
# reads anything, and a superseded one (proven lost, see SUPERSEDE) releases it: the record's copy is then kept
# aside, not deleted, as a superseded step's own copies are. So superseding every lost reader of a step releases
# its objects together. OBJ: the object's record; STEPKEY: its step's record (the model's prefix is taken from it).
# Returns (the first standing reader or nil, whether a superseded step read it).
READERS = """
local function readers(obj, stepkey)
  local prefix = string.match(stepkey, '^(.*)step:[^:]*$') or ''
  local aside = false
  local h = redis.call('HGETALL', obj)
  for i = 1, #h, 2 do
    local f, r, att = h[i], nil, nil
    if f == 'pinned' then r = h[i + 1] elseif string.sub(f, 1, 4) == 'pin:' then r = string.sub(f, 5); att = h[i + 1] end
    if r then
      local rs = redis.call('HMGET', prefix .. 'step:' .. r, 'state', 'superseded', 'attempt')
      local same = att == nil or att == (rs[3] or '1')
      if same and (rs[1] == 'committed' or rs[1] == 'durable') then return r, aside end
      if rs[2] or not same then aside = true end
    end
  end
  return nil, aside
end
"""

# The rank listing (ts:{m}:byrank, members "<rank>/<layer>/<step>/<rank>", all scored 0, so that one rank's
# objects are a ZRANGEBYLEX) and the mark (ts:{m}:xlinks) of a link that retention's rank-local pass cannot see
# through (see consistency.objects.ObjectIndex.list_rank_objects). links_local reads the base record of a delta,
# a key no script declares: it is in the model's slot (its prefix is the record's own).
BYRANK = """
local function byrank(objname)
  return string.match(objname, '([^/]+)$') .. '/' .. objname
end
-- whether a record of objname (at step) links only as retention's rank-local pass assumes: a ref names the
-- same step of this model, a delta the same rank of this model, on a recorded copy that is not a ref
local function links_local(prefix, model, objname, step, kind, base, target)
  if kind == 'ref' then
    local m, _, s = string.match(target or '', '^(.+)/([^/]+)/([^/]+)/([^/]+)$')
    return m == model and s == tostring(step)
  elseif kind == 'delta' then
    local m, l, s, r = string.match(base or '', '^(.+)/([^/]+)/([^/]+)/([^/]+)$')
    if m ~= model or r ~= string.match(objname, '([^/]+)$') then return false end
    local bk = redis.call('HGET', prefix .. l .. '/' .. s .. '/' .. r, 'kind')
    return bk ~= false and bk ~= 'ref'
  end
  return true
end
"""

# One vote, or the votes of several ranks at once (a node's aggregator): all recorded atomically.
# KEYS: epoch, step, steps, votes, manifest, vinfo; ARGV: epoch, step, world (0: unknown), layout_json, timeout_s,
# model, channel, prefix, n, then n times (rank, vote_json, ok, summary, reason), then the writer's attempt
# token ('' for none; see CLAIM), then now.
# The votes hash keeps each vote as its manifest part ('"<rank>":<vote_json>'), vinfo its summary (see
# complete_set), so the deciding vote decodes no vote. A decision is published on the model's events channel
# ("<step> <state>") and on its decided channel ("<step> <state> <started>": the attempt it decides, for
# StepProtocol.wait). The first negative vote aborts the step, its reason recorded. The deciding vote commits
# only a step whose complete set is in the index (see complete_set: every object it reads recorded, every step it
# requires committed, no layer without a version); otherwise the step is aborted with the reason "incomplete: ..."
# and {'aborted', started, reason} returned. Returns {state, started}.
VOTE = _FENCE + _NOW + _OPEN + OWNER_CHECK + """
local PREFIX = ARGV[8]
""" + _COMPLETE + """
local ntok = 10 + 5 * tonumber(ARGV[9])
local refused = check_owner(KEYS[2], #ARGV > ntok and ARGV[ntok] or '', 'a vote for step ' .. ARGV[2])
if refused then return refused end
local st = open_step(false)
if type(st) == 'table' then return st end
local started = redis.call('HGET', KEYS[2], 'started') or ''
if st ~= 'preparing' then return {st, started} end
local world = tonumber(redis.call('HGET', KEYS[2], 'world'))
local n = tonumber(ARGV[9])
for i = 0, n - 1 do
  local rank = ARGV[10 + 5 * i]
  if tonumber(rank) >= world then
    return redis.error_reply('TSRANK rank ' .. rank .. ' is outside the world of ' .. world)
  end
end
local timeout = tonumber(redis.call('HGET', KEYS[2], 'timeout'))
local why = nil
if timeout > 0 and now - tonumber(started) > timeout then why = 'timed out' end
for i = 0, n - 1 do
  if why then break end
  if ARGV[12 + 5 * i] ~= '1' then
    why = 'negative vote of rank ' .. ARGV[10 + 5 * i]
    if ARGV[14 + 5 * i] ~= '' then why = why .. ': ' .. ARGV[14 + 5 * i] end
  end
end
if why then
  redis.call('HSET', KEYS[2], 'state', 'aborted', 'decided', now, 'reason', why)
  redis.call('DEL', KEYS[6])
  redis.call('PUBLISH', ARGV[7], ARGV[2] .. ' aborted')
  redis.call('PUBLISH', PREFIX .. 'decided', ARGV[2] .. ' aborted ' .. started)
  return {'aborted', started}
end
for i = 0, n - 1 do
  local rank = ARGV[10 + 5 * i]
  redis.call('HSET', KEYS[4], rank, '"' .. rank .. '":' .. ARGV[11 + 5 * i])
  redis.call('HSET', KEYS[6], rank, ARGV[13 + 5 * i])
end
if redis.call('HLEN', KEYS[4]) < world then return {'preparing', started} end
local layout = redis.call('HGET', KEYS[2], 'layout')
local closure, incomplete = complete_set(ARGV[2], world, layout, redis.call('HVALS', KEYS[6]))
if incomplete then
  -- committed means restorable: a step whose complete set is not in the index is never recorded committed
  why = 'incomplete: ' .. incomplete
  redis.call('HSET', KEYS[2], 'state', 'aborted', 'decided', now, 'reason', why)
  redis.call('DEL', KEYS[6])
  redis.call('PUBLISH', ARGV[7], ARGV[2] .. ' aborted')
  redis.call('PUBLISH', PREFIX .. 'decided', ARGV[2] .. ' aborted ' .. started)
  return {'aborted', started, why}
end
local manifest = '{"version":' .. MANIFEST_VERSION .. ',"model":' .. cjson.encode(ARGV[6]) .. ',"step":' .. ARGV[2] ..
  ',"world":' .. world .. ',"epoch":' .. redis.call('HGET', KEYS[2], 'epoch') ..
  ',"attempt":' .. (redis.call('HGET', KEYS[2], 'attempt') or '1') ..
  ',"committed_at":' .. string.format('%.6f', now) .. ',"layout":' .. layout ..
  ',"ranks":{' .. table.concat(redis.call('HVALS', KEYS[4]), ',') .. '}' .. closure .. '}'
redis.call('SET', KEYS[5], manifest)
redis.call('DEL', KEYS[6])
redis.call('HSET', KEYS[2], 'state', 'committed', 'decided', now)
redis.call('PUBLISH', ARGV[7], ARGV[2] .. ' committed')
redis.call('PUBLISH', PREFIX .. 'decided', ARGV[2] .. ' committed ' .. started)
return {'committed', started}
""".replace("MANIFEST_VERSION", str(MANIFEST_VERSION))

# KEYS: step; ARGV: now. Abort a step still preparing past its timeout. Returns {state, started} ('' if unknown).
EXPIRE = _NOW + """
local st = redis.call('HGET', KEYS[1], 'state')
local started = redis.call('HGET', KEYS[1], 'started') or ''
if st ~= 'preparing' then return {st or '', started} end
local timeout = tonumber(redis.call('HGET', KEYS[1], 'timeout'))
if timeout > 0 and now - tonumber(started) > timeout then
  redis.call('HSET', KEYS[1], 'state', 'aborted', 'decided', now, 'reason', 'timed out')
  return {'aborted', started}
end
return {st, started}
"""

# KEYS: epoch, step; ARGV: epoch, rank. Counts each rank once. Returns {migrated, world, state}.
MIGRATED = _FENCE + """
if redis.call('EXISTS', KEYS[2]) == 0 then return {0, 0, ''} end
if redis.call('HSETNX', KEYS[2], 'migrated:' .. ARGV[2], '1') == 1 then
  redis.call('HINCRBY', KEYS[2], 'nmigrated', 1)
end
return {tonumber(redis.call('HGET', KEYS[2], 'nmigrated')), tonumber(redis.call('HGET', KEYS[2], 'world') or '0'),
        redis.call('HGET', KEYS[2], 'state') or ''}
"""

# KEYS: epoch, step; ARGV: epoch, channel, step, now. committed -> durable only. Not fenced: it runs once the
# durable manifest is written, and a committed step whose complete set is durable is durable whoever says so
# (a fence here would leave a durable manifest behind a step the index calls committed).
DURABLE = _NOW + """
if redis.call('HGET', KEYS[2], 'state') == 'committed' then
  redis.call('HSET', KEYS[2], 'state', 'durable', 'durable_at', now)
  redis.call('HDEL', KEYS[2], 'memory_only')
  redis.call('PUBLISH', ARGV[2], ARGV[3] .. ' durable')
  return 1
end
return 0
"""

# KEYS: epoch, step; ARGV: epoch, reason, channel, step, now. A committed (or durable) step that a newer
# incarnation could not read when it restored (its copies lost with a node, or corrupt in every tier) is
# recorded aborted with the reason, so that incarnation can save the step number again (BEGIN then opens a
# new attempt). Only a step an older epoch committed (never the caller's own); fenced. Returns the state
# before the call.
SUPERSEDE = _FENCE + _NOW + """
local st = redis.call('HGET', KEYS[2], 'state')
if st ~= 'committed' and st ~= 'durable' then return st or '' end
if ep < 0 or ep <= tonumber(redis.call('HGET', KEYS[2], 'epoch') or '-1') then return st end
redis.call('HSET', KEYS[2], 'state', 'aborted', 'decided', now, 'reason', ARGV[2], 'superseded', ARGV[1])
redis.call('PUBLISH', ARGV[3], ARGV[4] .. ' aborted')
return st
"""

# Collect the records of an aborted step's attempt (garbage collection): its manifest, votes and vote info, and,
# with ARGV[3] == '1', its record (the tombstone) too; only while that attempt is still the step's, aborted (a newer
# incarnation may have begun the number again meanwhile: its records are left alone). KEYS: step, steps, manifest,
# votes, vinfo; ARGV: step, attempt, drop the record. Returns 2 (record dropped), 1 (kept) or 0 (left alone).
DROP_ABORTED = """
local h = redis.call('HMGET', KEYS[1], 'state', 'attempt')
if h[1] ~= 'aborted' or (h[2] or '1') ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[3], KEYS[4], KEYS[5])
if ARGV[3] ~= '1' then return 1 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 2
"""

# KEYS: step; ARGV: reason. Record why a committed step stays in memory only (its migration gave up), if the
# step is still recorded and not durable.
MEMORY_ONLY = """
local st = redis.call('HGET', KEYS[1], 'state')
if st == false or st == 'durable' then return 0 end
redis.call('HSET', KEYS[1], 'memory_only', ARGV[1])
return 1
"""

# KEYS: epoch, incarnations; ARGV: token, base, want. An incarnation of a job (all ranks share its token) gets
# one epoch: the first rank to join raises the epoch to ``want`` (a candidate already recorded in the durable
# tier, see consistency.epochs) unless another incarnation raised it since ``base``, the epoch the incarnation
# saw when it started (then it is a zombie); the others get the same. A token whose epoch is older than the
# current one is fenced. Returns the epoch, or -1 when ``want`` is no longer newer than the current epoch (the
# caller reserves another candidate).
JOIN_EPOCH = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local known = redis.call('HGET', KEYS[2], ARGV[1])
if known then
  known = tonumber(known)
  if known < cur then return redis.error_reply('TSFENCED ' .. cur) end
  return known
end
local base = tonumber(ARGV[2])
if base >= 0 and cur > base then return redis.error_reply('TSFENCED ' .. cur) end
local want = tonumber(ARGV[3])
if want <= cur then return -1 end
redis.call('SET', KEYS[1], want)
redis.call('HSET', KEYS[2], ARGV[1], want)
return want
"""
