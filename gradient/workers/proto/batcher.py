"""The report batcher: every session's reports of this process, applied together.

A session's consumer hands each report (JobUpdate, JobCompleted, JobFailed, BuildProgress, EvalProgress,
BuildLog, and the AssignJobResponse answer) to `submit` and awaits its result, so one session still has
one report in flight and its reports apply in the order it sent them. The batcher collects what every
session submits for at most WINDOW_SECS (or MAX_BATCH reports), and applies the lot in one call on the
hot lane: one transaction, one commit (gradient.scheduling.services.reports.worker_reports, through the
job loop). While one batch is applied the next one fills, so under load batches grow and commits per
report fall; a lone report waits at most the window.

A batch whose database connection died is applied again on a fresh connection (runtime.lanes.retrying:
every report is fenced by its assignment_id and every write is conditional, so a batch that did commit
unheard changes nothing the second time); after its attempts the error goes to every report of the
batch, and each consumer ends its session as for any failure of ours.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gradient.runtime import lanes

log = logging.getLogger("gradient.workers")

WINDOW_SECS = 0.003
MAX_BATCH = 256

Apply = Callable[[Sequence[tuple[Any, Any]]], list[Any]]


@dataclass
class _Item:
    session: Any
    message: Any
    future: asyncio.Future[Any]


def _apply_with_retries(apply: Apply, batch: Sequence[tuple[Any, Any]]) -> list[Any]:
    return lanes.retrying(functools.partial(apply, batch), what=f"applying {len(batch)} reports", logger=log)


class Batcher:
    """One per event loop (a serve process has one): collects and applies."""

    def __init__(self, apply: Apply, window: float = WINDOW_SECS) -> None:
        self._apply = apply
        self._window = window
        self._items: list[_Item] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def submit(self, session: Any, message: Any) -> Any:
        """Apply `message` of `session` with the next batch; returns its result."""
        return await self.enqueue(session, message)

    def enqueue(self, session: Any, message: Any) -> asyncio.Future[Any]:
        """Queue `message` of `session` for the next batch, at once: the future has its result. What one
        session queues is applied in the order it was queued (in one batch, or in batches one after
        the other), so a session may queue several reports without waiting for each."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._items.append(_Item(session, message, future))
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())
        return future

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._items:
                continue
            await asyncio.sleep(self._window)  # let the other sessions' messages join
            while self._items:
                items, self._items = self._items[:MAX_BATCH], self._items[MAX_BATCH:]
                await self._apply_batch(items)

    async def _apply_batch(self, items: list[_Item]) -> None:
        batch = [(item.session, item.message) for item in items]
        try:
            results = await lanes.run(lanes.HOT, _apply_with_retries, self._apply, batch)
        except Exception as exc:
            for item in items:
                if not item.future.done():
                    item.future.set_exception(exc)
            return
        for item, result in zip(items, results, strict=True):
            if not item.future.done():
                item.future.set_result(result)


_batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Apply, Batcher]] = (
    weakref.WeakKeyDictionary()
)


def batcher_for(apply: Apply, window: float = WINDOW_SECS) -> Batcher:
    """This event loop's batcher of `apply` (tests run several loops, one per test): one for reports, one
    for RequestJobs."""
    loop = asyncio.get_running_loop()
    mine = _batchers.setdefault(loop, {})
    batcher = mine.get(apply)
    if batcher is None:
        batcher = mine[apply] = Batcher(apply, window)
    return batcher
