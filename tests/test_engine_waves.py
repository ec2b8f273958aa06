"""Unit tier: the engine's waves (workers/engine/waves.py): runs that arrive together enter
vLLM together, those arriving while others are inside wait for the window or until their wave
fills an engine step (in runs or in prompt tokens), not for the engine to empty (one that has
just emptied is not idle: the window runs from the last wave); an interactive
run enters at once, a run cancelled while it waits never enters. On a real asyncio loop; the
window is the only clock."""
from __future__ import annotations

import asyncio

from workers.engine.waves import Waves

WINDOW = 0.05


async def _hold(waves: Waves, entered: list, release: asyncio.Event, name: str,
                at_once: bool = False) -> None:
    async with waves.entry(at_once):
        entered.append((name, asyncio.get_running_loop().time()))
        await release.wait()


async def _until(cond) -> None:
    async with asyncio.timeout(5):
        while not cond():
            await asyncio.sleep(0.002)


def test_runs_arriving_together_at_an_empty_engine_enter_together_without_the_window():
    async def main():
        loop = asyncio.get_running_loop()
        waves, entered, release = Waves(WINDOW), [], asyncio.Event()
        start = loop.time()
        runs = [asyncio.ensure_future(_hold(waves, entered, release, f"r{i}")) for i in range(4)]
        await _until(lambda: len(entered) == 4)
        assert waves.waves == 1 and waves.inside == 4
        assert max(t for _, t in entered) - start < WINDOW / 2  # the next turn, not the window
        release.set()
        await asyncio.gather(*runs)
        assert waves.inside == 0

    asyncio.run(main())


def test_runs_arriving_while_others_are_inside_wait_for_the_window_and_enter_as_one_wave():
    async def main():
        loop = asyncio.get_running_loop()
        waves, entered, release = Waves(WINDOW), [], asyncio.Event()
        first = asyncio.ensure_future(_hold(waves, entered, release, "first"))
        await _until(lambda: len(entered) == 1)
        start = loop.time()
        rest = [asyncio.ensure_future(_hold(waves, entered, release, f"r{i}")) for i in range(5)]
        await asyncio.sleep(WINDOW / 5)
        assert len(entered) == 1 and waves.inside == 1  # they wait for the wave
        await _until(lambda: len(entered) == 6)
        times = [t for _, t in entered[1:]]
        assert waves.waves == 2 and waves.inside == 6
        assert max(times) - min(times) < WINDOW / 2  # one wave, one turn of the loop
        assert min(times) - start >= WINDOW * 0.9  # and not before the window
        release.set()
        await asyncio.gather(first, *rest)
        assert waves.inside == 0

    asyncio.run(main())


async def _hold_tokens(waves: Waves, entered: list, release: asyncio.Event, name: str,
                       tokens: int) -> None:
    async with waves.entry(tokens=tokens):
        entered.append((name, asyncio.get_running_loop().time()))
        await release.wait()


def test_a_wave_waits_for_its_window_even_when_the_engine_empties():
    async def main():
        loop = asyncio.get_running_loop()
        waves, entered = Waves(WINDOW, step_runs=100), []
        done, hold = asyncio.Event(), asyncio.Event()
        first = asyncio.ensure_future(_hold(waves, entered, done, "first"))
        await _until(lambda: len(entered) == 1)
        start = loop.time()
        later = asyncio.ensure_future(_hold(waves, entered, hold, "later"))
        await asyncio.sleep(0)
        done.set()  # the only run inside leaves: the engine is empty
        await first
        assert waves.inside == 0 and len(entered) == 1  # and the wave still waits
        await _until(lambda: len(entered) == 2)
        assert entered[1][1] - start >= WINDOW * 0.9  # for its window
        hold.set()
        await later

    asyncio.run(main())


