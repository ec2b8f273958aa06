"""Priority tiers: interactive work ahead of bulk work on the same fleet (docs/api.md,
"Priority").

A request names its tier (`priority`: interactive | default | bulk; default `default`; a batch
object's lines are `bulk`). Celery's own `apply_async(priority=N)` picks one too when the
request does not (kombu's Redis transport pops lower numbers first: 0-2 interactive, 3-5
default, 6-9 bulk). Every message of a request is published at its tier's broker priority
(app/requests/publish.py), so a worker pops interactive messages before default and bulk ones
(app/state/intake.py: the order, the slots reserved for interactive requests, bulk's floor).
"""
from __future__ import annotations

from app.state.intake import IntakeLimits

INTERACTIVE = "interactive"
DEFAULT = "default"
BULK = "bulk"
TIERS = (INTERACTIVE, DEFAULT, BULK)

# The kombu message priority each tier is published at: one of kombu's Redis priority steps
# (0, 3, 6, 9), which its BRPOP reads lowest first.
BROKER_PRIORITY = {INTERACTIVE: 0, DEFAULT: 3, BULK: 9}
# The tier of each of a queue's priority lists, in pop order (app/state/broker.py queue_lists:
# steps 0, 3, 6, 9); step 6, which Vigil does not publish at, counts as bulk.
TIER_OF_LIST = (INTERACTIVE, DEFAULT, BULK, BULK)
# The lowest broker step whose messages are bulk work (6 and 9).
BULK_FROM_STEP = 6
# vLLM's own per-request priority of each tier (lower first), which its "priority" scheduling
# policy reads (workers/engine/vllm_args.py sets that policy): an interactive request waiting
# in the engine is scheduled before default and bulk ones that came earlier.
ENGINE_PRIORITY = {INTERACTIVE: 0, DEFAULT: 1, BULK: 2}


def tier_of_celery_priority(priority: int) -> str:
    """The tier of a Celery `priority=` option (0-9, lower first, as kombu's Redis transport
    reads it): 0-2 interactive, 3-5 default, 6-9 bulk."""
    if priority <= 2:
        return INTERACTIVE
    return DEFAULT if priority <= 5 else BULK


def intake_limits_for(concurrency: int, interactive_slots: int, bulk_floor: float
                      ) -> IntakeLimits:
    """A worker's intake limits (app/state/intake.py): the bulk tier holds at most
    `concurrency` - `interactive_slots` requests (at least one), and with a backlog
    everywhere the lowest tier gets every round(1 / `bulk_floor`)-th pop first (0: never)."""
    floor_every = round(1 / bulk_floor) if bulk_floor > 0 else 0
    return IntakeLimits(lower_cap=max(1, concurrency - interactive_slots),
                        floor_every=floor_every, capped_from_step=BULK_FROM_STEP)


def engine_priority(tier: str | None) -> int:
    """vLLM's request priority of a tier (None: the default tier)."""
    return ENGINE_PRIORITY[tier or DEFAULT]


def broker_priority(tier: str | None) -> int:
    """The kombu message priority of a tier (None: the default tier)."""
    return BROKER_PRIORITY[tier or DEFAULT]
