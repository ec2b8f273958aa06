"""The requests one turn of the engine host's loop adds to vLLM, sent to EngineCore together.

EngineCore steps on whatever requests it has taken in when it wakes: an idle one that receives
the first request of a wave steps on that request alone, and on the next few in the step after.
The runs of a wave (workers/engine/waves.py) are added in one turn of the loop, but AsyncLLM
sends each to EngineCore as it is added, between the run's own work (its prompt, its state in
vLLM's front end); under one-token requests the engine emptied and woke ~15 times a round of
4,096, each time to a step of one run (docs/performance.md, "The eleventh pass").

`AddBatch` holds each ADD message AsyncLLM makes until the end of the loop's turn (one
`call_soon`), then sends those held, in order, back to back. Any other message (an abort, a
utility call such as pausing the scheduler) sends those held first, so EngineCore receives every
message in the order AsyncLLM made them. What the add's caller sees is unchanged: its request is
in vLLM's front end when the add returns, and its outputs come through it as before.

A dead engine fails an add at once, as vLLM's own send does (`ensure_alive`). One that dies
between the hold and the send fails the held requests through vLLM's own path: its output
handler hands EngineDeadError to every request in its front end, the held ones included. A
send fails only on a socket that is gone, which is an engine dead or shut down (vLLM marks
both); the held adds after it are not sent either.

It wraps `_send_input_message` of vLLM 0.32's AsyncMPClient (the one door of its async sends:
adds, aborts, utility calls); `install` leaves as it is a client without that door, and a
data-parallel one (its adds announce a first request on a socket of their own, outside the
door, so an add held would reach its engine after that announcement).
"""
from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("vigil.engine")

ADD = b"\x00"  # vLLM's EngineCoreRequestType.ADD, the first frame of an add's message


class AddBatch:
    """Holds a loop turn's ADD messages to one EngineCore client and sends them together (module
    docstring). Made by `install`; call on the client's loop."""

    def __init__(self, core, send):
        self._core = core
        self._send_now = send  # the client's own `_send_input_message`
        self._held: list[tuple] = []
        self._sent: asyncio.Future | None = None  # a done future: what a held add returns
        self.flushes = 0  # batches sent
        self.adds = 0  # adds handed to the socket in them

    @classmethod
    def install(cls, core) -> AddBatch | None:
        """Put an AddBatch in front of `core`'s sends (an AsyncLLM's `engine_core`); None, and
        `core` left as it is, where it has no `_send_input_message` and `ensure_alive` (another
        vLLM, or a client that is not the multiprocess one) or is a data-parallel client
        (module docstring)."""
        send = getattr(core, "_send_input_message", None)
        if not callable(send) or not callable(getattr(core, "ensure_alive", None)):
            log.info("vLLM's engine client sends each add alone (no _send_input_message here)")
            return None
        if getattr(core, "first_req_send_socket", None) is not None:
            log.info("vLLM's data-parallel engine client sends each add alone")
            return None
        batch = cls(core, send)
        core._send_input_message = batch.send
        return batch

    def send(self, message: tuple, engine):
        """The client's `_send_input_message`: an ADD is held until the end of this turn (its
        awaitable is done at once); any other message goes after those held."""
        if message[0] != ADD:
            self.flush()
            return self._send_now(message, engine)
        self._core.ensure_alive()
        if not self._held:
            loop = asyncio.get_running_loop()
            loop.call_soon(self.flush)
            if self._sent is None or self._sent.get_loop() is not loop:
                self._sent = loop.create_future()
                self._sent.set_result(None)
        self._held.append((message, engine))
        return self._sent

    def flush(self) -> None:
        """Send the held adds, in the order they were made. Never raises: a send that fails
        leaves its request to vLLM's dead-engine path (module docstring)."""
        held, self._held = self._held, []
        if not held:
            return
        self.flushes += 1
        for i, (message, engine) in enumerate(held):
            try:
                sent = self._send_now(message, engine)
            except Exception as e:  # noqa: BLE001 - the engine died since the hold
                log.warning("%d held request(s) not sent to EngineCore (%s: %s)",
                            len(held) - i, type(e).__name__, e)
                return
            self.adds += 1
            if isinstance(sent, asyncio.Future):
                sent.add_done_callback(_report)


def _report(sent: asyncio.Future) -> None:
    """Log a held add whose send failed after it was handed to the socket."""
    if not sent.cancelled() and sent.exception() is not None:
        log.warning("a held request's send to EngineCore failed (%s: %s)",
                    type(sent.exception()).__name__, sent.exception())
