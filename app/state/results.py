"""Celery's result keys, written the way Celery's Redis result backend writes them: SET with its
expiry, then PUBLISH on the same key (where a waiting `AsyncResult.get()` listens). Vigil writes
them itself where that saves round trips: many at once (the deadline sweep's chunk), one script
call instead of two round trips per result; and a worker's result, inside the set-once finish
that stores it (`ResultKey`, app/state/store.py `finish`). What goes in them (Celery's encoded
meta) is the caller's (app/fleet/outcomes.py); functions raise redis' own errors."""
from __future__ import annotations

from dataclasses import dataclass

import redis

from app.state.lua_outputs import SET_AND_PUBLISH_MANY


@dataclass
class ResultKey:
    """Celery's result key for one task, and its encoded meta cut around the result: the value
    Celery would store is `prefix + <the result's JSON> + suffix`. `written` becomes True once a
    finish wrote it (the finish won with a result)."""

    key: str
    prefix: str
    suffix: str
    expires_s: int
    written: bool = False



def set_and_publish_many(backend, items: list[tuple[bytes | str, bytes | str]]) -> int:
    """SET each (key, value) with Celery's Redis result `backend`'s expiry (its `expires`; None:
    no expiry) and PUBLISH it on its key, in one script call on the backend's own client (its
    `client`, which only app/state/ touches); returns how many were written."""
    if not items:
        return 0
    client: redis.Redis = backend.client
    args: list = [int(backend.expires or 0)]
    for key, value in items:
        args += [key, value]
    return int(_set_and_publish_many(client)(keys=[], args=args, client=client))


_script: "redis.commands.core.Script | None" = None


def _set_and_publish_many(client: redis.Redis):
    """SET_AND_PUBLISH_MANY, registered once per process (its SHA computed once) and run on
    whichever client the caller passes."""
    global _script
    if _script is None:
        _script = client.register_script(SET_AND_PUBLISH_MANY)
    return _script
