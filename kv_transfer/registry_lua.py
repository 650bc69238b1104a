"""The Lua scripts behind the registry's atomic steps (see registry.py for the life cycle)."""

# NOTE: fences are compared as the decimal strings Redis stores; INCR never yields leading zeros.
RESERVE = """
if ARGV[4] ~= '1' and redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, redis.call('HGET', KEYS[1], 'state') or ''}
end
local fence = redis.call('INCR', KEYS[2])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'state', 'reserved', 'owner', ARGV[1], 'writer', '',
           'fence', fence, 'blocks', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {1, fence}
"""
BEGIN_WRITE = """
local cur = redis.call('HMGET', KEYS[1], 'fence', 'state', 'writer')
if not cur[1] then return {'missing', ''} end
if cur[1] ~= ARGV[2] then return {'fence', cur[1]} end
if cur[2] ~= 'reserved' and cur[2] ~= 'writing' then return {'state', cur[2]} end
if cur[2] == 'writing' and cur[3] ~= ARGV[1] then return {'writer', cur[3]} end
redis.call('HSET', KEYS[1], 'state', 'writing', 'writer', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {'ok', ''}
"""
HANDOFF = """
local cur = redis.call('HMGET', KEYS[1], 'fence', 'owner')
if not cur[1] then return {'missing', ''} end
if cur[1] ~= ARGV[2] then return {'fence', cur[1]} end
if cur[2] ~= ARGV[1] then return {'owner', cur[2]} end
redis.call('HSET', KEYS[1], 'state', 'owned')
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {'ok', ''}
"""
RENEW = """
if redis.call('HGET', KEYS[1], 'fence') ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""
RELEASE = """
if redis.call('HGET', KEYS[1], 'fence') ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""
# KEYS[1] is the kind's id set, KEYS[i + 1] the hash of ARGV[i].
LIVE_WORKERS = """
local out = {}
for i = 2, #KEYS do
  out[i - 1] = redis.call('HGETALL', KEYS[i])
  if #out[i - 1] == 0 then redis.call('SREM', KEYS[1], ARGV[i - 1]) end
end
return out
"""
# NOTE: builds the per-hash keys from ARGV[2] (their common prefix), so it needs a single
# Redis (or every key in one cluster slot); the registry does not support Redis Cluster.
CLEAR_PREFIX = """
local members = redis.call('SMEMBERS', KEYS[1])
for _, h in ipairs(members) do redis.call('SREM', ARGV[2] .. h, ARGV[1]) end
redis.call('DEL', KEYS[1])
return #members
"""
