"""The Lua scripts of the two-phase commit (run atomically in the index server).

Every script touches only keys of one model (one hash tag, so one Redis
Cluster slot). Time is the server's ``TIME`` unless the caller passes its own
clock as the last ARGV. Loaded by :class:`consistency.twophase.StepProtocol`.
"""

from __future__ import annotations

from consistency.manifest import MANIFEST_VERSION

__all__ = ["BEGIN", "DURABLE", "EXPIRE", "MIGRATED", "VOTE"]

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
# Create the step, or restart it when a newer epoch begins a step an older epoch left preparing (its votes
# are dropped: they belong to a fenced incarnation). KEYS: epoch, step, steps, votes. ARGV: epoch, step,
# world, layout_json, timeout_s.
_OPEN = """
local function open_step()
  local st = redis.call('HGET', KEYS[2], 'state')
  local sep = tonumber(redis.call('HGET', KEYS[2], 'epoch') or '-1')
  if st and not (st == 'preparing' and sep >= 0 and ep > sep) then return st end
  if tonumber(ARGV[3]) < 1 then return redis.error_reply('TSNOSTEP step ' .. ARGV[2] .. ' was never begun') end
  redis.call('DEL', KEYS[2], KEYS[4])
  redis.call('HSET', KEYS[2], 'state', 'preparing', 'world', ARGV[3], 'epoch', ARGV[1], 'started', now,
             'layout', ARGV[4], 'timeout', ARGV[5], 'nmigrated', 0)
  redis.call('ZADD', KEYS[3], tonumber(ARGV[2]), ARGV[2])
  return 'preparing'
end
"""

# KEYS: epoch, step, steps, votes; ARGV: epoch, step, world, layout_json, timeout_s, now
BEGIN = _FENCE + _NOW + _OPEN + """
return open_step()
"""

# KEYS: epoch, step, steps, votes, manifest; ARGV: epoch, step, world (0: unknown), layout_json, timeout_s,
# rank, vote_json, ok, model, channel, now
VOTE = _FENCE + _NOW + _OPEN + """
local st = open_step()
if type(st) == 'table' then return st end
if st ~= 'preparing' then return st end
local world = tonumber(redis.call('HGET', KEYS[2], 'world'))
if tonumber(ARGV[6]) >= world then
  return redis.error_reply('TSRANK rank ' .. ARGV[6] .. ' is outside the world of ' .. world)
end
local started = tonumber(redis.call('HGET', KEYS[2], 'started'))
local timeout = tonumber(redis.call('HGET', KEYS[2], 'timeout'))
if ARGV[8] ~= '1' or (timeout > 0 and now - started > timeout) then
  local why = 'negative vote of rank ' .. ARGV[6]
  if ARGV[8] == '1' then why = 'timed out' end
  redis.call('HSET', KEYS[2], 'state', 'aborted', 'decided', now, 'reason', why)
  redis.call('PUBLISH', ARGV[10], ARGV[2] .. ' aborted')
  return 'aborted'
end
redis.call('HSET', KEYS[4], ARGV[6], ARGV[7])
if redis.call('HLEN', KEYS[4]) < world then return 'preparing' end
local votes = redis.call('HGETALL', KEYS[4])
local parts = {}
for i = 1, #votes, 2 do parts[#parts + 1] = '"' .. votes[i] .. '":' .. votes[i + 1] end
local layout = redis.call('HGET', KEYS[2], 'layout')
local manifest = '{"version":' .. MANIFEST_VERSION .. ',"model":' .. cjson.encode(ARGV[9]) .. ',"step":' .. ARGV[2] ..
  ',"world":' .. world .. ',"epoch":' .. redis.call('HGET', KEYS[2], 'epoch') ..
  ',"committed_at":' .. string.format('%.6f', now) .. ',"layout":' .. layout ..
  ',"ranks":{' .. table.concat(parts, ',') .. '}}'
redis.call('SET', KEYS[5], manifest)
redis.call('HSET', KEYS[2], 'state', 'committed', 'decided', now)
redis.call('PUBLISH', ARGV[10], ARGV[2] .. ' committed')
return 'committed'
""".replace("MANIFEST_VERSION", str(MANIFEST_VERSION))

# KEYS: step; ARGV: now. Abort a step still preparing past its timeout.
EXPIRE = _NOW + """
local st = redis.call('HGET', KEYS[1], 'state')
if st ~= 'preparing' then return st end
local started = tonumber(redis.call('HGET', KEYS[1], 'started'))
local timeout = tonumber(redis.call('HGET', KEYS[1], 'timeout'))
if timeout > 0 and now - started > timeout then
  redis.call('HSET', KEYS[1], 'state', 'aborted', 'decided', now, 'reason', 'timed out')
  return 'aborted'
end
return st
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

# KEYS: epoch, step; ARGV: epoch, channel, step, now. committed -> durable only.
DURABLE = _FENCE + _NOW + """
if redis.call('HGET', KEYS[2], 'state') == 'committed' then
  redis.call('HSET', KEYS[2], 'state', 'durable', 'durable_at', now)
  redis.call('PUBLISH', ARGV[2], ARGV[3] .. ' durable')
  return 1
end
return 0
"""
