"""Vigil's kombu transport: kombu's Redis (and Sentinel) transport with these changes (the one
place kombu's channel is changed).

- **One client per connection pool.** kombu's Redis channel builds a new redis-py client object
  for every command it sends outside its event loop (`Channel.conn_or_acquire`): the worker's
  note of each delivered message, each ack, each publish. A redis-py client is cheap to share
  (it takes a connection from its pool per command, thread-safe) but not cheap to build:
  redis-py 8 fills a dict of response callbacks in every `Redis.__init__`, which was 7% of an
  instant-engine worker's busy time (py-spy, docs/performance.md, "Per-request overhead"). Here
  each channel builds that client once per connection pool and shares it; a new pool (kombu
  drops its pools when the connection is lost) gets a new client.
- **Holding a delivery is part of taking it.** A worker registers a holder (`hold_deliveries`):
  for each message its channels take delivery of, the holder names the set that records who holds
  it (a Vigil worker: `vigil:inflight:{instance}`, app/state/keys.py), and the SADD goes in the
  same script call as kombu's own note of the delivery (its `unacked` hash and index). So a
  message a worker took is never in kombu's `unacked` without its holder recorded, and it costs
  no round trip of its own.
- **Acks off the consumer's thread.** Celery runs every ack on the consumer's event loop, the
  thread that also takes every message in; each was a blocking round trip there. Here the loop
  queues the tag and the channel's `Acker` thread sends what is queued, many tags per script
  call (app/state/acker.py: what a lost ack costs).
- **A script call instead of a MULTI pipeline** for the note of a delivery and for the acks: the
  same writes, as atomic, one command each way instead of four or five (~20 us less client CPU
  per call on these machines). Until Celery has made the message a request of its own (the consumer's
  callback returned), its member is listed in `arriving()`: a worker comparing the set with what
  it runs reads that first (workers/runtime.py, `reclaim_orphans`).

- **The tiers' intake.** A worker's BRPOP names the priority lists in the tiers' order within
  its intake limits: slots reserved for interactive requests, and a floor for bulk work
  (app/state/intake.py).
- **Guards** against a queue entry that is not a message envelope, and against a channel whose
  connection was closed (`_brpop_read`, `_connparams`).
- **No retry inside the event loop's reads.** Its BRPOP and pub/sub connections give a lost
  connection to kombu instead of reconnecting under it (`EVENT_LOOP_NO_RETRY`).

Selected by Celery's `broker_transport` (app/celery_app.py, `transport_for`): the URL keeps its
own scheme, so everything that reads `redis://` / `sentinel://` URLs reads them unchanged.
kombu's `global_keyprefix` is not used by Vigil; a holder's key is written as given.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import redis
from kombu.transport import redis as kredis
from kombu.transport import virtual
from kombu.utils.json import dumps
from redis.backoff import NoBackoff
from redis.retry import Retry

from app.state.acker import Acker
from app.state.intake import brpop_keys, held_capped, intake_limits
from app.state.lua_deliveries import ACK_DELIVERIES, NOTE_DELIVERY

log = logging.getLogger("vigil.transport")

# How long closing a channel waits for its queued acks to be sent.
ACK_FLUSH_TIMEOUT_S = 5.0
# The event loop's connections (its BRPOP and its pub/sub LISTEN) without redis-py's retry,
# whatever the broker's `retry_on_timeout`. With it, a pub/sub read that met the socket a Redis
# restart closed reconnected inside redis-py and read again, with no timeout (redis-py 8 reads
# pub/sub blocking), on a connection nobody had subscribed again: kombu takes that connection
# outside redis-py's `execute_command`, so redis-py's re-subscribe callback is never registered.
# Whenever Redis was back before the loop read the closed socket, the worker's consumer thread
# waited there for good and no queue was polled again. Raised instead, the loss reaches kombu
# and Celery, which reconnect and subscribe again. (redis-py still reconnects once before it
# raises: `_receive_one` closes that connection again.)
EVENT_LOOP_NO_RETRY = {"retry_on_timeout": False, "retry": Retry(NoBackoff(), 0)}

# Given a delivered message's headers, the (set key, member or members) this process holds it
# under, or None: set by `hold_deliveries`, read on every delivery.
Holder = Callable[[dict], "tuple[str, str | tuple[str, ...]] | None"]
_holder: Holder | None = None
# Members noted as held whose message Celery has not yet taken in (see `arriving`), with how
# many of their messages are on the way (a duplicate delivery can be).
_arriving: dict[str, int] = {}
_arriving_lock = threading.Lock()


def hold_deliveries(holder: Holder | None) -> None:
    """From now on, every message this process's channels take delivery of is offered to
    `holder(headers)`; when it answers (key, member), `SADD key member` is written in the same
    script call as kombu's note of the delivery. None stops it."""
    global _holder
    _holder = holder


def arriving() -> frozenset[str]:
    """Members held (written to their set) whose message the consumer has not yet handed over:
    the message is between kombu's note of the delivery and the end of the consumer's callback
    (where Celery lists it as reserved, scheduled or active)."""
    with _arriving_lock:
        return frozenset(_arriving)


