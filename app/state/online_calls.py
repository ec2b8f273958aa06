"""The online API's calls (docs/api.md, "The online API"): one record per HTTP call, so that any
gateway can go on with a call's stream when its client reconnects (`vigil:call:{call_id}`: the
key that made it, the Vigil request ids of its prompts, how its answers are formatted). Written
once, when the call is first made; it expires with the results it points to.
"""
from __future__ import annotations

import json

import redis.asyncio as aioredis

from app.state import keys

# KEYS[1] the call. ARGV: ttl seconds, then field/value pairs. Writes the call only if it is
# new; returns its fields either way (the stored ones when it existed).
CREATE_CALL = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 2))
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
  return {1, redis.call('HGETALL', KEYS[1])}
end
return {0, redis.call('HGETALL', KEYS[1])}
"""


class CallRecords:
    """Creates and reads call records (async: the gateway's loop)."""

    def __init__(self, client: aioredis.Redis):
        self.r = client
        self._create = client.register_script(CREATE_CALL)

    async def create(self, call_id: str, record: dict, ttl_s: float) -> tuple[bool, dict]:
        """Write the call if it is new: (True, `record`); else (False, the stored record).
        Values are JSON-encoded."""
        flat = [x for k, v in record.items() for x in (k, json.dumps(v))]
        new, raw = await self._create(keys=[keys.call(call_id)], args=[int(ttl_s)] + flat)
        fields = {raw[i].decode(): json.loads(raw[i + 1]) for i in range(0, len(raw), 2)}
        return bool(new), fields

    async def get(self, call_id: str) -> dict | None:
        """The call's record, or None (never made, or expired)."""
        raw = await self.r.hgetall(keys.call(call_id))
        return {k.decode(): json.loads(v) for k, v in raw.items()} if raw else None
