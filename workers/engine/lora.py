"""The LoRA half of the engine host: the gate, warm adapters, and lanes.

- **Gate.** A request with an adapter runs only once the adapter is loaded into the live engine
  by a checked call (workers/engine/lora_gate.py): a bad adapter fails its own requests with
  `lora_adapter_invalid` and the engine and every other request are untouched. Loads of one
  adapter are serialized; its other requests wait for that one load.
- **Warm adapters.** At most the model's `max_loras` are loaded at once; a new one evicts the
  least recently used adapter that no request is using (`lora_evictions`), and waits while all
  of them are in use. A reloaded adapter passes the same gate. An engine restart starts cold.
- **Lanes.** vLLM CPU 0.32 computes base requests wrong in a batch that mixes them with adapter
  requests (FIELD-NOTES.md). Unless the model says `lora_mixing_safe`, base requests and adapter
  requests never share the engine: the host runs one lane at a time and switches like it
  switches models, without evicting anything: a waiting request of the other lane stops new
  admissions to the current lane, and the switch happens when its requests have drained.

`EngineLora` is a mixin of `EngineHost` (workers/engine/host.py) and uses its state.
"""
from __future__ import annotations

import asyncio
import logging

from app.requests.adapters import AdapterRef
from app.requests.models import ModelSpec
from workers.engine.lora_gate import check_adapter_files, engine_cause, invalid
from workers.engine.suspects import Ticket

log = logging.getLogger("vigil.engine")
BASE_LANE = "base"
LORA_LANE = "lora"


def lane_of(spec: ModelSpec, adapter: AdapterRef | None) -> str:
    """The lane a request runs in: adapter requests apart from base ones unless mixing is safe."""
    return LORA_LANE if adapter is not None and not spec.lora_mixing_safe else BASE_LANE


class EngineLora:
    """Gate, warm adapters and lanes for EngineHost (see the module docstring)."""

    def _lane_ok(self, lane: str) -> bool:
        return ((self._inflight == 0 or self._lane == lane)
                and self._lane_wanted in (None, lane))

    async def _wait_for_lane(self, lane: str) -> None:
        """Wait (holding the host's condition) for the other lane to drain."""
        claimed = self._lane_wanted is None and self._lane != lane
        if claimed:
            self._lane_wanted = lane
        try:
            await self._cond.wait()
        except asyncio.CancelledError:
            if claimed and self._lane_wanted == lane:  # nobody else asked: withdraw
                self._lane_wanted = None
                self._cond.notify_all()
            raise

    async def _gate_or_release(self, engine, t: Ticket, spec: ModelSpec) -> None:
        """Make sure `t`'s adapter is loaded in `engine`; on failure give back the ticket's
        engine slot (counted by _acquire or the recovery) and raise the classified error."""
        try:
            await self._gate(engine, t, spec)
        except BaseException:
            async with self._cond:
                self._inflight -= 1
                self._last_used = self._clock()
                self._cond.notify_all()
            raise

    async def _gate(self, engine, t: Ticket, spec: ModelSpec) -> None:
        ref: AdapterRef = t.adapter
        while True:
            if self._adapters_engine is not engine:  # a fresh engine has no adapter loaded
                self._adapters_engine = engine
                self._warm_adapters.clear()
                self._adapter_users.clear()
            if ref.name in self._warm_adapters:
                self._warm_adapters.move_to_end(ref.name)
                if t.adapter_engine is not engine:
                    t.adapter_engine = engine
                    self._adapter_users[ref.name] = self._adapter_users.get(ref.name, 0) + 1
                return
            loading = self._adapter_loading.get(ref.name)
            if loading is not None:
                await asyncio.shield(loading)
                continue
            loading = self._loop.create_future()
            self._adapter_loading[ref.name] = loading
            try:
                await self._load_adapter(engine, ref, spec)
            finally:
                del self._adapter_loading[ref.name]
                loading.set_result(None)

    async def _load_adapter(self, engine, ref: AdapterRef, spec: ModelSpec) -> None:
        await self._loop.run_in_executor(None, check_adapter_files, ref, spec)
        async with self._cond:  # a free slot: evict the least recently used idle adapter
            await self._cond.wait_for(
                lambda: len(self._warm_adapters) < max(1, spec.max_loras)
                or any(not self._adapter_users.get(n) for n in self._warm_adapters))
            while len(self._warm_adapters) >= max(1, spec.max_loras):
                victim = next(n for n in self._warm_adapters if not self._adapter_users.get(n))
                old = self._warm_adapters.pop(victim)
                self._adapter_users.pop(victim, None)
                try:
                    await engine.remove_adapter(old)
                except Exception as e:  # its slot is taken over by the next add anyway
                    log.warning("removing adapter %s failed: %s", victim, e)
                self.lora_evictions += 1
        try:
            await engine.add_adapter(ref)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.lora_refused += 1
            log.warning("adapter %s refused by the engine: %s", ref.name, engine_cause(e))
            raise invalid(ref, engine_cause(e)) from None
        self._warm_adapters[ref.name] = ref
        self.lora_loads += 1
        log.info("adapter %s loaded (%d warm)", ref.name, len(self._warm_adapters))

    def _adapter_done(self, t: Ticket) -> None:
        """The ticket no longer uses its adapter (it may be evicted now)."""
        if t.adapter_engine is not None and t.adapter_engine is self._adapters_engine:
            name = t.adapter.name
            n = self._adapter_users.get(name, 0) - 1
            if n > 0:
                self._adapter_users[name] = n
            else:
                self._adapter_users.pop(name, None)
            self._loop.create_task(self._notify())
        t.adapter_engine = None

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()
