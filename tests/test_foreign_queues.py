"""Redis tier: vigil.generate messages on another Celery app's default queue are moved to
vigil.housekeeping, and nothing else there is touched (app/fleet/foreign_queues.py). The
messages are published by a real, bare Celery app (as another codebase's producer would) on
database 1, flushed per test."""
from __future__ import annotations

import json

import pytest
from celery import Celery

from app.fleet.foreign_queues import move_foreign_messages
from app.state import broker
from app.state.conn import connect
from app.state.queues import HOUSEKEEPING_QUEUE
from app.state.store import RequestStore

pytestmark = pytest.mark.redis


@pytest.fixture()
def other_app(redis_db1_url):
    """Another codebase's Celery app: no Vigil import, Celery's defaults (queue `celery`)."""
    app = Celery("other", broker=redis_db1_url, backend=redis_db1_url)
    yield app
    app.close()


def ids(client, key: str) -> list[str | None]:
    """Task ids in a list, in delivery order (rightmost first); None for a non-message."""
    return [broker.message_id(raw) for raw in reversed(client.lrange(key, 0, -1))]


def test_only_vigil_messages_leave_the_default_queue_and_the_rest_keep_their_order(
        settings, other_app):
    """Given Celery's default queue holding another app's tasks, two vigil.generate messages
    sent without a queue between them (one of them prioritised, so in kombu's priority
    sub-list) and a message that is not JSON, when the scan runs, then exactly the two Vigil
    messages are in vigil.housekeeping, byte for byte, and every other entry is still in
    `celery`, in its order; a second scan moves nothing."""
    client = connect(settings)
    store = RequestStore(client, settings.result_ttl)
    other = [other_app.send_task("other.add", kwargs={"x": i}).id for i in range(3)]
    v1 = other_app.send_task("vigil.generate", kwargs={"model": "tiny-llama", "prompt": "hi"})
    other += [other_app.send_task("other.add", kwargs={"x": 9}).id]
    v2 = other_app.send_task("vigil.generate", kwargs={"model": "tiny-llama", "prompt": "yo"},
                             priority=5)
    client.lpush("celery", b"not json at all, vigil.generate")
    before = client.lrange("celery", 0, -1)
    prio_key = [k for k in broker.queue_lists("celery")[1:] if client.llen(k)]
    assert len(prio_key) == 1  # kombu put the prioritised one in a sub-list

    assert move_foreign_messages(store, ["celery"]) == 2
    assert sorted(ids(client, HOUSEKEEPING_QUEUE)) == sorted([v1.id, v2.id])
    assert ids(client, "celery") == other + [None]  # everything else, in order
    after = client.lrange("celery", 0, -1)
    assert after == [raw for raw in before if broker.task_name(raw) != "vigil.generate"]
    assert client.llen(prio_key[0]) == 0
    moved = {json.loads(raw)["headers"]["id"]: raw for raw in
             client.lrange(HOUSEKEEPING_QUEUE, 0, -1)}
    assert json.loads(moved[v1.id])["headers"]["task"] == "vigil.generate"
    assert move_foreign_messages(store, ["celery"]) == 0


def test_a_message_taken_meanwhile_is_not_moved(settings, other_app):
    """The move is one step that checks the message is still there: one that a consumer (or a
    second scan) took after it was read is not pushed to vigil.housekeeping."""
    client = connect(settings)
    other_app.send_task("vigil.generate", kwargs={"model": "tiny-llama", "prompt": "hi"})
    [raw] = broker.messages_of_task(client, "celery", "vigil.generate", limit=100)
    assert client.rpop("celery") == raw  # a consumer took it
    store = RequestStore(client, settings.result_ttl)
    assert not store.broker.move_message("celery", HOUSEKEEPING_QUEUE, raw)
    assert client.llen(HOUSEKEEPING_QUEUE) == 0


def test_the_scan_reads_in_chunks_up_to_its_limit(settings, other_app):
    client = connect(settings)
    for i in range(25):
        other_app.send_task("other.add", kwargs={"x": i})
    other_app.send_task("vigil.generate", kwargs={"model": "tiny-llama", "prompt": "hi"})
    assert len(broker.messages_of_task(client, "celery", "vigil.generate", limit=100,
                                       chunk=4)) == 1
    # LPUSH puts the newest at index 0: within a limit of 1 entry it is still found...
    assert len(broker.messages_of_task(client, "celery", "vigil.generate", limit=1)) == 1
    # ...and behind 25 others it is not, within 10.
    client.rpush("celery", client.lpop("celery"))  # LRANGE reads from the left: 25 ahead
    assert broker.messages_of_task(client, "celery", "vigil.generate", limit=10, chunk=4) == []
