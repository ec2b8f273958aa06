"""The Lua scripts behind the fleet's other state, each run atomically by Redis: kombu's queues
and deliveries (app/state/views.py, app/state/transport.py), results (app/state/results.py),
token streams (app/state/streams.py), the health ledger (app/state/health.py), the worker
registry (app/state/registry.py) and batch objects (app/state/batches.py). The request
record's scripts: app/state/lua.py."""

# KEYS[1] the queue a message sits in, KEYS[2] the queue to move it to. ARGV[1] the message,
# byte for byte. Takes that one message out of KEYS[1] (its first occurrence, wherever the list
# has moved since it was read) and pushes it where a new message goes on KEYS[2], in one step:
# it is never in both queues and never in neither. -> 1 moved, 0 it was no longer there.
MOVE_MESSAGE = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 1 then
  redis.call('LPUSH', KEYS[2], ARGV[1])
  return 1
end
return 0
"""

# ARGV[1] expiry in seconds (0: none), then (key, value) pairs. Celery's Redis result backend
# writes each result as SET (with its expiry) then PUBLISH on the same key (the channel a
# waiting get() listens on); this is that write for many results in one call. -> how many.
SET_AND_PUBLISH_MANY = """
local ttl = tonumber(ARGV[1])
for i = 2, #ARGV, 2 do
  if ttl > 0 then
    redis.call('SET', ARGV[i], ARGV[i + 1], 'EX', ttl)
  else
    redis.call('SET', ARGV[i], ARGV[i + 1])
  end
  redis.call('PUBLISH', ARGV[i], ARGV[i + 1])
end
return (#ARGV - 1) / 2
"""

# KEYS[1] record, KEYS[2] the request's token stream. ARGV: the claim's begin token, start (the
# token offset of the chunk's first token), reset ('1': the attempt restarts the stream from token
# 0, its resume having been refused), the chunk's signature, then the entry's field/value pairs.
# Appends one chunk of generated tokens (app/state/streams.py) if, and only if, the claim that
# wrote it still runs the request (status RUNNING, its begin token: unique per claim) and the chunk
# starts where the stream ends (the record's `streamed`): a late writer (a worker reaped while
# alive, an attempt that lost its request) never adds to it, and a chunk is never written with a
# gap. A chunk sent again (a pipeline retried after a lost reply) finds its signature in
# `stream_last` and is not written twice.
# Optional KEYS[3]: the request's live channel (app/state/keys.py `live`): the appended entry is
# also published there, as JSON [entry id, field, value, ...], for readers that show tokens as
# they come (app/state/live.py); nothing is published for a chunk that was not appended.
# -> 1 appended (or already), 0 fenced (no longer this claim's request), -1 off sequence.
STREAM_APPEND = """
local f = redis.call('HMGET', KEYS[1], 'status', 'begin_token', 'streamed', 'stream_last')
if f[1] ~= 'RUNNING' or f[2] ~= ARGV[1] then return 0 end
if f[4] == ARGV[4] then return 1 end
local at = tonumber(f[3] or '0')
if ARGV[3] == '1' then at = 0 end
if at ~= tonumber(ARGV[2]) then return -1 end
local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 5))
if KEYS[3] then
  local entry = {id}
  for i = 5, #ARGV do entry[#entry + 1] = ARGV[i] end
  redis.call('PUBLISH', KEYS[3], cjson.encode(entry))
end
local n = 0
for i = 5, #ARGV, 2 do if ARGV[i] == 'n' then n = tonumber(ARGV[i + 1]) end end
redis.call('HSET', KEYS[1], 'streamed', at + n, 'stream_last', ARGV[4])
return 1
"""

# Vigil's kombu transport (app/state/transport.py): kombu's own bookkeeping of a delivered
# message, as one script call instead of a MULTI pipeline.
# KEYS[1] kombu's unacked index (zset), KEYS[2] its unacked hash, optional KEYS[3] the holder's
# set. ARGV: delivery tag, now, the stored message ([message, exchange, routing key] as JSON),
# optional members of KEYS[3] (one per request the message carries). Notes a delivery (and who
# holds it).
NOTE_DELIVERY = """
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
if KEYS[3] then redis.call('SADD', KEYS[3], unpack(ARGV, 4)) end
return 1
"""

# KEYS[1] kombu's unacked index, KEYS[2] its unacked hash. ARGV: delivery tags (at most
# transport.ACK_BATCH). Acks them all.
ACK_DELIVERIES = """
redis.call('ZREM', KEYS[1], unpack(ARGV))
redis.call('HDEL', KEYS[2], unpack(ARGV))
return #ARGV
"""


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


# -- batch objects (app/state/batches.py) ------------------------------------------------
# Record each finished line once: HSETNX on the line number in the `done` hash decides; the
# winner appends the output line, counts it and drops the line from the in-flight hash.
# KEYS: batch, done, out, err, inflight. ARGV: n1, kind1 ('o'|'e'), line1, request_id1, ...
# Returns how many lines this call recorded (a line already recorded is skipped: a tick that
# ran twice, or a reply lost and the script run again, records nothing twice).
BATCH_RECORD = """
local recorded = 0
for i = 1, #ARGV, 4 do
  local n, kind, line, rid = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  if redis.call('HSETNX', KEYS[2], n, kind) == 1 then
    if kind == 'o' then
      redis.call('RPUSH', KEYS[3], line)
      redis.call('HINCRBY', KEYS[1], 'completed', 1)
      redis.call('HINCRBY', KEYS[1], 'output_bytes', string.len(line))
    else
      redis.call('RPUSH', KEYS[4], line)
      redis.call('HINCRBY', KEYS[1], 'failed', 1)
      redis.call('HINCRBY', KEYS[1], 'error_bytes', string.len(line))
    end
    recorded = recorded + 1
  end
  if rid ~= '' then redis.call('HDEL', KEYS[5], rid) end
end
return recorded
"""
