"""The Lua scripts behind app/state/store.py: each multi-step change to a request record is one
script, run atomically by Redis (the other scripts, by what they guard:
app/state/lua_deliveries.py, lua_outputs.py, lua_workers.py, lua_batches.py)."""
from app.state.keys import STREAM_PREFIX

# The most attempts a record's `history` keeps (the oldest are dropped past it). Attempts are
# bounded by max_attempts anyway; this only bounds the field whatever the settings.
HISTORY_MAX = 32

# Lua helpers for the record's `history` field, prepended to the scripts that change it: a JSON
# list (cjson) of one entry per attempt, {attempt, dispatch, worker, instance (a string: cjson
# would turn a 63-bit id into a float), started_at, ended_at, outcome, error}. An entry is open
# while its outcome is null. error_code mirrors VigilError.code: the text before the first ':'
# ('unknown' without one), null for no error.
HISTORY_HELPERS = """
local function error_code(err)
  if not err or err == '' then return cjson.null end
  local i = string.find(err, ':', 1, true)
  if not i then return 'unknown' end
  return string.match(string.sub(err, 1, i - 1), '^%s*(.-)%s*$')
end
local function read_history(rec)
  local raw = redis.call('HGET', rec, 'history')
  if not raw then return {} end
  return cjson.decode(raw)
end
local function write_history(rec, h)
  while #h > """ + str(HISTORY_MAX) + """ do table.remove(h, 1) end
  redis.call('HSET', rec, 'history', cjson.encode(h))
end
-- Close the attempt `instance` has open (its latest), else the last entry if it is open; an
-- attempt is never invented when none is open (e.g. a PENDING request failed by the sweeper).
local function close_attempt(rec, instance, now, outcome, err)
  local h = read_history(rec)
  local pick = nil
  for i = #h, 1, -1 do
    if h[i].outcome == cjson.null and h[i].instance == instance then pick = i break end
  end
  if not pick and #h > 0 and h[#h].outcome == cjson.null then pick = #h end
  if not pick then return end
  h[pick].ended_at = tonumber(now)
  h[pick].outcome = outcome
  h[pick].error = error_code(err)
  write_history(rec, h)
end
"""

# Creates records: a run of requests of one job and pool, in order, each as if alone (one
# request is a run of one). Each request is its id, its deadline and one JSON array of its
# fields (field, value, ...: strings, as redis-py would send them), not ~38 arguments each
# packed by redis-py in Python. A record is counted in its job (app/fleet/jobs.py) and its
# pool. KEYS[1] deadline index, KEYS[2] job hash, KEYS[3] job's pending set, KEYS[4] pool's job
# set, KEYS[5] jobs zset, KEYS[6] pool's pending set. ARGV: job, now, own_queue (1: the job has
# its own queue in the pool), max pending per job, max pending per pool (0 = no cap), the
# record key's prefix (app/state/keys.py `request` without the id), the requests its caller
# will write after this call in its job and in its pool (counted against the caps as if open
# already: a submit written in parts is refused in its first part when the whole would pass a
# cap), then request_id, deadline_at, fields JSON per request.
# -> per request, in order: 1 created, 2 created and the job's queue is new in this pool, 0
# already there (never overwritten), -1 the job was deleted, -2 / -3 the job's / pool's pending
# set is at its cap (nothing written for that request on any negative answer).
CREATE = """
local max_job, max_pool = tonumber(ARGV[4]), tonumber(ARGV[5])
local deleted = redis.call('HGET', KEYS[2], 'state') == 'deleted'
-- The open counts, read once and kept as this run creates (a script runs alone).
local in_job = max_job > 0 and redis.call('SCARD', KEYS[3]) + tonumber(ARGV[7]) or 0
local in_pool = max_pool > 0 and redis.call('SCARD', KEYS[6]) + tonumber(ARGV[8]) or 0
local answers = {}
local created = false
for i = 9, #ARGV, 3 do
  local rid = ARGV[i]
  local rec = ARGV[6] .. rid
  local answer = 1
  if redis.call('EXISTS', rec) == 1 then answer = 0
  elseif deleted then answer = -1
  elseif max_job > 0 and in_job >= max_job then answer = -2
  elseif max_pool > 0 and in_pool >= max_pool then answer = -3
  else
    redis.call('HSET', rec, unpack(cjson.decode(ARGV[i + 2])))
    redis.call('ZADD', KEYS[1], ARGV[i + 1], rid)
    in_job = in_job + redis.call('SADD', KEYS[3], rid)
    in_pool = in_pool + redis.call('SADD', KEYS[6], rid)
    if not created then
      created = true
      if ARGV[3] == '1' and redis.call('SADD', KEYS[4], ARGV[1]) == 1 then answer = 2 end
    end
  end
  answers[#answers + 1] = answer
end
if created then  -- the job's own fields, once per run: every request of it has the same
  redis.call('HSETNX', KEYS[2], 'created_at', ARGV[2])
  redis.call('HSET', KEYS[2], 'name', ARGV[1], 'last_active', ARGV[2])
  redis.call('ZADD', KEYS[5], ARGV[2], ARGV[1])
end
return answers
"""

