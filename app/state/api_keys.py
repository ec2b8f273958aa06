"""The online API's keys (docs/api.md, "Who may do what"): who may call `vigil api`, under which
job, up to which tier. Operators create, list and revoke them with `vigil api-key` while every
gateway serves on: a gateway reads a key from Redis at most every KEY_CACHE_S, so a revoked key
stops working within that, with no restart.

A key is shown once, when it is made; Redis keeps only its SHA-256 (`vigil:apikey:{sha}`: name,
job, max_tier, created_at), and `vigil:apikeys` lists them (sha -> name). The key id shown by
`list` is the first 12 hex digits of the SHA.
"""
from __future__ import annotations

import hashlib
import secrets
import time

import redis
import redis.asyncio as aioredis

from app.state import keys
from app.state.calls import Calls

KEY_PREFIX = "vk-"
KEY_CACHE_S = 5.0
ID_LEN = 12


def digest(token: str) -> str:
    """The SHA-256 (hex) a key is stored under."""
    return hashlib.sha256(token.encode()).hexdigest()


class ApiKeys:
    """Creates, lists and revokes keys (the operator's side, synchronous)."""

    def __init__(self, client: redis.Redis, calls: Calls | None = None):
        self.r = client
        self._call = calls or Calls(client)

    def create(self, name: str, job: str | None, max_tier: str, now: float | None = None
               ) -> str:
        """A new key for `name` (its requests run under `job`, or the job a request names when
        None, at tiers up to `max_tier`); returns the key itself, which is not stored."""
        token = KEY_PREFIX + secrets.token_hex(24)
        sha = digest(token)
        pipe = self._call.pipeline(transaction=True)
        pipe.hset(keys.api_key(sha), mapping={
            "name": name, "job": job or "", "max_tier": max_tier,
            "created_at": f"{time.time() if now is None else now:.3f}"})
        pipe.hset(keys.API_KEYS, sha, name)
        self._call(pipe.execute)
        return token

    def list(self) -> list[dict]:
        """Every key: {id, name, job, max_tier, created_at}, oldest first."""
        out = []
        for sha, _ in sorted(self._call(self.r.hgetall, keys.API_KEYS).items()):
            raw = self._call(self.r.hgetall, keys.api_key(sha.decode()))
            if raw:
                f = {k.decode(): v.decode() for k, v in raw.items()}
                out.append({"id": sha.decode()[:ID_LEN], "name": f.get("name", ""),
                            "job": f.get("job") or None, "max_tier": f.get("max_tier", ""),
                            "created_at": float(f.get("created_at") or 0)})
        return sorted(out, key=lambda k: k["created_at"])

    def revoke(self, key_id_or_name: str) -> int:
        """Revoke the key whose id (or every key whose name) is `key_id_or_name`; returns how
        many were revoked."""
        gone = 0
        for sha, name in self._call(self.r.hgetall, keys.API_KEYS).items():
            sha, name = sha.decode(), name.decode()
            if sha.startswith(key_id_or_name) and len(key_id_or_name) >= 8 \
                    or name == key_id_or_name:
                pipe = self._call.pipeline(transaction=True)
                pipe.delete(keys.api_key(sha))
                pipe.hdel(keys.API_KEYS, sha)
                self._call(pipe.execute)
                gone += 1
        return gone


class KeyReader:
    """The gateway's side: a presented key's grant, read at most every KEY_CACHE_S per key."""

    def __init__(self, client: aioredis.Redis, clock=time.monotonic):
        self.r = client
        self._clock = clock
        self._cache: dict[str, tuple[float, dict | None]] = {}

    async def grant(self, token: str) -> dict | None:
        """{name, job (None: any), max_tier} of `token`, or None when it is no key."""
        if not token.startswith(KEY_PREFIX):
            return None
        sha = digest(token)
        now = self._clock()
        hit = self._cache.get(sha)
        if hit is not None and now - hit[0] < KEY_CACHE_S:
            return hit[1]
        raw = await self.r.hgetall(keys.api_key(sha))
        grant = None
        if raw:
            f = {k.decode(): v.decode() for k, v in raw.items()}
            grant = {"name": f.get("name", ""), "job": f.get("job") or None,
                     "max_tier": f.get("max_tier") or "interactive", "id": sha[:ID_LEN]}
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[sha] = (now, grant)
        return grant
