"""Redis tier: Vigil's kombu transport (app/state/transport.py) on a real Redis server, through
kombu's own Connection, Producer and Consumer (the objects Celery's worker and producers use).

What it must keep of kombu's: a delivered message is noted in kombu's `unacked` hash and index
until acked. What it adds: the holder's set written in the same script call, the member listed
in `arriving()` until the consumer's callback returned, acks sent from a thread of their own in
batches (and sent before the channel closes), one client per connection pool.
"""
from __future__ import annotations

import json
import logging
import socket
import threading

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

from app.state import keys
from app.state.acker import Acker
from app.state.store import RequestStore
from app.state.transport import arriving, hold_deliveries
from tests.redis_servers import PrivateRedis
from tests.unit_helpers import wait_until

pytestmark = pytest.mark.redis

TRANSPORT = "app.state.transport:VigilRedisTransport"
QUEUE = "vigil.test.transport"


@pytest.fixture()
def conn(redis_db1_url):
    with Connection(redis_db1_url, transport=TRANSPORT) as c:
        yield c
    hold_deliveries(None)


def publish(conn, task: str, rid: str) -> None:
    q = Queue(QUEUE, Exchange(QUEUE, type="direct"), routing_key=QUEUE)
    with conn.channel() as ch:
        Producer(ch).publish({"x": 1}, exchange=q.exchange, routing_key=QUEUE, declare=[q],
                             serializer="json", headers={"task": task, "id": rid})


def consume_one(conn, on_message) -> None:
    q = Queue(QUEUE, Exchange(QUEUE, type="direct"), routing_key=QUEUE)
    got = []

    def callback(body, message):
        got.append(message)
        on_message(message)

    with Consumer(conn, [q], callbacks=[callback], accept=["json"]):
        while not got:
            conn.drain_events(timeout=5)


def test_a_held_delivery_is_noted_with_its_holder_and_arrives_once_handed_over(conn):
    """Given a holder for generate messages of instance 7, when the consumer takes one, then
    inside its callback the id is already in the instance's in-flight set, the message in
    kombu's unacked hash and index, and the id listed as arriving; once the callback returned
    it is no longer arriving. Another task's message is noted as kombu notes it, held by no
    one."""
    hold_deliveries(RequestStore.delivery_holder(7, "vigil.generate"))
    r = conn.default_channel.client
    seen = {}

    def inside(message):
        seen["inflight"] = r.smembers(keys.inflight(7))
        seen["unacked"] = r.hkeys("unacked")
        seen["index"] = r.zrange("unacked_index", 0, -1)
        seen["arriving"] = arriving()
        seen["tag"] = message.delivery_tag
        message.ack()

    publish(conn, "vigil.generate", "r1")
    consume_one(conn, inside)
    assert seen["inflight"] == {b"r1"} and seen["arriving"] == {"r1"}
    assert seen["unacked"] == [seen["tag"].encode()] == seen["index"]
    assert arriving() == frozenset()

    publish(conn, "other.task", "r2")
    consume_one(conn, inside)
    assert seen["inflight"] == {b"r1"} and seen["arriving"] == frozenset()
    assert seen["unacked"] == [seen["tag"].encode()]
    # Both acked: the acker empties kombu's unacked hash and index.
    wait_until(lambda: not r.hlen("unacked") and not r.zcard("unacked_index"))


