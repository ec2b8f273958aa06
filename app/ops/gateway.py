"""One `vigil api` process' online side, wired: the producer's submit and cancel on the
Celery app's ports, the vLLM render lanes, and (started on the event loop) the async Redis
client, the live channels' hub, the call records and the API keys' reader.

A stopping gateway (SIGTERM/SIGINT) lets its open streams go without cancelling their requests:
their clients reconnect to another gateway and go on (docs/api.md, "How a stream continues").
"""
from __future__ import annotations

import asyncio
import logging
import signal
import threading

from app import heap
from app.celery_app import shared_app
from app.fleet.cancel import cancel_requests
from app.first_imports import GATEWAY_MODULES, import_first, vllm_env_defaults
from app.online.render import Renderers
from app.online.serving import OnlineCalls
from app.requests.model_files import ensure_model_files
from app.requests.models import ModelRegistry, get_registry
from app.requests.submit import submit_many, submit_request
from app.requests.version_gate import pool_reads
from app.settings import VigilSettings
from app.state.api_keys import KeyReader
from app.state.conn import async_client
from app.state.live import LiveHub
from app.state.online_calls import CallRecords
from app.state.store import RequestStore, open_store

log = logging.getLogger("vigil.api")
LIVE_VERSION = 3  # the request schema version that carries `live` (app/requests/schemas.py)


class Gateway:
    """What the online endpoints run on in one process (module docstring)."""

    def __init__(self, settings: VigilSettings, store: RequestStore, registry: ModelRegistry,
                 ports, *, warm: bool = True, freeze_heap: bool = False):
        self.settings, self.store, self.registry, self.ports = settings, store, registry, ports
        self.warm = warm  # build every model's render lane at start (on a thread)
        # Freeze the process' heap once the render modules are imported, and again once warm
        # lanes are built (app/heap.py): a `vigil api` process, not a gateway in a program.
        self.freeze_heap = freeze_heap
        self._warming: threading.Thread | None = None
        self.renderers = Renderers(registry, ensure_model_files)
        self.calls: OnlineCalls | None = None
        self.keys: KeyReader | None = None
        self.hub: LiveHub | None = None

    @classmethod
    def from_settings(cls, settings: VigilSettings) -> "Gateway":
        """A `vigil api` process' gateway on the fleet of `settings` (connects to nothing yet;
        its heap is frozen once it has started)."""
        app = shared_app()
        return cls(settings, open_store(settings), get_registry(), app.vigil_ports,
                   freeze_heap=True)

    def submit(self, items: list[dict], ids: list[str]) -> None:
        """Submit a call's requests (blocking): one message for one, messages of many for
        several (app/requests/submit.py), all recorded before any is published: a call is
        answered as one, so a refusal leaves none of it running (its ids are the client's to
        submit again)."""
        kw = dict(settings=self.settings, registry=self.registry, store=self.store,
                  ports=self.ports)
        if len(items) == 1:
            submit_request(items[0], ids[0], **kw)
        else:
            submit_many(items, ids, in_parts=False, **kw)

    def cancel(self, ids: list[str]) -> dict[str, str]:
        """Cancel requests (blocking): ended `cancelled`, aborted in their engines."""
        return cancel_requests(self.store, ids, backend=self.ports.backend, bus=self.ports.bus)

    def pool_is_live(self, pool: str) -> bool:
        """Whether every live worker of `pool` reads `live` requests."""
        return pool_reads(self.store.workers, pool, LIVE_VERSION, self.settings.live_window)

    async def start(self) -> None:
        """Import vLLM's render modules before any request is served (app/first_imports.py),
        open the async side on the running loop, mark SIGTERM/SIGINT as a stop, and build the
        render lanes on a thread (requests meanwhile wait for their model's lane). With
        `freeze_heap`, the heap is frozen after the imports and again after the lanes
        (`_freeze`)."""
        vllm_env_defaults()
        took = await asyncio.to_thread(import_first, GATEWAY_MODULES)
        log.info("online API: imported vLLM's render modules in %.1f s", took)
        if self.freeze_heap:  # before any request is served: nothing of one frozen with it
            self._freeze()
        client = async_client(self.settings)
        backend = self.ports.backend
        self.hub = LiveHub(client, lambda rid: backend.get_key_for_task(rid))
        self.keys = KeyReader(client)
        self.calls = OnlineCalls(self.renderers, self.hub, CallRecords(client),
                                 submit=self.submit, cancel=self.cancel,
                                 pool_is_live=self.pool_is_live,
                                 deadline_s=self.settings.request_deadline,
                                 result_ttl=self.settings.result_ttl)
        self._mark_stops()
        if self.warm:
            self._warming = threading.Thread(target=self._warm, name="vigil-render-warm",
                                             daemon=True)
            self._warming.start()

    def _warm(self) -> None:
        """Build every render lane; then, with `freeze_heap` and unless stopped meanwhile,
        freeze what they added (a few requests in flight by then may be frozen with it)."""
        if self.renderers.warm() and self.freeze_heap:
            self._freeze()

    def _freeze(self) -> None:
        """Freeze what the process holds now (app/heap.py): its imports (vLLM, transformers,
        torch: ~645,000 objects) and its render lanes live as long as it does, and each full
        collection walked them all, ~0.3 s of CPU holding the GIL here, while the event loop
        relaying every open stream stood still."""
        log.info("online API: heap frozen (%d objects out of the collector's sight)",
                 heap.freeze_heap())

    def _mark_stops(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)

            def handler(signum, frame, previous=previous):
                if self.calls is not None:
                    self.calls.stopping = True
                if callable(previous):
                    previous(signum, frame)

            signal.signal(sig, handler)

    async def close(self) -> None:
        """Close the async side; let a lane build under way finish (a thread stopped inside
        vLLM at interpreter exit aborts the process)."""
        self.renderers.stop_warming()
        if self._warming is not None:
            await asyncio.to_thread(self._warming.join, 60)
        if self.hub is not None:
            await self.hub.close()
