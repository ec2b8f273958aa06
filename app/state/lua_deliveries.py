"""The Lua scripts that guard kombu's queues and a worker's deliveries, each run atomically by
Redis: a message moved between queues (app/state/views.py), a delivery noted and acked
(app/state/transport.py). The other scripts: app/state/lua_records.py (request records),
lua_outputs.py, lua_workers.py, lua_batches.py."""

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
# acker.ACK_BATCH). Acks them all.
ACK_DELIVERIES = """
redis.call('ZREM', KEYS[1], unpack(ARGV))
redis.call('HDEL', KEYS[2], unpack(ARGV))
return #ARGV
"""