def test_a_message_kombu_puts_back_for_want_of_a_consumer_is_no_longer_held(conn, caplog):
    """Given a holder, when kombu takes a message for a queue whose consumer was cancelled in
    the same instant (its own `_deliver` with no callback for the queue: "Requeuing
    undeliverable message"), then the message is back on its queue, out of kombu's unacked
    hash, and its id is neither in the holder's set nor arriving (before: both, for good, and
    the worker's in-flight set kept a request it did not have)."""
    hold_deliveries(RequestStore.delivery_holder(7, "vigil.generate"))
    r = conn.default_channel.client
    publish(conn, "vigil.generate", "r-put-back")
    raw = r.rpop(QUEUE)  # what the worker's BRPOP took, as the consumer is cancelled
    with caplog.at_level(logging.WARNING):
        conn.transport._deliver(json.loads(raw), QUEUE)
    assert "undeliverable" in caplog.text
    assert r.llen(QUEUE) == 1 and not r.hlen("unacked") and not r.zcard("unacked_index")
    assert r.smembers(keys.inflight(7)) == set()
    assert arriving() == frozenset()
    # The message put back is taken again and handed over as any other.
    consume_one(conn, lambda m: m.ack())
    assert r.smembers(keys.inflight(7)) == {b"r-put-back"} and arriving() == frozenset()


def test_a_failed_note_leaves_nothing_arriving(conn):
    """Given a holder, when noting a delivery fails (Redis refuses the script), then the error
    reaches kombu's caller and the member is not left listed as arriving."""
    hold_deliveries(RequestStore.delivery_holder(7, "vigil.generate"))
    ch = conn.default_channel
    qos = ch.qos

    class Broken:
        headers = {"task": "vigil.generate", "id": "r-broken"}
        delivery_info = {"exchange": "", "routing_key": QUEUE}
        _raw = {"body": ""}

    ch.client.set(keys.inflight(7), "not a set")  # SADD on a string: WRONGTYPE
    with pytest.raises(Exception, match="WRONGTYPE"):
        qos.append(Broken(), "tag-1")
    assert arriving() == frozenset()


def test_queued_acks_are_sent_in_batches_and_before_the_channel_closes(conn, redis_db1_url):
    """Given 300 delivered messages acked while the acker's first send is held up, then the
    rest go in one batch once it returns (two sends in all); and acks queued when the channel
    closes are sent before it closes."""
    r = conn.default_channel.client
    for i in range(300):
        publish(conn, "other.task", f"m{i}")
    messages = []
    q = Queue(QUEUE, Exchange(QUEUE, type="direct"), routing_key=QUEUE)
    with Consumer(conn, [q], callbacks=[lambda body, m: messages.append(m)], accept=["json"]):
        while len(messages) < 300:
            conn.drain_events(timeout=5)
    assert r.hlen("unacked") == 300

    ch = conn.default_channel
    acker = ch._vigil_acker()
    sends, gate = [], threading.Event()
    real = acker._send

    def held_send(tags):
        sends.append(len(tags))
        gate.wait(5)
        real(tags)

    acker._send = held_send
    for m in messages[:200]:
        m.ack()
    wait_until(lambda: sends)  # the first send took what was queued then, and waits
    gate.set()
    wait_until(lambda: sum(sends) == 200)
    assert len(sends) <= 2
    wait_until(lambda: r.hlen("unacked") == 100)

    gate.clear()  # the last 100 are queued behind a held send when the channel closes
    closer = threading.Thread(target=lambda: (
        [m.ack() for m in messages[200:]], ch.close()))
    closer.start()
    wait_until(lambda: sum(sends) > 200)
    gate.set()
    closer.join(10)
    assert not closer.is_alive()
    with Connection(redis_db1_url) as other:
        assert other.default_channel.client.hlen("unacked") == 0


def test_an_acker_that_cannot_send_logs_and_carries_on(caplog):
    """Given an acker whose sends fail, then each failure is logged with what it means, the
    acker keeps sending what comes next, and `stop` sends what is queued first."""
    log = logging.getLogger("vigil.transport")  # as it is in a worker, whatever tests before did
    state = log.disabled, log.level
    log.disabled = False
    log.setLevel(logging.WARNING)
    log.addHandler(caplog.handler)
    sent, fail = [], [True]

    def send(tags):
        if fail[0]:
            raise ConnectionError("Redis went away")
        sent.extend(tags)

    acker = Acker(send)
    acker.ack("t1")
    assert acker.flush(5)
    assert "could not ack 1 message(s)" in caplog.text
    fail[0] = False
    acker.ack("t2")
    acker.ack("t3")
    acker.stop(5)
    assert sent == ["t2", "t3"]
    acker.ack("t4")  # after stop: sent at once, by the caller
    assert sent == ["t2", "t3", "t4"]
    log.removeHandler(caplog.handler)
    log.disabled = state[0]
    log.setLevel(state[1])


