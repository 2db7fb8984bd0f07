"""RequestJob: score every pending job of that kind for this worker, claim the best, hand it out.

One call is one unit of work in its own transaction. AssignJob goes out only after the claim committed:
the caller sends the returned message once this function has returned.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec
from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, transaction
from django.utils import timezone

from gradient.core.ids import parse_uuid
from gradient.core.protocol import AssignJob, FlakeStep, Job, WorkerMetrics
from gradient.core.vocab import EvaluationStatus, JobKind, JobKindName, job_kind_of
from gradient.runtime import boot, instances, lanes, setsql
from gradient.runtime.setsql import fixed_cursor
from gradient.scheduling import book as queue_book
from gradient.scheduling import jobs, selectors
from gradient.scheduling.decisions.scoring import (
    Candidate,
    PoolView,
    Score,
    WorkerView,
    download_mbps,
    mean_wait_secs,
    rank,
    score,
    wait_cap_secs,
)
from gradient.scheduling.models import DerivationBuild, Evaluation
from gradient.scheduling.selectors import PRESELECT
from gradient.scheduling.services import claims as claims_sql
from gradient.scheduling.services import lifecycle, offers
from gradient.scheduling.services.claims import BuildClaim
from gradient.scheduling.services.lifecycle import ClaimTerms
from gradient.workers.models import METRIC_FIELDS, IdleSlot

log = logging.getLogger("gradient.assignment")

MAX_LOST_CLAIMS = 3
# Rounds of claims a batch of RequestJobs makes: those whose claim lost try their next choice.
CLAIM_ROUNDS = 5
# Candidates a RequestJob looks at, best first, skipping those another RequestJob is claiming.
MAX_TRIED_CANDIDATES = 32


@dataclass(frozen=True)
class Assignment:
    assignment_id: uuid.UUID
    job_key: str
    kind: str
    job: Job
    score: Score

    def message(self) -> AssignJob:
        return AssignJob(
            job_id=self.job_key, assignment_id=str(self.assignment_id), job=self.job, cluster=None
        )


def _offered_passes_ago(worker_id: uuid.UUID, job_keys: list[str], now: datetime) -> dict[str, int]:
    """For the candidates the worker has not scored: how many assignment passes ago they were offered to
    it (RescoreWait holds such a build back for up to 4 passes, waiting for the worker's score)."""
    if not job_keys:
        return {}
    interval = max(1.0, float(settings.GRADIENT_SCHEDULER_PASS_INTERVAL_SECS))
    rows = offers.sent_times(worker_id, job_keys).items()
    return {job_id: int(max(0.0, (now - sent_at).total_seconds()) // interval) for job_id, sent_at in rows}


def _clear_idle_slots(worker_ids: Sequence[uuid.UUID], kind: str) -> None:
    # Every claim batch deletes its workers' idle slots, recorded or not: skipping those this process
    # did not record (8177095) saved a round trip but let a batch commit without writing idle_slot, and
    # the kill-mid-claim-batch fault test holds its batch on that write (a batch slipped past it in CI).
    if not worker_ids:
        return
    if connection.vendor == "postgresql":  # every claim batch: fixed text
        with fixed_cursor() as cursor:
            cursor.execute(_CLEAR_IDLE_SLOTS, [list(worker_ids), kind])
        return
    IdleSlot.objects.filter(worker_id__in=list(worker_ids), kind=kind).delete()


_CLEAR_IDLE_SLOTS = f"DELETE FROM {IdleSlot._meta.db_table} WHERE worker_id = ANY(%b::uuid[]) AND kind = %s"  # noqa: S608


def _record_idle_slots(worker_ids: Sequence[uuid.UUID], kind: str, now: datetime) -> None:
    if worker_ids:
        IdleSlot.objects.bulk_create(
            [IdleSlot(worker_id=w, kind=kind, recorded_at=now) for w in sorted(set(worker_ids))],
            update_conflicts=True,
            unique_fields=["worker", "kind"],
            update_fields=["recorded_at"],
        )


def request_job(
    *,
    worker_id: uuid.UUID,
    protocol_kind: JobKindName,
    now: datetime,
    tried: list[uuid.UUID] | None = None,
    session_id: uuid.UUID | None = None,
) -> Assignment | None:
    """Answer one RequestJob. Returns the assignment to send, or None: then the request stays
    unanswered and is remembered as an idle slot for cluster placement. `tried` collects the id of
    every claim it makes, before making it (hand_out finds a claim whose commit went unheard by them).
    `session_id`: the session that asked, when known; a request of a session that is no longer the
    worker's open one is not answered. A build request is a batch of one (request_builds)."""
    kind = job_kind_of(protocol_kind)
    tried = tried if tried is not None else []
    if kind == JobKind.BUILD:
        sessions = [session_id] if session_id is not None else None
        return request_builds(worker_ids=[worker_id], now=now, tried=tried, session_ids=sessions)[0]
    with transaction.atomic(durable=True):  # the RequestJob's one transaction: this entry owns it
        state = selectors.worker_state(worker_id)
        if state is None or state.draining or session_id not in (None, state.session_id):
            return None
        if selectors.worker_held(worker_id, kind):
            _record_idle_slots([worker_id], kind, now)  # a reserved seat: it waits, idle, for its cluster
            return None
        assignment = _assign_eval(state, now, tried)
        if assignment is None:
            _record_idle_slots([worker_id], kind, now)
        else:
            _clear_idle_slots([worker_id], kind)
        return assignment


def _policy() -> str:
    return str(getattr(settings, "GRADIENT_SCHEDULING_POLICY", "resource-aware"))


@dataclass
class _Asking:
    """One RequestJob{build} of a batch while it is decided: its worker and the choices left to it."""

    index: int
    state: selectors.WorkerState
    view: WorkerView
    scores: dict[str, tuple[int, int]]
    ranked: list[Score] = field(default_factory=list)  # best first; the worker's own scores applied
    shared: list[selectors.BuildRef] | None = None  # or: the group's order, scored for this worker lazily
    now: datetime | None = None  # when the group's order is scored
    at: int = 0
    lost: bool = False  # a claim of this request lost
    room: int | None = None  # its worker's slots left for it, checked by the claim statement (BuildClaim)
    finishing: int = 0
    refused: str = ""  # why the claim statement refused its claim for its worker (claims.REFUSED_*)

    def next_choice(
        self, taken: set[str], pool: PoolView, policy: str, hints: dict[int, int] | None = None
    ) -> Score | None:
        """The best candidate not taken by an earlier request of the batch (or lost), or None. `hints`,
        per shared order (by identity), where its first row not taken may be: every row before it is
        taken (`taken` only grows while a batch chooses), so the requests of one kind of worker do not
        each walk again past the rows the earlier ones took."""
        if self.shared is None:
            while self.at < len(self.ranked):
                choice = self.ranked[self.at]
                self.at += 1
                if choice.job_id not in taken:
                    return choice
            return None
        shared = self.shared
        if hints is not None:
            self.at = max(self.at, hints.get(id(shared), 0))
        end = len(shared)
        while self.at < end:
            ref = shared[self.at]
            self.at += 1
            if ref.job_key in taken:
                continue
            assert self.now is not None  # set with shared
            candidate = _candidate(ref, self.now, {})
            # Unscored builds differ only in wait and priority, which no worker's view changes: the
            # group's order is this worker's too, and what the worker's view adds (saturation, the
            # fetch reserve) is the same for all of them, so the first free one is its best, if any.
            choice = score(candidate, self.view, pool, policy)
            if not choice.eligible:
                return None
            if hints is not None:
                hints[id(shared)] = self.at  # the caller takes this one: all before self.at are taken
            return choice
        return None


def request_builds(
    *,
    worker_ids: Sequence[uuid.UUID],
    now: datetime,
    tried: list[uuid.UUID],
    lost: set[int] | None = None,
    session_ids: Sequence[uuid.UUID] | None = None,
    finishing: Sequence[int] | None = None,
    metrics: Sequence[SessionMetrics | None] | None = None,
) -> list[Assignment | None]:
    """Answer a batch of RequestJob{build}, one entry per request (a worker with several free slots asks
    once per slot), in one transaction that this entry owns: the workers read together, the pending
    builds read once per kind of worker, each request ranked by the pure scoring rules, and every
    choice claimed in one statement (lifecycle.claim_builds); a lost claim moves on to the request's
    next choice. None for a request left unanswered: an idle slot for cluster placement. `tried`
    collects every claim's assignment id before it is made (hand_out_builds finds unheard ones); `lost`
    the index of every request left unanswered after its claims lost (work there was, taken by others).
    `session_ids`, one per request when known: a request of a session that is no longer its worker's
    open one is left unanswered. Every claim holds only while the session it goes to is open (the
    claim statement checks it on the session's locked row). `finishing`, one per request when known:
    how many of its worker's open builds have ended on the worker, their JobCompleted or JobFailed
    sent before the request and not applied yet: their slots count as free (the worker asks only for a
    free slot; the report batch applies those ends beside this claim instead of before it). `metrics`,
    one per request when known: its session's latest heartbeat, newer than what its worker's row may
    hold (the presence flush writes it every few seconds).

    With session ids on PostgreSQL, what the process read of each session's worker is kept (its card,
    _Card) and the batch reads only the workers it has no card of: the claim statement checks what a
    card may have wrong (the session open and not draining, the seat held, the slots free), and a
    request a card left without a choice is decided again from a fresh read."""
    answers: list[Assignment | None] = [None] * len(worker_ids)
    chosen: set[str] = set()
    # The seat holds are read first, along with the batch's first statement, unless the claim statement
    # checks them itself.
    reads = () if _held_in_claim() else selectors.seat_hold_reads()
    try:
        # Its statements read and write rows by their keys: planned once per connection.
        with transaction.atomic(durable=True), setsql.generic_plans(reads_along=reads):
            _request_builds(
                worker_ids,
                answers,
                chosen,
                now,
                tried,
                lost if lost is not None else set(),
                session_ids,
                finishing,
                metrics,
            )
    finally:
        with _claiming_lock:
            _claiming.difference_update(chosen)
    return answers


# The builds that the batches of this process being applied right now have chosen (batches are applied
# several at once: batcher.IN_FLIGHT). Another batch passes over them instead of losing its claim on a
# row locked by the first one; the claim statement still decides, so this can only make a claim lose.
_claiming: set[str] = set()
_claiming_lock = threading.Lock()


def _request_builds(
    worker_ids: Sequence[uuid.UUID],
    answers: list[Assignment | None],
    chosen: set[str],
    now: datetime,
    tried: list[uuid.UUID],
    lost: set[int],
    session_ids: Sequence[uuid.UUID] | None,
    finishing: Sequence[int] | None,
    metrics: Sequence[SessionMetrics | None] | None,
) -> None:
    batch = _Batch(worker_ids, answers, chosen, now, tried, lost, session_ids, finishing, metrics)
    everyone = list(range(len(worker_ids)))
    workers = _workers(batch, everyone, remembered=_cards_kept(session_ids))
    unsure = _answer(batch, everyone, workers)
    if unsure:
        # Left without a choice by what the process remembered of their workers (a card behind a change
        # of the worker's projects, say): decided again from what the database holds now.
        for index in unsure:
            assert session_ids is not None  # cards are kept only for requests with sessions
            forget_card(session_ids[index])
        _answer(batch, unsure, _workers(batch, unsure, remembered=False))
    _clear_idle_slots(batch.clear, JobKind.BUILD)  # no claim statement took them: nothing was chosen
    _record_idle_slots(batch.idle, JobKind.BUILD, now)


@dataclass
class _Batch:
    """One batch of RequestJob{build} while it is answered (request_builds' arguments, and what it
    collects: the workers whose idle slots go, and those to record idle)."""

    worker_ids: Sequence[uuid.UUID]
    answers: list[Assignment | None]
    chosen: set[str]
    now: datetime
    tried: list[uuid.UUID]
    lost: set[int]
    session_ids: Sequence[uuid.UUID] | None
    finishing: Sequence[int] | None
    metrics: Sequence[SessionMetrics | None] | None
    clear: list[uuid.UUID] = field(default_factory=list)
    idle: list[uuid.UUID] = field(default_factory=list)


@dataclass
class _Workers:
    """The batch's workers as assignment sees them: their states and scores, their open builds where
    read now (not those a card served: the claim statement counts theirs), and which came from a
    card."""

    states: dict[uuid.UUID, selectors.WorkerState]
    open_builds: dict[uuid.UUID, selectors.OpenBuilds]
    scores: dict[uuid.UUID, selectors.Scores]
    large: dict[uuid.UUID, int]
    carded: set[uuid.UUID]


# A session's latest heartbeat and when it came (gradient.workers.presence keeps it in memory).
SessionMetrics = tuple[WorkerMetrics, datetime]

# --- What this process remembers of its sessions' workers: their cards ---------------------------------
#
# A claim batch read every asking worker first (its row, projects, session, open builds and scores): a
# round trip of its three, and a fifth of its thread's time. A worker's row changes through its own
# session's messages (WorkerCapabilities, RequestJobChunk, Draining: the handlers forget its card, and the
# heartbeat's metrics come with each request), so the batch reads only the workers it has no card of.
# What a card may have wrong the claim statement checks (claims.BuildClaim: the session open and not
# draining, the seat not held, the slots free): memory can make a claim lose, never win. A card older
# than CARD_SECS is read again beside the batches (a change by someone else: an operator's edit of the
# worker's projects); one not used for CARD_FORGET_SECS goes.
CARD_SECS = 10.0
CARD_FORGET_SECS = 60.0


@dataclass(slots=True)
class _Card:
    state: selectors.WorkerState
    scores: dict[str, tuple[int, int]]
    large: int  # open builds that transfer much, when read (scoring's saturation)
    read_at: float  # time.monotonic()
    refreshing: bool = False


_cards: dict[uuid.UUID, _Card] = {}  # by session id
_cards_epoch = 0  # one more at every forget_card
# When each session's card was last forgotten (the epoch it made, the time): a read begun before keeps
# nothing of that session (it may be older than the change).
_forgotten: dict[uuid.UUID, tuple[int, float]] = {}
_cards_lock = threading.Lock()
_cards_swept = 0.0


def forget_card(session_id: uuid.UUID) -> None:
    """What this process remembers of the session's worker is behind (its capabilities, scores or
    draining changed, or the session ended): its next request reads it again."""
    global _cards_epoch
    with _cards_lock:
        _cards.pop(session_id, None)
        _cards_epoch += 1
        _forgotten[session_id] = (_cards_epoch, time.monotonic())


def _cards_kept(session_ids: Sequence[uuid.UUID] | None) -> bool:
    """Cards serve the requests of known sessions on PostgreSQL, whose claim statement checks them."""
    return session_ids is not None and connection.vendor == "postgresql"


def _held_in_claim() -> bool:
    """Whether the claim statement checks every seat hold itself (PostgreSQL)."""
    return connection.vendor == "postgresql" and selectors.seat_holds_in_sql()


def _workers(batch: _Batch, indices: list[int], *, remembered: bool) -> _Workers:
    """The workers of the requests at `indices`: from their cards where `remembered`, the others read
    now in one statement (and kept as cards where the batch keeps them). Each request's heartbeat, when
    newer, replaces its worker's metrics."""
    worker_ids, session_ids = batch.worker_ids, batch.session_ids
    states: dict[uuid.UUID, selectors.WorkerState] = {}
    scores: dict[uuid.UUID, selectors.Scores] = {}
    large: dict[uuid.UUID, int] = {}
    carded: set[uuid.UUID] = set()
    missing: dict[uuid.UUID, None] = {}
    due: list[_Card] = []
    tick = time.monotonic()
    with _cards_lock:
        epoch = _cards_epoch
        for index in indices:
            worker_id = worker_ids[index]
            if worker_id in states or worker_id in missing:
                continue
            card = _cards.get(session_ids[index]) if remembered and session_ids is not None else None
            if card is None or card.state.id != worker_id:
                missing[worker_id] = None
                continue
            states[worker_id], scores[worker_id], large[worker_id] = card.state, card.scores, card.large
            carded.add(worker_id)
            if tick - card.read_at >= CARD_SECS and not card.refreshing:
                card.refreshing = True
                due.append(card)
    open_builds: dict[uuid.UUID, selectors.OpenBuilds] = {}
    if missing:
        read, open_builds, read_scores = selectors.workers_scored_of_batch(list(missing), batch.now)
        states.update(read)
        scores.update(read_scores)
        large.update((w, o.large_transfers) for w, o in open_builds.items())
        if _cards_kept(session_ids):
            _keep_cards(read, open_builds, read_scores, epoch, tick, gone=())
    if due:
        _in_background(functools.partial(_refresh_cards, due))
    if batch.metrics is not None:
        for index in indices:
            state = states.get(worker_ids[index])
            if state is not None and (beat := batch.metrics[index]) is not None:
                _with_metrics(state.worker, *beat)
    for worker_id in carded:
        selectors.scoring_metrics(states[worker_id].worker, batch.now)
    return _Workers(states, open_builds, scores, large, carded)


def _with_metrics(worker: Any, metrics: WorkerMetrics, at: datetime) -> None:
    """The heartbeat's metrics on the worker's row (not saved: the presence flush writes them), when
    newer than those it holds."""
    if worker.metrics_at is None or at > worker.metrics_at:
        for name in METRIC_FIELDS:
            setattr(worker, name, getattr(metrics, name))
        worker.metrics_at = at


def _keep_cards(
    read: dict[uuid.UUID, selectors.WorkerState],
    open_builds: dict[uuid.UUID, selectors.OpenBuilds],
    scores: dict[uuid.UUID, selectors.Scores],
    epoch: int,
    tick: float,
    gone: Sequence[uuid.UUID],
) -> None:
    """Keep what a read begun at `epoch` found, but for the sessions whose card was forgotten since (it
    may be older than that change); `gone`: sessions whose worker the read no longer found (closed,
    deactivated)."""
    global _cards_swept
    with _cards_lock:
        for worker_id, state in read.items():
            if _forgotten.get(state.session_id, (0, 0.0))[0] > epoch:
                continue
            _cards[state.session_id] = _Card(
                state,
                scores.get(worker_id, {}),
                open_builds.get(worker_id, selectors.OpenBuilds()).large_transfers,
                tick,
            )
        for session_id in gone:
            _cards.pop(session_id, None)
        if tick - _cards_swept >= CARD_SECS:
            _cards_swept = tick
            for session_id in [s for s, c in _cards.items() if tick - c.read_at >= CARD_FORGET_SECS]:
                del _cards[session_id]
            for session_id in [s for s, (_, at) in _forgotten.items() if tick - at >= CARD_FORGET_SECS]:
                del _forgotten[session_id]


def _refresh_cards(due: list[_Card]) -> None:
    """Read the due cards' workers again (beside the claim batches, on another thread of the claims
    lane): a change nobody announced (an operator's) reaches the cards within CARD_SECS."""
    with _cards_lock:
        epoch = _cards_epoch
    tick = time.monotonic()
    try:
        read, open_builds, scores = selectors.workers_scored_of_batch([c.state.id for c in due])
        found = {state.session_id for state in read.values()}
        gone = [c.state.session_id for c in due if c.state.session_id not in found]
        _keep_cards(read, open_builds, scores, epoch, tick, gone=gone)
    finally:
        for card in due:
            card.refreshing = False


def _answer(batch: _Batch, indices: list[int], workers: _Workers) -> list[int]:
    """Answer the batch's requests at `indices`; returns those a card served that were left without a
    choice, refused by nothing (to be decided again from a fresh read)."""
    worker_ids, now = batch.worker_ids, batch.now
    check_in_claim = _cards_kept(batch.session_ids)
    held = set() if _held_in_claim() else selectors.workers_held(list(workers.states), JobKind.BUILD)
    asking: list[_Asking] = []
    # The batch's requests already answered count against their workers' slots.
    planned: dict[uuid.UUID, int] = {}
    for index, answer in enumerate(batch.answers):
        if answer is not None:
            planned[worker_ids[index]] = planned.get(worker_ids[index], 0) + 1
    for index in indices:
        worker_id = worker_ids[index]
        state = workers.states.get(worker_id)
        if state is None or state.draining:
            continue
        if batch.session_ids is not None and batch.session_ids[index] != state.session_id:
            continue  # asked by a session closed since: its worker has another now (or none)
        finishing = batch.finishing[index] if batch.finishing is not None else 0
        slots = max(1, state.worker.max_concurrent_builds)
        if worker_id not in workers.carded:
            counts = workers.open_builds.get(worker_id, selectors.OpenBuilds())
            running = max(0, counts.running - finishing)
            if running + planned.get(worker_id, 0) >= slots:
                batch.clear.append(worker_id)  # full
                continue
        if worker_id in held:
            batch.idle.append(worker_id)  # a reserved seat: it waits, idle, for its cluster
            continue
        room = slots - planned.get(worker_id, 0) if check_in_claim else None
        planned[worker_id] = planned.get(worker_id, 0) + 1
        view = _worker_view(state, workers.large.get(worker_id, 0))
        asking.append(
            _Asking(index, state, view, workers.scores.get(worker_id, {}), room=room, finishing=finishing)
        )
    # Read again beside the batches once a second, where the claim batch's workers are known sessions.
    pool = selectors.pool_view(now, background=_in_background if check_in_claim else None)
    policy = _policy()
    with _claiming_lock:
        busy = set(_claiming)
    _rank_each(asking, pool, policy, now, len(busy))
    # The idle slots of the workers served or full go; those of the asking workers go with the first
    # claim statement (those left unanswered are recorded again below).
    batch.clear.extend(a.state.id for a in asking)
    _claim_choices(asking, batch.answers, pool, policy, now, batch.tried, busy, batch.chosen, batch.clear)
    kept = queue_book.book()
    behind = [a for a in asking if batch.answers[a.index] is None and a.shared is not None and not a.refused]
    if kept is not None and behind:
        # Left unanswered from the book: its entry may be behind (claims of another process, a change
        # not announced yet). Once more from the queue itself.
        for a in behind:
            kept.forget((*_shape(a.state), wait_cap_secs(pool) is None))
            a.shared, a.at = None, 0
        _rank_each(behind, pool, policy, now, len(busy))
        _claim_choices(
            behind,
            batch.answers,
            pool,
            policy,
            now,
            batch.tried,
            busy | batch.chosen,
            batch.chosen,
            batch.clear,
        )
    unanswered = [a for a in asking if batch.answers[a.index] is None]
    unsure = [a.index for a in unanswered if not a.refused and not a.lost and a.state.id in workers.carded]
    batch.lost.update(a.index for a in unanswered if a.lost and not a.refused)
    batch.idle.extend(
        a.state.id for a in unanswered if a.refused in ("", claims_sql.REFUSED_HELD) and a.index not in unsure
    )
    return unsure


def _uuid4s(n: int) -> list[uuid.UUID]:
    """n random uuids, as uuid.uuid4 makes them, from one read of the system's randomness (one each was
    a twentieth of a claim batch's time on its thread: the read gives up the GIL and waits to get it
    back)."""
    raw = os.urandom(16 * n)
    return [uuid.UUID(bytes=raw[i : i + 16], version=4) for i in range(0, 16 * n, 16)]


def _worker_view(state: selectors.WorkerState, large_transfers: int | None = None) -> WorkerView:
    w = state.worker
    if large_transfers is None:
        large_transfers = selectors.large_transfers_running(w.id)
    return WorkerView(
        can_fetch=w.can_fetch,
        cpu_core_score=w.cpu_core_score,
        cpu_usage_pct=w.cpu_usage_pct,
        ram_free_mb=w.ram_free_mb,
        ram_total_mb=w.ram_total_mb,
        build_peak_ram_mb=w.build_peak_ram_mb,
        download_speed_mbps=w.download_speed_mbps,
        large_transfers_running=large_transfers,
    )


def _shape(state: selectors.WorkerState) -> tuple[object, ...]:
    """What decides which builds a worker may take: workers alike share one read of the queue."""
    w = state.worker
    return (
        w.can_build,
        frozenset(w.architectures or []),
        frozenset(w.system_features or []),
        state.project_ids,
    )


def _candidate(ref: selectors.BuildRef, now: datetime, scores: dict[str, tuple[int, int]]) -> Candidate:
    s = scores.get(ref.job_key)
    return Candidate(
        job_id=ref.job_key,
        kind="build",
        waited_secs=(now - (ref.queued_at or ref.created_at)).total_seconds(),
        prioritized=ref.prioritized,
        missing_nar_size=s[0] if s else None,
        missing_count=s[1] if s else None,
    )


def _rank_each(asking: list[_Asking], pool: PoolView, policy: str, now: datetime, busy: int) -> None:
    """Give every request its choices, best first: a worker without scores takes the order its group
    shares (one read of the queue and one ranking per kind of worker); a worker that scores its offers
    is ranked on its own, its scores and RescoreWait applied."""
    groups: dict[tuple[object, ...], list[_Asking]] = {}
    for a in asking:
        groups.setdefault(_shape(a.state), []).append(a)
    cap = wait_cap_secs(pool)
    for members in groups.values():
        plain = [a for a in members if not a.scores]
        if plain:
            k, n = _process_share(now)
            shared = _shared_heads(
                plain[0].state, now, cap, pool, max(PRESELECT, 2 * len(plain) + 8 + busy), serves=n
            )
            if n > 1:
                shared = _prefer_own(shared, k, n, 2 * n * (len(plain) + busy) + 16)
            for a in plain:
                a.shared, a.now = shared, now
        for a in members:
            if a.scores:
                a.ranked = _ranked_with_scores(a, pool, policy, now, cap)


# Several `serve` processes read the same heads and choose them in the same order: their batches then
# claim the same builds in the same milliseconds and one loses almost all of its claims (SKIP LOCKED),
# to try its next choices. Each live process prefers, among the first heads a batch could reach, the
# builds of its own residue (build id modulo the live processes): the claims spread, and a build waits
# behind at most that window of others (not behind the other process's whole half: one with few
# workers would otherwise hold the oldest builds of its half back). The database still decides.
SHARE_SECS = 10.0
_share: tuple[float, uuid.UUID, int, int] | None = None


def _process_share(now: datetime) -> tuple[int, int]:
    """(k, n): this serve is the k-th of the n live ones (by boot id), read again every SHARE_SECS;
    (0, 1) outside a serve that keeps a book (tests, Celery) or when it is alone."""
    global _share
    if queue_book.book() is None:
        return 0, 1
    me, tick = boot.current_boot(), time.monotonic()
    if _share is None or _share[1] != me or tick - _share[0] >= SHARE_SECS:
        ids = sorted(b.id for b in instances.live_boots(now=now))
        k, n = (ids.index(me), len(ids)) if me in ids else (0, 1)
        _share = (tick, me, k, n)
    return _share[2], _share[3]


def _prefer_own(refs: list[selectors.BuildRef], k: int, n: int, window: int) -> list[selectors.BuildRef]:
    """The first `window` heads with this process's own first (each part in its order), then the rest."""
    head = refs[:window]
    return [r for r in head if r.id.int % n == k] + [r for r in head if r.id.int % n != k] + refs[window:]


# What the book reads at once for a kind of worker. A serve alone: enough for some twenty batches of
# fifty. Each read walks the queue's index past the entries of builds claimed since the last vacuum,
# whatever it reads, and builds are claimed 2 000 a second here: 1 024 a read against 256 took
# PostgreSQL 0.32-0.34 against 0.36-0.40 ms a hand-out and serve 0.43-0.50 against 0.48-0.66
# (bench/handout.py, 100 clients, four pairs run alternately, every one faster by 7-28 %). Beside other
# serves, their claims make an entry stale sooner and each claim lost to them reads it again at once:
# 1 024 there took PostgreSQL 0.84-0.86 ms a hand-out against 0.50 (two serves, 200 clients).
BOOK_PRESELECT = 16 * PRESELECT
BOOK_PRESELECT_SHARED = 4 * PRESELECT


def _shared_heads(
    state: selectors.WorkerState,
    now: datetime,
    cap: float | None,
    pool: PoolView,
    preselect: int,
    *,
    serves: int,
) -> list[selectors.BuildRef]:
    """The heads of the queue for workers of this one's kind: from this process's book where it keeps one
    (gradient.scheduling.book), else read now. `serves`: the live serve processes (_process_share)."""
    kept = queue_book.book()

    def ranked(n: int) -> list[selectors.BuildRef]:
        """Read and put in the order every unscored worker of this kind ranks them: prioritized, then
        the longest wait, then the id. Time changes every build's wait alike, so the order holds while
        the book keeps it (the WaitTime cap, which makes waits past it tie, is one reason the book
        reads again after a second)."""
        refs = selectors.queued_build_refs(state, now, wait_cap_secs=cap, preselect=n)
        by_key = {r.job_key: r for r in refs}
        return [by_key[s.job_id] for s in rank([_candidate(r, now, {}) for r in refs], WorkerView(), pool)]

    def kept_with_payloads(n: int) -> list[selectors.BuildRef]:
        """ranked, with the payloads of the heads read into the book at once: the batches that claim
        them then read none (a read of each batch's chosen builds was 8 % of its time)."""
        heads = ranked(n)
        _payloads([r.id for r in heads])
        return heads

    if kept is None:
        return ranked(preselect)
    read = BOOK_PRESELECT if serves == 1 else BOOK_PRESELECT_SHARED
    return kept.heads(
        (*_shape(state), cap is None),
        max(preselect, read),
        kept_with_payloads,
        _in_background,
        first=preselect,
    )


def _in_background(call: Callable[[], None]) -> object:
    """Run `call` on another of the claims lane's threads (one claim batch runs at a time; the others
    wait for RequestJob{eval}), on a sound connection (a dead one is dropped after it)."""
    return lanes.CLAIMS.executor().submit(lanes.retrying, call, what="reading the queue's heads", attempts=1)


def _ranked_with_scores(a: _Asking, pool: PoolView, policy: str, now: datetime, cap: float) -> list[Score]:
    by_score = selectors.ScoredPreselect(
        mean_wait_secs=mean_wait_secs(pool),
        download_mbps=download_mbps(a.view),
        large_transfers=a.view.large_transfers_running,
    )
    refs = selectors.queued_build_refs(a.state, now, wait_cap_secs=cap, scored=a.scores, by_score=by_score)
    # RescoreWait holds back what a scoring worker was offered and has not scored yet.
    offered = _offered_passes_ago(a.state.id, [r.job_key for r in refs if r.job_key not in a.scores], now)
    candidates = [_with_offered(_candidate(r, now, a.scores), offered.get(r.job_key)) for r in refs]
    return rank(candidates, a.view, pool, policy)


def _with_offered(c: Candidate, passes: int | None) -> Candidate:
    return dataclasses.replace(c, offered_passes_ago=passes) if passes is not None else c


def _claim_choices(
    asking: list[_Asking],
    answers: list[Assignment | None],
    pool: PoolView,
    policy: str,
    now: datetime,
    tried: list[uuid.UUID],
    busy: set[str],
    chosen: set[str],
    clear: list[uuid.UUID],
) -> None:
    """Claim each request's best free choice, all in one statement; the requests whose claim lost try
    their next choice, up to CLAIM_ROUNDS rounds. `busy`: builds other batches are claiming now;
    `chosen` collects this batch's choices (while it runs, the other batches pass over them); `clear`,
    workers whose idle slots the first claim statement deletes (emptied once it has). Fills `answers`."""
    taken: set[str] = set(busy)
    hints: dict[int, int] = {}  # for next_choice, by id(): the requests keep their shared orders alive
    waiting = list(asking)
    for _round in range(CLAIM_ROUNDS):
        chosen_now: list[tuple[_Asking, Score]] = []
        with _claiming_lock:  # chosen and marked at once: two batches never choose the same build
            taken |= _claiming
            for a in waiting:
                choice = a.next_choice(taken, pool, policy, hints)
                if choice is not None:
                    taken.add(choice.job_id)
                    chosen_now.append((a, choice))
            _claiming.update(c.job_id for _, c in chosen_now)
        if not chosen_now:
            break
        chosen.update(c.job_id for _, c in chosen_now)
        builds = _payloads([_build_id(c.job_id) for _, c in chosen_now])
        # The claim's time is when the rows are locked, not when the requests arrived: a build queued by a
        # dependency that finished meanwhile is never shown dispatched before that dependency finished.
        claimed_at = max(now, timezone.now())
        claims: list[tuple[_Asking, Score, BuildClaim, Job]] = []
        new_ids = iter(_uuid4s(len(chosen_now)))
        for a, choice in chosen_now:
            made = builds.get(_build_id(choice.job_id))
            if made is None:
                continue
            build, job, job_builtins = made
            s = a.scores.get(choice.job_id)
            terms = ClaimTerms(
                score=choice.total,
                breakdown=choice.breakdown,
                missing_nar_size=s[0] if s else None,
                missing_count=s[1] if s else None,
            )
            tried.append(assignment_id := next(new_ids))
            claim = lifecycle.build_claim(
                build=build,
                worker_id=a.state.id,
                job=job,
                terms=terms,
                assignment_id=assignment_id,
                job_builtins=job_builtins,
                session_id=a.state.session_id,
                room=a.room,
                finishing=a.finishing,
            )
            claims.append((a, choice, claim, job))
        refused: dict[uuid.UUID, str] = {}
        won = lifecycle.claim_builds(
            claims=[c for _, _, c, _ in claims], now=claimed_at, idle_cleared=clear, refused=refused
        )
        if claims:  # the statement took them
            clear.clear()
        if (kept := queue_book.book()) is not None:
            # Claimed, or lost (taken elsewhere, no longer Queued or wanted): out of the book either way.
            # A claim refused for its worker says nothing of its build.
            kept.gone(_build_id(c.job_id) for a, c, claim, _ in claims if claim.assignment_id not in refused)
        waiting = []
        for a, choice, claim, payload in claims:
            if claim.assignment_id in won:
                answers[a.index] = Assignment(
                    claim.assignment_id, choice.job_id, JobKind.BUILD, payload, choice
                )
            elif claim.assignment_id in refused:
                # Its worker's session closed or draining, its seat held or its slots full: what the
                # process remembered of it was behind; no next choice.
                a.refused = refused[claim.assignment_id]
                if a.refused != claims_sql.REFUSED_HELD:
                    forget_card(a.state.session_id)
            else:
                a.lost = True
                waiting.append(a)


_Payload = tuple[DerivationBuild, Job, dict[str, Any] | None]


def _payloads(build_ids: list[uuid.UUID]) -> dict[uuid.UUID, _Payload]:
    """The chosen builds with their AssignJob payloads: from this process's book, which makes each
    build's once (the claim statement takes the queued time from the locked row, not from the kept
    one); read now where no book is kept."""

    def made(ids: list[uuid.UUID]) -> dict[uuid.UUID, _Payload]:
        out: dict[uuid.UUID, _Payload] = {}
        for build in _payload_builds(ids):
            job = jobs.build_job(build)
            out[build.id] = (build, job, msgspec.to_builtins(job) if kept is not None else None)
        return out

    kept = queue_book.book()
    return made(build_ids) if kept is None else kept.payloads(build_ids, made)


# Only what the payload and the claim read (jobs.build_job, lifecycle.build_claim).
# In the model's order (Model.from_db takes the values in that order).
_PAYLOAD_FIELDS = tuple(
    f.attname
    for f in DerivationBuild._meta.concrete_fields
    if f.attname
    in {
        "id",
        "drv_path",
        "system",
        "required_features",
        "outputs",
        "timeout_secs",
        "max_silent_secs",
        "queued_at",
    }
)
_PAYLOAD_SQL = (
    f"SELECT {', '.join(_PAYLOAD_FIELDS)} FROM {DerivationBuild._meta.db_table} "  # noqa: S608 (fixed names)
    "WHERE id = ANY(%b::uuid[])"
)


def _payload_builds(ids: list[uuid.UUID]) -> list[DerivationBuild]:
    """The chosen builds with the payload's fields only: on PostgreSQL one fixed-text read (every claim
    batch reads its new builds), made into rows as the ORM would (setsql.from_row)."""
    if connection.vendor != "postgresql":
        return list(DerivationBuild.objects.filter(id__in=ids).only(*_PAYLOAD_FIELDS))
    with fixed_cursor() as cursor:
        cursor.execute(_PAYLOAD_SQL, [ids])
        rows = cursor.fetchall()
    return [setsql.from_row(DerivationBuild, _PAYLOAD_FIELDS, row) for row in rows]


def _build_id(job_key: str) -> uuid.UUID:
    build_id = parse_uuid(job_key.removeprefix("build:"))  # remembered: parsed once per key
    assert build_id is not None  # a key this process made from a build's row
    return build_id


def _assign_eval(state: selectors.WorkerState, now: datetime, tried: list[uuid.UUID]) -> Assignment | None:
    split = selectors.has_idle_eval_only_worker()
    evaluations: dict[str, tuple[Evaluation, tuple[FlakeStep, ...]]] = {}
    for e in selectors.queued_evaluations(state)[:5000]:
        steps = jobs.eval_steps(e, split=split)
        if selectors.worker_can_run_eval_steps(state.worker, steps):
            evaluations[e.job_key] = (e, steps)
    if not evaluations:
        return None
    scores = selectors.worker_scores([state.id]).get(state.id, {})
    candidates = [
        Candidate(
            job_id=key,
            kind="eval",
            waited_secs=(now - e.updated_at).total_seconds()
            if e.followup_pending
            else (now - e.created_at).total_seconds(),
            prioritized=e.priority,
            has_fetch_step=jobs.FETCH_FLAKE in steps,
            missing_nar_size=scores[key][0] if key in scores else None,
        )
        for key, (e, steps) in evaluations.items()
    ]
    view = _worker_view(state)
    ranked = rank(candidates, view, selectors.pool_view(now), _policy())
    lost = 0
    for choice in ranked[:MAX_TRIED_CANDIDATES]:
        evaluation, steps = evaluations[choice.job_id]
        if _lock_if_free(Evaluation, evaluation.id, EvaluationStatus.QUEUED) is None:
            continue
        # Stamped when the row was locked, as a build's claim is: an evaluation whose last assignment a
        # report batch closed (and requeued) while this request was on its way is never shown dispatched
        # again before that assignment's close.
        claimed_at = max(now, timezone.now())
        tried.append(assignment_id := uuid.uuid4())
        claimed = lifecycle.claim_evaluation(
            assignment_id=assignment_id,
            evaluation=evaluation,
            steps=steps,
            worker_id=state.id,
            worker_name=state.worker.name,
            reason=f"assigned to {state.worker.name}: {', '.join(steps)}",
            now=claimed_at,
            terms=ClaimTerms(score=choice.total, breakdown=choice.breakdown),
            session_id=state.session_id,
        )
        if claimed is not None:
            return Assignment(claimed.assignment_id, evaluation.job_key, JobKind.EVAL, claimed.job, choice)
        lost += 1
        if lost >= MAX_LOST_CLAIMS:
            break
    return None


def _lock_if_free(model: Any, row_id: uuid.UUID, status: str) -> Any:
    """The job's row, locked for this transaction, if it still has `status` and no concurrent RequestJob
    holds it (SKIP LOCKED): concurrent requests spread over the best jobs instead of queueing behind the
    same one. The claim statement still decides who wins; this only avoids waiting for a likely loser.
    (SQLite serializes writers and ignores the lock.)"""
    return (
        model.objects.select_for_update(skip_locked=True, no_key=True)
        .filter(id=row_id, status=status)
        .first()
    )


IdleListener = Callable[[datetime], None]
_idle_listeners: list[IdleListener] = []


def register_idle_listener(listener: IdleListener) -> None:
    """Called with `now` after a RequestJob went unanswered (a new idle slot): the cluster code places
    waiting clusters at once instead of at its next pass (registered from its AppConfig.ready)."""
    if listener not in _idle_listeners:
        _idle_listeners.append(listener)


def hand_out(
    *, worker_id: uuid.UUID, protocol_kind: JobKindName, now: datetime, session_id: uuid.UUID | None = None
) -> AssignJob | None:
    """A worker's RequestJob: the AssignJob to send back once this returned (its claim has committed), or
    None: the request stays unanswered, an idle slot for cluster placement, and the idle listeners run.

    When the database connection dies while claiming, the claim may have committed without this call
    hearing so (dying at COMMIT): that job is this worker's now and must go out, or it would stay open on
    a worker that never heard of it. Otherwise the claim rolled back and the error propagates (the caller
    asks again on a fresh connection). `session_id`: the session that asked (request_job)."""
    tried: list[uuid.UUID] = []
    try:
        handed = request_job(
            worker_id=worker_id, protocol_kind=protocol_kind, now=now, tried=tried, session_id=session_id
        )
    except (OperationalError, InterfaceError):
        return _unheard_or_raise([worker_id], tried)[0]
    if handed is None:
        _idle_slots_appeared()
        return None
    return handed.message()


class AskAgain:
    """The answer to a RequestJob whose claims all lost to other claimers: there was work; the request
    goes into the next batch instead of waiting for the worker to ask again."""


ASK_AGAIN = AskAgain()


def hand_out_builds(
    *,
    worker_ids: Sequence[uuid.UUID],
    now: datetime,
    session_ids: Sequence[uuid.UUID] | None = None,
    finishing: Sequence[int] | None = None,
    metrics: Sequence[SessionMetrics | None] | None = None,
) -> list[AssignJob | AskAgain | None]:
    """A batch of RequestJob{build} from any sessions of this process (the dispatcher's): the AssignJob
    of each, ASK_AGAIN for one whose claims lost, or None for one left unanswered, once the batch's
    claims committed. A claim whose commit went unheard is handed out as in hand_out. `session_ids`:
    the session that asked each, and `finishing`, its worker's builds whose end is on its way
    (request_builds), and `metrics`, its session's latest heartbeat."""
    tried: list[uuid.UUID] = []
    lost: set[int] = set()
    try:
        handed = request_builds(
            worker_ids=worker_ids,
            now=now,
            tried=tried,
            lost=lost,
            session_ids=session_ids,
            finishing=finishing,
            metrics=metrics,
        )
    except (OperationalError, InterfaceError):
        return list(_unheard_or_raise(worker_ids, tried))
    if any(h is None for h in handed):
        _idle_slots_appeared()
    return [
        h.message() if h is not None else ASK_AGAIN if index in lost else None
        for index, h in enumerate(handed)
    ]


def _unheard_or_raise(worker_ids: Sequence[uuid.UUID], tried: list[uuid.UUID]) -> list[AssignJob | None]:
    """The connection died under the claims: those that committed unheard go out to their workers (one
    per worker at most, as each request of a worker waits in order); if none did, the claims rolled back
    and the error propagates, so the caller tries again on a fresh connection."""
    lanes.drop_connection()
    answers: list[AssignJob | None] = [None] * len(worker_ids)
    found = False
    for index, worker_id in enumerate(worker_ids):
        unheard = selectors.unheard_assignment(worker_id, tried)
        if unheard is not None and all(a is None or a.job_id != unheard.job_id for a in answers):
            answers[index] = unheard
            found = True
            log.warning("a claim for worker %s committed unheard; handing it out", worker_id)
    if not found:
        raise
    return answers


def _idle_slots_appeared() -> None:
    for listener in list(_idle_listeners):
        try:
            listener(timezone.now())
        except Exception:  # a failing listener must not cost the worker its session
            log.exception("an idle-slot listener failed")
