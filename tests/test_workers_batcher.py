"""The batcher (workers/proto/dispatcher.py): what queues while a batch is applied goes together in the next
one, which starts as the first ends; each session's messages apply in the order queued; the batcher's
loop is not woken for every message while its slots are busy."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from gradient.runtime import lanes
from gradient.workers.proto.dispatcher import Batcher

pytestmark = pytest.mark.django_db(transaction=True)


async def test_what_queues_while_a_batch_is_applied_goes_in_the_next_one_in_each_sessions_order() -> None:
    release = threading.Event()
    started = threading.Event()
    batches: list[list[tuple[str, int]]] = []

    def apply(batch: Sequence[tuple[Any, Any]]) -> list[Any]:
        batches.append([(session.name, message) for session, message in batch])
        if len(batches) == 1:
            started.set()
            assert release.wait(10)  # the first batch is held until everything else has queued
        return [message * 10 for _, message in batch]

    class Session:
        def __init__(self, name: str) -> None:
            self.name = name

    a, b = Session("a"), Session("b")
    batcher = Batcher(apply, window=0.001, in_flight=1, lane=lanes.HOT)
    first = batcher.enqueue(a, 0)
    assert await asyncio.to_thread(started.wait, 10)  # the first batch is being applied
    wake = batcher._wake
    sets: list[int] = []
    real_set = wake.set

    def counted_set() -> None:
        sets.append(1)
        real_set()

    wake.set = counted_set  # type: ignore[method-assign]
    later = [batcher.enqueue(a if i % 2 else b, i) for i in range(1, 101)]
    assert sets == [], "not woken per message while its one slot is busy"
    release.set()
    assert await asyncio.wait_for(first, 10) == 0
    assert [await asyncio.wait_for(f, 10) for f in later] == [i * 10 for i in range(1, 101)]
    assert len(batches) == 2, "the hundred went together, as soon as the first batch ended"
    for name in ("a", "b"):
        order = [m for s, m in batches[1] if s == name]
        assert order == sorted(order), "each session's messages in the order it queued them"


async def test_with_two_batches_at_once_a_session_in_one_waits_for_it_the_others_go() -> None:
    """Two slots: while a batch holding session a's messages is applied, the next batch takes b's and c's
    and holds a's back; a's go, in order, once its batch ends (a session's messages are in one batch at
    a time)."""
    release = threading.Event()
    started = threading.Event()
    batches: list[list[tuple[str, int]]] = []
    lock = threading.Lock()

    def apply(batch: Sequence[tuple[Any, Any]]) -> list[Any]:
        with lock:
            batches.append([(session.name, message) for session, message in batch])
            first = len(batches) == 1
        if first:
            started.set()
            assert release.wait(10)
        return [message for _, message in batch]

    class Session:
        def __init__(self, name: str) -> None:
            self.name = name

    a, b, c = Session("a"), Session("b"), Session("c")
    batcher = Batcher(apply, window=0.001, in_flight=2, lane=lanes.HOT)
    held = batcher.enqueue(a, 0)
    assert await asyncio.to_thread(started.wait, 10)
    later = [batcher.enqueue(s, i) for i, s in enumerate((a, b, c, a, b), start=1)]
    others = [later[1], later[2], later[4]]  # b's and c's
    assert [await asyncio.wait_for(f, 10) for f in others] == [2, 3, 5], "b and c went beside a's batch"
    assert not later[0].done() and not later[3].done(), "a's wait for its batch"
    assert [(s, m) for s, m in batches[1]] == [("b", 2), ("c", 3), ("b", 5)]
    release.set()
    assert await asyncio.wait_for(held, 10) == 0
    assert [await asyncio.wait_for(later[i], 10) for i in (0, 3)] == [1, 4]
    assert [m for batch in batches[2:] for s, m in batch if s == "a"] == [1, 4]


async def test_a_lone_message_is_applied_within_its_window() -> None:
    applied: list[int] = []

    def apply(batch: Sequence[tuple[Any, Any]]) -> list[Any]:
        applied.extend(message for _, message in batch)
        return [None for _ in batch]

    batcher = Batcher(apply, window=0.002, in_flight=1, lane=lanes.HOT)
    await asyncio.wait_for(batcher.enqueue(object(), 7), 5)
    assert applied == [7]


async def test_a_batcher_yielding_to_another_waits_for_its_batches_for_at_most_its_time() -> None:
    order: list[str] = []
    release = threading.Event()

    def claims(batch: Sequence[tuple[Any, Any]]) -> list[Any]:
        order.append("claims")
        assert release.wait(10)
        return [None for _ in batch]

    def offers(batch: Sequence[tuple[Any, Any]]) -> list[Any]:
        order.append("offers")
        return [None for _ in batch]

    first = Batcher(claims, window=0.001, in_flight=1, lane=lanes.HOT)
    patient = Batcher(offers, window=0.001, in_flight=1, lane=lanes.OFFERS, yield_to=first, yield_secs=10.0)
    busy = first.enqueue(object(), 1)
    waiting = patient.enqueue(object(), 2)
    await asyncio.sleep(0.3)
    assert order == ["claims"] and not waiting.done()  # the other's batch is applied: this one waits
    release.set()
    await asyncio.wait_for(asyncio.gather(busy, waiting), 5)
    assert order == ["claims", "offers"]

    # Behind a batcher that does not go idle, it goes after its time all the same.
    release.clear()
    order.clear()
    hasty = Batcher(offers, window=0.001, in_flight=1, lane=lanes.OFFERS, yield_to=first, yield_secs=0.1)
    busy = first.enqueue(object(), 3)
    await asyncio.wait_for(hasty.enqueue(object(), 4), 5)
    assert order == ["claims", "offers"] and not busy.done()
    release.set()
    await asyncio.wait_for(busy, 5)

    # Behind an idle one it does not wait.
    order.clear()
    await asyncio.wait_for(patient.enqueue(object(), 5), 2)
    assert order == ["offers"]
