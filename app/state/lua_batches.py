"""The Lua script that guards a batch object's record, run atomically by Redis
(app/state/batches.py). The other scripts: app/state/lua_records.py (request records),
lua_deliveries.py, lua_outputs.py, lua_workers.py."""

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
