"""Values derived from several of Vigil's settings (app/settings.py): what the settings mean
together, worked out in one place. A mixin of `VigilSettings`: each property reads its fields."""
from __future__ import annotations


class DerivedSettings:
    """The derived values of `VigilSettings` (module docstring)."""

    @property
    def job_lease_s(self) -> float:
        """How long a job lives without a submit or poll: `job_lease`, else the deadline."""
        return self.job_lease if self.job_lease is not None else self.request_deadline

    @property
    def foreign_queue_names(self) -> list[str]:
        """`foreign_queues` as a list (no empty names)."""
        return [q.strip() for q in self.foreign_queues.split(",") if q.strip()]

    @property
    def live_window(self) -> float:
        """Seconds since its last heartbeat within which a worker counts as alive (a copy of
        what it runs is not run again, `vigil status` shows it live, the reconcile may pick it):
        the reap timeout, or three heartbeat intervals when the reaper is off."""
        return self.worker_reap_timeout or 3 * self.heartbeat_interval

    @property
    def failure_window(self) -> float:
        """Seconds a failure counts in the health ledger: `health_window`, stretched to at least
        failure_threshold x request_timeout so a trickle of one timeout per request timeout
        still adds up to a quarantine."""
        return max(self.health_window, self.failure_threshold * self.request_timeout)

    @property
    def stall_after(self) -> float:
        """The watchdog's stall timeout in effect: `stall_timeout`, kept below half the request
        timeout so a stall is caught before every request times out; 0 when disabled."""
        if self.stall_timeout <= 0:
            return 0.0
        return min(self.stall_timeout, self.request_timeout / 2)

    @property
    def admission_timeout(self) -> float:
        """The longest a request may wait for an engine before it runs (the current model's
        requests draining, then an engine start): one request timeout plus one engine start.
        Past it the attempt is given up as `engine_restarting`, which is not wedge evidence."""
        return self.request_timeout + self.engine_start_timeout

    @property
    def visibility_timeout(self) -> int:
        """Seconds Redis keeps an unacked message before redelivering it.

        Above the longest task (waiting for an engine, then the generation) plus the largest
        retry backoff, so a healthy worker's long request is never delivered twice
        (docs/field-notes.md: a task longer than this runs twice)."""
        return int(self.admission_timeout + self.request_timeout + self.retry_backoff_max + 60)