def test_a_run_at_an_engine_that_just_emptied_waits_for_the_window_from_the_last_wave():
    async def main():
        loop = asyncio.get_running_loop()
        waves, entered, release = Waves(WINDOW), [], asyncio.Event()
        done = asyncio.Event()
        first = asyncio.ensure_future(_hold(waves, entered, done, "first"))  # an idle engine
        await _until(lambda: len(entered) == 1)
        went = entered[0][1]  # its wave went just before it entered
        done.set()
        await first  # the engine is empty again, but not idle: a wave went just now
        later = asyncio.ensure_future(_hold(waves, entered, release, "later"))
        await _until(lambda: len(entered) == 2)
        assert entered[1][1] - went >= WINDOW * 0.9
        release.set()
        await later
        await asyncio.sleep(WINDOW * 1.2)  # idle for a window: the next one goes at once
        start = loop.time()
        lone = asyncio.ensure_future(_hold(waves, entered, release, "lone"))
        await _until(lambda: len(entered) == 3)
        assert entered[2][1] - start < WINDOW / 2
        await lone

    asyncio.run(main())


def test_a_wave_that_fills_an_engine_step_goes_at_once():
    async def main():
        loop = asyncio.get_running_loop()
        release = asyncio.Event()
        # In runs: a window far longer than the test, a step of 3 runs.
        waves, entered = Waves(10.0, step_runs=3), []
        first = asyncio.ensure_future(_hold(waves, entered, release, "first"))
        await _until(lambda: len(entered) == 1)
        start = loop.time()
        full = [asyncio.ensure_future(_hold(waves, entered, release, f"r{i}")) for i in range(3)]
        await _until(lambda: len(entered) == 4)
        assert loop.time() - start < 1.0 and waves.waves == 2
        late = asyncio.ensure_future(_hold(waves, entered, release, "late"))  # the next wave
        await asyncio.sleep(WINDOW)
        assert len(entered) == 4
        late.cancel()
        # In prompt tokens: a step of 100, runs of 60.
        by_tokens, in_tokens = Waves(10.0, step_tokens=100), []
        head = asyncio.ensure_future(_hold(by_tokens, in_tokens, release, "first"))
        await _until(lambda: len(in_tokens) == 1)
        one = asyncio.ensure_future(_hold_tokens(by_tokens, in_tokens, release, "a", 60))
        await asyncio.sleep(WINDOW)
        assert len(in_tokens) == 1  # 60 tokens: not a step yet
        two = asyncio.ensure_future(_hold_tokens(by_tokens, in_tokens, release, "b", 60))
        await _until(lambda: len(in_tokens) == 3)
        release.set()
        await asyncio.gather(first, *full, head, one, two)
        assert waves.inside == 0 and by_tokens.inside == 0

    asyncio.run(main())


def test_a_run_cancelled_while_it_waits_never_enters_and_the_wave_still_comes():
    async def main():
        waves, entered, release = Waves(WINDOW), [], asyncio.Event()
        first = asyncio.ensure_future(_hold(waves, entered, release, "first"))
        await _until(lambda: len(entered) == 1)
        gone = asyncio.ensure_future(_hold(waves, entered, release, "gone"))
        kept = asyncio.ensure_future(_hold(waves, entered, release, "kept"))
        await asyncio.sleep(0)
        gone.cancel()
        await _until(lambda: len(entered) == 2)
        assert [n for n, _ in entered] == ["first", "kept"] and gone.cancelled()
        assert waves.inside == 2
        release.set()
        await asyncio.gather(first, kept)
        assert waves.inside == 0

    asyncio.run(main())


def test_an_interactive_run_and_every_run_without_a_window_enter_at_once():
    async def main():
        waves, entered, release = Waves(WINDOW), [], asyncio.Event()
        first = asyncio.ensure_future(_hold(waves, entered, release, "first"))
        await _until(lambda: len(entered) == 1)
        urgent = asyncio.ensure_future(_hold(waves, entered, release, "urgent", at_once=True))
        await asyncio.sleep(0)
        assert [n for n, _ in entered] == ["first", "urgent"]
        none, plain = Waves(0.0), []
        runs = [asyncio.ensure_future(_hold(none, plain, release, f"r{i}")) for i in range(3)]
        await asyncio.sleep(0)
        assert len(plain) == 3 and none.waves == 0
        release.set()
        await asyncio.gather(first, urgent, *runs)

    asyncio.run(main())
