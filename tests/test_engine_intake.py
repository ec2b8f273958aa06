"""Unit tier: the engine's intake (workers/engine/intake.py): runs that arrive while others are
in the engine enter in one wave, a lone run enters at once, a run cancelled while it waits
never enters. On a real asyncio loop; the window is the only clock."""
from __future__ import annotations

import asyncio

from workers.engine.intake import Intake

WINDOW = 0.05


async def _hold(intake: Intake, entered: list, release: asyncio.Event, name: str) -> None:
    async with intake:
        entered.append((name, asyncio.get_running_loop().time()))
        await release.wait()


def test_a_run_at_an_empty_engine_enters_at_once_and_later_ones_enter_together_in_a_wave():
    async def main():
        loop = asyncio.get_running_loop()
        intake, entered, release = Intake(WINDOW), [], asyncio.Event()
        first = asyncio.ensure_future(_hold(intake, entered, release, "first"))
        await asyncio.sleep(0)
        assert [n for n, _ in entered] == ["first"] and intake.waves == 0  # no wait at all
        start = loop.time()
        rest = [asyncio.ensure_future(_hold(intake, entered, release, f"r{i}")) for i in range(5)]
        await asyncio.sleep(WINDOW / 5)
        assert len(entered) == 1 and intake.inside == 1  # they wait for the wave
        async with asyncio.timeout(5):
            while len(entered) < 6:
                await asyncio.sleep(0.005)
        times = [t for n, t in entered[1:]]
        assert intake.waves == 1 and intake.inside == 6
        assert max(times) - min(times) < WINDOW / 2  # one wave, one turn of the loop
        assert min(times) - start >= WINDOW * 0.9  # and not before the window
        release.set()
        await asyncio.gather(first, *rest)
        assert intake.inside == 0

    asyncio.run(main())


def test_a_run_cancelled_while_it_waits_never_enters_and_the_wave_still_comes():
    async def main():
        intake, entered, release = Intake(WINDOW), [], asyncio.Event()
        first = asyncio.ensure_future(_hold(intake, entered, release, "first"))
        await asyncio.sleep(0)
        gone = asyncio.ensure_future(_hold(intake, entered, release, "gone"))
        kept = asyncio.ensure_future(_hold(intake, entered, release, "kept"))
        await asyncio.sleep(0)
        gone.cancel()
        async with asyncio.timeout(5):
            while len(entered) < 2:
                await asyncio.sleep(0.005)
        assert [n for n, _ in entered] == ["first", "kept"] and gone.cancelled()
        assert intake.inside == 2
        release.set()
        await asyncio.gather(first, kept)
        assert intake.inside == 0

    asyncio.run(main())


def test_with_no_window_every_run_enters_at_once():
    async def main():
        intake, entered, release = Intake(0.0), [], asyncio.Event()
        runs = [asyncio.ensure_future(_hold(intake, entered, release, f"r{i}")) for i in range(4)]
        await asyncio.sleep(0)
        assert len(entered) == 4 and intake.waves == 0
        release.set()
        await asyncio.gather(*runs)

    asyncio.run(main())
