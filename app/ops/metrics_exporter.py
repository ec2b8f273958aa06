"""`vigil metrics`: the fleet's gauges for Prometheus, from one place.

Each worker's own `/metrics` (VIGIL_METRICS_PORT, workers/metrics_server.py) says what that
worker does; this says what each pool needs, whoever serves it: per pool and tier, the requests
waiting in its queues, the requests running, the oldest wait, and the live healthy workers
(app/fleet/fleet_gauges.py), read from Redis when Prometheus scrapes. One process per fleet
(the Procfile's `metrics`), stateless: run two and they say the same. An autoscaler scales a
pool's GPU workers on them (docs/operations.md, "Autoscaling").
"""
from __future__ import annotations

import logging
import threading
import time

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily

from app.fleet.fleet_gauges import pool_gauges
from app.requests.models import ModelRegistry
from app.settings import VigilSettings
from app.state.store import RequestStore

log = logging.getLogger("vigil.metrics")

GAUGES = {
    "waiting": ("vigil_pool_waiting", "Requests waiting in the pool's queues, by tier."),
    "running": ("vigil_pool_running", "Requests running on the pool's live workers, by tier."),
    "oldest_wait_s": ("vigil_pool_oldest_wait_seconds", "How long the oldest waiting request "
                      "of the tier has waited since it was submitted (0 when none waits)."),
}


class FleetCollector:
    """Reads the fleet's gauges from Redis at each scrape (nothing kept between scrapes)."""

    def __init__(self, store: RequestStore, registry: ModelRegistry, settings: VigilSettings,
                 clock=time.time):
        self._store, self._registry, self._settings, self._clock = (store, registry, settings,
                                                                    clock)

    def collect(self):
        """The gauges; a scrape while Redis is away returns `vigil_fleet_up 0` only."""
        up = GaugeMetricFamily("vigil_fleet_up", "1 when Redis answered this scrape.")
        try:
            rows = pool_gauges(self._store, self._registry, self._settings, self._clock())
        except Exception as e:
            log.warning("metrics: cannot read the fleet from Redis: %s", e)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        for field, (name, doc) in GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=["pool", "tier"])
            for r in rows:
                g.add_metric([r["pool"], r["tier"]], float(r[field] or 0))
            yield g
        w = GaugeMetricFamily("vigil_pool_workers", "Live healthy workers serving the pool.",
                              labels=["pool"])
        for r in {r["pool"]: r for r in rows}.values():
            w.add_metric([r["pool"]], r["workers"])
        yield w


def serve(store: RequestStore, registry: ModelRegistry, settings: VigilSettings, port: int,
          address: str, stop: threading.Event | None = None) -> None:
    """Serve the fleet's gauges on http://address:port/metrics until `stop` is set (forever
    without one)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FleetCollector(store, registry, settings))
    server, thread = start_http_server(port, address, registry=reg)
    log.info("vigil metrics: the fleet's gauges on http://%s:%d/metrics", address, port)
    try:
        (stop or threading.Event()).wait()
    finally:
        server.shutdown()
        thread.join(5)