def test_a_channel_shares_one_client_per_connection_pool(conn):
    """kombu would build a redis-py client per command; the channel builds one per pool, and a
    new one once kombu replaced its pool (after a lost connection)."""
    ch = conn.default_channel
    first = ch._create_client()
    assert ch._create_client() is first
    ch._pool = None  # what kombu's _disconnect_pools leaves
    second = ch._create_client()
    assert second is not first and second.connection_pool is ch.pool
    assert ch._create_client(asynchronous=True) is not second  # the event loop's own


def test_a_channel_left_without_its_connection_fails_like_a_lost_connection(conn,
                                                                           redis_db1_url,
                                                                           caplog):
    """The guard of the Redis restart row (docs/failure-modes.md), provoked on purpose.

    Given a channel holding a delivery whose task still runs (an earlier one acked, so its
    acker ran), when its kombu connection is closed under it (the transport's `client` None,
    as kombu's Connection.close leaves it: Celery closes a lost connection before the
    consumer's channel closes and before the running tasks ack), then the channel's close,
    restoring the delivery, and the task's ack afterwards (sent at once: the acker stopped with
    the channel) each fail with redis' ConnectionError, one of kombu's connection errors, which
    Celery ignores on a close and logs on an ack (kombu's `ignore_errors`, `ack_log_error`).
    Never AttributeError
    (`None.hostname` in kombu 5.7's `_connparams`), which Celery takes for an "Unrecoverable
    error" and exits on. The delivery stays in kombu's unacked hash, to come back after the
    visibility timeout."""
    publish(conn, "other.task", "done")
    publish(conn, "other.task", "running")
    messages = []
    q = Queue(QUEUE, Exchange(QUEUE, type="direct"), routing_key=QUEUE)
    consumer = Consumer(conn, [q], callbacks=[lambda body, m: messages.append(m)],
                        accept=["json"])
    consumer.consume()
    wait_until(lambda: conn.drain_events(timeout=5) or len(messages) == 2)
    errors = conn.connection_errors  # what Celery's consumer keeps from its connection
    done, running = messages
    done.ack()
    witness = Connection(redis_db1_url).default_channel.client
    wait_until(lambda: witness.hkeys("unacked") == [running.delivery_tag.encode()])

    ch = running.channel
    ch.connection.client = None  # kombu's Connection close (`_do_close_transport`)
    try:
        # Celery closes a consumer's channel as `ignore_errors(connection, channel.close)`
        # (celery/bootsteps.py): a connection error is ignored, anything else escapes.
        with pytest.raises(errors):
            ch.close()  # restores its unacked delivery: through `_connparams`, with no client
        with caplog.at_level(logging.ERROR, logger="test.acks"):
            running.ack_log_error(logging.getLogger("test.acks"), errors)  # must not raise
    finally:
        ch.connection.client = conn  # for the fixture's own close
    assert "Couldn't ack" in caplog.text
    assert "the broker connection of this channel was closed" in caplog.text
    assert witness.hkeys("unacked") == [running.delivery_tag.encode()]


