"""The Lua scripts behind the registry's atomic steps (see registry.py for the life cycle)."""

# NOTE: fences are compared as the decimal strings Redis stores (written with %.0f: exact, as
# they stay below 2^53). A fence is max(last + 1, now in microseconds by the Redis server's clock
# and the caller's): after a restart that lost the counter, the first fence is the time again,
# which no earlier fence can have passed (a reserve takes more than a microsecond).
# KEYS: record, fence counter, "since" (the first fence issued since Redis lost its data).
# ARGV: owner, blocks, lease_ms, replace, caller's clock (us), nonce (repeating this call).
RESERVE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local cur = redis.call('HMGET', KEYS[1], 'nonce', 'fence', 'state')
  if cur[1] == ARGV[6] then return {1, cur[2]} end
  if ARGV[4] ~= '1' then return {0, cur[3] or ''} end
end
local t = redis.call('TIME')
local fence = math.max(tonumber(t[1]) * 1000000 + tonumber(t[2]), tonumber(ARGV[5]))
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
if last >= fence then fence = last + 1 end
fence = string.format('%.0f', fence)
redis.call('SET', KEYS[2], fence)
redis.call('SET', KEYS[3], fence, 'NX')
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'state', 'reserved', 'owner', ARGV[1], 'writer', '',
           'fence', fence, 'blocks', ARGV[2], 'nonce', ARGV[6])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {1, fence}
"""
# "since" (the key `since_key`) marks when this Redis' data began: the first fence it issued,
# or the time it was first asked about a missing record, whichever came first. A missing record
# whose fence is older was "lost" in a restart (not released, not lapsed).
SINCE = """
local since = redis.call('GET', since_key)
if not since then
  local t = redis.call('TIME')
  since = string.format('%.0f', tonumber(t[1]) * 1000000 + tonumber(t[2]))
  redis.call('SET', since_key, since)
end
"""
LOST = (
    "local since_key = KEYS[2]"
    + SINCE
    + """
if tonumber(since) > tonumber(ARGV[2]) then return {'lost', ''} end
return {'missing', ''}
"""
)
BEGIN_WRITE = (
    """
local cur = redis.call('HMGET', KEYS[1], 'fence', 'state', 'writer')
if not cur[1] then """
    + LOST
    + """ end
if cur[1] ~= ARGV[2] then return {'fence', cur[1]} end
if cur[2] ~= 'reserved' and cur[2] ~= 'writing' then return {'state', cur[2]} end
if cur[2] == 'writing' and cur[3] ~= ARGV[1] then return {'writer', cur[3]} end
redis.call('HSET', KEYS[1], 'state', 'writing', 'writer', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {'ok', ''}
"""
)
# ARGV: owner, fence, lease_ms, blocks (JSON; '' unless the owner still holds them: a record
# whose lease lapsed meanwhile is then written again, owned).
HANDOFF = (
    """
local cur = redis.call('HMGET', KEYS[1], 'fence', 'owner')
if not cur[1] and ARGV[4] ~= '' then
  redis.call('HSET', KEYS[1], 'state', 'owned', 'owner', ARGV[1], 'writer', '',
             'fence', ARGV[2], 'blocks', ARGV[4])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'rewritten', ''}
end
if not cur[1] then """
    + LOST
    + """ end
