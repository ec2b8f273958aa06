"""Whether beat's promises are being kept: when each housekeeping task last ran, against how
often beat should run it (app/housekeeping_schedule.py).

A deadline sweep, a reap or a batch tick that no beat sends never runs, and nothing fails: the
requests simply wait. This is what says so: `vigil status` shows every task's last run and
flags the overdue ones, and a batch's status says when the batch tick last ran (app/fleet/
batches.py). A task is **overdue** once it has not ended a run for OVERDUE_INTERVALS of its
intervals (plus OVERDUE_SLACK_S, for a short interval on a busy housekeeper), and **never**
when no run of it was ever recorded in this Redis.
"""
from __future__ import annotations

from app.housekeeping_schedule import Scheduled
from app.task_names import BATCH_TICK

OVERDUE_INTERVALS = 3
OVERDUE_SLACK_S = 10.0
OK, OVERDUE, NEVER = "ok", "overdue", "never"


def task_state(runs: dict[str, dict], t: Scheduled, now: float) -> dict:
    """One task's view: {task, every_s, last_run_at, age_s, took_s, error, state (ok | overdue |
    never), warning (empty unless overdue or never)}."""
    run = runs.get(t.task)
    at = float(run["at"]) if run and run.get("at") is not None else None
    age = None if at is None else max(0.0, now - at)
    if at is None:
        state = NEVER
        warning = (f"{t.task} has never run (every {t.every:g} s): is `celery -A app beat` "
                   "running, and a housekeeper or a worker consuming vigil.housekeeping?")
    elif age > OVERDUE_INTERVALS * t.every + OVERDUE_SLACK_S:
        state = OVERDUE
        warning = (f"{t.task} last ran {age:.0f} s ago but should run every {t.every:g} s: "
                   "beat is down or stuck, or nothing consumes vigil.housekeeping")
    else:
        state, warning = OK, ""
    return {"task": t.task, "every_s": t.every, "last_run_at": at,
            "age_s": None if age is None else round(age, 1),
            "took_s": run.get("took") if run else None, "error": (run or {}).get("error", ""),
            "state": state, "warning": warning}


def housekeeping_view(runs: dict[str, dict], schedule: list[Scheduled], now: float
                      ) -> list[dict]:
    """Every scheduled task's `task_state`, in schedule order."""
    return [task_state(runs, t, now) for t in schedule]


def batch_tick_state(runs: dict[str, dict], schedule: list[Scheduled], now: float) -> dict:
    """The batch tick's `task_state` (what advances batch objects)."""
    t = next((t for t in schedule if t.task == BATCH_TICK), Scheduled(BATCH_TICK, 2.0))
    return task_state(runs, t, now)
