"""The Lua scripts that guard what a request produces, each run atomically by Redis: Celery's
result keys written and published (app/state/results.py) and a request's token stream
(app/state/streams.py). The other scripts: app/state/lua_records.py (request records),
lua_deliveries.py, lua_workers.py, lua_batches.py."""

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
