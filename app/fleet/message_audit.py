"""Find the open requests whose message is gone, and publish them again.

A request's record and its message live apart (the record in `vigil:req:*`, the message in a
kombu list, then in kombu's unacked hash once a consumer fetched it), so a message can vanish
while its record waits PENDING for ever, or until its deadline. Two events do that:

- **A Redis crash.** With `appendfsync everysec`, a Redis that crashes (SIGKILL, power loss)
  comes back from its AOF without its last second or so of writes (docs/reliability.md): a record
  written just before the crash can survive while the message published after it does not. (A
  worker's retry that could not be published within VIGIL_REDIS_OUTAGE_GRACE is the same case.)
  Beat's deadline sweep calls `audit_after_restart` on every run: one INFO and one GET, unless
  Redis' run_id differs from the one recorded after the last audit.
- **A worker killed while its consumer waited in BRPOP.** Redis answers a blocked BRPOP by popping
  the message and writing it to the client's socket; if the client is dead and Redis has not yet
  noticed the closed socket, the message leaves the list and never reaches kombu's unacked hash
  or the worker's in-flight set: no reaper and no visibility timeout can bring it back. Measured
  by bench/soak.py: 1-2 requests per ~4 worker kills, published 13-33 ms after the SIGKILL. The
  reaper calls `audit_after_reap` for the dead worker's pools once it has reaped it (by then the
  dead client's BRPOP has long timed out, so nothing more can be taken).

Either way, under a lock, every open request that is PENDING, held by no worker (in no in-flight
set: a worker that holds one hands it back itself, workers/runtime.py reclaim_orphans, and a dead
worker's are the reaper's), old enough (created before the restart, or `MIN_AGE_S` before the
reap: a submit between its record and its publish is not an orphan), and whose id is in no queue
of its pool, is moved to its next dispatch and published again. A copy in kombu's unacked hash
does not count: a message there whose request no worker holds was fetched by a consumer that died
(or lost its connection) before Celery reported it, and would come back only after the
visibility timeout (2,220 s by default). A copy of the old message that turns up later, from
there or anywhere, is an older dispatch and is dropped unexecuted, so a needless republish (a live
consumer a millisecond from reporting its fetch) costs one delivery, never a second run.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from app.state import keys
from app.state.store import RequestStore

log = logging.getLogger("vigil.message_audit")

AUDIT_LOCK = "message_audit"
RESTART_REASON = "redis_unavailable: its message was lost in a Redis restart"
REAP_REASON = "worker_lost: its message was taken by a worker that died"
ORPHAN_REASON = ("redis_unavailable: no queue, worker or unacked entry held its message (its "
                 "producer stopped before publishing it, or it was lost)")
# A record this young may be a submit between its record and its publish: not an orphan yet.
MIN_AGE_S = 5.0

Republish = Callable[[str, dict, int], None]


def queued_ids(store: RequestStore, pools: list[str] | None = None) -> set[str]:
    """Request ids with a message waiting in a queue of `pools` (every pool queue if None)."""
    queues = (store.broker.all_pool_queues() if pools is None
              else [q for p in pools for q in store.pool_queues(p)])
    return store.broker.queued_ids(queues)


def republish_lost(store: RequestStore, now: float, republish: Republish, *,
                   created_before: float, reason: str, pools: list[str] | None = None,
                   skip: set[str] = frozenset()) -> int:
    """Publish again every open request (of `pools`, or all) that is PENDING, created before
    `created_before`, held by no worker, has no message in its pool's queues and is not in
    `skip` (just published by the caller); returns how many (module docstring). The caller holds
    AUDIT_LOCK."""
    # Open ids, then the queues, then the in-flight sets: a message moves from a queue to a
    # worker's set, so one that moves during the reads is seen in one or the other, except in
    # the instant between its fetch and Celery's report of it (a needless republish there costs
    # a stale delivery, never a second run).
    open_ids = store.open_ids(pools)
    queued = queued_ids(store, pools)
    holding = store.held_ids()
    published = 0
    for rid in open_ids:
        if rid in holding or rid in queued or rid in skip:
            continue
        rec = store.get(rid)
        if (not rec or rec.get("status") != keys.PENDING
                or float(rec.get("created_at") or now) >= created_before):
            continue
        dispatch = int(rec.get("dispatch", 0)) + 1
        if not store.requeue(rid, "", dispatch, now=now, reason=reason):
            continue
        republish(rid, rec, dispatch)
        published += 1
    return published


def audit_after_restart(store: RequestStore, now: float, republish: Republish, *,
                        lock_ttl_s: float = 120.0) -> int | None:
    """Republish the orphans a Redis restart left: requests created before Redis started
    (`started` is to the second: one submitted in the first second after the restart may be
    published twice, which costs a delivery, never a second run). Returns how many were
    published again; None when Redis did not restart since the last audit, or another audit
    runs. The run_id is recorded only after a complete audit, so one that fails is redone."""
    run_id, started = store.redis_run()
    seen = store.audited_run_id()
    if seen == run_id:
        return None
    with store.locked(AUDIT_LOCK, lock_ttl_s) as held:
        if not held:
            return None
        timer = time.monotonic()
        published = republish_lost(store, now, republish, created_before=started,
                                   reason=RESTART_REASON)
        store.mark_audited(run_id)
    if published or seen is not None:
        log.warning("Redis restarted (run_id %s): %d open request(s) had lost their message and "
                    "were published again (%.1f s)", run_id[:12], published,
                    time.monotonic() - timer)
    return published


def audit_after_reap(store: RequestStore, now: float, republish: Republish, pools: list[str],
                     *, requeued: set[str] = frozenset(), lock_ttl_s: float = 120.0
                     ) -> int | None:
    """Republish the messages a reaped worker's consumer may have taken as it died, in `pools`
    (those it consumed): requests created more than MIN_AGE_S ago, less those the reap itself
    just published again (`requeued`). Returns how many; None when another audit runs (the next
    reap's audit, or a restart's, covers them)."""
    if not pools:
        return 0
    with store.locked(AUDIT_LOCK, lock_ttl_s) as held:
        if not held:
            return None
        published = republish_lost(store, now, republish, created_before=now - MIN_AGE_S,
                                   reason=REAP_REASON, pools=pools, skip=requeued)
    if published:
        log.warning("%d request(s) of pool(s) %s had lost their message to a dead worker's "
                    "consumer and were published again", published, ", ".join(pools))
    return published


def audit_orphans(store: RequestStore, now: float, republish: Republish, *,
                  lock_ttl_s: float = 120.0) -> int | None:
    """Republish every open request, of any pool, created more than MIN_AGE_S ago, that no
    queue, worker or unacked entry holds: a producer that stopped between writing the record
    and publishing its message (and is never rerun) leaves one, which would otherwise wait for
    its deadline. Beat runs it every VIGIL_MESSAGE_AUDIT_INTERVAL. Returns how many; None when
    another audit runs."""
    with store.locked(AUDIT_LOCK, lock_ttl_s) as held:
        if not held:
            return None
        published = republish_lost(store, now, republish, created_before=now - MIN_AGE_S,
                                   reason=ORPHAN_REASON)
    if published:
        log.warning("%d open request(s) had no message anywhere and were published again",
                    published)
    return published
