"""The Lua scripts of the Redis broker (``kombu.py``): each runs atomically on the server, so
a claim is popped and recorded in one step, and an ack, renewal or dead-lettering acts only on
a claim still held. Records are ``<n>:<first n bytes><rest>`` (a list name, then a message)."""

from __future__ import annotations

_SPLIT = """
local function split(v)  -- '<n>:<first n bytes><rest>' -> first, rest
  local colon = string.find(v, ':', 1, true)
  local n = tonumber(string.sub(v, 1, colon - 1))
  return string.sub(v, colon + 1, colon + n), string.sub(v, colon + n + 1)
end
"""

CLAIM = (
    _SPLIT
    + """
-- KEYS: held, until, deliveries, seq, the lists; ARGV: now, lease end, max
local held, back_at, counts = KEYS[1], KEYS[2], KEYS[3]
-- What is due goes back first (100 at most: the next claims put back the rest), the
-- earliest due at the head.
local due = redis.call('ZRANGEBYSCORE', back_at, '-inf', ARGV[1], 'LIMIT', 0, 100)
for i = #due, 1, -1 do
  local v = redis.call('HGET', held, due[i])
  redis.call('HDEL', held, due[i])
  redis.call('ZREM', back_at, due[i])
  if v then
    local list, message = split(v)
    redis.call('RPUSH', list, message)
  end
end
local out, room = {}, tonumber(ARGV[3])
for k = 5, #KEYS do
  while room > 0 do
    local message = redis.call('RPOP', KEYS[k])
    if not message then break end
    local id = redis.call('INCR', KEYS[4])
    redis.call('HSET', held, id, #KEYS[k] .. ':' .. KEYS[k] .. message)
    redis.call('ZADD', back_at, ARGV[2], id)
    local n = redis.call('HINCRBY', counts, redis.sha1hex(message), 1)
    out[#out + 1] = id; out[#out + 1] = message; out[#out + 1] = n; out[#out + 1] = k - 4
    room = room - 1
  end
end
return out
"""
)

SET_BACK = """
-- KEYS: held, until; ARGV: claim id, when it goes back
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('ZADD', KEYS[2], 'XX', ARGV[2], ARGV[1])
return 1
"""

_RELEASE = (
    _SPLIT
    + """
-- A claim still held, forgotten (with its message's delivery count): its list and message;
-- nil when it is no longer held.
local function release(held, back_at, counts, claim)
  local v = redis.call('HGET', held, claim)
  if not v then return nil end
  local list, message = split(v)
  redis.call('HDEL', held, claim)
  redis.call('ZREM', back_at, claim)
  redis.call('HDEL', counts, redis.sha1hex(message))
  return list, message
end
"""
)

ACK = (
    _RELEASE
    + """
-- KEYS: held, until, deliveries; ARGV: claim id
if not release(KEYS[1], KEYS[2], KEYS[3], ARGV[1]) then return 0 end
return 1
"""
)

BURY = (
    _RELEASE
    + """
-- KEYS: held, until, deliveries, seq, dead, dead-ids; ARGV: claim id, metadata (JSON)
local list, message = release(KEYS[1], KEYS[2], KEYS[3], ARGV[1])
if not list then return 0 end
local id = redis.call('INCR', KEYS[4])
redis.call('HSET', KEYS[5], id, #list .. ':' .. list .. #ARGV[2] .. ':' .. ARGV[2] .. message)
redis.call('ZADD', KEYS[6], id, id)
return id
"""
)

RESEND = (
    _SPLIT
    + """
-- KEYS: dead, dead-ids; ARGV: dead letter ids
local out = {}
for _, id in ipairs(ARGV) do
  local v = redis.call('HGET', KEYS[1], id)
  if v then
    local list, rest = split(v)
    local _, message = split(rest)
    redis.call('LPUSH', list, message)
    redis.call('HDEL', KEYS[1], id)
    redis.call('ZREM', KEYS[2], id)
    out[#out + 1] = id
  end
end
return out
"""
)


def split(data: bytes) -> tuple[bytes, bytes]:
    """``<n>:<first n bytes><rest>`` -> first, rest (the scripts' record format)."""
    size, _, rest = data.partition(b":")
    n = int(size)
    return rest[:n], rest[n:]
