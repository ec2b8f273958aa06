"""vigil.generate messages on other Celery apps' queues: found and moved to Vigil's.

A producer in another codebase (a bare `Celery(broker=..., backend=...)`, which cannot import
tasks/) that calls `send_task("vigil.generate", kwargs=...)` without `queue=`, or `celery -A other
call vigil.generate`, publishes to its app's default queue, Celery's `celery`, which no Vigil
process consumes. Beat's `vigil.foreign_queues` task runs `move_foreign_messages` every
VIGIL_FOREIGN_QUEUE_SCAN_INTERVAL (2 s): it reads each queue of VIGIL_FOREIGN_QUEUES (and kombu's
priority sub-lists of it) in chunks, and moves every vigil.generate message, byte for byte and in
one Redis step, to vigil.housekeeping. There `vigil.generate` forwards it to its pool's queue
after validating it (workers/service.py, `forward`; an invalid one ends with its typed error in
the result backend, where the producer's `r.get()` reads it). Nothing else in those queues is
touched: another app's messages stay where they are, in their order. A worker that dies
holding a moved message gives it back to the queue it was published to (kombu restores by its
routing key), and the next scan moves it again.
"""
from __future__ import annotations

import logging

from app.state import broker
from app.state.queues import HOUSEKEEPING_QUEUE
from app.state.store import RequestStore
from app.task_names import GENERATE

log = logging.getLogger("vigil.housekeeping")

# Entries of one queue list read per scan: a foreign queue with a deep backlog of its own costs
# a bounded read each pass (a message of ours behind that many is found once the list drains).
SCAN_LIMIT = 10_000


def move_foreign_messages(store: RequestStore, queues: list[str],
                          limit: int = SCAN_LIMIT) -> int:
    """Move the vigil.generate messages found in `queues` to vigil.housekeeping (module
    docstring); returns how many moved. Raises TransientError(redis_unavailable) when Redis
    cannot be reached."""
    moved = 0
    for queue in queues:
        for key in broker.queue_lists(queue):
            for raw in store.broker.messages_of_task(key, GENERATE, limit=limit):
                if store.broker.move_message(key, HOUSEKEEPING_QUEUE, raw):
                    moved += 1
    if moved:
        log.warning("moved %d vigil.generate message(s) sent without a Vigil queue from %s to "
                    "%s, to be forwarded to their pools (send with queue=, or through "
                    "tasks.inference.generate, to skip this detour)", moved, ", ".join(queues),
                    HOUSEKEEPING_QUEUE)
    return moved
