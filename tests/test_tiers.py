"""Unit and Redis tiers: priority tiers (app/requests/tiers.py) and the worker's intake
(app/state/intake.py): every message of a request is published at its tier's priority, a
worker's consumer pops interactive before default before bulk and jobs in turn within a tier,
keeps the slots reserved for interactive requests free of lower tiers, and gives bulk work its
floor. Through kombu's own Connection, Producer and Consumer on Vigil's transport, on a real
Redis (database 1)."""
from __future__ import annotations

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

from app.celery_app import create_app
from app.errors import RequestError
from app.requests.models import get_registry
from app.requests.submit import submit_request
from app.requests.tiers import (BULK, DEFAULT, INTERACTIVE, broker_priority, intake_limits_for,
                                tier_of_celery_priority)
from app.state import broker
from app.state.intake import IntakeLimits, brpop_keys, limit_intake

TRANSPORT = "app.state.transport:VigilRedisTransport"
JOBS = ("vigil.test.tier.a", "vigil.test.tier.b")


def test_a_messages_own_priority_picks_the_tier_of_a_request_sent_around_the_producer():
    """`app.send_task("vigil.generate", priority=9)` reaches the worker with no `priority`
    field: the message's Celery priority (its delivery info) picks the tier, as
    `apply_async(priority=9)` would at submit; the field, when given, wins. 0 picks none:
    kombu's Redis transport gives 0 to every message that names no priority (read from its
    own `prepare_message`), so a plain `send_task` stays default; anything but an int 1-9
    leaves the default tier."""
    from kombu.transport.virtual import Channel

    from app.requests.admit import with_delivery_priority

    kw = {"model": "tiny-llama", "prompt": "p"}
    assert with_delivery_priority(kw, {"priority": 1})["priority"] == INTERACTIVE
    assert with_delivery_priority(kw, {"priority": 9})["priority"] == BULK
    assert with_delivery_priority(kw, {"priority": 3})["priority"] == DEFAULT
    assert with_delivery_priority({**kw, "priority": BULK}, {"priority": 1})["priority"] == BULK
    unnamed = Channel.prepare_message(Channel.__new__(Channel), "body")["properties"]["priority"]
    for info in (None, {}, {"priority": None}, {"priority": unnamed}, {"priority": 255},
                 {"priority": "1"}):
        assert "priority" not in with_delivery_priority(kw, info)


def test_celery_priorities_map_onto_tiers_and_tiers_onto_kombus_steps():
    assert [tier_of_celery_priority(p) for p in range(10)] == \
        [INTERACTIVE] * 3 + [DEFAULT] * 3 + [BULK] * 4
    assert [broker_priority(t) for t in (INTERACTIVE, DEFAULT, BULK, None)] == [0, 3, 9, 3]
    limits = intake_limits_for(128, 8, 0.1)
    assert (limits.lower_cap, limits.floor_every) == (120, 10)
    assert intake_limits_for(4, 8, 0).lower_cap == 1 and intake_limits_for(4, 8, 0).floor_every == 0


def test_the_pop_order_is_tier_major_then_queues_in_turn_and_the_cap_leaves_step_zero_only():
    def of(q, step):
        return q if step == 0 else f"{q}:{step}"

    steps = [0, 3, 6, 9]
    assert brpop_keys(["a", "b"], steps, of, 0, None) == \
        ["a", "b", "a:3", "b:3", "a:6", "b:6", "a:9", "b:9"]
    capped = IntakeLimits(lower_cap=2)
    assert brpop_keys(["a", "b"], steps, of, 2, capped) == ["a", "b", "a:3", "b:3"]
    assert brpop_keys(["a", "b"], steps, of, 1, capped)[-1] == "b:9"
    floor = IntakeLimits(lower_cap=100, floor_every=3)
    orders = [brpop_keys(["a"], steps, of, 0, floor)[0] for _ in range(9)]
    assert orders.count("a:9") == 3 and orders.count("a") == 6  # one pop in 3: lowest first


@pytest.fixture()
def conn(redis_db1_url):
    with Connection(redis_db1_url, transport=TRANSPORT) as c:
        yield c
    limit_intake(None)


def publish(conn, queue: str, rid: str, tier: str, carries: list[str] | None = None) -> None:
    """Publish one message at `tier`'s priority: a vigil.generate of request `rid`, or with
    `carries` a vigil.generate_many naming those requests in its `vigil_ids` header."""
    q = Queue(queue, Exchange(queue, type="direct"), routing_key=queue)
    headers = {"task": "vigil.generate", "id": rid}
    if carries is not None:
        headers = {"task": "vigil.generate_many", "id": rid, "vigil_ids": carries}
    with conn.channel() as ch:
        Producer(ch).publish({"x": 1}, exchange=q.exchange, routing_key=queue, declare=[q],
                             serializer="json", headers=headers,
                             priority=broker_priority(tier))