def _held_as(message) -> "tuple[str, str] | None":
    holder = _holder
    if holder is None:
        return None
    headers = message.headers
    return holder(headers) if isinstance(headers, dict) else None


class HoldingQoS(kredis.QoS):
    """kombu's Redis QoS whose note of a delivery also records its holder, and whose note and
    ack are one script call each instead of a MULTI pipeline (module doc)."""

    def append(self, message, delivery_tag):
        """kombu's note of a delivery (`unacked` hash and index), plus the holder's SADD, in one
        script call."""
        held = _held_as(message)
        delivery = message.delivery_info
        raw = dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
        keys = [self.unacked_index_key, self.unacked_key]
        args = [delivery_tag, time.time(), raw]
        members = _members(held)
        if members:
            keys.append(held[0])
            args.extend(members)
            with _arriving_lock:
                for m in members:
                    _arriving[m] = _arriving.get(m, 0) + 1
        try:
            self.channel._vigil_scripts()[0](keys=keys, args=args)
        except BaseException:
            for m in members:
                _arrived(m)
            raise
        virtual.QoS.append(self, message, delivery_tag)  # kombu's own in-process bookkeeping
        if members:
            message._vigil_held = members
            message._vigil_held_in = held[0]

    def reject(self, delivery_tag, requeue=False):
        """kombu's reject. A message put back on its queue before the consumer handed it over
        is no longer this process's: its members leave the holder's set and `arriving()`.

        kombu does that to a message it took for a queue whose consumer was cancelled in the
        same instant ("Requeuing undeliverable message ... No consumers"): the hold noted with
        it stayed in the set, listed as arriving for good, so the worker never let it go (its
        in-flight set kept a request it did not have, seen in tests/test_jobs_e2e.py when a
        deleted job's queue was cancelled). A task's own Reject(requeue) comes after the
        hand-over; the worker lets that one go itself (workers/delivery_answers.py
        `give_back`)."""
        message = self._delivered.get(delivery_tag)
        super().reject(delivery_tag, requeue=requeue)
        members = getattr(message, "_vigil_held", ())
        if not requeue or not members or getattr(message, "_vigil_handed_over", False):
            return
        try:
            self.channel._vigil_client_and_scripts()[0].srem(message._vigil_held_in, *members)
        except Exception as e:  # not arriving any more: the worker's reclaim hands it back
            log.warning("could not let go of %s put back on its queue: %s", members, e)
        finally:
            for m in members:
                _arrived(m)

    def ack(self, delivery_tag):
        """kombu's ack: done in this process at once, and in Redis (the delivery leaves the
        `unacked` hash and index) by the channel's acker thread, many per script call."""
        virtual.QoS.ack(self, delivery_tag)
        self.channel._vigil_acker().ack(delivery_tag)


def _members(held) -> tuple[str, ...]:
    """The members a holder's answer names: one (a request's message) or several (a message
    carrying many requests)."""
    if held is None:
        return ()
    return (held[1],) if isinstance(held[1], str) else tuple(held[1])


def _arrived(member: str) -> None:
    with _arriving_lock:
        left = _arriving.get(member, 0) - 1
        if left > 0:
            _arriving[member] = left
        else:
            _arriving.pop(member, None)


