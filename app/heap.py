"""A long-lived process' Python heap under the garbage collector: a worker's while its engine
is up (workers/engine/slot.py), a `vigil api` process' once its gateway has started
(app/ops/gateway.py).

A worker's heap is large and almost all of it lives as long as its engine: the interpreter, its
imports (torch, transformers, Celery) and the engine's front end, some 700,000 objects. Python's
full collection walks all of them (~0.3 s on this machine, holding the GIL, so the engine's loop
and every task thread stop), and under a stream of short requests one ran every few seconds
(docs/performance.md, "Where a short request's time goes"). As vLLM's own server does after its
start, the heap is frozen once an engine is up: what is alive then moves out of the collector's
sight, and a collection walks only what was made since. An engine's shutdown thaws it first, so
that the engine's own objects can be collected once it is gone.

The youngest generation is collected every GEN0_THRESHOLD allocations instead of Python's 700:
a short request makes a few hundred objects that die within milliseconds, and at 700 they were
collected (and the survivors promoted, then walked again) every few requests. Measured with a
collector callback in the worker, 4,096 one-token requests through `generate_many`: 0.67 s of
collections at 700 (4 full ones of ~80 ms), 0.17 s at 20,000 (none full).
"""
from __future__ import annotations

import gc

GEN0_THRESHOLD = 20_000


def freeze_heap() -> int:
    """Collect what is garbage now, then freeze every object left (the collector no longer walks
    them) and collect the youngest generation every GEN0_THRESHOLD allocations; returns how many
    objects are frozen. Call once the process' long-lived objects are built (an engine up, a
    gateway's imports); calling it again freezes what was made since."""
    gc.collect()
    gc.freeze()
    young, older, oldest = gc.get_threshold()
    gc.set_threshold(max(GEN0_THRESHOLD, young), older, oldest)
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Give every frozen object back to the collector (before an engine's shutdown, so that
    what it leaves behind is collected). Harmless when nothing is frozen."""
    gc.unfreeze()
