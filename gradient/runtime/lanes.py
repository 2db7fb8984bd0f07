"""Lanes: the threads of this process that talk to the database for the hot path.

A lane is a small, fixed pool of threads, each keeping one long-lived Django connection for as long as
the process lives. Nothing on a lane calls `close_old_connections`, so no message pays Django's
connection health check (`CONN_HEALTH_CHECKS`: a `SELECT 1` before the first query after each
"request"); a connection is checked only when it failed: the caller that sees an OperationalError or
InterfaceError outside a transaction drops it (`drop_connection`) and the next query opens a new one.

Four lanes, so that slow work cannot hold up fast work:

- `SESSIONS`: handshakes, session closes and the presence flush (gradient.workers.presence): however
  deep the job traffic's queue, a worker connects, a closed session is closed at once (its worker may
  reconnect), and "seen" reaches the database long before the liveness timeout.
- `CLAIMS`: the batches of RequestJob{build} (the claim batcher, gradient.workers.proto.dispatcher), and
  a single RequestJob for an evaluation.
- `HOT`: the batched reports (gradient.workers.proto.dispatcher).
- `OFFERS`: the offer pass of one worker (JobOffer deltas, JobListChunk pages) and score uploads, which
  with a deep queue take far longer than a claim; they queue behind each other, never behind a claim.

The event loop never waits on a lane: `await run(lane, fn, ...)` suspends only the coroutine that asked
(one socket's consumer), and every other socket goes on being read, answered and pinged.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from django.conf import settings
from django.db import InterfaceError, OperationalError, connections

from gradient.core.lines import first_line

log = logging.getLogger("gradient.runtime")

# A call whose database connection died is made again on a fresh connection this many times in all.
DB_ATTEMPTS = 3
DB_RETRY_PAUSE_SECS = 0.1

T = TypeVar("T")


class Lane:
    """A named pool of database threads (created on first use, in whichever process uses it)."""

    def __init__(self, name: str, threads: Callable[[], int]) -> None:
        self.name = name
        self._threads = threads
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._busy = 0

    @property
    def size(self) -> int:
        return max(1, int(self._threads()))

    @property
    def busy(self) -> int:
        """Calls running or queued on this lane right now."""
        return self._busy

    def executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=self.size, thread_name_prefix=f"gradient-lane-{self.name}"
                )
            return self._executor

    def warm(self, threads: int, prepare: Callable[[], None] | None = None) -> int:
        """Start `threads` of the lane's threads now (at most its size), each with its database
        connection open and `prepare()` run on it, so that the first calls do not pay for them (a
        serve's start: its first claim batches each met a fresh connection). Returns how many were
        warmed; a thread that fails is logged and left to open its connection on first use."""
        count = min(threads, self.size)
        if count <= 0:
            return 0
        # Each call waits for the others: every one runs on a thread of its own.
        barrier = threading.Barrier(count, timeout=5)
        futures = [self.executor().submit(_warm_one, barrier, prepare) for _ in range(count)]
        warmed = 0
        for future in futures:
            try:
                future.result(timeout=10)
                warmed += 1
            except Exception as exc:
                log.warning("warming a thread of lane %s failed: %s", self.name, first_line(exc))
        return warmed

    def shutdown(self) -> None:
        """Close every connection the lane's threads hold and stop them (serve's exit, a test's end)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is None:
            return
        # One close per thread: each connection belongs to the thread that opened it.
        threads = executor._max_workers  # the executor's own count: the setting may have changed since
        barrier = threading.Barrier(threads, timeout=5)
        futures = [executor.submit(_close_after, barrier) for _ in range(threads)]
        for future in futures:
            try:
                future.result(timeout=10)
            except Exception:  # a thread that could not join the barrier still closed its own
                log.debug("closing a lane connection failed", exc_info=True)
        executor.shutdown(wait=True)


def _warm_one(barrier: threading.Barrier, prepare: Callable[[], None] | None) -> None:
    barrier.wait()
    connections["default"].ensure_connection()
    if prepare is not None:
        prepare()


def _close_after(barrier: threading.Barrier) -> None:
    try:
        barrier.wait()
    finally:
        connections.close_all()


def _hot_threads() -> int:
    return int(getattr(settings, "GRADIENT_HOT_LANE_THREADS", 4))


def _claim_threads() -> int:
    return int(getattr(settings, "GRADIENT_CLAIM_LANE_THREADS", 4))


def _offer_threads() -> int:
    return int(getattr(settings, "GRADIENT_OFFER_LANE_THREADS", 1))


def _session_threads() -> int:
    return int(getattr(settings, "GRADIENT_SESSION_LANE_THREADS", 2))


SESSIONS = Lane("sessions", _session_threads)
CLAIMS = Lane("claims", _claim_threads)
HOT = Lane("hot", _hot_threads)
OFFERS = Lane("offers", _offer_threads)
LANES = (SESSIONS, CLAIMS, HOT, OFFERS)


async def run(lane: Lane, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run `fn(*args, **kwargs)` on one of the lane's threads and return its result; the caller's
    context variables go with it."""
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()
    call = functools.partial(context.run, fn, *args, **kwargs)
    lane._busy += 1
    try:
        return await loop.run_in_executor(lane.executor(), call)
    finally:
        lane._busy -= 1


def drop_connection() -> None:
    """Forget this thread's database connection after it died; the next query opens a new one."""
    try:
        connections["default"].close()
    except Exception:  # it is dead already
        log.debug("closing a dead database connection failed", exc_info=True)


def retrying(
    call: Callable[[], T],
    *,
    what: str,
    logger: logging.Logger = log,
    attempts: int = DB_ATTEMPTS,
    pause: float = DB_RETRY_PAUSE_SECS,
) -> T:
    """`call()`, made again on a fresh connection when its database connection died (OperationalError or
    InterfaceError outside a transaction: the transaction it was in has rolled back), up to `attempts`
    in all, pausing `pause` times the attempt between; the last failure goes on. Only for calls that are
    safe to repeat (fenced, conditional writes). `what` says what was being done, for the log line. A
    dead connection is dropped also after the last attempt, so the next call opens a fresh one
    (`attempts=1`: one try, and a clean connection after a failure)."""
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except (OperationalError, InterfaceError) as exc:
            if connections["default"].in_atomic_block:
                raise  # the transaction's owner decides; its connection is not this call's to drop
            drop_connection()
            if attempt == attempts:
                raise
            logger.warning("database connection lost %s (%s); trying again", what, first_line(exc))
            time.sleep(pause * attempt)
    raise AssertionError("unreachable")


def shutdown_all() -> None:
    for lane in LANES:
        lane.shutdown()
