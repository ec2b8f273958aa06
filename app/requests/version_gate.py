"""The producer's gate for a rolling upgrade: a request of a newer schema version is published
only to a pool where no live worker would fail it (docs/api.md, "Version safety").

A worker says which request schema versions it reads in its registry entry (`schema_versions`,
`ADVERTISED` here, written by every heartbeat) and hands a message of a newer version back
instead of failing it (workers/service.py). Workers from before that (before schema version 2)
say nothing, read version 1 only and end any other message `unsupported_version` (terminal):
their code cannot be changed now, so the producer keeps such messages from them. A request is
stamped with the lowest version that holds it (app/requests/schemas.py), so only a request that
uses a version 2 field is gated: while a live worker of its pool advertises no versions, it is
refused at submit with TransientError(workers_too_old), nothing written or published, naming
those workers; the caller retries once they are upgraded (a batch's line waits for the next
tick). A version 1 request is never gated and costs nothing here.

What the gate cannot see: a worker that registers after the check (an old one started during
the upgrade, or a rollback) may still take a version 2 message already queued; a message sent
around the producer (`send_task`, a foreign producer) is not gated.
"""
from __future__ import annotations

import time
import weakref

from app.errors import WORKERS_TOO_OLD, TransientError
from app.requests.schemas import SUPPORTED_VERSIONS, GenerateRequest, v2_fields_used
from app.settings import VigilSettings
from app.state.registry import WorkerRegistry

# What a worker of this code writes in its registry entry: the versions it reads.
ADVERTISED = ",".join(str(v) for v in sorted(SUPPORTED_VERSIONS))
# A pool's verdict is read from the registry at most this often per producer: a submit of a
# version 2 request costs no registry read in between. (A worker upgraded is seen this late.)
VERDICT_CACHE_S = 5.0

_verdicts: "weakref.WeakKeyDictionary[WorkerRegistry, dict[str, tuple[float, list[str]]]]" = \
    weakref.WeakKeyDictionary()


def unadvertised_workers(registry: WorkerRegistry, pool: str, window: float,
                         now: float | None = None) -> list[str]:
    """Node names of the live workers (heartbeat within `window`) consuming `pool` that
    advertise no schema versions: workers from before version 2, which fail any message of
    another version. Read from the registry at most every VERDICT_CACHE_S per pool."""
    now = time.time() if now is None else now
    per_pool = _verdicts.setdefault(registry, {})
    cached = per_pool.get(pool)
    if cached is not None and now - cached[0] < VERDICT_CACHE_S:
        return cached[1]
    old = sorted(e.name or e.instance for e in registry.entries()
                 if e.live(now, window) and pool in e.pools and not e.schema_versions)
    per_pool[pool] = (now, old)
    return old


def check_served(req: GenerateRequest, pool: str, registry: WorkerRegistry,
                 settings: VigilSettings, now: float | None = None) -> None:
    """Raise TransientError(workers_too_old) when `req` needs a schema version above 1 and a
    live worker of `pool` would fail it (module docstring); nothing when it is version 1."""
    if req.schema_version <= 1:
        return
    old = unadvertised_workers(registry, pool, settings.live_window, now)
    if old:
        shown = ", ".join(old[:5]) + (f" and {len(old) - 5} more" if len(old) > 5 else "")
        raise TransientError.of(WORKERS_TOO_OLD, (
            f"pool {pool!r} has {len(old)} live worker(s) from before schema version 2 "
            f"({shown}), which would fail this request (it uses "
            f"{', '.join(v2_fields_used(req))}); nothing was sent: submit it again once they "
            "are upgraded, or without those fields"))


def pool_reads(registry: WorkerRegistry, pool: str, version: int, window: float,
               now: float | None = None) -> bool:
    """True when every live worker (heartbeat within `window`) consuming `pool` reads request
    schema `version` (it advertises it), and at least one lives. What a producer asks before it
    uses a field a worker from before `version` would only hand back (the online API's `live`
    streams, version 3). Read from the registry at most every VERDICT_CACHE_S per pool."""
    now = time.time() if now is None else now
    per_pool = _reads.setdefault(registry, {})
    cached = per_pool.get((pool, version))
    if cached is not None and now - cached[0] < VERDICT_CACHE_S:
        return cached[1]
    serving = [e for e in registry.entries() if e.live(now, window) and pool in e.pools]
    verdict = bool(serving) and all(version in e.schema_versions for e in serving)
    per_pool[(pool, version)] = (now, verdict)
    return verdict


_reads: "weakref.WeakKeyDictionary[WorkerRegistry, dict[tuple[str, int], tuple[float, bool]]]" = \
    weakref.WeakKeyDictionary()
