"""The pool reconcile (beat, every `VIGIL_RECONCILE_INTERVAL`): a pool with waiting work and no
live, healthy worker gets one; a pool grows to the replicas its jobs ask for; a worker that
was lent to a pool goes back once that pool is idle (docs/architecture.md,
"Jobs, fairness and the pool reconcile").

A function of `(store, registry, now, control)`, lock-guarded with the rest of the reconcile,
reading only Redis (worker entries and their heartbeats' memory figures, health ledgers, queue
lengths) and acting only through Celery's `add_consumer` / `cancel_consumer`:

- **Which worker.** Only live (heartbeat within the reap timeout, started: has_pinged) HEALTHY
  workers whose last heartbeat says the model fits: free device memory, plus what its current
  engine holds (a worker switches models by evicting), at least the model's `memory_gib` +
  `kv_cache_floor_gib`; on GPUs, as many cards as its `tensor_parallel_size` (when it names
  one).
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
from typing import Callable

from app.requests.models import ModelRegistry
from app.state.health import HEALTHY, SUSPECT
from app.state.registry import WorkerEntry

log = logging.getLogger("vigil.reconcile")
GiB = 1 << 30
RECONCILE_CONCURRENCY = 4

Control = Callable[[str, str, bool], None]  # (worker name, queue, add=True / cancel=False)


def need_bytes(registry: ModelRegistry, model: str) -> int:
    """Device memory a model needs to start: its other needs plus the smallest KV cache."""
    return registry.get(model).start_floor_bytes()


def fits(w: WorkerEntry, registry: ModelRegistry, model: str) -> bool:
    """True when the worker's last heartbeat says `model` fits (its current engine's memory
    counts as free: switching evicts it) and, on GPUs, that it has the number of cards the
    model's `tensor_parallel_size` asks for (vLLM runs one rank per card). Unknown memory never
    fits."""
    if w.free_bytes is None:
        return False
    if w.device == "cuda" and registry.get(model).card_problem(max(w.cards, 1)):
        return False
    held = need_bytes(registry, w.model) if w.model and w.model in registry else 0
    return w.free_bytes + held >= need_bytes(registry, model)


def reconcile_pools(store, registry: ModelRegistry, now: float, control: Control, *,
                    live_window: float, concurrency: int = RECONCILE_CONCURRENCY) -> dict:
    """One reconcile pass (see the module docstring). Returns what it did:
    {"assigned": [(pool, worker)], "unserved": {pool: reason}, "released": [(pool, worker)]}."""
    # Only a worker that finished starting (has_pinged) can act on a control broadcast: before
    # its consumer is up, an add_consumer sent to it is lost.
    workers = [w for w in store.workers.entries()
               if w.live(now, live_window) and w.has_pinged and w.name]
    waiting = {p: sum(store.broker.depths(store.pool_queues(p)))
               for p in registry.names()}
    done: dict = {"assigned": [], "unserved": {}, "released": []}
    for pool in registry.names():
        if len(done["assigned"]) >= concurrency:
            break
        if not waiting[pool]:
            store.jobs.clear_unserved(pool)
            continue
        serving = [w for w in workers if pool in w.pools and w.health_state in (HEALTHY, SUSPECT)]
        want = store.jobs.replicas_wanted(pool)
        if len(serving) >= want:
            store.jobs.clear_unserved(pool)
            continue
        candidates = [w for w in workers if pool not in w.pools and w.health_state == HEALTHY
                      and fits(w, registry, pool)]
        if not candidates:
            best = max((w.free_bytes or 0 for w in workers), default=0)
            tp = registry.get(pool).engine_args.get("tensor_parallel_size")
            reason = (f"pool {pool}: no live healthy worker can take it: it needs "
                      f"{need_bytes(registry, pool) / GiB:.1f} GiB free"
                      + (f" on a GPU worker of {tp} cards" if tp else "")
                      + f", the most any worker reports is {best / GiB:.1f} GiB" if workers else
                      f"pool {pool}: no live worker at all")
            store.jobs.set_unserved(pool, reason, now)
            done["unserved"][pool] = reason
            continue
        for w in sorted(candidates, key=lambda w: (sum(waiting.get(p, 0) for p in w.pools),
                                                   w.in_flight, w.name))[:want - len(serving)]:
            for q in store.pool_queues(pool):
                control(w.name, q, True)
            w.pools.append(pool)
            done["assigned"].append((pool, w.name))
            log.warning("reconcile: pool %s had %d waiting and no worker; assigned %s",
                        pool, waiting[pool], w.name)
        store.jobs.clear_unserved(pool)
    for w in workers:  # lent workers go back when their borrowed pool is idle
        for pool in [p for p in w.pools if p not in w.configured_pools]:
            if not waiting.get(pool) and w.model != pool:
                for q in store.pool_queues(pool):
                    control(w.name, q, False)
                done["released"].append((pool, w.name))
    return done
