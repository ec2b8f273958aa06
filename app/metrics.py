"""Vigil's event counters, counted where the events happen (docs/operations.md, "Metrics").

One counter increment per event, no Redis call: requests ended by this process (its set-once
finish won) by pool, outcome and error code; attempts begun; retries; deliveries dropped;
housekeeping runs (duration histograms), reaped workers and requests, consumers cancelled by the
health tick. Beat only schedules: its housekeeping tasks run inside workers (or the
housekeeper), so those metrics come from whichever process ran them (sum over the fleet).

A worker's `/metrics` endpoint, and the state it reads at scrape time (engine, health, queue
depths), is workers/metrics_server.py. Metrics live in `REGISTRY`, not prometheus_client's global
one: a producer or Flower process that imports Vigil (Flower serves its own /metrics from the
global registry) exposes none of these.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

# -- events (the hot path: one increment per finished request) ----------------------------------
REQUESTS = Counter(
    "vigil_requests", "Requests this process ended (its set-once finish won), by pool, outcome "
    "(succeeded, failed) and error code ('' on success). Summed over the fleet: every request "
    "ended, once.", ["pool", "outcome", "code"], registry=REGISTRY)
ATTEMPTS = Counter("vigil_attempts", "Attempts begun on this worker (begin said run).",
                   ["pool"], registry=REGISTRY)
RETRIES = Counter("vigil_retries", "Attempts this worker handed back for a retry, by the error "
                  "code that ended them.", ["pool", "code"], registry=REGISTRY)
DROPPED = Counter(
    "vigil_deliveries_dropped", "Deliveries that ran nothing or whose result lost: "
    "duplicate_delivery (the request had ended), stale (an older dispatch), given_back (worker "
    "stopping or quarantined: requeued untouched), avoided (its last attempt failed on this "
    "worker and another serves the pool: requeued untouched), duplicate_result (another result "
    "won).",
    ["pool", "reason"], registry=REGISTRY)
HOUSEKEEPING = Histogram(
    "vigil_housekeeping_duration_seconds", "Housekeeping runs that held their lock "
    "(deadline_sweep, reaper, health_tick), by duration; _count is the number of runs.",
    ["task"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    registry=REGISTRY)
HOUSEKEEPING_SKIPPED = Counter("vigil_housekeeping_skipped", "Housekeeping runs that did nothing "
                               "because another run held the lock.", ["task"], registry=REGISTRY)
REAPED_WORKERS = Counter("vigil_reaped_workers", "Silent workers the reaper removed.",
                         registry=REGISTRY)
REAPED_REQUESTS = Counter("vigil_reaped_requests", "Requests of reaped workers, by what the "
                          "reaper did (requeued, failed).", ["outcome"], registry=REGISTRY)
CONSUMERS_CANCELLED = Counter("vigil_health_tick_cancelled_consumers", "Pool consumers the "
                              "health tick cancelled on quarantined workers.", registry=REGISTRY)
TOKENS_RESUMED = Counter("vigil_tokens_resumed", "Generated tokens a new run continued from "
                         "instead of generating them again (resume from the token stream).",
                         ["pool"], registry=REGISTRY)
TOKENS_DISCARDED = Counter("vigil_tokens_discarded", "Generated tokens thrown away: a resume "
                           "refused (the run restarted from the prompt), or tokens an attempt "
                           "made but had not written to its stream when it ended without a "
                           "result.", ["pool"], registry=REGISTRY)
STREAM_READERS = Counter("vigil_stream_reads", "Token stream reads this process began "
                         "(`stream()` calls, `vigil request --follow`).", registry=REGISTRY)
HOUSEKEEPING_TASKS = ("deadline_sweep", "reaper", "health_tick")
for _task in HOUSEKEEPING_TASKS:  # present (at 0) from the first scrape
    HOUSEKEEPING.labels(_task)
    HOUSEKEEPING_SKIPPED.labels(_task)


def _code(message: str) -> str:
    # VigilError.code's rule: the text before the first ':', 'unknown' without one.
    return message.split(":", 1)[0].strip() if ":" in message else ("unknown" if message else "")


def request_ended(pool: str, status: str, error: str = "") -> None:
    """Count a request this process ended (its finish won) with `status` (SUCCEEDED or FAILED)
    and, when it failed, its stored error message."""
    if status == "SUCCEEDED":
        REQUESTS.labels(pool, "succeeded", "").inc()
    else:
        REQUESTS.labels(pool, "failed", _code(error)).inc()


def attempt_begun(pool: str) -> None:
    """Count an attempt begun on this worker."""
    ATTEMPTS.labels(pool).inc()


def retried(pool: str, code: str) -> None:
    """Count an attempt handed back for a retry, by the code of the error that ended it."""
    RETRIES.labels(pool, code).inc()


def dropped(pool: str, reason: str) -> None:
    """Count a delivery that ran nothing, or whose result lost (see DROPPED)."""
    DROPPED.labels(pool, reason).inc()


def housekeeping_ran(task: str, seconds: float) -> None:
    """Record one housekeeping run that held its lock."""
    HOUSEKEEPING.labels(task).observe(seconds)


def housekeeping_skipped(task: str) -> None:
    """Count a housekeeping run that found the lock taken."""
    HOUSEKEEPING_SKIPPED.labels(task).inc()


def tokens_resumed(pool: str, n: int) -> None:
    """Count `n` generated tokens a run continued from."""
    if n > 0:
        TOKENS_RESUMED.labels(pool).inc(n)


def tokens_discarded(pool: str, n: int) -> None:
    """Count `n` generated tokens thrown away."""
    if n > 0:
        TOKENS_DISCARDED.labels(pool).inc(n)


def token_totals() -> tuple[int, int]:
    """(generated tokens resumed, generated tokens discarded) by this process so far, every
    pool's: what `vigil_tokens_resumed_total` and `vigil_tokens_discarded_total` say."""
    def total(counter) -> int:
        return int(sum(s.value for m in counter.collect() for s in m.samples
                       if s.name.endswith("_total")))
    return total(TOKENS_RESUMED), total(TOKENS_DISCARDED)


def stream_read() -> None:
    """Count a token stream read begun by this process."""
    STREAM_READERS.inc()