def test_a_worker_does_not_hand_back_a_request_whose_message_is_still_arriving(
        conn, settings, monkeypatch):
    """Given a worker whose consumer is taking a request's message (its in-flight set names the
    request, Celery does not have it yet), when Redis comes back at that moment and the worker
    hands back what its set names but it does not hold, then that request is not handed back:
    it is arriving. Once the message was handed over and dropped, it is."""
    from tests.unit_helpers import RecordingPorts
    from tests.test_store_and_service import create
    from workers.runtime import WorkerRuntime

    ports = RecordingPorts()
    published = ports.sent
    rt = WorkerRuntime(settings, "w-test", engine="instant", guard=False, ports=ports)
    hold_deliveries(rt.store.delivery_holder(rt.instance_id, "vigil.generate"))
    create(rt.store, "r-arriving")
    reclaimed = []
    publish(conn, "vigil.generate", "r-arriving")
    consume_one(conn, lambda message: reclaimed.append(rt.held.reclaim_orphans()))
    assert reclaimed == [0] and published == []
    # The message was handed over and Celery never took it in (this test's consumer is not
    # Celery's): now it is an orphan of this worker's, handed back.
    assert rt.held.reclaim_orphans() == 1 and published == [("r-arriving", 1)]


# A lost connection's read raises at once; the bound leaves room for a loaded machine.
LOST_PUBSUB_BOUND_S = 10.0


def _drained(conn) -> bool:
    try:
        conn.drain_events(timeout=0.5)
    except socket.timeout:
        pass
    return False


def test_a_lost_pubsub_connection_is_raised_to_kombu_even_when_redis_is_already_back(settings):
    """The Redis restart row's pub/sub hang (docs/failure-modes.md), provoked on purpose.

    Given a kombu connection with Vigil's broker options (app/celery_app.py) consuming a fanout
    queue (Celery's pidbox and events: kombu's pub/sub `LISTEN` connection), when Redis
    restarts and is back before the event loop reads the closed socket, then that read raises
    one of kombu's connection errors within the bound, for Celery to reconnect and subscribe
    again; and the channel, read again, subscribes a connection it watches. Never a read
    retried under kombu: redis-py retried it on a fresh connection that kombu never subscribed
    again (it took the connection outside redis-py's `execute_command`, so no re-subscribe
    callback) and waited there with no timeout (redis-py 8 reads pub/sub without the socket
    timeout): the worker's consumer thread blocked for good and no queue was polled again
    (seen twice in tests/test_redis_restart_e2e.py)."""
    from app.celery_app import celery_config
    from app.requests.models import get_registry

    server = PrivateRedis().start()
    try:
        options = celery_config(settings, get_registry())["broker_transport_options"]
        with Connection(server.url(), transport=TRANSPORT, transport_options=options) as conn:
            fanout = Queue("vigil.test.fanout", Exchange("vigil.test.fanout", type="fanout"))
            got = []
            Consumer(conn, [fanout], callbacks=[lambda body, m: got.append(body)],
                     accept=["json"]).consume()
            _drained(conn)  # registers and subscribes the LISTEN connection
            with Connection(server.url()) as other:
                Producer(other).publish({"n": 1}, exchange=fanout.exchange,
                                        declare=[fanout.exchange], serializer="json")
            wait_until(lambda: _drained(conn) or got == [{"n": 1}])

            server.kill()
            server.start()  # back before the loop reads the socket the restart closed
            outcome: list = []

            def read() -> None:
                try:
                    conn.drain_events(timeout=2)
                    outcome.append("drained")
                except Exception as e:  # noqa: BLE001 - what the read raised is the answer
                    outcome.append(e)

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            reader.join(LOST_PUBSUB_BOUND_S)
            assert outcome, (f"the pub/sub read still blocked {LOST_PUBSUB_BOUND_S} s after "
                             f"Redis came back: reconnected under kombu, never subscribed again")
            assert isinstance(outcome[0], conn.connection_errors), outcome

            # The same channel read again (as a caller that keeps its kombu connection would)
            # watches and subscribes a fresh connection: the next fanout message arrives.
            _drained(conn)
            with Connection(server.url()) as other:
                Producer(other).publish({"n": 2}, exchange=fanout.exchange,
                                        declare=[fanout.exchange], serializer="json")
            wait_until(lambda: _drained(conn) or got == [{"n": 1}, {"n": 2}])
    finally:
        server.stop()