# KEYS[1] record, KEYS[2] inflight set of this instance, KEYS[3] stats, KEYS[4] worker registry
# zset. ARGV: request_id, dispatch, worker, instance, now, max_attempts, inflight key prefix,
# claim token (a claim retried after its reply was lost returns its own run again), live window
# (an owner seen this recently is alive: its same-dispatch copy is 'busy', not run twice),
# avoid ('1': another healthy worker serves the pool, so a request whose last attempt failed
# transiently on this very worker is given back untouched, 'avoid', instead of run here again).
# The request leaves its previous holder's in-flight set (a worker keeps a request it released
# for a retry there until someone begins it: see RELEASE). A run appends an open attempt to
# `history`.
# -> {'missing'} | {'done', status, result, error_kind, error} | {'stale', dispatch}
#  | {'busy', owner} | {'expired'} | {'avoid'} | {'exhausted', attempts, last_error}
#  | {'run', attempts, streamed (tokens in the request's token stream), preemptions (times it
#     yielded its slot to an interactive request)}
BEGIN = HISTORY_HELPERS + """
local rec = KEYS[1]
-- One read of every field the decision needs (HMGET gives false for a missing one).
local r = redis.call('HMGET', rec, 'status', 'begin_token', 'dispatch', 'instance',
                     'deadline_at', 'attempts', 'last_error', 'streamed', 'preemptions')
local st = r[1]
if not st then return {'missing'} end
if st == 'SUCCEEDED' or st == 'FAILED' then
  redis.call('SREM', KEYS[2], ARGV[1])
  redis.call('HINCRBY', KEYS[3], 'duplicate_deliveries', 1)
  local f = redis.call('HMGET', rec, 'result', 'error_kind', 'error')
  return {'done', st, f[1] or '', f[2] or '', f[3] or ''}
end
if st == 'RUNNING' and r[2] == ARGV[8] then
  return {'run', r[6], r[8] or '0', r[9] or '0'}  -- this begin already ran (reply lost)
end
local current = tonumber(r[3] or '0')
local dispatch = tonumber(ARGV[2])
if dispatch < current then
  redis.call('SREM', KEYS[2], ARGV[1])
  redis.call('HINCRBY', KEYS[3], 'stale_deliveries', 1)
  return {'stale', tostring(current)}
end
local owner = r[4]
if st == 'RUNNING' and dispatch == current then
  -- The same copy again while its run is alive: this worker runs it (kombu restored the
  -- message when the connection dropped), or another worker that heartbeats runs it (a
  -- redelivery after the visibility timeout). Not a second run: the owner finishes it, or the
  -- reaper requeues it under a newer dispatch if the owner dies.
  local seen = owner and redis.call('ZSCORE', KEYS[4], owner)
  if owner == ARGV[4] or (seen and tonumber(seen) >= tonumber(ARGV[5]) - tonumber(ARGV[9])) then
    if owner ~= ARGV[4] then redis.call('SREM', KEYS[2], ARGV[1]) end
    redis.call('HINCRBY', KEYS[3], 'duplicate_deliveries', 1)
    return {'busy', owner}
  end
end
local deadline = tonumber(r[5] or '0')
if deadline > 0 and tonumber(ARGV[5]) > deadline then return {'expired'} end
local h = nil
if ARGV[10] == '1' and st == 'PENDING' then
  h = read_history(rec)
  local last = h[#h]
  if last and last.instance == ARGV[4] and last.outcome == 'retry'
      and last.error ~= 'lora_adapter_pending' and last.error ~= 'preempted' then
    redis.call('SREM', KEYS[2], ARGV[1])  -- given back: this worker no longer holds it
    return {'avoid'}
  end
end
local attempts = tonumber(r[6] or '0')
if attempts >= tonumber(ARGV[6]) then
  return {'exhausted', tostring(attempts), r[7] or ''}
end
attempts = attempts + 1
if owner and owner ~= ARGV[4] then redis.call('SREM', ARGV[7] .. owner, ARGV[1]) end
redis.call('HSET', rec, 'status', 'RUNNING', 'attempts', attempts, 'dispatch', dispatch,
           'worker', ARGV[3], 'instance', ARGV[4], 'started_at', ARGV[5],
           'begin_token', ARGV[8])
h = h or read_history(rec)
h[#h + 1] = {attempt = attempts, dispatch = dispatch, worker = ARGV[3], instance = ARGV[4],
             started_at = tonumber(ARGV[5]), ended_at = cjson.null, outcome = cjson.null,
             error = cjson.null}
write_history(rec, h)
redis.call('SADD', KEYS[2], ARGV[1])
return {'run', tostring(attempts), r[8] or '0', r[9] or '0'}
"""