def pop(conn, n: int, *, ack: bool = True, timeout: float = 3.0) -> list[str]:
    """The ids of the next `n` messages the consumer takes (fewer when none comes in time)."""
    queues = [Queue(q, Exchange(q, type="direct"), routing_key=q) for q in JOBS]
    got = []

    def callback(body, message):
        got.append(message.headers["id"])
        if ack:
            message.ack()

    with Consumer(conn, queues, callbacks=[callback], accept=["json"], prefetch_count=1):
        while len(got) < n:
            try:
                conn.drain_events(timeout=timeout)
            except TimeoutError:
                break
    return got


@pytest.mark.redis
def test_a_worker_takes_interactive_then_default_then_bulk_and_jobs_in_turn(conn):
    limit_intake(IntakeLimits(lower_cap=100))
    for job in JOBS:
        publish(conn, job, f"{job}-bulk", BULK)
        publish(conn, job, f"{job}-default", DEFAULT)
    publish(conn, JOBS[1], "b-interactive", INTERACTIVE)
    order = pop(conn, 5)
    assert order[0] == "b-interactive"
    assert sorted(order[1:3]) == sorted(f"{j}-default" for j in JOBS)
    assert sorted(order[3:]) == sorted(f"{j}-bulk" for j in JOBS)


@pytest.mark.redis
def test_at_the_bulk_cap_only_higher_tiers_are_taken(conn):
    """Given a worker whose cap for bulk work is 1, holding one bulk message (not acked),
    then a queued bulk message is not taken while an interactive one is."""
    limit_intake(IntakeLimits(lower_cap=1))
    publish(conn, JOBS[0], "bulk-1", BULK)
    publish(conn, JOBS[0], "bulk-2", BULK)
    queues = [Queue(q, Exchange(q, type="direct"), routing_key=q) for q in JOBS]
    got = []
    with Consumer(conn, queues, callbacks=[lambda b, m: got.append(m)], accept=["json"],
                  prefetch_count=10):
        while not got:
            conn.drain_events(timeout=3)
        assert [m.headers["id"] for m in got] == ["bulk-1"]  # held, not acked
        publish(conn, JOBS[1], "interactive-1", INTERACTIVE)
        while len(got) < 2:
            conn.drain_events(timeout=3)
        assert got[1].headers["id"] == "interactive-1"
        with pytest.raises(TimeoutError):  # bulk-2 waits while bulk-1 is held
            conn.drain_events(timeout=2.5)
        got[0].ack()
        while len(got) < 3:
            conn.drain_events(timeout=3)
        assert got[2].headers["id"] == "bulk-2"


@pytest.mark.redis
def test_the_bulk_cap_counts_the_requests_a_message_carries(conn):
    """Given a worker whose cap for bulk work is 2 requests, holding one bulk message of many
    that carries 2 requests (not acked), then a queued single bulk message is not taken while
    an interactive one is: the cap counts requests, not messages (a batch object's window
    arrives as such messages)."""
    limit_intake(IntakeLimits(lower_cap=2))
    publish(conn, JOBS[0], "many-1", BULK, carries=["r1", "r2"])
    publish(conn, JOBS[0], "bulk-1", BULK)
    queues = [Queue(q, Exchange(q, type="direct"), routing_key=q) for q in JOBS]
    got = []
    with Consumer(conn, queues, callbacks=[lambda b, m: got.append(m)], accept=["json"],
                  prefetch_count=10):
        while not got:
            conn.drain_events(timeout=3)
        assert [m.headers["id"] for m in got] == ["many-1"]
        publish(conn, JOBS[1], "interactive-1", INTERACTIVE)
        while len(got) < 2:
            conn.drain_events(timeout=3)
        assert got[1].headers["id"] == "interactive-1"
        with pytest.raises(TimeoutError):  # 2 bulk requests held: bulk-1 waits
            conn.drain_events(timeout=2.5)
        got[0].ack()
        while len(got) < 3:
            conn.drain_events(timeout=3)
        assert got[2].headers["id"] == "bulk-1"


@pytest.mark.redis
def test_a_request_is_published_at_its_tiers_list_and_celerys_priority_picks_a_tier(settings):
    """`generate.delay(priority="interactive")` lands in the queue's own list; the default tier
    and `apply_async(priority=7)` land in their priority lists; a bad priority is refused."""
    app = create_app(settings)

    def submit(options=None, **kw):
        return submit_request({"model": "tiny-llama", "prompt": "p", **kw}, settings=settings,
                              registry=get_registry(), store=app.vigil_store,
                              ports=app.vigil_ports, **(options or {}))

    r = app.vigil_store.raw
    q = "vigil.pool.tiny-llama"
    submit(priority=INTERACTIVE)
    submit()
    submit(options={"priority": 7})
    lists = broker.queue_lists(q)
    assert [r.llen(k) for k in lists] == [1, 1, 0, 1]  # step 0, 3, 6, 9
    rec = app.vigil_store.get(broker.next_ids(r, [q])[0])
    assert '"priority": "interactive"' in rec["request"]
    with pytest.raises(RequestError, match="^invalid_request: priority=12"):
        submit(options={"priority": 12})
    with pytest.raises(RequestError, match="priority"):
        submit(priority="urgent")
