"""How the suite shares the machine when pytest-xdist runs it in several processes (`make test`
runs `-n 2 --dist loadfile`: docs/testing.md, "Two processes").

Each xdist process is a whole suite of its own: its own redis-server, its own warm worker, its
own witness directory (tests/conftest.py), so nothing one process does is seen by the other.
What they do share is the machine, and two things follow from that:

- **Order.** A module is the unit of work (`--dist loadfile`: module fixtures are built once),
  and a process takes the next module when it finishes one. The longest modules go first
  (`LONGEST_FIRST`, from the per-module times of a fresh-clone run in docs/testing.md), so the
  run does not end with one process busy on a long module while the other idles.
- **Tests that must have the machine to themselves** (`@pytest.mark.alone`): one that squeezes
  the machine's free memory, or one whose assertion is a promised time bound that a neighbour
  starting an engine could stretch. Every test holds a lock on the run's lock file for its
  whole setup, call and teardown: shared for most, exclusive for `alone` ones. An exclusive
  waiter first takes the gate, so the other process's next test waits behind it rather than
  starving it.

Run alone (no xdist), nothing here waits on anything.
"""
from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

import pytest

# The modules that take longest (measured: docs/testing.md), longest first. A module not
# listed runs after these, in collection order.
LONGEST_FIRST = [
    "test_generation_contract_e2e.py",
    "test_engine_death_e2e.py",
    "test_soak_e2e.py",
    "test_memory_pressure_e2e.py",
    "test_black_hole_e2e.py",
    "test_wedge_e2e.py",
    "test_gpu_check_e2e.py",
    "test_abort_ended_e2e.py",
    "test_redis_restart_e2e.py",
    "test_reconcile_e2e.py",
    "test_batch_api_e2e.py",
    "test_slow_start_e2e.py",
    "test_tiers_e2e.py",
    "test_housekeeper_e2e.py",
    "test_metrics_e2e.py",
    "test_reaper_e2e.py",
    "test_generate_many_e2e.py",
    "test_graceful_stop_e2e.py",
    "test_procfile_honcho_e2e.py",
    "test_core_failure_e2e.py",
]


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "alone: runs with no other test running (tests/suite_schedule.py): it "
                   "squeezes the machine or asserts a time bound a neighbour could stretch")


def pytest_collection_modifyitems(session, config, items):
    """Longest modules first; within a module, the order it was written in."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))


class RunLock:
    """The run's shared/exclusive lock, with a gate that gives an exclusive waiter priority."""

    def __init__(self, path: Path):
        self._gate = open(f"{path}.gate", "a+")
        self._main = open(path, "a+")

    def acquire(self, alone: bool) -> None:
        """Block until this test may run: exclusively when `alone`, else beside other
        shared holders. A waiting exclusive holder goes before shared ones that come later."""
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._main, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)

    def release(self) -> None:
        """Let the next test of either process run."""
        fcntl.flock(self._main, fcntl.LOCK_UN)


_lock: RunLock | None = None


def _run_lock() -> RunLock | None:
    """The lock of this xdist run (its processes share PYTEST_XDIST_TESTRUNUID), or None when
    the suite runs in one process."""
    global _lock
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run and _lock is None:
        _lock = RunLock(Path(tempfile.gettempdir()) / f"vigil-suite-{run}.lock")
    return _lock


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Hold the run's lock over the test's setup (module fixtures included), call and teardown."""
    lock = _run_lock()
    if lock is None:
        yield
        return
    lock.acquire(alone=item.get_closest_marker("alone") is not None)
    try:
        yield
    finally:
        lock.release()
