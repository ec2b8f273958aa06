"""LoRA adapters in the engine host: the gate, the warm adapters, and lanes.

- **Gate.** A request with an adapter runs only once the adapter is loaded into the live engine
  by a checked call (workers/engine/lora_gate.py): a bad adapter fails its own requests with
  `lora_adapter_invalid` and the engine and every other request are untouched. Loads of one
  adapter are serialized; its other requests wait for that one load.
- **Warm adapters.** At most the model's `max_loras` are loaded at once; a new one evicts the
  least recently used adapter that no request is using (`evictions`), and waits while all of
  them are in use. A reloaded adapter passes the same gate. A fresh engine starts cold.
- **Lanes.** vLLM CPU 0.32 computes base requests wrong in a batch that mixes them with adapter
  requests (docs/field-notes.md). Unless the model says `lora_mixing_safe`, base requests and
  adapter requests never share the engine: the host admits one lane at a time and switches
  like it switches models, without evicting anything (workers/engine/host.py). Requests that
  name `logprob_token_ids` get lanes of their own too, one per number of ids: vLLM 0.32's
  sampler gives every request of a batch the named ids' logprobs once any request of it names
  ids (`Sampler.forward`: "prefer logprob_token_ids", batch-wide), so a `logprobs` request
  beside one lost its alternatives, and a shorter list gets padding entries of token 0. On an
  engine with LoRA enabled, a request asking `prompt_logprobs` runs alone in a lane of its own:
  vLLM 0.32's LoRA logits path computes its prompt's logits with one adapter index per request
  of the batch, and a prefill beside another request killed EngineCore (docs/field-notes.md).

`AdapterCache` owns the adapter state (warm LRU, use counts, loads in progress, counters); it
runs on the host's loop and waits on the host's condition, which it is handed per call.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from app.requests.adapters import AdapterRef
from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest
from workers.engine.lora_gate import check_adapter_files, engine_cause, invalid
from workers.engine.ticket import Ticket

log = logging.getLogger("vigil.engine")
BASE_LANE = "base"
LORA_LANE = "lora"
NAMED_LOGPROBS_LANE = "logprob_token_ids"
PROMPT_LOGPROBS_LANE = "prompt_logprobs"


def lane_of(spec: ModelSpec, adapter: AdapterRef | None,
            req: GenerateRequest | None = None, engine_request_id: str = "") -> str:
    """The lane a request runs in: adapter requests apart from base ones unless mixing is safe;
    a request naming `logprob_token_ids` apart from every request that does not name as many;
    on an engine with LoRA enabled, a request asking `prompt_logprobs` alone (a lane of its
    engine request id) (module docstring)."""
    lane = LORA_LANE if adapter is not None and not spec.lora_mixing_safe else BASE_LANE
    if req is not None and req.logprob_token_ids:
        lane = f"{lane}+{NAMED_LOGPROBS_LANE}:{len(req.logprob_token_ids)}"
    if req is not None and req.prompt_logprobs is not None and spec.max_loras:
        lane = f"{lane}+{PROMPT_LOGPROBS_LANE}:{engine_request_id}"
    return lane


class AdapterCache:
    """The adapters loaded into one engine at a time (module docstring)."""

    def __init__(self):
        self.warm: OrderedDict[str, AdapterRef] = OrderedDict()
        self._users: dict[str, int] = {}
        self._engine: object = None
        self._loading: dict[str, asyncio.Future] = {}
        self.loads = 0
        self.evictions = 0
        self.refused = 0

    async def gate(self, engine, t: Ticket, spec: ModelSpec, cond: asyncio.Condition) -> None:
        """Return once `t`'s adapter is loaded in `engine` and counted as used by `t`; raises
        RequestError(lora_adapter_invalid) or TransientError(lora_adapter_pending) when it
        cannot be (lora_gate.py)."""
        ref: AdapterRef = t.adapter
        loop = asyncio.get_running_loop()
        while True:
            if self._engine is not engine:  # a fresh engine has no adapter loaded
                self._engine = engine
                self.warm.clear()
                self._users.clear()
            if ref.name in self.warm:
                self.warm.move_to_end(ref.name)
                if t.adapter_engine is not engine:
                    t.adapter_engine = engine
                    self._users[ref.name] = self._users.get(ref.name, 0) + 1
                return
            loading = self._loading.get(ref.name)
            if loading is not None:
                await asyncio.shield(loading)
                continue
            loading = loop.create_future()
            self._loading[ref.name] = loading
            try:
                await self._load(engine, ref, spec, cond)
            finally:
                del self._loading[ref.name]
                loading.set_result(None)

    async def _load(self, engine, ref: AdapterRef, spec: ModelSpec,
                    cond: asyncio.Condition) -> None:
        await asyncio.get_running_loop().run_in_executor(None, check_adapter_files, ref, spec)
        async with cond:  # a free slot: evict the least recently used idle adapter
            await cond.wait_for(
                lambda: len(self.warm) < max(1, spec.max_loras)
                or any(not self._users.get(n) for n in self.warm))
            while len(self.warm) >= max(1, spec.max_loras):
                victim = next(n for n in self.warm if not self._users.get(n))
                old = self.warm.pop(victim)
                self._users.pop(victim, None)
                try:
                    await engine.remove_adapter(old)
                except Exception as e:  # its slot is taken over by the next add anyway
                    log.warning("removing adapter %s failed: %s", victim, e)
                self.evictions += 1
        try:
            await engine.add_adapter(ref)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.refused += 1
            log.warning("adapter %s refused by the engine: %s", ref.name, engine_cause(e))
            raise invalid(ref, engine_cause(e)) from None
        self.warm[ref.name] = ref
        self.loads += 1
        log.info("adapter %s loaded (%d warm)", ref.name, len(self.warm))

    def done(self, t: Ticket) -> bool:
        """`t` no longer uses its adapter (it may be evicted now). Returns True when a use was
        released: the caller should wake whoever waits for a free slot."""
        released = False
        if t.adapter_engine is not None and t.adapter_engine is self._engine:
            name = t.adapter.name
            n = self._users.get(name, 0) - 1
            if n > 0:
                self._users[name] = n
            else:
                self._users.pop(name, None)
            released = True
        t.adapter_engine = None
        return released
