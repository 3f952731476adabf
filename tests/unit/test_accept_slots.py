"""The API's accept slots: bounded, re-entrant within a task, given back around a slow wait."""

from __future__ import annotations

import asyncio
import contextlib

from api.state import AcceptSlots


def test_at_most_size_holders_and_the_rest_wait_their_turn() -> None:
    async def scenario() -> None:
        slots = AcceptSlots(2)
        inside = 0
        most = 0
        release = asyncio.Event()

        async def request() -> None:
            nonlocal inside, most
            async with slots.hold():
                inside += 1
                most = max(most, inside)
                await release.wait()
                inside -= 1

        tasks = [asyncio.create_task(request()) for _ in range(5)]
        await asyncio.sleep(0.01)
        assert inside == 2
        release.set()
        await asyncio.gather(*tasks)
        assert most == 2

    asyncio.run(scenario())


def test_a_holder_accepting_again_inside_does_not_wait_for_itself() -> None:
    async def scenario() -> None:
        slots = AcceptSlots(1)
        async with slots.hold(), asyncio.timeout(1), slots.hold():  # a compaction's summary, from inside
            pass
        async with asyncio.timeout(1), slots.hold():  # and the slot came back once
            pass

    asyncio.run(scenario())


def test_a_slot_given_up_lets_another_in_and_is_taken_again_after() -> None:
    async def scenario() -> None:
        slots = AcceptSlots(1)
        other_in = asyncio.Event()
        finished_waiting = asyncio.Event()

        async def other() -> None:
            async with slots.hold():
                other_in.set()
                await finished_waiting.wait()

        async with slots.hold():
            task = asyncio.create_task(other())
            async with slots.given_up():
                await asyncio.wait_for(other_in.wait(), 1)  # it got in meanwhile
                finished_waiting.set()
            await task  # this task holds a slot again, once the other gave it back
            second = asyncio.create_task(slots.hold().__aenter__())  # a task of its own waits
            await asyncio.sleep(0.01)
            assert not second.done()
            second.cancel()
        async with asyncio.timeout(1), slots.hold():
            pass

    asyncio.run(scenario())


def test_a_holder_cancelled_while_taking_its_slot_back_gives_nothing_back() -> None:
    async def scenario() -> None:
        slots = AcceptSlots(1)
        blocker_in = asyncio.Event()
        stop_blocker = asyncio.Event()

        async def holder() -> None:
            async with slots.hold(), slots.given_up():
                await blocker_in.wait()  # the slot is the blocker's now; taking it back waits

        async def blocker() -> None:
            async with slots.hold():
                blocker_in.set()
                await stop_blocker.wait()

        held = asyncio.create_task(holder())
        await asyncio.sleep(0)
        blocking = asyncio.create_task(blocker())
        await asyncio.wait_for(blocker_in.wait(), 1)
        await asyncio.sleep(0.01)
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held
        stop_blocker.set()
        await blocking
        # Exactly one slot: one holder gets in, a second must wait.
        async with slots.hold():
            waiting = asyncio.create_task(slots.hold().__aenter__())
            await asyncio.sleep(0.01)
            assert not waiting.done()
            waiting.cancel()

    asyncio.run(scenario())