# KEYS[1] record, KEYS[2] inflight set of the finishing instance, KEYS[3] stats,
# KEYS[4] deadline index, KEYS[5] worker registry. ARGV: request_id, status, result, error_kind,
# error, now, ttl, inflight key prefix (to drop the id from its owner's set too: the sweeper
# finishes requests that a worker holds), finishing instance, job and pool pending-set prefixes.
# -> {1, status, '', error_kind, error} when this write won (the caller has its own result),
# {0, ...stored} when it lost.
# Optional KEYS[6] Celery's result key, ARGV[12] / ARGV[13] Celery's encoded meta before / after
# the result's JSON, ARGV[14] its expiry in seconds (0: none): a winning SUCCEEDED write also
# writes Celery's result key as Celery's Redis backend would (SET with expiry, PUBLISH on the key
# for a waiting `get()`), so the worker need not write it again (app/state/results.py).
# Only a winning write closes an attempt in `history` (the finisher's open one, else the last if
# open) as succeeded / failed. A worker instance's finish also counts as its heartbeat: its
# `last_seen` moves up (only if it is registered: a reaped worker is not brought back), so a
# worker whose heartbeat thread is starved while it serves is not taken for dead.
FINISH_FN = """
-- f: the record's {instance, job, pool, status} when the caller read them already, else nil.
local function finish_one(rec, finisher_inflight, stats, deadlines, workers, rid, status,
                          result, ekind, err, now, ttl, inflight_prefix, instance, job_prefix,
                          pool_prefix, f)
  if instance ~= '0' then redis.call('ZADD', workers, 'XX', 'GT', now, instance) end
  redis.call('SREM', finisher_inflight, rid)
  redis.call('ZREM', deadlines, rid)
  f = f or redis.call('HMGET', rec, 'instance', 'job', 'pool', 'status')
  if f[1] then redis.call('SREM', inflight_prefix .. f[1], rid) end
  if f[2] then redis.call('SREM', job_prefix .. f[2], rid) end
  if f[3] then redis.call('SREM', pool_prefix .. f[3], rid) end
  if f[4] == 'SUCCEEDED' or f[4] == 'FAILED' then
    redis.call('HINCRBY', stats, 'duplicate_results', 1)
    local g = redis.call('HMGET', rec, 'result', 'error_kind', 'error')
    return {0, f[4], g[1] or '', g[2] or '', g[3] or ''}
  end
  redis.call('HSET', rec, 'status', status, 'result', result, 'error_kind', ekind,
             'error', err, 'finished_at', now)
  close_attempt(rec, instance, now, status == 'SUCCEEDED' and 'succeeded' or 'failed', err)
  redis.call('EXPIRE', rec, tonumber(ttl))
  -- The token stream, if one was written, ends here: readers blocked on it wake at once, and
  -- it expires with the result.
  local sk = '""" + STREAM_PREFIX + """' .. rid
  if redis.call('EXISTS', sk) == 1 then
    redis.call('XADD', sk, '*', 'end', status)
    redis.call('EXPIRE', sk, tonumber(ttl))
  end
  return {1, status, result, ekind, err}
end
"""
FINISH = HISTORY_HELPERS + FINISH_FN + """
local r = finish_one(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], ARGV[2], ARGV[3],
                     ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11])
if r[1] == 1 then
  if KEYS[6] and r[2] == 'SUCCEEDED' then
    local meta = ARGV[12] .. ARGV[3] .. ARGV[13]
    if tonumber(ARGV[14]) > 0 then
      redis.call('SET', KEYS[6], meta, 'EX', tonumber(ARGV[14]))
    else
      redis.call('SET', KEYS[6], meta)
    end
    redis.call('PUBLISH', KEYS[6], meta)
  end
  r[3] = ''
end
return r
"""

