"""Unit tier: a loop turn's adds reach EngineCore together (workers/engine/add_batch.py). The
client is a fake that records what it is asked to send; that vLLM's own client has the door the
batch wraps, and that every async send goes through it, is checked against vLLM's source. Every
run of the e2e modules goes through the batch on the real engine."""
from __future__ import annotations

import asyncio
import inspect
import logging

import pytest

from workers.engine.add_batch import ADD, AddBatch

ABORT, UTILITY = b"\x01", b"\x03"


class EngineDead(Exception):
    pass


class FakeClient:
    """What AddBatch needs of vLLM's AsyncMPClient: its one door for async sends (each message
    recorded, a done future back) and `ensure_alive`."""

    def __init__(self, dies_after: int | None = None):
        self.sent: list[tuple] = []
        self.dead = False
        self.dies_after = dies_after  # sends after which the engine is dead
        self.hold_sends = False  # True: each send's future is left for the test to complete
        self.pending: list[asyncio.Future] = []  # those futures

    def ensure_alive(self):
        if self.dead:
            raise EngineDead("engine dead")

    def _send_input_message(self, message, engine):
        self.ensure_alive()
        self.sent.append((message, engine))
        if self.dies_after is not None and len(self.sent) >= self.dies_after:
            self.dead = True
        fut = asyncio.get_running_loop().create_future()
        if self.hold_sends:
            self.pending.append(fut)
        else:
            fut.set_result(None)
        return fut


def add(rid: str) -> tuple:
    return (ADD, rid.encode())


def test_the_adds_of_one_turn_are_sent_together_at_its_end_in_order():
    async def main():
        core = FakeClient()
        batch = AddBatch.install(core)
        for rid in ("a", "b", "c"):
            await core._send_input_message(add(rid), b"e0")  # returns at once
        assert core.sent == []  # held for the turn
        await asyncio.sleep(0)  # one turn of the loop
        assert core.sent == [(add("a"), b"e0"), (add("b"), b"e0"), (add("c"), b"e0")]
        await core._send_input_message(add("d"), b"e0")
        await asyncio.sleep(0)
        assert core.sent[-1] == (add("d"), b"e0")
        assert (batch.flushes, batch.adds) == (2, 4)

    asyncio.run(main())


@pytest.mark.parametrize("kind", [ABORT, UTILITY])
def test_any_other_message_goes_after_the_adds_held_before_it(kind):
    """An abort (or a pause of the scheduler) of a request added in the same turn must reach
    EngineCore after its add, else EngineCore would run a request nobody reads."""
    async def main():
        core = FakeClient()
        AddBatch.install(core)
        await core._send_input_message(add("a"), b"e0")
        await core._send_input_message(add("b"), b"e0")
        await core._send_input_message((kind, b"a"), b"e0")  # not held
        assert [m for m, _ in core.sent] == [add("a"), add("b"), (kind, b"a")]
        await asyncio.sleep(0)
        assert len(core.sent) == 3  # nothing sent twice

    asyncio.run(main())


def test_an_add_to_a_dead_engine_fails_at_once():
    async def main():
        core = FakeClient()
        AddBatch.install(core)
        core.dead = True
        with pytest.raises(EngineDead):
            await core._send_input_message(add("a"), b"e0")
        await asyncio.sleep(0)
        assert core.sent == []

    asyncio.run(main())


def test_an_engine_that_dies_during_a_flush_leaves_the_rest_unsent_and_says_how_many(caplog):
    """The held requests are failed by vLLM's own dead-engine path (its output handler); the
    flush sends what it can, counts it, and names how many it did not send."""
    async def main():
        core = FakeClient(dies_after=1)  # the first send goes, then the engine is dead
        batch = AddBatch.install(core)
        for rid in ("a", "b", "c"):
            await core._send_input_message(add(rid), b"e0")
        await asyncio.sleep(0)
        return core, batch

    with caplog.at_level(logging.WARNING, logger="vigil.engine"):
        core, batch = asyncio.run(main())
    assert core.sent == [(add("a"), b"e0")]
    assert batch.adds == 1
    assert "2 held request(s) not sent to EngineCore (EngineDead" in caplog.text


def test_a_send_that_fails_after_the_socket_took_it_is_logged(caplog):
    async def main():
        core = FakeClient()
        core.hold_sends = True
        AddBatch.install(core)
        await core._send_input_message(add("a"), b"e0")
        await asyncio.sleep(0)
        assert len(core.pending) == 1
        core.pending[0].set_exception(OSError("socket closed"))
        await asyncio.sleep(0)  # its done callbacks run

    with caplog.at_level(logging.WARNING, logger="vigil.engine"):
        asyncio.run(main())
    assert "a held request's send to EngineCore failed (OSError: socket closed)" in caplog.text


def test_a_client_without_the_door_is_left_as_it_is():
    class Other:
        def ensure_alive(self):
            pass

    other = Other()
    assert AddBatch.install(other) is None
    assert not hasattr(other, "_send_input_message")


def test_a_data_parallel_client_is_left_as_it_is():
    """Its adds announce a first request on a socket outside the door: held, an add would reach
    its engine after the announcement."""
    core = FakeClient()
    core.first_req_send_socket = object()
    door = core._send_input_message
    assert AddBatch.install(core) is None
    assert core._send_input_message == door


def test_vllms_async_client_sends_everything_through_the_door_it_wraps():
    """vLLM's AsyncMPClient: the wrapped method exists, adds and aborts (`_send_input`) and
    utility calls go through it, and an add's first frame is the ADD the batch holds. A vLLM
    where this changes fails here, not silently in the worker."""
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core_client import AsyncMPClient, DPAsyncMPClient, MPClient

    assert EngineCoreRequestType.ADD.value == ADD
    assert callable(AsyncMPClient._send_input_message)
    assert callable(AsyncMPClient.ensure_alive)
    # The message's first frame is its type: what `AddBatch.send` tells an add by.
    assert "(request_type.value, *self.encoder.encode(request))" in \
        inspect.getsource(AsyncMPClient._send_input)
    for name in ("_send_input", "_call_utility_async"):
        assert "self._send_input_message(" in inspect.getsource(getattr(AsyncMPClient, name))
    for name in ("add_request_async", "abort_requests_async"):
        assert "self._send_input(" in inspect.getsource(getattr(AsyncMPClient, name))
    # The door is the only send on the client's input socket (its class and the base it
    # shares with the sync client): nothing overtakes a held add.
    sends = [line.strip() for line in inspect.getsource(AsyncMPClient).splitlines()
             if "input_socket.send" in line]
    assert len(sends) == 1 and sends[0] in inspect.getsource(AsyncMPClient._send_input_message)
    assert "input_socket.send" not in inspect.getsource(MPClient)
    # A data-parallel client, which `install` leaves alone, is told by this attribute.
    assert "self.first_req_send_socket = " in inspect.getsource(DPAsyncMPClient.__init__)
