"""Offers: the candidates a worker may score, as full lists (JobListChunk) and deltas (JobOffer).

The server remembers per worker which candidates it sent (sent_candidate). Each offer resets that set
to the candidates visible now, so a claimed, finished or aborted job drops out; returning a job to the
pool deletes its rows (forget_sent), which puts it into the next delta.

A first offer shared by workers alike (a fleet connecting at once) is stored once (sent_list), each
worker pointing at it (sent_offer) instead of a row per key; the worker's next delta or full list
writes the keys still Queued as its own rows (_materialize). Its sent set is both, until then.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import CharField, Exists, OuterRef, Q, QuerySet, UUIDField, Value
from django.db.models.functions import Cast, Concat, Substr

from gradient.core.jobkey import SINGLE_JOB_KEYS, JobKey
from gradient.core.protocol import CandidateScore as CandidateScoreMessage
from gradient.core.protocol import JobCandidate, JobListChunk, JobOffer
from gradient.core.vocab import BUILD_UNFINISHED, EVALUATION_TERMINAL, BuildStatus, JobKeyKind
from gradient.runtime.setsql import fixed_cursor
from gradient.scheduling import book as queue_book
from gradient.scheduling import jobs, selectors
from gradient.scheduling.models import (
    CandidateScore,
    DerivationBuild,
    Evaluation,
    SentCandidate,
    SentList,
    SentOffer,
)
from gradient.workers.models import WorkerSession

PAGE_SIZE = 1000


def forget_sent(job_key: str) -> None:
    """Return a job to the pool: clear its sent flag for every worker, so the next offer includes it."""
    SentCandidate.objects.filter(job_id=job_key).delete()
    if connection.vendor == "postgresql":  # the shared first offers holding it (few rows)
        with connection.cursor() as cursor:
            cursor.execute(_FORGET_LISTED, [job_key, job_key])
        return
    for listed in SentList.objects.all():
        if job_key in listed.job_ids:
            listed.job_ids = [k for k in listed.job_ids if k != job_key]
            listed.save(update_fields=["job_ids"])


_FORGET_LISTED = f"UPDATE {SentList._meta.db_table} SET job_ids = job_ids - %s WHERE job_ids ? %s"  # noqa: S608


def forget_sent_all(job_keys: Sequence[str]) -> None:
    """forget_sent for many jobs at once (a pass's cluster claims): two statements on PostgreSQL."""
    keys = sorted(set(job_keys))
    if not keys:
        return
    if connection.vendor != "postgresql":
        for key in keys:
            forget_sent(key)
        return
    with fixed_cursor() as cursor:
        cursor.execute(_FORGET_SENT_ALL, [keys])
        cursor.execute(_FORGET_LISTED_ALL, [keys, keys])


_FORGET_SENT_ALL = f"DELETE FROM {SentCandidate._meta.db_table} WHERE job_id = ANY(%s::text[])"  # noqa: S608
_FORGET_LISTED_ALL = (
    f"UPDATE {SentList._meta.db_table} SET job_ids = job_ids - %s::text[] WHERE job_ids ?| %s::text[]"  # noqa: S608
)


def sent_keys(worker_id: uuid.UUID) -> set[str]:
    """The worker's sent set: its rows, and the keys of the shared first offer it was sent, if any."""
    keys = set(SentCandidate.objects.filter(worker_id=worker_id).values_list("job_id", flat=True))
    listed = (
        SentOffer.objects.filter(worker_id=worker_id).values_list("sent_list__job_ids", flat=True).first()
    )
    return keys | set(listed or [])


def sent_times(worker_id: uuid.UUID, job_keys: list[str]) -> dict[str, datetime]:
    """When each of `job_keys` that the worker was sent was sent to it (RescoreWait)."""
    if not job_keys:
        return {}
    if connection.vendor == "postgresql":  # a scoring worker's every RequestJob: one statement
        with fixed_cursor() as cursor:
            cursor.execute(_SENT_TIMES, {"w": worker_id, "keys": job_keys})
            return {job_id: sent_at for job_id, sent_at in cursor.fetchall()}
    found = dict(
        SentCandidate.objects.filter(worker_id=worker_id, job_id__in=job_keys).values_list(
            "job_id", "sent_at"
        )
    )
    offer = SentOffer.objects.filter(worker_id=worker_id).select_related("sent_list").first()
    if offer is not None:
        wanted = set(job_keys)
        for key in offer.sent_list.job_ids:
            if key in wanted:
                found.setdefault(key, offer.sent_at)
    return found


_SENT_TIMES = """
SELECT job_id, sent_at FROM sent_candidate WHERE worker_id = %(w)s AND job_id = ANY(%(keys)b::text[])
UNION ALL
SELECT k.key, o.sent_at FROM sent_offer o JOIN sent_list l ON l.id = o.sent_list_id
    CROSS JOIN LATERAL jsonb_array_elements_text(l.job_ids) AS k(key)
WHERE o.worker_id = %(w)s AND k.key = ANY(%(keys)b::text[])
"""


def _materialize(worker_id: uuid.UUID) -> bool:
    """Write the shared first offer the worker was sent, if any, as its own sent rows (the keys of builds
    still Queued and of evaluations: the delta drops what it can no longer see anyway) and drop its
    pointer. True when the worker has a sent set (rows or such an offer)."""
    if connection.vendor == "postgresql":  # every delta: one statement
        with fixed_cursor() as cursor:
            cursor.execute(
                _MATERIALIZE,
                {"w": worker_id, "prefix": JobKeyKind.BUILD.prefix, "queued": BuildStatus.QUEUED.value},
            )
            row = cursor.fetchone()
            return bool(row and row[0])
    offer = SentOffer.objects.filter(worker_id=worker_id).select_related("sent_list").first()
    if offer is not None:
        prefix = JobKeyKind.BUILD.prefix
        listed = offer.sent_list.job_ids
        builds = [k for k in listed if k.startswith(prefix)]
        queued = {
            f"{prefix}{i}"
            for i in DerivationBuild.objects.filter(
                id__in=[k[len(prefix) :] for k in builds], status=BuildStatus.QUEUED
            ).values_list("id", flat=True)
        }
        keep = [k for k in listed if not k.startswith(prefix) or k in queued]
        SentCandidate.objects.bulk_create(
            [SentCandidate(worker_id=worker_id, job_id=k, sent_at=offer.sent_at) for k in keep],
            ignore_conflicts=True,
        )
        offer.delete()
        return True
    return SentCandidate.objects.filter(worker_id=worker_id).exists()


_MATERIALIZE = """
WITH moved AS (
    DELETE FROM sent_offer WHERE worker_id = %(w)s RETURNING sent_list_id, sent_at
), written AS (
    INSERT INTO sent_candidate (worker_id, job_id, sent_at)
    SELECT %(w)s, k.key, m.sent_at FROM moved m JOIN sent_list l ON l.id = m.sent_list_id
        CROSS JOIN LATERAL jsonb_array_elements_text(l.job_ids) AS k(key)
    WHERE left(k.key, length(%(prefix)s)) <> %(prefix)s OR EXISTS (
        SELECT 1 FROM derivation_build b
        WHERE b.id = substr(k.key, length(%(prefix)s) + 1)::uuid AND b.status = %(queued)s)
    ON CONFLICT DO NOTHING
)
SELECT EXISTS (SELECT 1 FROM moved) OR EXISTS (SELECT 1 FROM sent_candidate WHERE worker_id = %(w)s)
"""


def forget_scores(job_key: str) -> None:
    """A finished job is nobody's candidate again: the workers' scores of it go, so that a RequestJob
    reads only scores of jobs that can still be handed out."""
    forget_scores_of([job_key])


def forget_scores_of(job_keys: Sequence[str]) -> None:
    """forget_scores for many finished jobs at once."""
    if not job_keys:
        return
    if connection.vendor == "postgresql":  # every report batch that completes builds: fixed text
        with fixed_cursor() as cursor:
            cursor.execute(_FORGET_SCORES, [list(job_keys)])
        return
    CandidateScore.objects.filter(job_id__in=list(job_keys)).delete()


_FORGET_SCORES = f"DELETE FROM {CandidateScore._meta.db_table} WHERE job_id = ANY(%b::text[])"  # noqa: S608


def candidates_for_worker(state: selectors.WorkerState, now: datetime) -> list[JobCandidate]:
    """Every evaluation and build job this worker is authorized for and can run, with NAR sizes on the
    cached required paths."""
    if state.draining:
        return []
    return _candidates(_offerable_evaluations(state), selectors.queued_builds(state, now))


@dataclass
class PassCache:
    """What one assignment pass computes once for all the workers it offers to: the split decision
    (design: decided per pass) and each build's candidate message, which is the same for every worker."""

    split: bool | None = None
    builds: dict[uuid.UUID, JobCandidate] = field(default_factory=dict)


_PASS_CACHE: ContextVar[PassCache | None] = ContextVar("gradient_offer_pass_cache", default=None)


@contextmanager
def pass_cache() -> Iterator[PassCache]:
    """Share candidate messages between the offers of one pass (nothing outlives it)."""
    cache = PassCache()
    token = _PASS_CACHE.set(cache)
    try:
        yield cache
    finally:
        _PASS_CACHE.reset(token)


def _split() -> bool:
    cache = _PASS_CACHE.get()
    if cache is None:
        return selectors.has_idle_eval_only_worker()
    if cache.split is None:
        cache.split = selectors.has_idle_eval_only_worker()
    return cache.split


def _offerable_evaluations(state: selectors.WorkerState) -> list[Evaluation]:
    split = _split()
    return [
        e
        for e in selectors.queued_evaluations(state)[:20000]
        if selectors.worker_can_run_eval_steps(state.worker, jobs.eval_steps(e, split=split))
    ]


# A build's candidate message is the same for every worker: the offers of one process share those made
# in the last RECENT_SECS (an assignment pass's interval; the NAR sizes on it are that old at most), so
# 300 workers connecting at once cost one message per build, not 300.
RECENT_SECS = 5.0
RECENT_MAX = 200_000
_recent: dict[uuid.UUID, tuple[float, JobCandidate]] = {}


def _recent_candidates(build_ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, JobCandidate]:
    fresh_after = time.monotonic() - RECENT_SECS
    found: dict[uuid.UUID, JobCandidate] = {}
    for build_id in build_ids:
        hit = _recent.get(build_id)
        if hit is not None and hit[0] >= fresh_after:
            found[build_id] = hit[1]
    return found


def _remember(made: dict[uuid.UUID, JobCandidate]) -> None:
    if len(_recent) + len(made) > RECENT_MAX:
        _recent.clear()
    stamp = time.monotonic()
    for build_id, candidate in made.items():
        _recent[build_id] = (stamp, candidate)


def _build_candidates(
    builds: list[DerivationBuild], sources: list[str]
) -> tuple[dict[uuid.UUID, JobCandidate], dict[str, int]]:
    """Candidate messages of `builds` (made, or taken from this pass or the last few seconds), and the
    NAR sizes of `sources` and of the inputs of the builds that were made."""
    cache = _PASS_CACHE.get()
    known = dict(cache.builds) if cache is not None else {}
    known.update(_recent_candidates(b.id for b in builds if b.id not in known))
    missing = [b for b in builds if b.id not in known]
    inputs = selectors.input_paths([b.id for b in missing])
    sizes = selectors.nar_sizes(sources + [p for paths in inputs.values() for p in paths])
    made = {b.id: jobs.build_candidate(b, inputs.get(b.id, []), sizes) for b in missing}
    if cache is not None:
        cache.builds.update(made)
    _remember(made)
    known.update(made)
    return known, sizes


def _candidates(evaluations: list[Evaluation], builds: list[DerivationBuild]) -> list[JobCandidate]:
    sources = [e.flake_source for e in evaluations if e.followup_pending and e.flake_source]
    known, sizes = _build_candidates(builds, sources)
    out = [jobs.eval_candidate(e, sizes) for e in evaluations]
    out.extend(known[b.id] for b in builds)
    return out


def _pages(candidates: list[JobCandidate]) -> list[list[JobCandidate]]:
    return [candidates[i : i + PAGE_SIZE] for i in range(0, len(candidates), PAGE_SIZE)] or [[]]


def _reset_sent(worker_id: uuid.UUID, keys: set[str], now: datetime) -> set[str]:
    """Make the sent set exactly `keys`; returns the keys that were not in it before."""
    before = set(SentCandidate.objects.filter(worker_id=worker_id).values_list("job_id", flat=True))
    gone = before - keys
    if gone:
        SentCandidate.objects.filter(worker_id=worker_id, job_id__in=gone).delete()
    new = keys - before
    SentCandidate.objects.bulk_create(
        [SentCandidate(worker_id=worker_id, job_id=k, sent_at=now) for k in new], ignore_conflicts=True
    )
    return new


def job_list(*, worker_id: uuid.UUID, now: datetime) -> list[JobListChunk]:
    """RequestJobList: the full candidate list in JobListChunk pages of 1 000, the last one is_final."""
    with transaction.atomic():
        state = selectors.worker_state(worker_id)
        if state is None:
            return []
        candidates = candidates_for_worker(state, now)
        SentOffer.objects.filter(worker_id=worker_id).delete()  # the sent set is exactly these now
        _reset_sent(worker_id, {c.job_id for c in candidates}, now)
    pages = _pages(candidates)
    return [JobListChunk(candidates=page, is_final=i == len(pages) - 1) for i, page in enumerate(pages)]


def job_list_batch(*, worker_ids: Sequence[uuid.UUID], now: datetime) -> list[list[JobListChunk]]:
    """job_list of several workers (the RequestJobLists of a few milliseconds: 1 000 workers fencing
    their heartbeats every 10 s asked 100 a second, each its own transaction of six statements on the
    offers lane, and the lane fell tens of seconds behind, bench/connections.py) in one transaction:
    their states in one read, each shape's list made once, the sent sets of those offered nothing reset
    in one statement (each other one as job_list resets it). One list of pages per worker, in order;
    none for a worker not connected. Elsewhere each is job_list."""
    if connection.vendor != "postgresql":
        return [job_list(worker_id=w, now=now) for w in worker_ids]
    lists: dict[uuid.UUID, list[JobCandidate]] = {}
    book = queue_book.book()
    tick = time.monotonic()
    with transaction.atomic(), pass_cache():
        states = selectors.worker_states(worker_ids, now)
        generation = book.generation if book is not None else 0  # read before the queue is
        made: dict[tuple[object, ...], list[JobCandidate]] = {}
        for worker_id, state in states.items():
            shape = (_offer_shape(state, 0), state.draining)
            if shape not in made:
                if _still_empty(_empty_lists, shape, book, tick):
                    made[shape] = []  # nothing for this shape a moment ago, and no change heard since
                else:
                    made[shape] = candidates_for_worker(state, now)
                    if not made[shape]:
                        _keep_empty(_empty_lists, shape, book, tick, generation)
            lists[worker_id] = made[shape]
        nothing = [w for w, listed in lists.items() if not listed]
        forget_offers_of_workers(nothing)  # their sent sets: empty, in one statement
        listed_some = [w for w, listed in lists.items() if listed]
        if listed_some:
            SentOffer.objects.filter(worker_id__in=listed_some).delete()
            for worker_id in listed_some:
                _reset_sent(worker_id, {c.job_id for c in lists[worker_id]}, now)
    out: list[list[JobListChunk]] = []
    for worker_id in worker_ids:
        if worker_id not in lists:
            out.append([])
            continue
        pages = _pages(lists[worker_id])
        out.append(
            [JobListChunk(candidates=page, is_final=i == len(pages) - 1) for i, page in enumerate(pages)]
        )
    return out


def _max_per_offer() -> int:
    return max(1, int(getattr(settings, "GRADIENT_OFFER_MAX_CANDIDATES", 1000)))


def job_offers(*, worker_id: uuid.UUID, now: datetime) -> list[JobOffer]:
    """The delta for one worker: candidates visible now that it was not sent yet, as JobOffer messages;
    at most GRADIENT_OFFER_MAX_CANDIDATES (1 000, one JobOffer) per call, evaluations first, then the
    builds that have waited longest. The rest stay unsent and come with the next call (the next
    assignment pass, 5 s later): with a deep queue and many workers, one pass offering everything to
    everyone would build, store and send millions of candidates at once."""
    limit = _max_per_offer()
    with transaction.atomic():
        state = selectors.worker_state(worker_id)
        if state is None:
            return []
        if connection.vendor == "postgresql":
            fresh = _fresh_candidates(state, now, limit)
        else:  # the embedded database: the whole diff in Python, fine at its scale
            _materialize(worker_id)
            candidates = candidates_for_worker(state, now)
            before = set(SentCandidate.objects.filter(worker_id=worker_id).values_list("job_id", flat=True))
            fresh = [c for c in candidates if c.job_id not in before][:limit]
            _reset_sent(worker_id, (before & {c.job_id for c in candidates}) | {c.job_id for c in fresh}, now)
    if not fresh:
        return []
    return [JobOffer(candidates=page) for page in _pages(fresh)]


def job_offers_batch(*, worker_ids: Sequence[uuid.UUID], now: datetime) -> list[list[JobOffer]]:
    """job_offers of several workers (the WorkerCapabilities of a fleet connecting at once, collected
    for a few milliseconds), in one transaction on PostgreSQL: their states in one read, which of them
    were sent anything in one, and those sent nothing yet and alike (one shape) pointed at their shared
    first offer in one statement. 1 000 workers connecting to 100 000 pending builds, each its own
    transaction (five statements and a commit) on the offers lane, had their first offer 17-27 s after
    they connected (bench/connections.py --pending). A worker already sent something gets its own delta,
    as from job_offers. One list of JobOffer per worker, in order. Elsewhere each is job_offers."""
    if connection.vendor != "postgresql":
        return [job_offers(worker_id=w, now=now) for w in worker_ids]
    limit = _max_per_offer()
    fresh: dict[uuid.UUID, list[JobCandidate]] = {}
    with transaction.atomic():
        states = selectors.worker_states(worker_ids, now)
        sent = _workers_sent_anything(list(states))
        firsts: dict[tuple[object, ...], list[selectors.WorkerState]] = {}
        for worker_id, state in states.items():
            if state.draining or worker_id in sent:
                fresh[worker_id] = _fresh_candidates(state, now, limit)
            else:
                firsts.setdefault(_offer_shape(state, limit), []).append(state)
        for alike in firsts.values():
            shared = _shared_first_offer(alike, now, limit)
            for state in alike:
                fresh[state.id] = shared
    # Workers sent one shared list get the very same JobOffer objects (encoded once by the dispatcher).
    made: dict[int, list[JobOffer]] = {}
    out: list[list[JobOffer]] = []
    for w in worker_ids:
        listed = fresh.get(w)
        if not listed:
            out.append([])
            continue
        if id(listed) not in made:
            made[id(listed)] = [JobOffer(candidates=page) for page in _pages(listed)]
        out.append(made[id(listed)])
    return out


_SENT_ANYTHING = """
SELECT worker_id FROM sent_offer WHERE worker_id = ANY(%(w)s::uuid[])
UNION
SELECT DISTINCT worker_id FROM sent_candidate WHERE worker_id = ANY(%(w)s::uuid[])
"""


def _workers_sent_anything(worker_ids: list[uuid.UUID]) -> set[uuid.UUID]:
    """Those of the workers with a sent set (rows, or a shared offer pointed at): one statement."""
    if not worker_ids:
        return set()
    with fixed_cursor() as cursor:
        cursor.execute(_SENT_ANYTHING, {"w": worker_ids})
        return {row[0] for row in cursor.fetchall()}


# The first offer of workers alike that have been sent nothing (a fleet connecting at once, after a
# restart of serve or of the network) is the same list: the first candidates of what they can run. It
# is made once per shape and reused for SHARED_FIRST_OFFER_SECS by this process: 100 workers connecting
# to a queue of 30 000 builds made it 100 times (~45 ms of Python and as much of PostgreSQL each, on the
# offers lane, while the hand-outs began). A job claimed meanwhile drops out of the worker's sent set
# at its next delta, as it would had it been claimed right after the offer; one queued meanwhile comes
# with that delta. As old as the candidate messages it is made of may be (RECENT_SECS, an assignment
# pass's interval): made again each second, the list was made five times while 300 workers connected to
# 20 000 builds (the offers lane 1.27 s of CPU in serve's first 10 s against 1.00 s, bench/handout.py).
#
# An empty first offer (nothing this shape can run) is kept too, while the process's book has heard of
# no change of the queue (book.generation): 1 000 workers connecting at once to an idle service made it
# 1 000 times, one after the other on the offers lane (~20 ms each), and the heartbeats' RequestJobList
# waited behind them for 45 s (bench/connections.py). Without a book (no serve on PostgreSQL) it is
# made each time.
SHARED_FIRST_OFFER_SECS = RECENT_SECS
_first_offers: dict[tuple[object, ...], tuple[float, list[JobCandidate], uuid.UUID]] = {}
_empty_first_offers: dict[tuple[object, ...], tuple[float, int]] = {}  # _still_empty, _keep_empty
# The same for a RequestJobList's whole list (1 000 idle workers fence their heartbeats with one each).
_empty_lists: dict[tuple[object, ...], tuple[float, int]] = {}
# A shared first offer no worker points at any more is deleted once this old (its workers had their
# first delta; the lists made by any process's offers in the last SHARED_FIRST_OFFER_SECS stay).
SENT_LIST_KEEP_SECS = 60.0


EmptyKept = dict[tuple[object, ...], tuple[float, int]]  # shape -> (made at, book generation)


def _still_empty(
    kept: EmptyKept, shape: tuple[object, ...], book: queue_book.QueueBook | None, tick: float
) -> bool:
    """This shape's list was empty a moment ago (SHARED_FIRST_OFFER_SECS) and the book has heard of no
    change of the queue since. Never without a book: nothing would say when it is behind."""
    empty = kept.get(shape)
    return (
        book is not None
        and empty is not None
        and empty[1] == book.generation
        and tick - empty[0] < SHARED_FIRST_OFFER_SECS
    )


def _keep_empty(
    kept: EmptyKept,
    shape: tuple[object, ...],
    book: queue_book.QueueBook | None,
    tick: float,
    generation: int,
) -> None:
    """Remember that this shape's list was empty at `tick`, read under the book's `generation`."""
    if book is None:
        return
    if len(kept) >= 64:  # shapes are few; never let them pile up
        kept.clear()
    kept[shape] = (tick, generation)


def _offer_shape(state: selectors.WorkerState, limit: int) -> tuple[object, ...]:
    """What decides a worker's candidates: its capabilities, features, systems and projects."""
    w = state.worker
    return (
        w.can_build,
        w.can_eval,
        w.can_fetch,
        frozenset(w.architectures or []),
        frozenset(w.system_features or []),
        state.project_ids,
        limit,
    )


def _shared_first_offer(
    alike: Sequence[selectors.WorkerState], now: datetime, limit: int
) -> list[JobCandidate]:
    """The first offer of workers of one shape (`alike`: sent nothing yet), made once a second; stored
    once (SentList), each worker sent it pointing at it (SentOffer): a fleet of 100 connecting to a deep
    queue wrote 100 000 sent_candidate rows (~10 ms of PostgreSQL each worker) while the hand-outs began.
    The pointers of the group are one statement."""
    state = alike[0]
    ids = [s.id for s in alike]
    shape = _offer_shape(state, limit)
    tick = time.monotonic()
    book = queue_book.book()
    if _still_empty(_empty_first_offers, shape, book, tick):
        return []
    generation = book.generation if book is not None else 0  # read before the queue is
    kept = _first_offers.get(shape)
    # Kept only if its transaction committed: one that rolled back left no list to point at.
    if kept is not None and tick - kept[0] < SHARED_FIRST_OFFER_SECS and _point_at(ids, kept[2], now):
        return kept[1]
    fresh = _diffed_candidates(
        state, SentCandidate.objects.filter(worker_id=state.id), now, limit, remember=False
    )
    if not fresh:
        _keep_empty(_empty_first_offers, shape, book, tick, generation)
        return fresh
    SentList.objects.filter(
        made_at__lt=now - timedelta(seconds=SENT_LIST_KEEP_SECS), offers__isnull=True
    ).delete()
    listed = SentList.objects.create(job_ids=[c.job_id for c in fresh], made_at=now)
    _point_at(ids, listed.id, now)
    if len(_first_offers) >= 64:  # shapes are few; never let them pile up
        _first_offers.clear()
    _first_offers[shape] = (tick, fresh, listed.id)
    return fresh


def _point_at(worker_ids: Sequence[uuid.UUID], list_id: uuid.UUID, now: datetime) -> bool:
    """The workers were sent the shared list `list_id`, if it is still there; whether it was."""
    if connection.vendor == "postgresql":  # a fleet's first offers: one statement
        with fixed_cursor() as cursor:
            cursor.execute(_POINT_AT, {"w": list(worker_ids), "list": list_id, "at": now})
            return cursor.fetchone() is not None
    if not SentList.objects.filter(id=list_id).exists():
        return False
    SentOffer.objects.bulk_create(
        [SentOffer(worker_id=w, sent_list_id=list_id, sent_at=now) for w in worker_ids]
    )
    return True


_POINT_AT = """
INSERT INTO sent_offer (worker_id, sent_list_id, sent_at)
SELECT w, l.id, %(at)s FROM sent_list l CROSS JOIN unnest(%(w)s::uuid[]) AS w WHERE l.id = %(list)s
RETURNING 1
"""


def _fresh_candidates(state: selectors.WorkerState, now: datetime, limit: int) -> list[JobCandidate]:
    """What job_offers' reset of the sent set gives, with the builds diffed in SQL: the assignment pass
    runs this for every connected worker every few seconds, and with a deep queue (100 000 pending
    builds) loading every pending build and every sent row per worker took the pass far past its
    interval. Only the builds not sent yet are loaded; sent rows of builds no longer visible are deleted
    by an anti-join. Evaluations (few, and capped) are diffed in Python as before. A worker sent
    nothing yet gets the first offer of its shape, shared (_shared_first_offer)."""
    sent = SentCandidate.objects.filter(worker_id=state.id)
    if state.draining:
        sent.delete()
        SentOffer.objects.filter(worker_id=state.id).delete()
        return []
    if not _materialize(state.id):
        return _shared_first_offer([state], now, limit)
    return _diffed_candidates(state, sent, now, limit)


def _diffed_candidates(
    state: selectors.WorkerState,
    sent: QuerySet[SentCandidate],
    now: datetime,
    limit: int,
    *,
    remember: bool = True,
) -> list[JobCandidate]:
    evaluations = _offerable_evaluations(state)
    sent_evals = set(sent.filter(job_id__startswith=JobKeyKind.EVAL.prefix).values_list("job_id", flat=True))
    gone = sent_evals - {e.job_key for e in evaluations}
    if gone:
        sent.filter(job_id__in=gone).delete()
    builds = selectors.offerable_builds(state, now)
    # Correlated on the build's primary key (the key's uuid part), so each sent row is one index probe.
    prefix = JobKeyKind.BUILD.prefix
    key_uuid = Cast(Substr(OuterRef("job_id"), len(prefix) + 1), output_field=UUIDField())
    sent.filter(job_id__startswith=prefix).exclude(Exists(builds.filter(id=key_uuid))).delete()
    # PostgreSQL writes a uuid as Python's str() does, so this is the build's job key.
    already = SentCandidate.objects.filter(
        worker_id=state.id, job_id=Concat(Value(prefix), Cast(OuterRef("id"), CharField()))
    )
    fresh_evaluations = [e for e in evaluations if e.job_key not in sent_evals][:limit]
    room = limit - len(fresh_evaluations)
    # Only the ids first: the rows are loaded for the builds whose candidate no recent offer made.
    fresh_ids = list(builds.exclude(Exists(already)).values_list("id", flat=True)[:room]) if room > 0 else []
    recent = _recent_candidates(fresh_ids)
    rows = {b.id: b for b in DerivationBuild.objects.filter(id__in=[i for i in fresh_ids if i not in recent])}
    fresh = _candidates(fresh_evaluations, [])
    made, _ = _build_candidates(list(rows.values()), [])
    made.update(recent)
    fresh.extend(made[i] for i in fresh_ids if i in made)
    if remember:
        _remember_sent(state.id, [c.job_id for c in fresh], now)
    return fresh


_REMEMBER_SENT = (
    "INSERT INTO sent_candidate (worker_id, job_id, sent_at) SELECT %s, k, %s FROM unnest(%b::text[]) AS k "
    "ON CONFLICT DO NOTHING"
)


def _remember_sent(worker_id: uuid.UUID, job_keys: list[str], now: datetime) -> None:
    """The worker was sent these candidates: one statement with the keys as an array (PostgreSQL), not a
    row of parameters per candidate (a connecting worker is sent up to 1 000)."""
    if job_keys:
        with fixed_cursor() as cursor:
            cursor.execute(_REMEMBER_SENT, [worker_id, now, job_keys])


def promote_retries(*, now: datetime) -> int:
    """FailedTransient builds whose backoff has passed are Queued again."""
    return DerivationBuild.objects.filter(
        Q(status=BuildStatus.FAILED_TRANSIENT), Q(retry_at__isnull=True) | Q(retry_at__lte=now)
    ).update(status=BuildStatus.QUEUED, queued_at=now, updated_at=now, retry_at=None)


def connected_worker_ids() -> list[uuid.UUID]:
    return list(
        WorkerSession.objects.filter(closed_at__isnull=True, draining=False, worker__active=True).values_list(
            "worker_id", flat=True
        )
    )


def candidate_scores_store(
    *, worker_id: uuid.UUID, scores: Iterable[CandidateScoreMessage], now: datetime
) -> int:
    """Keep a worker's RequestJobChunk answer, one row per (worker, job); a later score replaces an
    earlier one. Scores for anything that is not the key of a job that can still be handed out (a
    build not finished, an evaluation not ended) are ignored: made-up or finished ids store nothing."""
    keyed = {s.job_id: (s, key) for s in scores if (key := JobKey.parse(s.job_id, kinds=SINGLE_JOB_KEYS))}
    if not keyed:
        return 0
    kinds = {key.kind for _, key in keyed.values()}
    live: set[uuid.UUID] = set()
    if JobKeyKind.BUILD in kinds:
        builds = [key.id for _, key in keyed.values() if key.kind == JobKeyKind.BUILD]
        live |= set(
            DerivationBuild.objects.filter(id__in=builds, status__in=BUILD_UNFINISHED).values_list(
                "id", flat=True
            )
        )
    if JobKeyKind.EVAL in kinds:
        evaluations = [key.id for _, key in keyed.values() if key.kind == JobKeyKind.EVAL]
        live |= set(
            Evaluation.objects.filter(id__in=evaluations)
            .exclude(status__in=EVALUATION_TERMINAL)
            .values_list("id", flat=True)
        )
    latest = {job_id: s for job_id, (s, key) in keyed.items() if key.id in live}
    if not latest:
        return 0
    CandidateScore.objects.bulk_create(
        [
            CandidateScore(
                worker_id=worker_id,
                job_id=s.job_id,
                missing_count=s.missing_count,
                missing_nar_size=s.missing_nar_size,
                outputs_present=s.outputs_present,
                updated_at=now,
            )
            for s in latest.values()
        ],
        update_conflicts=True,
        unique_fields=["worker", "job_id"],
        update_fields=["missing_count", "missing_nar_size", "outputs_present", "updated_at"],
    )
    return len(latest)


def forget_worker_offers(worker_id: uuid.UUID) -> None:
    """A worker's session opened or ended: it has been offered nothing (its next offer is a full one)."""
    forget_offers_of_workers([worker_id])


def forget_offers_of_workers(worker_ids: Sequence[uuid.UUID]) -> None:
    """forget_worker_offers of several workers (a batch of handshakes), in one statement."""
    if not worker_ids:
        return
    if connection.vendor == "postgresql":  # every batch of handshakes: one statement
        with fixed_cursor() as cursor:
            cursor.execute(_FORGET_WORKER_OFFERS, {"w": list(worker_ids)})
        return
    SentCandidate.objects.filter(worker_id__in=worker_ids).delete()
    SentOffer.objects.filter(worker_id__in=worker_ids).delete()


_FORGET_WORKER_OFFERS = """
WITH rows AS (DELETE FROM sent_candidate WHERE worker_id = ANY(%(w)s::uuid[]))
DELETE FROM sent_offer WHERE worker_id = ANY(%(w)s::uuid[])
"""