# KEYS[1] stats, KEYS[2] deadline index, KEYS[3] worker registry, KEYS[4] the finishing
# instance's in-flight set. ARGV: error_kind, error, now, ttl, in-flight set prefix, finishing
# instance, job and pool pending-set prefixes, request key prefix, pool-state key prefix, then
# the request ids. FINISH for many requests ending FAILED with one error at once (the deadline
# sweep's chunk), each the same set-once finish; a request whose pool has an unserved reason (the
# reconcile's, in its pool-state hash) gets "; <reason>" after the error. -> 6 values per
# request, in order: won, status, result, error_kind, error (the stored ones when it lost), pool.
FINISH_FAILED_MANY = HISTORY_HELPERS + FINISH_FN + """
local out = {}
local reasons = {}
for i = 11, #ARGV do
  local rec = ARGV[9] .. ARGV[i]
  local f = redis.call('HMGET', rec, 'instance', 'job', 'pool', 'status')
  local pool = f[3] or ''
  if reasons[pool] == nil then
    reasons[pool] = (pool ~= '' and redis.call('HGET', ARGV[10] .. pool, 'reason')) or ''
  end
  local err = ARGV[2]
  if reasons[pool] ~= '' then err = err .. '; ' .. reasons[pool] end
  local r = finish_one(rec, KEYS[4], KEYS[1], KEYS[2], KEYS[3], ARGV[i], 'FAILED', '',
                       ARGV[1], err, ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], f)
  for _, v in ipairs(r) do table.insert(out, v) end
  table.insert(out, pool)
end
return out
"""

# KEYS[1] record, KEYS[2] inflight set. ARGV: request_id, instance, next_dispatch, last_error,
# now, refund ('1': the attempt is refunded), pressure ('1': a start refused for memory
# pressure: `pressure_since` keeps when the squeeze began; '0' forgets it), preempted ('1': it
# yielded its slot to an interactive request: `preemptions` counts it). Hands a RUNNING
# request back to the queue for a retry, closing its attempt in `history` (outcome 'retry', the
# code of last_error); a no-op (0) if it is no longer ours.
# The id stays in this worker's in-flight set: the retry's message is an ETA message that this
# worker's consumer holds unacked until it is due, so if the worker dies now the reaper must
# still find the request (the next BEGIN, anywhere, removes it from the set).
RELEASE = HISTORY_HELPERS + """
local f = redis.call('HMGET', KEYS[1], 'status', 'instance', 'dispatch')
if f[1] == 'PENDING' and f[2] == ARGV[2] and f[3] == ARGV[3] then
  return 1  -- this release already ran (its reply was lost): say so again
end
if redis.call('HGET', KEYS[1], 'status') ~= 'RUNNING' then
  redis.call('SREM', KEYS[2], ARGV[1])
  return 0
end
if redis.call('HGET', KEYS[1], 'instance') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'status', 'PENDING', 'dispatch', ARGV[3], 'last_error', ARGV[4])
if ARGV[6] == '1' then redis.call('HINCRBY', KEYS[1], 'attempts', -1) end
if ARGV[7] == '1' then
  redis.call('HSETNX', KEYS[1], 'pressure_since', ARGV[5])
else
  redis.call('HDEL', KEYS[1], 'pressure_since')
end
if ARGV[8] == '1' then redis.call('HINCRBY', KEYS[1], 'preemptions', 1) end
close_attempt(KEYS[1], ARGV[2], ARGV[5], 'retry', ARGV[4])
return 1
"""


# KEYS[1] record, KEYS[2] inflight set of the dead instance. ARGV: request_id, dead instance,
# new dispatch, now, [reason: the error recorded, worker_lost by default ('' too)], [drained:
# '1' for a stopping worker's hand-back that refunds the attempt]. Hands a dead worker's
# request (RUNNING under it, or PENDING: received but
# not begun, or released for a retry whose ETA message it held) back to PENDING under a newer
# dispatch (the caller then publishes that dispatch's message: a refused requeue publishes
# nothing); a no-op (0) if the request is terminal or no longer the dead worker's. An attempt
# still open in `history` is closed 'requeued' with the reason's code. Drained, a RUNNING
# request's attempt is refunded (`attempts` - 1) and counted in `drains`; a PENDING one had
# no attempt open, so nothing is refunded or counted.
REQUEUE = HISTORY_HELPERS + """
redis.call('SREM', KEYS[2], ARGV[1])
local st = redis.call('HGET', KEYS[1], 'status')
if st ~= 'RUNNING' and st ~= 'PENDING' then return 0 end
if st == 'RUNNING' and redis.call('HGET', KEYS[1], 'instance') ~= ARGV[2] then return 0 end
local d = tonumber(redis.call('HGET', KEYS[1], 'dispatch') or '0')
if tonumber(ARGV[3]) > d then d = tonumber(ARGV[3]) end
local lost = ARGV[5]
if not lost or lost == '' then lost = 'worker_lost: its worker stopped heartbeating and was reaped' end
redis.call('HSET', KEYS[1], 'status', 'PENDING', 'dispatch', d, 'last_error', lost)
if ARGV[6] == '1' and st == 'RUNNING' then
  redis.call('HINCRBY', KEYS[1], 'attempts', -1)
  redis.call('HINCRBY', KEYS[1], 'drains', 1)
end
close_attempt(KEYS[1], ARGV[2], ARGV[4], 'requeued', lost)
return 1
"""

# KEYS[1] lock. ARGV: owner. Deletes the lock only if this owner still holds it.
UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
