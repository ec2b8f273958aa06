"""The pool reconcile (beat, every `VIGIL_RECONCILE_INTERVAL`): a pool with waiting work and no
live, healthy worker gets one; a pool grows to the replicas its jobs ask for; a worker that
was lent to a pool goes back once that pool is idle (DESIGN.md section 6).

A function of `(store, registry, now, control)`, lock-guarded with the rest of the reconcile,
reading only Redis (worker entries and their heartbeats' memory figures, health ledgers, queue
lengths) and acting only through Celery's `add_consumer` / `cancel_consumer`:

- **Which worker.** Only live (heartbeat within the reap timeout, started: has_pinged) HEALTHY
  workers whose last heartbeat says the model fits: free device memory, plus what its current
  engine holds (a worker switches models by evicting), at least the model's `memory_gib` +
  `kv_cache_floor_gib`.
  Among those, the idlest (fewest in flight, no waiting work of its own). A worker that cannot
  fit the model is never chosen.
- **Why not.** When no worker can take the pool, the reason is written to
  `vigil:poolstate:{pool}` (`vigil status` shows it; a request that then ends at its deadline
  says so in its `deadline_exceeded` detail).
- **At most `reconcile_concurrency`** (4) pools are given a worker per pass.
- **Lent workers go back**: a worker serving a pool it was not started with (`configured_pools`
  in its heartbeat) stops consuming it once the pool has no waiting work and its engine no
  longer holds that model (the idle cleanup evicted it).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from app.state import keys
from app.state.health import HEALTHY, SUSPECT
from app.state.queues import pool_queues
from app.requests.models import ModelRegistry

log = logging.getLogger("vigil.reconcile")
GiB = 1 << 30
RECONCILE_CONCURRENCY = 4
# A pool's recorded reason outlives the pass that wrote it by this much (it is rewritten or
# deleted by every pass; this only bounds it if beat stops).
POOL_STATE_TTL_S = 3600

Control = Callable[[str, str, bool], None]  # (worker name, queue, add=True / cancel=False)


@dataclass
class WorkerView:
    """What the reconcile knows of a worker (from its registry entry and ledger)."""

    instance: str
    name: str
    live: bool
    state: str
    pools: list[str]
    configured: list[str]
    model: str
    in_flight: int
    free: int | None


def pool_state_key(pool: str) -> str:
    """Why a pool is unserved (hash: reason, at), written by the reconcile."""
    return f"{keys.PREFIX}poolstate:{pool}"


def read_workers(store, now: float, live_window: float) -> list[WorkerView]:
    """Every registered worker as the reconcile sees it."""
    out = []
    for inst, seen in store.r.zrange(keys.WORKERS, 0, -1, withscores=True):
        inst = inst.decode()
        e = {k.decode(): v.decode() for k, v in store.r.hgetall(keys.worker(inst)).items()}
        st = store.r.hget(keys.health(inst), "state")
        free = e.get("device_free_bytes")
        # Only a worker that finished starting (has_pinged) can act on a control broadcast:
        # before its consumer is up, an add_consumer sent to it is lost.
        live = seen >= now - live_window and e.get("has_pinged", "1") == "1"
        out.append(WorkerView(
            inst, e.get("name", ""), live,
            st.decode() if st else HEALTHY,
            [p for p in e.get("pools", "").split(",") if p],
            [p for p in e.get("configured_pools", e.get("pools", "")).split(",") if p],
            e.get("model", ""), int(e.get("in_flight", 0) or 0),
            int(free) if free not in (None, "") else None))
    return out


def need_bytes(registry: ModelRegistry, model: str) -> int:
    """Device memory a model needs to start: its other needs plus the smallest KV cache."""
    spec = registry.get(model)
    return int((spec.memory_gib + spec.kv_cache_floor_gib) * GiB)


def fits(w: WorkerView, registry: ModelRegistry, model: str) -> bool:
    """True when the worker's last heartbeat says `model` fits (its current engine's memory
    counts as free: switching evicts it). Unknown memory never fits."""
    if w.free is None:
        return False
    held = need_bytes(registry, w.model) if w.model and w.model in registry else 0
    return w.free + held >= need_bytes(registry, model)


def replicas_wanted(store, pool: str) -> int:
    """The most workers any live job with a queue in `pool` asks for (at least 1)."""
    want = 1
    for job in store.r.smembers(keys.pool_jobs(pool)):
        r = store.r.hget(keys.job(job.decode()), "replicas")
        if r:
            want = max(want, int(r))
    return want


def reconcile_pools(store, registry: ModelRegistry, now: float, control: Control, *,
                    live_window: float, concurrency: int = RECONCILE_CONCURRENCY) -> dict:
    """One reconcile pass (see the module docstring). Returns what it did:
    {"assigned": [(pool, worker)], "unserved": {pool: reason}, "released": [(pool, worker)]}."""
    workers = [w for w in read_workers(store, now, live_window) if w.live and w.name]
    waiting = {p: sum(store.r.llen(q) for q in pool_queues(store.r, p))
               for p in registry.names()}
    done: dict = {"assigned": [], "unserved": {}, "released": []}
    for pool in registry.names():
        if len(done["assigned"]) >= concurrency:
            break
        if not waiting[pool]:
            store.r.delete(pool_state_key(pool))
            continue
        serving = [w for w in workers if pool in w.pools and w.state in (HEALTHY, SUSPECT)]
        want = replicas_wanted(store, pool)
        if len(serving) >= want:
            store.r.delete(pool_state_key(pool))
            continue
        candidates = [w for w in workers if pool not in w.pools and w.state == HEALTHY
                      and fits(w, registry, pool)]
        if not candidates:
            best = max((w.free or 0 for w in workers), default=0)
            reason = (f"pool {pool}: no live healthy worker can take it: it needs "
                      f"{need_bytes(registry, pool) / GiB:.1f} GiB free, the most any worker "
                      f"reports is {best / GiB:.1f} GiB" if workers else
                      f"pool {pool}: no live worker at all")
            pipe = store.r.pipeline(transaction=True)
            pipe.hset(pool_state_key(pool), mapping={"reason": reason, "at": now})
            pipe.expire(pool_state_key(pool), POOL_STATE_TTL_S)  # stale once passes stop
            pipe.execute()
            done["unserved"][pool] = reason
            continue
        for w in sorted(candidates, key=lambda w: (sum(waiting.get(p, 0) for p in w.pools),
                                                   w.in_flight, w.name))[:want - len(serving)]:
            for q in pool_queues(store.r, pool):
                control(w.name, q, True)
            w.pools.append(pool)
            done["assigned"].append((pool, w.name))
            log.warning("reconcile: pool %s had %d waiting and no worker; assigned %s",
                        pool, waiting[pool], w.name)
        store.r.delete(pool_state_key(pool))
    for w in workers:  # lent workers go back when their borrowed pool is idle
        for pool in [p for p in w.pools if p not in w.configured]:
            if not waiting.get(pool) and w.model != pool:
                for q in pool_queues(store.r, pool):
                    control(w.name, q, False)
                done["released"].append((pool, w.name))
    return done


def unserved_reason(client, pool: str) -> str:
    """The reconcile's last word on why `pool` has no worker ('' if none)."""
    r = client.hget(pool_state_key(pool), "reason")
    return r.decode() if r else ""

