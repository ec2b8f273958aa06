"""The Lua scripts that guard the workers' state, each run atomically by Redis: the health
ledger (app/state/health.py) and the worker registry (app/state/registry.py). The other
scripts: app/state/lua_records.py (request records), lua_deliveries.py, lua_outputs.py,
lua_batches.py."""

# -- the health ledger (app/state/health.py) ---------------------------------------------
# KEYS[1] ledger. ARGV: now, reason, window, threshold, ttl.
# -> {state, streak, became_quarantined (0/1)}
HEALTH_FAILURE = """
local now = tonumber(ARGV[1])
local raw = redis.call('HGET', KEYS[1], 'failures')
local kept = {}
if raw then
  for _, t in ipairs(cjson.decode(raw)) do
    if t > now - tonumber(ARGV[3]) then kept[#kept + 1] = t end
  end
end
kept[#kept + 1] = now
while #kept > 64 do table.remove(kept, 1) end
local state = redis.call('HGET', KEYS[1], 'state') or 'HEALTHY'
local became = 0
if state == 'HEALTHY' or state == 'SUSPECT' then
  if #kept >= tonumber(ARGV[4]) then
    state = 'QUARANTINED'
    became = 1
    redis.call('HINCRBY', KEYS[1], 'quarantines', 1)
  else
    state = 'SUSPECT'
  end
end
redis.call('HSET', KEYS[1], 'state', state, 'failures', cjson.encode(kept), 'streak', #kept,
           'last_failure_at', ARGV[1], 'last_failure_reason', ARGV[2], 'updated_at', ARGV[1])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[5]))
return {state, #kept, became}
"""

# KEYS[1] ledger. ARGV: now, ttl. A completed generation: the streak is over. Only in HEALTHY or
# SUSPECT: a quarantined worker returns through its canary alone. -> state
HEALTH_SUCCESS = """
local state = redis.call('HGET', KEYS[1], 'state') or 'HEALTHY'
if state == 'HEALTHY' or state == 'SUSPECT' then
  state = 'HEALTHY'
  redis.call('HSET', KEYS[1], 'state', state, 'failures', '[]', 'streak', 0,
             'last_success_at', ARGV[1], 'updated_at', ARGV[1])
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
end
return state
"""

# KEYS[1] ledger. ARGV: now, ok (1/0), reason, ttl. -> {state, canary_failures}
HEALTH_CANARY = """
if ARGV[2] == '1' then
  redis.call('HSET', KEYS[1], 'state', 'HEALTHY', 'failures', '[]', 'streak', 0,
             'canary_failures', 0, 'last_success_at', ARGV[1], 'updated_at', ARGV[1])
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
  return {'HEALTHY', 0}
end
local n = redis.call('HINCRBY', KEYS[1], 'canary_failures', 1)
redis.call('HSET', KEYS[1], 'state', 'QUARANTINED', 'last_failure_at', ARGV[1],
           'last_failure_reason', ARGV[3], 'updated_at', ARGV[1])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
return {'QUARANTINED', n}
"""

# -- the worker registry (app/state/registry.py) -----------------------------------------
# KEYS[1] vigil:workers, KEYS[2] the entry, KEYS[3] its in-flight set, KEYS[4] its ledger.
# ARGV: instance, the last_seen the caller read. Drops the worker only if its last_seen is still
# that one: a heartbeat (or a finish) that landed since means it is alive. -> 1 dropped, 0 kept.
DROP_WORKER_IF_UNCHANGED = """
local seen = redis.call('ZSCORE', KEYS[1], ARGV[1])
if seen and tonumber(seen) ~= tonumber(ARGV[2]) then return 0 end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
redis.call('ZREM', KEYS[1], ARGV[1])
return 1
"""
