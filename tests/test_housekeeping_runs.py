"""Unit and Redis tiers: nothing waits in silence (app/fleet/housekeeping_runs.py). Every run of
a beat task is recorded; `vigil status` and a batch's status say when each last ran and flag
one that is overdue (no beat, or beat stuck) or never ran."""
from __future__ import annotations

import time

import pytest

from app.fleet.housekeeping_runs import (NEVER, OK, OVERDUE, OVERDUE_INTERVALS, OVERDUE_SLACK_S,
                                         batch_tick_state, housekeeping_view, task_state)
from app.housekeeping_schedule import Scheduled, schedule
from app.ops.status import render
from app.settings import load_settings
from app.state.store import shared_store
from app.task_names import (BATCH_TICK, DEADLINE_SWEEP, FOREIGN_QUEUES, HOUSEKEEPING_TASKS,
                            REAP_WORKERS)

NOW = 10_000.0


def test_a_task_is_ok_within_its_intervals_then_overdue_and_never_without_a_run():
    t = Scheduled(DEADLINE_SWEEP, 30.0)
    bound = OVERDUE_INTERVALS * 30.0 + OVERDUE_SLACK_S
    assert task_state({DEADLINE_SWEEP: {"at": NOW - bound, "took": 0.1, "error": ""}}, t,
                      NOW)["state"] == OK
    late = task_state({DEADLINE_SWEEP: {"at": NOW - bound - 1, "took": 0.1, "error": ""}}, t,
                      NOW)
    assert late["state"] == OVERDUE and late["age_s"] == bound + 1
    assert "last ran 101 s ago but should run every 30 s" in late["warning"]
    never = task_state({}, t, NOW)
    assert never["state"] == NEVER and never["age_s"] is None
    assert "has never run" in never["warning"] and "celery -A app beat" in never["warning"]


def test_the_view_follows_beats_schedule():
    s = load_settings(worker_reap_timeout=0, foreign_queues="")
    names = [h["task"] for h in housekeeping_view({}, schedule(s), NOW)]
    assert REAP_WORKERS not in names and FOREIGN_QUEUES not in names and BATCH_TICK in names
    full = [t.task for t in schedule(load_settings())]
    assert set(full) <= set(HOUSEKEEPING_TASKS) and DEADLINE_SWEEP in full
    assert batch_tick_state({}, schedule(load_settings()), NOW)["every_s"] == \
        load_settings().batch_tick_interval


def test_status_shows_each_tasks_last_run_and_warns_of_an_overdue_one():
    from rich.console import Console

    snap = {"redis": "r", "at": NOW, "workers": [], "pools": [], "jobs": [],
            "housekeeping": housekeeping_view(
                {DEADLINE_SWEEP: {"at": NOW - 5, "took": 0.01, "error": ""}},
                [Scheduled(DEADLINE_SWEEP, 30.0), Scheduled(BATCH_TICK, 2.0)], NOW)}
    console = Console(width=120, record=True)
    console.print(render(snap))
    text = console.export_text()
    assert "deadline_sweep" in text and "5 s ago" in text
    assert "! vigil.batch_tick has never run (every 2 s)" in text


@pytest.mark.redis
def test_every_run_of_a_beat_task_is_recorded_a_failed_one_with_its_error(monkeypatch):
    """Given the suite's Redis, when beat's tasks run (one of them failing), then each run is
    recorded with when it ended and, for the failed one, its error; and none of them sends
    task events (Flower would show the ticks instead of the requests)."""
    import tasks.housekeeping as hk

    store = shared_store()
    t0 = time.time()
    hk.message_audit()
    monkeypatch.setattr(hk, "sweep_deadlines", lambda *a: (_ for _ in ()).throw(
        RuntimeError("sweep broke")))
    with pytest.raises(RuntimeError):
        hk.deadline_sweep()
    runs = store.housekeeping.runs()
    assert runs["vigil.message_audit"]["at"] >= t0 and runs["vigil.message_audit"]["error"] == ""
    assert runs[DEADLINE_SWEEP]["at"] >= t0
    assert runs[DEADLINE_SWEEP]["error"] == "RuntimeError: sweep broke"
    for name in HOUSEKEEPING_TASKS:
        assert hk.app.tasks[name].send_events is False, name
