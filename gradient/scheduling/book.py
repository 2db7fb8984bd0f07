"""The book of a `serve` process: the heads of the queue of shared builds, in memory, per kind of worker.

A batch of RequestJob{build} ranks, for each kind of worker asking (its systems, its projects: the
worker's shape), the heads of the queue that such a worker may take: every prioritized build, the oldest,
those past the WaitTime cap in id order (selectors.queued_build_refs). Without the book every batch read
them again; with it a process reads them once and keeps them until they no longer hold:

- a build claimed by this process, or whose claim lost (taken elsewhere, no longer Queued, no longer
  wanted), leaves the book at once (`gone`);
- a change that can put a build ahead of the book's (a build becomes Queued, a Queued build is
  prioritized or comes out of backoff, a Queued build becomes wanted by another evaluation, an
  evaluation becomes active again) is announced by PostgreSQL: statement-level triggers send
  NOTIFY gradient_queue (migration 0013), a thread of this process LISTENs and marks every entry old;
- an entry is read again once it is MAX_AGE_SECS old (what the clock alone changes: backoffs that
  end, builds that pass the WaitTime cap; and a lost notification), or when few of its rows are left
  (a quarter of a large entry, half of a small one: _refill_below; the rows behind them were never
  read). Where the caller can read in the background (a serve's claims lane has threads to spare), a
  depleted or old entry is read again there while the batches go on taking what is left; a missing
  or announced-changed one, or one with nothing left, is read at once.

Memory may make a claim lose, never win: the claim statement (claims.claim_builds_statement) checks
every condition again on the locked row (Queued, out of backoff, no live cluster member's, wanted by an
active evaluation of one of the claiming worker's projects), and the open-assignment index arbitrates.

Only a `serve` on PostgreSQL keeps a book (`enable`, from the serve command): everywhere else (the
embedded SQLite mode, Celery, tests calling the services) each batch reads the queue, as before.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

log = logging.getLogger("gradient.scheduling")

CHANNEL = "gradient_queue"
MAX_AGE_SECS = 1.0
RECONNECT_SECS = 1.0
RECENT_SECS = 5.0
RECENT_MAX = 20_000
PAYLOADS_MAX = 50_000


# The rows an entry of RUNWAY rows or fewer keeps at least before it is read again (half of them): the
# batches take them while it is read in the background.
RUNWAY = 256


def _refill_below(rows: int) -> float:
    """An entry of `rows` is read again once fewer than this are left: a quarter of a large one (each read
    of a thousand heads ranks them all again: read at half left, every head handed out had been read
    and ranked twice on average, 13-15 % of serve's time under load, bench/handout.py, 100 clients),
    but half of a small one (RUNWAY)."""
    return max(rows / 4, min(RUNWAY, rows / 2))


class Item(Protocol):
    """What the book keeps: anything with the build's id (the hand-out path keeps its ranked
    selectors.BuildRef)."""

    @property
    def id(self) -> uuid.UUID: ...


Row = TypeVar("Row", bound=Item)
P = TypeVar("P")


@dataclass
class _Entry(Generic[Row]):
    rows: list[Row]
    generation: int
    loaded_at: float
    preselect: int
    gone: set[uuid.UUID] = field(default_factory=set)
    # left(), kept until more is gone: every claim batch asks for it, and a uuid's hash is Python code.
    _left: list[Row] | None = None
    # The rows left by id, in order (made at the first drop): a batch's claims leave by their ids, a
    # hash each, instead of a pass over every row left (two per claim batch, a thousand hashes each).
    _by_id: dict[uuid.UUID, Row] | None = None

    def left(self) -> list[Row]:
        if self._left is None:
            if self._by_id is not None:
                self._left = list(self._by_id.values())
            else:
                self._left = [r for r in self.rows if r.id not in self.gone]
        return self._left

    def drop(self, ids: set[uuid.UUID]) -> None:
        """These are gone (claimed, or their claim lost)."""
        by_id = self._by_id
        if by_id is None:
            by_id = self._by_id = {r.id: r for r in self.left()}
        taken = [by_id.pop(i, None) for i in ids]
        if any(r is not None for r in taken):
            self._left = None
        self.gone |= ids


class QueueBook:
    """The heads per shape, thread-safe (the claims lane applies several batches at once)."""

    def __init__(self, max_age: float = MAX_AGE_SECS) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Hashable, _Entry[Any]] = {}
        self._generation = 0
        self._max_age = max_age
        # Builds gone lately, with when: a read that began before their claim committed still sees them
        # Queued, so a fresh entry starts with them gone (kept for RECENT_SECS).
        self._recent: dict[uuid.UUID, float] = {}
        self.loads = 0  # how many times the queue was read (the benchmark and the tests look)
        self._payloads: dict[uuid.UUID, Any] = {}  # insertion-ordered: the oldest first
        self._refilling: set[Hashable] = set()  # shapes being read in the background

    @property
    def generation(self) -> int:
        """Bumped by every announced change of the queue (and every clear): what was read under an older
        one may be behind."""
        return self._generation

    def changed(self) -> None:
        """Something may have put a build ahead of what the book holds: every entry is read again."""
        with self._lock:
            self._generation += 1

    def heads(
        self,
        shape: Hashable,
        preselect: int,
        load: Callable[[int], list[Row]],
        background: Callable[[Callable[[], None]], object] | None = None,
        first: int | None = None,
    ) -> list[Row]:
        """The rows of `shape` still in the book, read with `load(preselect)` when the entry is missing,
        old, announced changed, read with fewer, or depleted (_refill_below). With `background` (a way to
        run a call on another thread), a depleted or old entry that still has rows is read again there,
        once at a time per shape, and its rows are returned meanwhile. `first` (with `background`): what the
        caller needs now, fewer than `preselect`. An entry to be read at once (missing, announced
        changed, or nothing left) is then read with `load(first)`, and with `load(preselect)` in the
        background: the first batch of a fleet waited for a thousand heads and their payloads (85 of
        its 105 ms, bench/handout.py), and so did each of its hundred workers' first RequestJob."""
        now = time.monotonic()
        with self._lock:
            entry = self._entries.get(shape)
            generation = self._generation
            if entry is not None and entry.generation == generation:
                left = entry.left()
                if entry.preselect < preselect:
                    # Read with fewer: the whole read is on its way in the background (or read now).
                    if left and shape in self._refilling:
                        return left
                else:
                    fresh = now - entry.loaded_at < self._max_age
                    if fresh and len(left) >= _refill_below(len(entry.rows)):
                        return left
                    if left and background is not None:
                        if shape in self._refilling or self._in_background(
                            shape, preselect, load, background
                        ):
                            return left
        quick = background is not None and first is not None and first < preselect
        read = first if quick and first is not None else preselect
        rows = load(read)  # outside the lock: the other batches go on meanwhile
        with self._lock:
            stored = self._store(shape, rows, generation, now, read)
            if quick and background is not None and shape not in self._refilling:
                self._in_background(shape, preselect, load, background)  # the whole read behind
            return stored.left()

    def _in_background(
        self,
        shape: Hashable,
        preselect: int,
        load: Callable[[int], list[Row]],
        background: Callable[[Callable[[], None]], object],
    ) -> bool:
        """Under the lock: read `shape` again on another thread; False where no thread can (the process
        is stopping)."""
        try:
            background(lambda: self._refill(shape, preselect, load))
        except RuntimeError:
            log.debug("no background read of the queue's heads", exc_info=True)
            return False
        self._refilling.add(shape)
        return True

    def _store(
        self, shape: Hashable, rows: list[Row], generation: int, read_at: float, preselect: int
    ) -> _Entry[Row]:
        """Under the lock: the entry read at `read_at` (read before a change announced meanwhile? then it
        is stored as old already). The builds gone lately may have been read still Queued: gone here too."""
        self.loads += 1
        recent = self._recent
        gone = {r.id for r in rows if r.id in recent}
        entry = self._entries[shape] = _Entry(rows, generation, read_at, preselect, gone)
        return entry

    def _refill(self, shape: Hashable, preselect: int, load: Callable[[int], list[Row]]) -> None:
        with self._lock:
            generation = self._generation
        started = time.monotonic()
        try:
            rows = load(preselect)
        except Exception:  # the next batch reads it itself
            log.warning("reading the queue's heads in the background failed", exc_info=True)
            with self._lock:
                self._refilling.discard(shape)
                self._entries.pop(shape, None)
            return
        with self._lock:
            self._refilling.discard(shape)
            current = self._entries.get(shape)
            if current is None or current.loaded_at <= started:  # not behind one read since
                self._store(shape, rows, generation, started, preselect)

    def payloads(
        self, build_ids: Iterable[uuid.UUID], load: Callable[[list[uuid.UUID]], dict[uuid.UUID, P]]
    ) -> dict[uuid.UUID, P]:
        """Each build's job payload, made once per process (a build's payload never changes): those not
        kept yet loaded with `load(missing)`; the oldest forgotten past PAYLOADS_MAX."""
        ids = list(build_ids)
        with self._lock:
            found = {b: self._payloads[b] for b in ids if b in self._payloads}
        missing = [b for b in ids if b not in found]
        if missing:
            made = load(missing)
            with self._lock:
                self._payloads.update(made)
                while len(self._payloads) > PAYLOADS_MAX:
                    self._payloads.pop(next(iter(self._payloads)))
            found.update(made)
        return found

    def gone(self, build_ids: Iterable[uuid.UUID]) -> None:
        """Builds claimed, or whose claim lost: out of every entry."""
        ids = set(build_ids)
        if not ids:
            return
        now = time.monotonic()
        with self._lock:
            for entry in self._entries.values():
                entry.drop(ids)
            for build_id in ids:
                self._recent[build_id] = now
            if len(self._recent) > RECENT_MAX:
                self._recent = {b: t for b, t in self._recent.items() if now - t < RECENT_SECS}

    def forget(self, shape: Hashable) -> None:
        """Read the queue again for this shape next time (its claims lost: the entry is behind)."""
        with self._lock:
            self._entries.pop(shape, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._generation += 1


_book: QueueBook | None = None
_listener: threading.Thread | None = None
_stop = threading.Event()


def book() -> QueueBook | None:
    """This process's book, or None where none is kept (each batch reads the queue)."""
    return _book


def enable(connection_params: dict[str, Any] | None = None) -> QueueBook:
    """Keep a book in this process (a serve on PostgreSQL): start the thread that LISTENs for changes."""
    global _book, _listener
    if _book is None:
        _book = QueueBook()
    if connection_params is not None and (_listener is None or not _listener.is_alive()):
        _stop.clear()
        _listener = threading.Thread(
            target=_listen, args=(_book, connection_params), name="gradient-queue-listener", daemon=True
        )
        _listener.start()
    return _book


# What the listener's own connection takes of Django's (not its cursor factory or adapters).
_CONNECTION_PARAMS = frozenset(
    {
        "dbname",
        "user",
        "password",
        "host",
        "port",
        "application_name",
        "sslmode",
        "sslrootcert",
        "sslcert",
        "sslkey",
        "passfile",
        "options",
        "service",
        "connect_timeout",
    }
)


def enable_here() -> QueueBook | None:
    """Keep a book in this process if its database is PostgreSQL (the serve command calls it)."""
    from django.db import connection

    if connection.vendor != "postgresql":
        return None
    params = {k: v for k, v in connection.get_connection_params().items() if k in _CONNECTION_PARAMS}
    return enable(params)


def disable() -> None:
    global _book
    _stop.set()
    _book = None


def _listen(book: QueueBook, params: dict[str, Any]) -> None:
    """LISTEN on its own connection; every notification (and every reconnection, which may have missed
    some) marks the book old."""
    import psycopg

    while not _stop.is_set():
        try:
            with psycopg.connect(**params, autocommit=True) as conn:
                conn.execute(f"LISTEN {CHANNEL}")
                book.changed()  # whatever happened while no one listened
                while not _stop.is_set():
                    for _ in conn.notifies(timeout=1.0, stop_after=1):
                        book.changed()
        except Exception as exc:  # the database away: the entries age out meanwhile (MAX_AGE_SECS)
            book.changed()
            log.warning("listening for queue changes failed (%s); again in %.0f s", exc, RECONNECT_SECS)
            _stop.wait(RECONNECT_SECS)
