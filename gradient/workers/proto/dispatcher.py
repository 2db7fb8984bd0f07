"""The dispatcher: every session's messages of one kind in this process, applied together in batches.

Four per process: the handshake batcher (InitConnection; workers.services.worker_sessions_open, on the
sessions lane), the offers batcher (the offer delta after WorkerCapabilities;
scheduling.services.offers.job_offers_batch, on the offers lane), the report batcher (JobUpdate,
JobCompleted, JobFailed, BuildProgress, EvalProgress, BuildLog, and the AssignJobResponse answer;
gradient.scheduling.services.reports.worker_reports, on the hot lane) and the claim batcher
(RequestJob{build}; assignment.hand_out_builds, on the claims lane). A session's consumer hands each
message to `enqueue` (a report: without waiting for its result) or `submit` (a RequestJob: waiting for its
AssignJob). The batcher collects what every session queued for at most its window (or MAX_BATCH items) and
applies the lot in one call on its lane: one transaction, one commit. Up to IN_FLIGHT batches are applied
at once; while they are, the next one fills, and it starts as soon as a batch ends, before that one's
results are handed out (the lane works while the event loop answers). Under load batches grow and commits
per message fall; a lone message waits at most the window. A session's messages are in one batch at a
time, in the order it queued them.

A batch whose database connection died is applied again on a fresh connection (runtime.lanes.retrying:
every report is fenced by its assignment_id and every write is conditional, so a batch that did commit
unheard changes nothing the second time; a claim batch hands out a claim that committed unheard,
assignment.hand_out_builds); after its attempts the error goes to every message of the batch, and each
consumer ends its session as for any failure of ours.

What the two batchers apply is here too, one domain call per batch (`reports_batch`,
`request_builds_batch`): the consumer's route table (jobloop) keeps the calls of single messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from django.db import DataError, transaction
from django.utils import timezone

from gradient.core.protocol import (
    AssignJob,
    JobListChunk,
    RequestJob,
    RequestJobList,
    WorkerCapabilities,
    encode,
)
from gradient.runtime import lanes
from gradient.runtime.boot import current_boot
from gradient.scheduling.services import assignment, claims, offers, reports
from gradient.scheduling.services.reports import Incoming
from gradient.workers import presence, services
from gradient.workers.services import HandshakeAccepted, HandshakeRejected, SessionOpen, SessionRef

log = logging.getLogger("gradient.workers")

WINDOW_SECS = 0.003
MAX_BATCH = 256
# A hand-out brings four reports (AssignJobResponse, two JobUpdates, JobCompleted): the report batcher
# takes as many hand-outs' worth as the claim batcher takes requests.
MAX_REPORTS_BATCH = 4 * MAX_BATCH
# Batches of each kind applied at once. A session's messages are in one batch at a time (what it queued
# meanwhile waits for the next), so they apply in the order it sent them. One: since a claim batch lost
# five of its round trips (its sessions, idle slots, scores and payloads went into its other statements,
# 2026-12-03), one batch at a time makes larger batches, fewer statements per job, and shorter waits
# (bench/handout.py, 100 clients, quiet machine, 1/2/3 at once: 2 348 and 2 437 / 2 146 and 2 219 /
# 1 956 and 1 532 hand-outs/s, serve's CPU 0.31-0.33 / 0.37 / 0.41-0.51 ms each; claims 1 with reports
# 2 or the reverse were no better; at 300 clients 1 and 2 were alike). Before that, at 35-50 ms of wall
# time per batch for 5-9 ms of CPU, two at once overlapped their commits (4: 1 107/s, 2: 1 259-1 298/s).
IN_FLIGHT = 1  # the default of GRADIENT_BATCH_IN_FLIGHT

Apply = Callable[[Sequence[tuple[Any, Any]]], list[Any]]


@dataclass(slots=True)
class _Item:
    session: Any
    message: Any
    future: asyncio.Future[Any]
    # The session's, by identity (a consumer hands every message of its session with one object): hashing
    # a SessionRef hashes its two uuids in Python, several times per message in a batch's bookkeeping.
    key: int


def _apply_with_retries(apply: Apply, batch: Sequence[tuple[Any, Any]]) -> list[Any]:
    what = f"applying a batch of {len(batch)} ({getattr(apply, '__name__', 'messages')})"
    return lanes.retrying(functools.partial(apply, batch), what=what, logger=log)


class Batcher:
    """One per event loop (a serve process has one): collects and applies."""

    def __init__(
        self,
        apply: Apply,
        window: float = WINDOW_SECS,
        in_flight: int | None = None,
        lane: lanes.Lane = lanes.HOT,
        max_batch: int = MAX_BATCH,
        loop: asyncio.AbstractEventLoop | None = None,
        yield_to: Batcher | None = None,
        yield_secs: float = 0.0,
    ) -> None:
        if in_flight is None:
            from django.conf import settings

            in_flight = max(1, int(getattr(settings, "GRADIENT_BATCH_IN_FLIGHT", IN_FLIGHT)))
        self._apply = apply
        self._window = window
        self._lane = lane
        self._max_batch = max_batch
        # The loop it serves, kept: asyncio.get_running_loop() is a getpid() system call on Python 3.11
        # (its fork check), and the hot path asked it several times a message.
        self._loop = loop if loop is not None else asyncio.get_running_loop()
        self._free = in_flight  # batches that may start now
        self._applying: set[asyncio.Task[None]] = set()
        # The sessions (keys) with items in a batch being applied: in one batch each (_take holds back the
        # items of a session that has some in a batch being applied).
        self._sessions_applying: set[int] = set()
        self._items: list[_Item] = []
        self._first_at = 0.0  # when the oldest of self._items was queued (the loop's clock)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Nothing queued and nothing being applied (what a batcher yielding to this one waits for).
        self._idle = asyncio.Event()
        self._idle.set()
        self._yield_to = yield_to
        self._yield_secs = yield_secs

    async def idle(self, within: float) -> None:
        """Return once nothing is queued here nor being applied, or after `within` seconds."""
        if self._idle.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), within)

    async def submit(self, session: Any, message: Any) -> Any:
        """Apply `message` of `session` with the next batch; returns its result."""
        return await self.enqueue(session, message)

    def enqueue(self, session: Any, message: Any) -> asyncio.Future[Any]:
        """Queue `message` of `session` for the next batch, at once: the future has its result. What one
        session queues is applied in the order it was queued (in one batch, or in batches one after
        the other), so a session may queue several reports without waiting for each."""
        loop = self._loop
        future: asyncio.Future[Any] = loop.create_future()
        if not self._items:
            self._first_at = loop.time()
        self._idle.clear()
        self._items.append(_Item(session, message, future, id(session)))
        if self._free:
            # Nothing is being applied: the loop may start a batch. While every slot is busy it is not
            # woken for each message (a task step each, several per hand-out): the batch that ends
            # starts the next one (_applied).
            self._wake.set()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())
        return future

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            applying = self._sessions_applying
            if not self._free or not any(item.key not in applying for item in self._items):
                continue  # while every slot is busy the next batch grows; the first to end starts it
            # Let the other sessions' messages join, unless the oldest has waited a window already (it
            # came while the last batch was applied: under load the next batch is there, and waiting
            # more would leave the lane idle for nothing).
            waited = self._loop.time() - self._first_at
            if waited < self._window:
                await asyncio.sleep(self._window - waited)
            if self._yield_to is not None and waited < self._yield_secs:
                # What this batcher applies can wait; the other's cannot: its batches go first, for
                # at most yield_secs after this one's oldest message.
                await self._yield_to.idle(self._yield_secs - (self._loop.time() - self._first_at))
            self._start()

    def _start(self) -> None:
        """Start batches while a slot is free and something can be taken."""
        while self._free > 0:
            items = self._take()
            if not items:
                return
            self._free -= 1
            self._applying.add(self._loop.create_task(self._apply_batch(items)))

    def _take(self) -> list[_Item]:
        """The next batch: up to its max_batch items, in order, of sessions with none in a batch being
        applied (a session held back has all its items held back, so its order stays)."""
        taken: list[_Item] = []
        held: list[_Item] = []
        blocked: set[int] = set()
        applying = self._sessions_applying
        for item in self._items:
            key = item.key
            if len(taken) >= self._max_batch or key in blocked or key in applying:
                blocked.add(key)
                held.append(item)
            else:
                taken.append(item)
        applying.update([item.key for item in taken])
        self._items = held  # those held back have waited a window already: _first_at stays
        return taken

    def _applied(self, items: list[_Item]) -> None:
        """A batch has been applied (or has failed): its sessions and its slot are free, and the next
        batch starts now if its messages have waited a window, before this one's results go out (the
        lane is busy again while the event loop answers them)."""
        task = asyncio.current_task(self._loop)
        if task is not None:
            self._applying.discard(task)
        self._sessions_applying.difference_update([item.key for item in items])
        self._free += 1
        if not self._items and not self._applying:
            self._idle.set()
        if self._items:
            if self._loop.time() - self._first_at >= self._window:
                self._start()
            else:
                self._wake.set()  # what was held back for these sessions may go after its window

    async def _apply_batch(self, items: list[_Item]) -> None:
        batch = [(item.session, item.message) for item in items]
        try:
            results = await lanes.run(self._lane, _apply_with_retries, self._apply, batch)
        except Exception as exc:
            self._applied(items)
            for item in items:
                if not item.future.done():
                    item.future.set_exception(exc)
            return
        except BaseException:  # cancelled: the process is stopping
            self._applied(items)
            raise
        self._applied(items)
        for item, result in zip(items, results, strict=True):
            if not item.future.done():
                item.future.set_result(result)


_batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Apply, Batcher]] = (
    weakref.WeakKeyDictionary()
)

_last: tuple[Callable[[], asyncio.AbstractEventLoop | None], dict[Apply, Batcher]] = (lambda: None, {})


def batcher_for(
    apply: Apply,
    window: float = WINDOW_SECS,
    lane: lanes.Lane = lanes.HOT,
    max_batch: int = MAX_BATCH,
    loop: asyncio.AbstractEventLoop | None = None,
    yield_to: Batcher | None = None,
    yield_secs: float = 0.0,
) -> Batcher:
    """This event loop's batcher of `apply` (tests run several loops, one per test): one for reports on
    the hot lane, one for RequestJobs on the claims lane. `loop`: the running one, where the caller
    keeps it (asking for it is a system call, see Batcher)."""
    global _last
    if loop is None:
        loop = asyncio.get_running_loop()
    last_loop, mine = _last
    if last_loop() is not loop:  # WeakKeyDictionary.setdefault makes a weak reference per call
        mine = _batchers.setdefault(loop, {})
        _last = (weakref.ref(loop), mine)
    batcher = mine.get(apply)
    if batcher is None:
        batcher = mine[apply] = Batcher(
            apply, window, lane=lane, max_batch=max_batch, loop=loop, yield_to=yield_to, yield_secs=yield_secs
        )
    return batcher


def warm_lanes() -> None:
    """Before the first worker connects (serve's start): the database connections of the threads the
    batchers use first opened, and the claim statement planned on the claims lane's (a claim batch and
    a background read of the queue's heads run at once there). A fleet connecting at once had its first
    RequestJobs answered 120-145 ms after they were sent, where later ones took 40-60 ms
    (bench/handout.py, 100 clients): its first batches were each the first call of a thread."""
    now = timezone.now()
    lanes.CLAIMS.warm(2, functools.partial(claims.claim_statement_prepare, now=now))
    for lane in (lanes.HOT, lanes.SESSIONS, lanes.OFFERS):
        lane.warm(1)


# --- What the batchers apply: one domain call per batch ----------------------------------------------


def capabilities_batch(batch: Sequence[tuple[SessionRef, WorkerCapabilities]]) -> list[None]:
    """The WorkerCapabilities of any sessions of this process (a fleet connecting at once), stored
    together (services.workers_capabilities_replace: one statement). A value the database refuses (a
    DataError) costs only its own message: the batch is stored one by one, that one dropped and logged."""
    now = timezone.now()
    try:
        with transaction.atomic():
            services.workers_capabilities_replace(items=batch, now=now)
    except DataError:
        for session, capabilities in batch:
            try:
                with transaction.atomic():
                    services.worker_capabilities_replace(session=session, capabilities=capabilities, now=now)
            except DataError:
                log.warning("WorkerCapabilities of worker %s refused by the database", session.worker_id)
    for session, _ in batch:
        assignment.forget_card(session.session_id)
    return [None] * len(batch)


def job_lists_batch(batch: Sequence[tuple[SessionRef, RequestJobList]]) -> list[list[JobListChunk]]:
    """The RequestJobLists of any sessions of this process, answered together (offers.job_list_batch);
    the JobListChunk pages of each, in order."""
    return offers.job_list_batch(worker_ids=[session.worker_id for session, _ in batch], now=timezone.now())


def offers_batch(batch: Sequence[tuple[SessionRef, WorkerCapabilities]]) -> list[list[str]]:
    """The offer deltas after WorkerCapabilities of any sessions of this process (a fleet connecting at
    once), made together (offers.job_offers_batch); the JobOffer frames of each, in order, encoded here
    on the lane, once for the workers sent one shared first offer: 100 workers connecting to a deep
    queue each had its page of 1 000 candidates encoded on the event loop, in front of the first
    hand-outs (their p99 266 ms in the first half second against 75-104 ms after it, bench/handout.py)."""
    made = offers.job_offers_batch(worker_ids=[session.worker_id for session, _ in batch], now=timezone.now())
    frames: dict[int, str] = {}
    out: list[list[str]] = []
    for offered in made:
        for offer in offered:
            if id(offer) not in frames:
                frames[id(offer)] = encode(offer)
        out.append([frames[id(offer)] for offer in offered])
    return out


def open_sessions_batch(
    batch: Sequence[tuple[Any, SessionOpen]],
) -> list[HandshakeAccepted | HandshakeRejected]:
    """The InitConnections of any sockets of this process (keyed by their consumer), collected for a few
    milliseconds: their sessions opened together (services.worker_sessions_open); one result each."""
    return services.worker_sessions_open(
        requests=[request for _, request in batch], server_boot=current_boot(), now=timezone.now()
    )


def reports_batch(batch: Sequence[tuple[SessionRef, Incoming]]) -> list[reports.Result]:
    """A batch of reports, answers and log pieces from any sessions of this process, in one transaction
    (see Batcher); one result per message."""
    return reports.worker_reports(
        batch=[(session.worker_id, message) for session, message in batch], now=timezone.now()
    )


ASK_AGAIN = assignment.ASK_AGAIN


@dataclass(frozen=True, slots=True)
class BuildRequest:
    """A RequestJob{build} for the claim batcher, with how many of its worker's builds are finishing:
    their JobCompleted or JobFailed sent before it and still on their way to the database (the report
    batch applies them beside this claim, not before it)."""

    message: RequestJob
    finishing: int = 0


def request_builds_batch(
    batch: Sequence[tuple[SessionRef, BuildRequest]],
) -> list[AssignJob | assignment.AskAgain | None]:
    """RequestJob{build} from any sessions of this process, collected for a few milliseconds by the
    consumer's claim batcher: claimed together in one transaction (assignment.hand_out_builds); one
    AssignJob per request, ASK_AGAIN for one whose claims all lost (the consumer puts it in a next
    batch), or None for one left unanswered. A single request is a batch of one."""
    return assignment.hand_out_builds(
        worker_ids=[session.worker_id for session, _ in batch],
        now=timezone.now(),
        session_ids=[session.session_id for session, _ in batch],
        finishing=[request.finishing for _, request in batch],
        metrics=[presence.latest_metrics(session.session_id) for session, _ in batch],
    )