class _SharedClient:
    """A channel whose synchronous client is built once per connection pool, with the delivery
    scripts registered on it, and whose held deliveries leave `arriving()` once handed over
    (module doc)."""

    _vigil_shared = None  # (client, note script, ack script)
    _vigil_shared_lock = threading.Lock()
    _vigil_acker_of_channel = None

    def _vigil_acker(self) -> Acker:
        """This channel's acker (built on its first ack: a producer never has one)."""
        acker = self._vigil_acker_of_channel
        if acker is None:
            with self._vigil_shared_lock:
                acker = self._vigil_acker_of_channel
                if acker is None:
                    acker = self._vigil_acker_of_channel = Acker(self._send_acks)
        return acker

    def _send_acks(self, tags: list) -> None:
        qos = self.qos
        self._vigil_scripts()[1](keys=[qos.unacked_index_key, qos.unacked_key], args=tags)

    def close(self):
        """kombu's, once the acks queued on this channel were sent (bounded by the socket
        timeout)."""
        acker = self._vigil_acker_of_channel
        if acker is not None:
            acker.stop(ACK_FLUSH_TIMEOUT_S)
        return super().close()

    def _vigil_client_and_scripts(self):
        pool = self.pool  # kombu builds it here the first time, or again after a lost connection
        shared = self._vigil_shared
        if shared is None or shared[0].connection_pool is not pool:
            with self._vigil_shared_lock:
                shared = self._vigil_shared
                if shared is None or shared[0].connection_pool is not pool:
                    client = super()._create_client()
                    shared = self._vigil_shared = (client, client.register_script(NOTE_DELIVERY),
                                                   client.register_script(ACK_DELIVERIES))
        return shared

    def _create_client(self, asynchronous=False):
        """The channel's shared client for its current pool (kombu's own, built fresh, for the
        event loop's asynchronous client, which kombu builds once anyway)."""
        if asynchronous:
            return super()._create_client(asynchronous=True)
        return self._vigil_client_and_scripts()[0]

    def _vigil_scripts(self):
        """(note a delivery, ack a delivery) on the shared client (app/state/lua_deliveries.py)."""
        return self._vigil_client_and_scripts()[1:]

    def _brpop_start(self, timeout=None):
        """kombu's BRPOP of the next message, naming its lists in the tiers' order and within
        the worker's intake limits (app/state/intake.py); kombu's own without limits."""
        limits = intake_limits()
        if limits is None:
            return super()._brpop_start(timeout)
        if timeout is None:
            timeout = self.brpop_timeout
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        held = held_capped(self.qos._delivered, self.qos._dirty, limits)
        keys = brpop_keys(queues, self.priority_steps, self._q_for_pri, held, limits)
        self._in_poll = self.client.connection
        self._brpop_sent_at = time.monotonic()
        self.client.connection.send_command("BRPOP", *keys, timeout or 0)

    def _brpop_read(self, **options):
        """kombu's read of one BRPOP reply, except that a queue entry that is not a message
        envelope (not JSON, not a mapping) is dropped with an ERROR log instead of raising out
        of the worker's event loop. The entry was already popped and never became a message, so
        nothing is lost but it; the consumer's guard (workers/consumer.py) handles everything
        that got as far as a message."""
        try:
            return super()._brpop_read(**options)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            log.error("dropped a queue entry that is not a kombu message: %s: %s",
                      type(exc).__name__, str(exc)[:200])
            return True

    def _receive_one(self, c):
        """kombu's read of one pub/sub reply, except that a connection found lost is left
        closed. redis-py reconnects it once before raising even with no retry (its failure
        callback runs first), and kombu would then subscribe that connection again without
        watching its socket (its poller still lists the old one): the fanout exchanges
        (Celery's pidbox, its events) went deaf on a channel read again after the error."""
        try:
            return super()._receive_one(c)
        except self.connection_errors:
            connection = c.connection
            if connection is not None:
                connection.disconnect()  # unwatched by kombu's poller; a fresh one next time
            raise

    def _connparams(self, asynchronous=False):
        """kombu's, except that a channel whose connection is already closed raises a
        connection error, which kombu and Celery handle, instead of AttributeError, which stops
        the worker.

        On a Redis restart Celery closes the lost connection (its transport's `client` becomes
        None), but the channel is still asked for a client twice: by its close, to restore its
        unacked messages, and by every task that finishes afterwards, to ack its message. Both
        went through `_connparams` to `None.hostname`, and the AttributeError escaped as an
        "Unrecoverable error": the worker exited (measured, Celery 5.7 / kombu 5.7, in
        tests/test_redis_restart_e2e.py). Now the restore and the ack fail like any write to a
        lost connection: the messages stay in kombu's unacked hash, a copy of a request still
        running is dropped as busy when it comes back (app/state/lua_records.py BEGIN), and what the
        worker no longer holds it hands back when Redis returns (workers/held.py
        `reclaim_orphans`).

        The event loop's connections (BRPOP and the pub/sub LISTEN) never retry inside
        redis-py (`EVENT_LOOP_NO_RETRY`): a lost one is raised to kombu, which reconnects and
        subscribes again."""
        if self.connection.client is None:
            raise redis.ConnectionError("the broker connection of this channel was closed")
        params = super()._connparams(asynchronous=asynchronous)
        if asynchronous:
            params.update(EVENT_LOOP_NO_RETRY)
        return params

    def basic_consume(self, queue, no_ack, callback, consumer_tag, **kwargs):
        """kombu's, with each held message taken off `arriving()` once the consumer's callback
        returned (or raised)."""
        def handed_over(message):
            try:
                return callback(message)
            finally:
                message._vigil_handed_over = True
                for member in getattr(message, "_vigil_held", ()):
                    _arrived(member)

        return super().basic_consume(queue, no_ack, handed_over, consumer_tag, **kwargs)


class VigilChannel(_SharedClient, kredis.Channel):
    """kombu's Redis channel: one shared client per connection pool, holders recorded."""

    QoS = HoldingQoS


class VigilSentinelChannel(_SharedClient, kredis.SentinelChannel):
    """kombu's Sentinel channel: one shared client per connection pool, holders recorded."""

    QoS = HoldingQoS


class VigilRedisTransport(kredis.Transport):
    """kombu's Redis transport (redis://, rediss://, unix sockets) on `VigilChannel`."""

    Channel = VigilChannel


class VigilSentinelTransport(kredis.SentinelTransport):
    """kombu's Sentinel transport on `VigilSentinelChannel`."""

    Channel = VigilSentinelChannel


def transport_for(redis_url: str) -> str:
    """Celery's `broker_transport` for Vigil's Redis URL: this module's transport for its
    scheme."""
    cls = "VigilSentinelTransport" if redis_url.startswith("sentinel") else "VigilRedisTransport"
    return f"app.state.transport:{cls}"
