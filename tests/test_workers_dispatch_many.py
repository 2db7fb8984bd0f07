"""The consumer's message loop (consumer._dispatch_many): Channels' await_many_dispatch, one task per
source instead of one per message."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from channels.exceptions import StopConsumer

from gradient.workers.proto.consumer import _dispatch_many


def test_every_message_of_every_source_is_dispatched_one_at_a_time_in_each_sources_order() -> None:
    async def scenario() -> tuple[list[Any], int]:
        socket: asyncio.Queue[Any] = asyncio.Queue()
        channel: asyncio.Queue[Any] = asyncio.Queue()
        for i in range(50):
            socket.put_nowait(("socket", i))
            channel.put_nowait(("channel", i))
        seen: list[Any] = []
        running = 0
        most = 0

        async def dispatch(message: Any) -> None:
            nonlocal running, most
            if message == "stop":
                raise StopConsumer
            running += 1
            most = max(most, running)
            await asyncio.sleep(0)  # a dispatch that awaits: nothing else may be dispatched meanwhile
            seen.append(message)
            running -= 1
            if len(seen) == 100:
                socket.put_nowait("stop")

        with pytest.raises(StopConsumer):
            await _dispatch_many([socket.get, channel.get], dispatch)
        return seen, most

    seen, most = asyncio.run(scenario())
    assert most == 1
    assert [m for m in seen if m[0] == "socket"] == [("socket", i) for i in range(50)]
    assert [m for m in seen if m[0] == "channel"] == [("channel", i) for i in range(50)]


def test_after_a_failure_nothing_more_is_dispatched_and_the_receives_are_cancelled() -> None:
    async def scenario() -> tuple[list[Any], bool]:
        socket: asyncio.Queue[Any] = asyncio.Queue()
        channel: asyncio.Queue[Any] = asyncio.Queue()
        pending: list[asyncio.Task[Any]] = []

        async def channel_receive() -> Any:
            pending.append(asyncio.current_task())  # type: ignore[arg-type]
            return await channel.get()

        seen: list[Any] = []

        async def dispatch(message: Any) -> None:
            if message == "boom":
                channel.put_nowait("late")  # ready while the failure is on its way out
                await asyncio.sleep(0)
                raise ValueError("boom")
            seen.append(message)

        socket.put_nowait("first")
        socket.put_nowait("boom")
        with pytest.raises(ValueError, match="boom"):
            await _dispatch_many([socket.get, channel_receive], dispatch)
        return seen, all(task.done() for task in pending)

    seen, receives_ended = asyncio.run(scenario())
    assert seen == ["first"]  # "late" was there before the failure was out: never dispatched
    assert receives_ended


def test_a_failing_source_ends_the_loop_with_its_error() -> None:
    async def scenario() -> None:
        socket: asyncio.Queue[Any] = asyncio.Queue()

        async def broken() -> Any:
            await asyncio.sleep(0)
            raise ConnectionError("the channel layer is gone")

        async def dispatch(message: Any) -> None:
            raise AssertionError("nothing to dispatch")

        await _dispatch_many([socket.get, broken], dispatch)

    with pytest.raises(ConnectionError, match="channel layer"):
        asyncio.run(scenario())


def test_a_source_failing_while_a_message_is_dispatched_lets_that_dispatch_finish() -> None:
    """A channel layer gone (Redis restarted) while a handshake is being applied: the handshake ends
    (its session is known, so the consumer can close it) before the failure ends the loop."""

    async def scenario() -> list[str]:
        socket: asyncio.Queue[Any] = asyncio.Queue()
        socket.put_nowait("handshake")
        steps: list[str] = []
        started = asyncio.Event()

        async def broken() -> Any:
            await started.wait()
            raise ConnectionError("the channel layer is gone")

        async def dispatch(message: Any) -> None:
            steps.append(f"{message} begun")
            started.set()
            for _ in range(5):  # the lane's work, across several turns of the loop
                await asyncio.sleep(0)
            steps.append(f"{message} done")

        with pytest.raises(ConnectionError):
            await _dispatch_many([socket.get, broken], dispatch)
        return steps

    assert asyncio.run(scenario()) == ["handshake begun", "handshake done"]


def test_cancelled_from_outside_it_stops_at_once() -> None:
    async def scenario() -> bool:
        socket: asyncio.Queue[Any] = asyncio.Queue()
        socket.put_nowait("slow")
        finished = False

        async def dispatch(message: Any) -> None:
            nonlocal finished
            await asyncio.sleep(60)
            finished = True

        loop_task = asyncio.ensure_future(_dispatch_many([socket.get], dispatch))
        await asyncio.sleep(0.01)
        loop_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop_task
        return finished

    assert asyncio.run(scenario()) is False