if cur[1] ~= ARGV[2] then return {'fence', cur[1]} end
if cur[2] ~= ARGV[1] then return {'owner', cur[2]} end
redis.call('HSET', KEYS[1], 'state', 'owned')
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {'ok', ''}
"""
)
# KEYS[i] a request's record, ARGV[i + 1] its fence, ARGV[1] the lease (ms): the positions of
# the records not renewed (gone, or carrying another fence).
RENEW = """
local lost = {}
for i = 1, #KEYS do
  if redis.call('HGET', KEYS[i], 'fence') ~= ARGV[i + 1]
      or redis.call('PEXPIRE', KEYS[i], ARGV[1]) == 0 then
    lost[#lost + 1] = i
  end
end
return lost
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
# Clears the prefix entries of index ids at once (a worker's GPU and host tiers): KEYS[i] is
# id i's list of hashes, ARGV[i + 1] id i, ARGV[1] the per-hash keys' common prefix. Returns
# how many entries it removed.
# NOTE: builds the per-hash keys from ARGV[1], so it needs a single Redis (or every key in one
# cluster slot); the registry does not support Redis Cluster.
CLEAR_PREFIX = """
local removed = 0
for i = 1, #KEYS do
  local members = redis.call('SMEMBERS', KEYS[i])
  for _, h in ipairs(members) do redis.call('SREM', ARGV[1] .. h, ARGV[i + 1]) end
  redis.call('DEL', KEYS[i])
  removed = removed + #members
end
return removed
"""
# Re-publishes records a worker still holds that Redis lost (never one released or lapsed),
# once per "since": ARGV[2] is the "since" the worker's last call returned, and records restored
# then that lapsed later are not brought back. KEYS[1] is "since", KEYS[i + 1] record i;
# ARGV[1] the lease, then state, owner, fence, blocks of each record in turn.
# Returns {since, how many it re-created}.
RESTORE = (
    "local since_key = KEYS[1]"
    + SINCE
    + """
if since == ARGV[2] then return {since, 0} end
local restored = 0
for i = 2, #KEYS do
  local a = 3 + (i - 2) * 4
  local lost = tonumber(since) > tonumber(ARGV[a + 2])
  if lost and redis.call('EXISTS', KEYS[i]) == 0 then
    redis.call('HSET', KEYS[i], 'state', ARGV[a], 'owner', ARGV[a + 1], 'writer', '',
               'fence', ARGV[a + 2], 'blocks', ARGV[a + 3])
    redis.call('PEXPIRE', KEYS[i], ARGV[1])
    restored = restored + 1
  end
end
return {since, restored}
"""
)
# Walks a prompt's chained block hashes (ARGV[3]: their hex digests end to end, each ARGV[4]
# characters long; one argument, not thousands) through the prefix index server-side
# and stops at the first block no worker can still use, so a miss costs one SMEMBERS and a hit
# only its own length (not a reply of every block's holders). ARGV[1]: the per-hash keys'
# common prefix; ARGV[2]: the host-tier id suffix. Returns a flat list: index id, its GPU run
# (leading blocks held on the GPU), its reusable run (that GPU run, then the blocks right after
# it held in its host tier), for every real worker id that holds the first block in a tier.
# NOTE: as the engine's lookup takes them: the GPU's run first, then the host tier's from where
# it ended, never back to the GPU.
MATCH_TIERS = """
local suffix, chain, width = ARGV[2], ARGV[3], tonumber(ARGV[4])
local gpu, reusable = {}, {}
for pos = 0, #chain / width - 1 do
  local key = ARGV[1] .. string.sub(chain, pos * width + 1, (pos + 1) * width)
  local held = {}
  for _, id in ipairs(redis.call('SMEMBERS', key)) do held[id] = true end
  if pos == 0 then
    for id, _ in pairs(held) do
      local owner = id
      if string.sub(id, -#suffix) == suffix then owner = string.sub(id, 1, #id - #suffix) end
      gpu[owner], reusable[owner] = 0, 0
    end
  end
  local alive = false
  for owner, g in pairs(gpu) do
    if g == pos and held[owner] then gpu[owner] = pos + 1 end
    if reusable[owner] == pos and (gpu[owner] > pos or held[owner .. suffix]) then
      reusable[owner] = pos + 1
      alive = true
    end
  end
  if not alive then break end
end
local out = {}
for owner, n in pairs(reusable) do
  if n > 0 then
    out[#out + 1] = owner
    out[#out + 1] = gpu[owner]
    out[#out + 1] = n
  end
end
return out
"""
