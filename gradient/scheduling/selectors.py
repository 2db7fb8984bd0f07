"""Reads of the scheduling app: which jobs a worker may get, and what scoring needs to know."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import msgspec
from django.conf import settings
from django.db import connection
from django.db.models import Count, Exists, OuterRef, Q, QuerySet
from django.utils import timezone

from gradient.core.jobkey import JobKey, build_key
from gradient.core.protocol import AssignJob, FlakeStep, Job
from gradient.core.vocab import (
    BUILD_LASTING_FAILURE,
    BUILD_SUCCESS,
    BUILTIN_SYSTEM,
    CLUSTER_TERMINAL,
    EVALUATION_ACTIVE,
    BuildStatus,
    EvaluationStatus,
    JobKeyKind,
    JobKind,
)
from gradient.records.errors import DecodeError, InvalidHistory, UnknownRecord
from gradient.records.selectors import record_job
from gradient.recovery.models import ServerBoot
from gradient.runtime import setsql
from gradient.runtime.setsql import fixed_cursor
from gradient.scheduling import jobs
from gradient.scheduling.decisions.scoring import (
    ESTIMATE_CAP_SECS,
    LARGE_TRANSFER_BYTES,
    QOS_BONUS,
    TRANSFER_PENALTY,
    TRANSFER_SLOTS,
    WAIT_CAP,
    PoolView,
    metrics_stale,
)
from gradient.scheduling.decisions.waiting import clock_time, unbuildable_deadline, what_happens_next
from gradient.scheduling.models import (
    CachedPath,
    CandidateScore,
    DerivationBuild,
    DerivationBuildDependency,
    DispatchedJob,
    Evaluation,
    EvaluationBuild,
)
from gradient.workers.models import METRIC_FIELDS, Worker, WorkerSession

MEAN_WAIT_WINDOW = timedelta(hours=1)
MEAN_WAIT_SAMPLE = 1000


@dataclass(frozen=True)
class WorkerState:
    """A connected worker as assignment sees it: its metrics only while fresh (`scoring_metrics`)."""

    worker: Worker
    session_id: uuid.UUID
    draining: bool
    project_ids: frozenset[uuid.UUID]

    @property
    def id(self) -> uuid.UUID:
        return self.worker.id


def scoring_metrics(worker: Worker, now: datetime) -> Worker:
    """The worker as scoring may read it: metrics older than scoring.METRICS_STALE_SECS are unknown
    (None on this loaded row, which nothing saves), so a load reported long ago holds nothing back."""
    if metrics_stale(worker.metrics_at, now):
        for name in METRIC_FIELDS:
            setattr(worker, name, None)
    return worker


def worker_state(worker_id: uuid.UUID, now: datetime | None = None) -> WorkerState | None:
    """The worker with its open session, or None when it is not connected or not active. On PostgreSQL
    one statement of fixed text (each worker's offers read it: 300 connecting at once paid the ORM's
    two queries each, on the offers lane, beside the hand-outs)."""
    if connection.vendor == "postgresql":
        with fixed_cursor() as cursor:
            cursor.execute(_WORKER_STATE, {"id": worker_id})
            row = cursor.fetchone()
        if row is None:
            return None
        session_id, draining, projects, *values = row
        return _state_of_row(session_id, draining, projects, values, now or timezone.now())
    session = (
        WorkerSession.objects.select_related("worker")
        .filter(worker_id=worker_id, closed_at__isnull=True, worker__active=True)
        .first()
    )
    if session is None:
        return None
    projects = frozenset(session.worker.projects.values_list("id", flat=True))
    return WorkerState(
        worker=scoring_metrics(session.worker, now or timezone.now()),
        session_id=session.id,
        draining=session.draining,
        project_ids=projects,
    )


def worker_states(
    worker_ids: Sequence[uuid.UUID], now: datetime | None = None, *, orm: bool = False
) -> dict[uuid.UUID, WorkerState]:
    """worker_state for many workers at once (a batch of offers or job lists): on PostgreSQL one statement
    of fixed text, elsewhere (or with `orm`, which the tests compare it with) two ORM queries."""
    ids = list(set(worker_ids))
    now = now or timezone.now()
    if connection.vendor == "postgresql" and not orm:
        with fixed_cursor() as cursor:
            cursor.execute(_WORKER_STATES, {"ids": ids})
            rows = cursor.fetchall()
        states = (
            _state_of_row(session_id, draining, projects, values, now)
            for session_id, draining, projects, *values in rows
        )
        return {state.id: state for state in states}
    sessions = WorkerSession.objects.select_related("worker").filter(
        worker_id__in=ids, closed_at__isnull=True, worker__active=True
    )
    projects: dict[uuid.UUID, set[uuid.UUID]] = {w: set() for w in ids}
    for worker_id, project_id in Worker.projects.through.objects.filter(worker_id__in=ids).values_list(
        "worker_id", "project_id"
    ):
        projects[worker_id].add(project_id)
    return {
        s.worker_id: WorkerState(
            worker=scoring_metrics(s.worker, now),
            session_id=s.id,
            draining=s.draining,
            project_ids=frozenset(projects[s.worker_id]),
        )
        for s in sessions
    }


@dataclass(frozen=True, slots=True)
class OpenBuilds:
    running: int = 0  # open build assignments
    large_transfers: int = 0  # of them, those with a missing NAR size of a large transfer


def workers_of_batch(
    worker_ids: Sequence[uuid.UUID], now: datetime | None = None
) -> tuple[dict[uuid.UUID, WorkerState], dict[uuid.UUID, OpenBuilds]]:
    """worker_states and open_builds_of together, for a batch of RequestJobs (workers_scored_of_batch
    without the scores)."""
    states, open_builds, _ = workers_scored_of_batch(worker_ids, now)
    return states, open_builds


# A worker's own RequestJobChunk answers: job key -> (missing NAR size, missing count).
Scores = dict[str, tuple[int, int]]


def workers_scored_of_batch(
    worker_ids: Sequence[uuid.UUID], now: datetime | None = None
) -> tuple[dict[uuid.UUID, WorkerState], dict[uuid.UUID, OpenBuilds], dict[uuid.UUID, Scores]]:
    """worker_states, open_builds_of and the workers' scores (worker_scores) together, for a batch of
    RequestJobs: on PostgreSQL one statement of fixed text (every batch asks; building the ORM's three
    took longer than running them, and each was a round trip), elsewhere the three functions."""
    if connection.vendor != "postgresql":
        found = worker_states(worker_ids, now)
        return found, open_builds_of(list(found)), worker_scores(list(found))
    now = now or timezone.now()
    states: dict[uuid.UUID, WorkerState] = {}
    open_builds: dict[uuid.UUID, OpenBuilds] = {}
    scores: dict[uuid.UUID, Scores] = {}
    # Planned with its values each time: a generic plan made while dispatched_job was nearly empty counted
    # each worker's open builds on its index of every assignment (3.7 against 0.5 ms a batch).
    with fixed_cursor(literal=True) as cursor:
        cursor.execute(
            _WORKERS_OF_BATCH,
            {
                "ids": list(set(worker_ids)),
                "build": JobKind.BUILD.value,
                "large": LARGE_TRANSFER_BYTES,
            },
        )
        for session_id, draining, projects, running, large, jobs, sizes, counts, *values in cursor.fetchall():
            state = _state_of_row(session_id, draining, projects, values, now)
            if jobs:
                scores[state.id] = dict(zip(jobs, zip(sizes, counts, strict=True), strict=True))
            states[state.id] = state
            if running:
                open_builds[state.id] = OpenBuilds(running, large)
    return states, open_builds, scores


def worker_scores(worker_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, Scores]:
    """The workers' own RequestJobChunk answers: worker -> job key -> (missing NAR size, count)."""
    out: dict[uuid.UUID, Scores] = {}
    if not worker_ids:
        return out
    rows = CandidateScore.objects.filter(worker_id__in=list(worker_ids)).values_list(
        "worker_id", "job_id", "missing_nar_size", "missing_count"
    )
    for worker_id, job_id, size, count in rows:
        out.setdefault(worker_id, {})[job_id] = (size, count)
    return out


_WORKER_NAMES = tuple(f.attname for f in Worker._meta.concrete_fields)
# A worker's open session, its projects and (after `extra`) its row, as _state_of_row takes them.
_SESSION_PROJECTS = (
    "SELECT s.id, s.draining, "  # noqa: S608 (column names from the model, no input)
    "(SELECT array_agg(wp.project_id) FROM worker_project wp WHERE wp.worker_id = w.id), {extra}"
    + ", ".join(f"w.{f.column}" for f in Worker._meta.concrete_fields)
    + " FROM worker_session s JOIN worker w ON w.id = s.worker_id"
)
_WORKERS_OF_BATCH = (
    _SESSION_PROJECTS.format(extra="o.running, o.large, sc.jobs, sc.sizes, sc.counts, ")  # noqa: S608
    + " CROSS JOIN LATERAL (SELECT count(*) AS running,"
    " count(*) FILTER (WHERE d.missing_nar_size >= %(large)s) AS large FROM dispatched_job d"
    " WHERE d.worker_id = w.id AND d.finished_at IS NULL AND d.kind = %(build)s) o"
    " CROSS JOIN LATERAL (SELECT array_agg(cs.job_id) AS jobs, array_agg(cs.missing_nar_size) AS sizes,"
    " array_agg(cs.missing_count) AS counts FROM candidate_score cs WHERE cs.worker_id = w.id) sc"
    " WHERE s.worker_id = ANY(%(ids)s::uuid[]) AND s.closed_at IS NULL AND w.active"
)


_WORKER_STATES = _SESSION_PROJECTS.format(extra="") + (
    " WHERE s.worker_id = ANY(%(ids)s::uuid[]) AND s.closed_at IS NULL AND w.active"
)
_WORKER_STATE = _SESSION_PROJECTS.format(extra="") + (
    " WHERE s.worker_id = %(id)s AND s.closed_at IS NULL AND w.active ORDER BY s.id LIMIT 1"
)


def _state_of_row(
    session_id: uuid.UUID,
    draining: bool,
    projects: Sequence[uuid.UUID] | None,
    values: Sequence[Any],
    now: datetime,
) -> WorkerState:
    """A row of _SESSION_PROJECTS (the worker's columns in `values`) as a WorkerState."""
    return WorkerState(
        worker=scoring_metrics(setsql.from_row(Worker, _WORKER_NAMES, values), now),
        session_id=session_id,
        draining=draining,
        project_ids=frozenset(projects or ()),
    )


def open_builds_of(worker_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, OpenBuilds]:
    """Each worker's open build assignments, and how many of them transfer much, in one query."""
    rows = (
        DispatchedJob.objects.filter(
            worker_id__in=list(worker_ids), finished_at__isnull=True, kind=JobKind.BUILD
        )
        .values("worker_id")
        .annotate(n=Count("id"), large=Count("id", filter=Q(missing_nar_size__gte=LARGE_TRANSFER_BYTES)))
        .values_list("worker_id", "n", "large")
    )
    return {w: OpenBuilds(n, large) for w, n, large in rows}


def worker_can_build(worker: Worker, system: str, required_features: list[str]) -> bool:
    """A build matches when the worker's architectures contain its system (builtin skips the check) and
    its system features contain every required feature."""
    if not worker.can_build:
        return False
    if system != BUILTIN_SYSTEM and system not in (worker.architectures or []):
        return False
    return set(required_features or []) <= set(worker.system_features or [])


def open_assignments(worker_id: uuid.UUID, kind: str | None = None) -> QuerySet[DispatchedJob]:
    qs = DispatchedJob.objects.filter(worker_id=worker_id, finished_at__isnull=True)
    return qs.filter(kind=kind) if kind else qs


def member_eval_steps(evaluation: Evaluation) -> tuple[FlakeStep, ...]:
    """The steps of a cluster member evaluation's next job: never split into fetch and evaluate."""
    return jobs.eval_steps(evaluation, split=False)


def eval_needs_fetch(steps: Sequence[FlakeStep]) -> bool:
    """Whether a job of these steps fetches the flake (so only a fetching worker can run it)."""
    return jobs.FETCH_FLAKE in steps


def unheard_assignment(worker_id: uuid.UUID, assignment_ids: Sequence[uuid.UUID]) -> AssignJob | None:
    """The AssignJob of the open, unanswered single-job assignment of this worker among the claims a
    RequestJob tried (`assignment_ids`, chosen before each claim): a claim whose COMMIT succeeded
    although the connection died before the caller heard so (assignment.hand_out hands it out instead of
    leaving it open on a worker that never heard of it). Looked up by id: a claim's dispatched_at is
    when its row was locked, not when the request arrived."""
    if not assignment_ids:
        return None
    row = (
        DispatchedJob.objects.filter(
            id__in=list(assignment_ids),
            worker_id=worker_id,
            finished_at__isnull=True,
            accepted_at__isnull=True,
            cluster_attempt__isnull=True,
        )
        .only("id", "job_id", "job")
        .first()
    )
    if row is None:
        return None
    return AssignJob(
        job_id=row.job_id, assignment_id=str(row.id), job=msgspec.convert(row.job, Job), cluster=None
    )


def has_idle_eval_only_worker() -> bool:
    """WorkerPool::has_idle_eval_only_worker: active, eval without fetch, no assigned job."""
    busy = DispatchedJob.objects.filter(worker_id=OuterRef("worker_id"), finished_at__isnull=True)
    return (
        WorkerSession.objects.filter(
            closed_at__isnull=True,
            draining=False,
            worker__active=True,
            worker__can_eval=True,
            worker__can_fetch=False,
        )
        .exclude(Exists(busy))
        .exists()
    )


def _no_member(model: Any) -> Any:
    """Not a member of a cluster that has not ended, as NOT EXISTS: a member of a Queued or Running
    cluster waits for it; once its cluster ended, the job is a single job again (a build an aborted
    cluster spared because evaluations outside the cluster need it, or one rebuilt afterwards).

    NOT EXISTS, so that PostgreSQL walks the queue's index in order and stops at the LIMIT (the LEFT
    JOIN ... IS NULL form made it read and sort every Queued build). The member model is reached
    through the reverse relation: scheduling imports nothing of clusters."""
    member = model._meta.get_field("cluster_members").related_model
    column = "derivation_build_id" if model is DerivationBuild else "evaluation_id"
    live = member.objects.filter(**{column: OuterRef("pk")}).exclude(cluster_job__status__in=CLUSTER_TERMINAL)
    return ~Exists(live)


def queued_evaluations(state: WorkerState) -> QuerySet[Evaluation]:
    """Queued evaluations of the worker's projects with no open assignment, oldest first. Cluster members
    are never single jobs."""
    open_row = DispatchedJob.objects.filter(evaluation_id=OuterRef("pk"), finished_at__isnull=True)
    return (
        Evaluation.objects.filter(status=EvaluationStatus.QUEUED, project_id__in=state.project_ids)
        .filter(_no_member(Evaluation))
        .exclude(Exists(open_row))
        .order_by("created_at", "id")
    )


@dataclass(frozen=True, slots=True)
class BuildRef:
    """What scoring needs of a queued shared build; the full row is loaded only for the one chosen."""

    id: uuid.UUID
    queued_at: datetime | None
    created_at: datetime
    prioritized: bool
    job_key: str = ""  # build_key(id), made once (a batch compares many)

    def __post_init__(self) -> None:
        if not self.job_key:
            object.__setattr__(self, "job_key", build_key(self.id))


def _queued_builds_for(state: WorkerState, now: datetime) -> QuerySet[DerivationBuild]:
    wanted = EvaluationBuild.objects.filter(
        build_id=OuterRef("pk"),
        blocks_evaluation=True,
        evaluation__status__in=EVALUATION_ACTIVE,
        evaluation__project_id__in=state.project_ids,
    )
    systems = [*(state.worker.architectures or []), BUILTIN_SYSTEM]
    return (
        DerivationBuild.objects.filter(status=BuildStatus.QUEUED, system__in=systems)
        .filter(Q(retry_at__isnull=True) | Q(retry_at__lte=now))
        .filter(_no_member(DerivationBuild))
        .filter(Exists(wanted))
        .order_by("queued_at", "id")
    )


PRESELECT = 64


@dataclass(frozen=True, slots=True)
class ScoredPreselect:
    """What a scoring worker's builds are ranked by, beyond the rows (scoring.score's inputs): the pool's
    mean wait (WaitTime), the worker's download speed and large transfers running (EstimatedTime,
    TransferLimit)."""

    mean_wait_secs: float
    download_mbps: float
    large_transfers: int


def queued_build_refs(
    state: WorkerState,
    now: datetime,
    *,
    wait_cap_secs: float | None = None,
    scored: Iterable[str] = (),
    preselect: int = PRESELECT,
    by_score: ScoredPreselect | None = None,
) -> list[BuildRef]:
    """Queued shared builds this worker can take (see queued_builds), as light references.

    RequestJob scores every pending build; only these can be the best, so only these are loaded (the
    rest of the rules are the same for every build on one worker): every prioritized build; the oldest
    builds whose wait has not reached the WaitTime cap; among those past the cap (whose wait scores
    tie), the smallest ids, as the tie-break picks; and every build the worker has scored. An unscored,
    unprioritized build outside these loses to one inside on wait or on id, so the winner is the same.
    `preselect` of each kind are loaded: a batch of RequestJobs from workers alike asks for more.

    With `by_score` (a scoring worker, on PostgreSQL), the scored builds are not all loaded: only the
    `preselect` best by the score the worker's own answers give them (the same rules, in SQL, over its
    candidate_score rows), besides the heads. A scored build's EstimatedTime is at most an unscored
    one's, so a scored build outside those cannot beat them; a worker that had scored every candidate
    it was offered (up to 1 000 an offer) loaded and ranked each of them on every RequestJob.
    """
    rows = queued_head_rows(
        state,
        now,
        wait_cap_secs=wait_cap_secs,
        scored=() if by_score is not None and connection.vendor == "postgresql" else scored,
        preselect=preselect,
    )
    if by_score is not None and connection.vendor == "postgresql" and state.worker.can_build:
        rows = [*rows, *_best_scored_heads(state, now, by_score, preselect)]
    return build_refs(state, rows)


def queued_head_rows(
    state: WorkerState,
    now: datetime,
    *,
    wait_cap_secs: float | None = None,
    scored: Iterable[str] = (),
    preselect: int = PRESELECT,
) -> list[tuple[Any, ...]]:
    """The rows queued_build_refs reads (id, queued_at, created_at, prioritized, system, required
    features), before the worker's features are checked: what a process's book keeps per kind of worker."""
    if not state.worker.can_build:
        return []
    scored_ids = [parsed for key in scored if (parsed := _build_id(key)) is not None]
    if connection.vendor == "postgresql":
        return _queued_heads(state, now, wait_cap_secs, scored_ids, preselect)
    return _queued_heads_orm(state, now, wait_cap_secs, scored_ids, preselect)


def build_refs(state: WorkerState, rows: Iterable[tuple[Any, ...]]) -> list[BuildRef]:
    """The rows of queued_head_rows that the worker can build, once each, as light references."""
    worker = state.worker
    refs: dict[uuid.UUID, BuildRef] = {}
    for b, q, c, p, system, features in rows:
        if b not in refs and worker_can_build(worker, system, features):
            refs[b] = BuildRef(id=b, queued_at=q, created_at=c, prioritized=p)
    return list(refs.values())


def _queued_heads_orm(
    state: WorkerState,
    now: datetime,
    wait_cap_secs: float | None,
    scored_ids: list[uuid.UUID],
    preselect: int,
) -> list[tuple[Any, ...]]:
    base = _queued_builds_for(state, now)
    columns = ("id", "queued_at", "created_at", "prioritized", "system", "required_features")
    parts = [base.filter(prioritized=True).values_list(*columns)[: preselect * 4]]
    if wait_cap_secs is None:
        parts.append(base.values_list(*columns)[:preselect])
    else:
        cap = now - timedelta(seconds=wait_cap_secs)
        parts.append(base.filter(queued_at__gt=cap).values_list(*columns)[:preselect])
        parts.append(base.filter(queued_at__lte=cap).order_by("id").values_list(*columns)[:preselect])
    for start in range(0, len(scored_ids), 5000):
        parts.append(base.filter(id__in=scored_ids[start : start + 5000]).values_list(*columns))
    return [row for part in parts for row in part]


# _queued_builds_for as one statement of fixed text (PostgreSQL): RequestJob batches ask it many times a
# second, and building the ORM's query (its EXISTS subqueries) cost more than running it. The same
# rules; tests/test_scheduling_assignment.py holds it to the ORM's queued_builds.
_HEADS_READY = """
    b.status = %(queued)s AND b.system = ANY(%(systems)s)
    AND (b.retry_at IS NULL OR b.retry_at <= %(now)s)"""
_HEADS_WANTED = """
    NOT EXISTS (
        SELECT 1 FROM cluster_member m JOIN cluster_job c ON c.id = m.cluster_job_id
        WHERE m.derivation_build_id = b.id AND c.status <> ALL(%(cluster_ended)s) OFFSET 0)
    AND EXISTS (
        SELECT 1 FROM evaluation_build eb JOIN evaluation e ON e.id = eb.evaluation_id
        WHERE eb.build_id = b.id AND eb.blocks_evaluation AND e.status = ANY(%(active)s)
          AND e.project_id = ANY(%(projects)s) OFFSET 0)"""
_HEADS_WHERE = _HEADS_READY + " AND " + _HEADS_WANTED
# OFFSET 0 keeps each EXISTS a lookup per build walked (PostgreSQL cannot make it a join), so a head
# walks the queue's index in order and stops at its LIMIT, whatever the statistics say.
_HEADS_FROM = (
    "(SELECT b.id, b.queued_at, b.created_at, b.prioritized, b.system, b.required_features "
    "FROM derivation_build b WHERE " + _HEADS_WHERE
)
_HEADS_PRIORITIZED = _HEADS_FROM + " AND b.prioritized ORDER BY b.queued_at, b.id LIMIT %(many)s)"
_HEADS_OLDEST = _HEADS_FROM + " ORDER BY b.queued_at, b.id LIMIT %(few)s)"
_HEADS_YOUNGER = _HEADS_FROM + " AND b.queued_at > %(cap)s ORDER BY b.queued_at, b.id LIMIT %(few)s)"
# Gated on the oldest Queued build (one index read, evaluated once): while none is past the cap, the walk
# in id order would read every Queued build to find none.
_OLDEST_PAST_CAP = "(SELECT min(q.queued_at) FROM derivation_build q WHERE q.status = %(queued)s) <= %(cap)s"
_HEADS_CAPPED_BY_ID = (
    _HEADS_FROM + " AND b.queued_at <= %(cap)s AND " + _OLDEST_PAST_CAP + " ORDER BY b.id LIMIT %(few)s)"
)
_HEADS_SCORED = _HEADS_FROM + " AND b.id = ANY(%(scored)s))"
_HEADS_UNCAPPED = " UNION ALL ".join((_HEADS_PRIORITIZED, _HEADS_OLDEST, _HEADS_SCORED))
_HEADS_CAPPED = " UNION ALL ".join((_HEADS_PRIORITIZED, _HEADS_YOUNGER, _HEADS_CAPPED_BY_ID, _HEADS_SCORED))


def _queued_heads(
    state: WorkerState,
    now: datetime,
    wait_cap_secs: float | None,
    scored_ids: list[uuid.UUID],
    preselect: int,
) -> list[tuple[Any, ...]]:
    params = _heads_params(state, now, preselect)
    params["cap"] = now - timedelta(seconds=wait_cap_secs) if wait_cap_secs is not None else None
    params["scored"] = scored_ids
    # Planned with its values each time (its generic plan read every Queued build), in whatever batch.
    with fixed_cursor(literal=True) as cursor:
        cursor.execute(_HEADS_UNCAPPED if wait_cap_secs is None else _HEADS_CAPPED, params)
        return _head_rows(cursor.fetchall())


def _heads_params(state: WorkerState, now: datetime, preselect: int) -> dict[str, Any]:
    """The values _HEADS_WHERE and the heads' limits take, for this worker."""
    return {
        "queued": BuildStatus.QUEUED.value,
        "systems": [*(state.worker.architectures or []), BUILTIN_SYSTEM],
        "now": now,
        "cluster_ended": [s.value for s in CLUSTER_TERMINAL],
        "active": [s.value for s in EVALUATION_ACTIVE],
        "projects": list(state.project_ids),
        "many": preselect * 4,
        "few": preselect,
    }


def _head_rows(rows: Iterable[Sequence[Any]]) -> list[tuple[Any, ...]]:
    """The heads' rows with their required features decoded (Django reads jsonb as text and decodes it
    itself: so does this)."""
    return [(*row[:5], json.loads(row[5]) if isinstance(row[5], str) else row[5]) for row in rows]


# A scoring worker's builds by the score its answers give them (decisions/scoring.py: WaitTime + Qos +
# EstimatedTime + TransferLimit; the other rules are the same for every build of one worker), best
# first, ties to the smaller key. tests/test_scheduling_assignment.py holds it to scoring.rank.
_SCORED_TOTAL = (
    f"LEAST({WAIT_CAP}, 60.0 * GREATEST(0, EXTRACT(EPOCH FROM (%(now)s - COALESCE(b.queued_at, "
    "b.created_at)))) / %(mean_wait)s)"
    f" + CASE WHEN b.prioritized THEN {QOS_BONUS} ELSE 0 END"
    f" + {ESTIMATE_CAP_SECS} - LEAST(cs.missing_nar_size / (%(mbps)s * 125000.0), {ESTIMATE_CAP_SECS})"
    f" + CASE WHEN cs.missing_nar_size >= {LARGE_TRANSFER_BYTES} AND %(large_running)s >= {TRANSFER_SLOTS}"
    f" THEN -{TRANSFER_PENALTY} ELSE 0 END"
)
_SCORED_BY_TOTAL = ' ORDER BY total DESC, cs.job_id COLLATE "C"'  # within _SCORED_FROM
_SCORED_OUTER_BY_TOTAL = ' ORDER BY b.total DESC, b.key COLLATE "C"'
# Ordered on what the rows of the worker's scores and their builds say, and only the best `many` of them
# checked against the evaluations and clusters (the lookups that cost most, a build at a time); read
# whole (_SCORED_HEADS_ALL) when fewer than `few` of those pass.
_SCORED_FROM = (
    "SELECT b.*, cs.job_id AS key, " + _SCORED_TOTAL + " AS total "  # noqa: S608 (fixed text)
    "FROM candidate_score cs JOIN derivation_build b ON b.id = "
    "(CASE WHEN left(cs.job_id, 6) = 'build:' THEN substr(cs.job_id, 7)::uuid END) "
    "WHERE cs.worker_id = %(worker)s AND " + _HEADS_READY
)
# With how many the ordering took (`many` of them: more were left, so fewer than `few` passing says
# nothing of those), as its last column.
_SCORED_HEADS = (
    "WITH best AS (" + _SCORED_FROM + _SCORED_BY_TOTAL + " LIMIT %(many)s) "  # noqa: S608 (fixed text)
    "SELECT b.id, b.queued_at, b.created_at, b.prioritized, b.system, b.required_features, "
    "(SELECT count(*) FROM best) FROM best b WHERE "
    + _HEADS_WANTED
    + _SCORED_OUTER_BY_TOTAL
    + " LIMIT %(few)s"
)
_SCORED_HEADS_ALL = (
    "SELECT b.id, b.queued_at, b.created_at, b.prioritized, b.system, b.required_features FROM ("  # noqa: S608
    + _SCORED_FROM
    + ") b WHERE "
    + _HEADS_WANTED
    + _SCORED_OUTER_BY_TOTAL
    + " LIMIT %(few)s"
)


def _best_scored_heads(
    state: WorkerState, now: datetime, by_score: ScoredPreselect, preselect: int
) -> list[tuple[Any, ...]]:
    params = _heads_params(state, now, preselect)
    params.update(
        worker=state.id,
        mean_wait=by_score.mean_wait_secs,
        mbps=by_score.download_mbps,
        large_running=by_score.large_transfers,
    )
    with fixed_cursor(literal=True) as cursor:
        cursor.execute(_SCORED_HEADS, params)
        rows = cursor.fetchall()
        if len(rows) < preselect and (not rows or rows[0][-1] >= params["many"]):
            # Most of the best `many` not wanted, and more scored behind them: all of them, then.
            cursor.execute(_SCORED_HEADS_ALL, params)
            rows = cursor.fetchall()
    return _head_rows(rows)


def _build_id(text: str) -> uuid.UUID | None:
    key = JobKey.parse(text, kinds=(JobKeyKind.BUILD,))
    return key.id if key is not None else None


def queued_builds(state: WorkerState, now: datetime) -> list[DerivationBuild]:
    """Queued shared builds this worker can take: its architecture and features, wanted by an active
    evaluation of one of its projects, out of backoff, no cluster member."""
    worker = state.worker
    if not worker.can_build:
        return []
    return [
        b for b in _queued_builds_for(state, now) if worker_can_build(worker, b.system, b.required_features)
    ]


def offerable_builds(state: WorkerState, now: datetime) -> QuerySet[DerivationBuild]:
    """queued_builds as one query, the features check included (PostgreSQL: jsonb `<@`), so that it can
    be diffed against the sent set in SQL."""
    if not state.worker.can_build:
        return DerivationBuild.objects.none()
    return _queued_builds_for(state, now).filter(
        required_features__contained_by=list(state.worker.system_features or [])
    )


def eval_requires(steps: tuple[str, ...]) -> tuple[bool, bool]:
    """(needs fetch, needs eval) for a job's steps: WorkerCaps::can_eval."""
    return "FetchFlake" in steps, any(s in ("EvaluateFlake", "EvaluateDerivations") for s in steps)


def worker_can_run_eval_steps(worker: Worker, steps: tuple[str, ...]) -> bool:
    needs_fetch, needs_eval = eval_requires(steps)
    return (worker.can_fetch or not needs_fetch) and (worker.can_eval or not needs_eval)


_POOL_CACHE_SECS = 1.0
_pool_cache: tuple[float, PoolView] | None = None
_pool_refreshing = False
_pool_lock = threading.Lock()


def pool_view(now: datetime, background: Callable[[Callable[[], None]], object] | None = None) -> PoolView:
    """The mean wait of the last hour's hand-outs and how busy the fetch-capable workers are. Every
    RequestJob scores with it, so a process reuses it for a second. With `background` (a way to run a
    call on another thread: the claim batches), one older than that is read again there and returned
    meanwhile: a claim batch does not wait for it."""
    global _pool_cache, _pool_refreshing
    tick = time.monotonic()
    cached = _pool_cache
    if cached is not None and tick - cached[0] < _POOL_CACHE_SECS:
        return cached[1]
    if cached is not None and background is not None:
        with _pool_lock:
            if _pool_refreshing:
                return cached[1]
            _pool_refreshing = True
        try:
            background(_refresh_pool)
        except RuntimeError:  # no thread to run it (the process is stopping): read it here
            with _pool_lock:
                _pool_refreshing = False
        else:
            return cached[1]
    view = _pool_view(now)
    _pool_cache = (tick, view)
    return view


def _refresh_pool() -> None:
    global _pool_cache, _pool_refreshing
    try:
        tick = time.monotonic()
        _pool_cache = (tick, _pool_view(timezone.now()))
    finally:
        with _pool_lock:
            _pool_refreshing = False


# _pool_view in one fixed-text statement (PostgreSQL): the mean is taken by the database, not by
# loading a thousand rows of timestamps each second.
_POOL_VIEW = """
SELECT
    (SELECT avg(EXTRACT(EPOCH FROM (r.dispatched_at - r.queued_at))) FROM (
        SELECT queued_at, dispatched_at FROM dispatched_job
        WHERE dispatched_at >= %(since)s AND queued_at IS NOT NULL
        ORDER BY dispatched_at DESC LIMIT %(sample)s) r),
    count(*),
    count(*) FILTER (WHERE NOT EXISTS (
        SELECT 1 FROM dispatched_job d WHERE d.worker_id = s.worker_id AND d.finished_at IS NULL))
FROM worker_session s JOIN worker w ON w.id = s.worker_id
WHERE s.closed_at IS NULL AND NOT s.draining AND w.active AND w.can_fetch
"""


def _pool_view(now: datetime) -> PoolView:
    if connection.vendor == "postgresql":
        with fixed_cursor(literal=True) as cursor:  # a range of times: planned with its values
            cursor.execute(_POOL_VIEW, {"since": now - MEAN_WAIT_WINDOW, "sample": MEAN_WAIT_SAMPLE})
            mean_wait, total, idle = cursor.fetchone()
        return PoolView(
            mean_wait_secs=float(mean_wait) if mean_wait is not None else None,
            fetch_workers_idle=int(idle),
            fetch_workers_total=int(total),
        )
    recent = (
        DispatchedJob.objects.filter(dispatched_at__gte=now - MEAN_WAIT_WINDOW, queued_at__isnull=False)
        .order_by("-dispatched_at")
        .values_list("queued_at", "dispatched_at")[:MEAN_WAIT_SAMPLE]
    )
    waits = [(d - q).total_seconds() for q, d in recent if q is not None]
    mean = sum(waits) / len(waits) if waits else None
    fetchers = WorkerSession.objects.filter(
        closed_at__isnull=True, draining=False, worker__active=True, worker__can_fetch=True
    )
    busy = DispatchedJob.objects.filter(worker_id=OuterRef("worker_id"), finished_at__isnull=True)
    total = fetchers.count()
    idle = fetchers.exclude(Exists(busy)).count() if total else 0
    return PoolView(mean_wait_secs=mean, fetch_workers_idle=idle, fetch_workers_total=total)


def large_transfers_running(worker_id: uuid.UUID) -> int:
    return (
        open_assignments(worker_id, JobKind.BUILD).filter(missing_nar_size__gte=LARGE_TRANSFER_BYTES).count()
    )


def nar_sizes(paths: list[str]) -> dict[str, int]:
    if not paths:
        return {}
    return dict(CachedPath.objects.filter(path__in=paths).values_list("path", "nar_size"))


def input_paths(build_ids: list[uuid.UUID]) -> dict[uuid.UUID, list[str]]:
    """The output paths of each build's dependencies: what a worker must have to build it."""
    out: dict[uuid.UUID, list[str]] = {b: [] for b in build_ids}
    edges = DerivationBuildDependency.objects.filter(build_id__in=build_ids).values_list(
        "build_id", "dependency__outputs"
    )
    for build_id, outputs in edges:
        out[build_id].extend(o["path"] for o in outputs or [])
    return out


def build_visible_to(build_id: uuid.UUID, user: Any) -> bool:
    """A submitter may read a shared build that an evaluation of one of its projects needs."""
    return EvaluationBuild.objects.filter(build_id=build_id, evaluation__project__members=user).exists()


# --- What the console's pages read -----------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """An evaluation's builds by where they are: "412/1030 built, 3 failed, 615 queued"."""

    total: int
    built: int
    failed: int
    dependency_failed: int
    building: int
    queued: int
    waiting: int  # Created: waiting for dependencies
    aborted: int

    def __str__(self) -> str:
        if not self.total:
            return "no builds yet"
        parts = [f"{self.built}/{self.total} built"]
        for count, word in (
            (self.failed, "failed"),
            (self.dependency_failed, "failed with a dependency"),
            (self.building, "building"),
            (self.queued, "queued"),
            (self.waiting, "waiting for dependencies"),
            (self.aborted, "aborted"),
        ):
            if count:
                parts.append(f"{count} {word}")
        return ", ".join(parts)


def evaluation_progress(evaluation_id: uuid.UUID) -> Progress:
    counts: dict[str, int] = dict(
        DerivationBuild.objects.filter(evaluation_links__evaluation_id=evaluation_id)
        .values_list("status")
        .annotate(n=Count("id"))
        .values_list("status", "n")
    )

    def of(*statuses: str) -> int:
        return sum(counts.get(s, 0) for s in statuses)

    return Progress(
        total=sum(counts.values()),
        built=of(*BUILD_SUCCESS),
        failed=of(BuildStatus.FAILED_PERMANENT, BuildStatus.FAILED_TIMEOUT, BuildStatus.FAILED_TRANSIENT),
        dependency_failed=of(BuildStatus.DEPENDENCY_FAILED),
        building=of(BuildStatus.BUILDING),
        queued=of(BuildStatus.QUEUED),
        waiting=of(BuildStatus.CREATED),
        aborted=of(BuildStatus.ABORTED),
    )


def evaluation_failed_builds(evaluation_id: uuid.UUID, limit: int = 50) -> list[DerivationBuild]:
    """The evaluation's builds that failed (lastingly, or awaiting a retry), with their errors."""
    return list(
        DerivationBuild.objects.filter(
            evaluation_links__evaluation_id=evaluation_id,
            status__in=[*BUILD_LASTING_FAILURE, BuildStatus.FAILED_TRANSIENT],
        ).order_by("finished_at", "drv_path")[:limit]
    )


def build_queue_position(build: DerivationBuild) -> int:
    """How many queued builds are ahead of this one (prioritized first, then the oldest)."""
    if build.status != BuildStatus.QUEUED or build.queued_at is None:
        return 0
    ahead = DerivationBuild.objects.filter(status=BuildStatus.QUEUED)
    if build.prioritized:
        return ahead.filter(prioritized=True, queued_at__lt=build.queued_at).count()
    return ahead.filter(Q(prioritized=True) | Q(queued_at__lt=build.queued_at)).count()


SeatHold = Callable[[Sequence[uuid.UUID], JobKind], set[uuid.UUID]]
_seat_holds: list[SeatHold] = []
_seat_hold_reads: list[str] = []
_seat_hold_conditions: list[str] = []


def register_seat_hold(hold: SeatHold, reads: Sequence[str] = (), condition: str | None = None) -> None:
    """A rule that keeps single assignment from giving a worker a new job of a kind (the cluster code's
    reserved seats, registered from its AppConfig.ready): such a request stays an idle slot. `reads`:
    fixed statements (no parameters) the rule reads on PostgreSQL, sent along with a claim batch's first
    read instead of in round trips of their own (setsql.read_along). `condition`: the same rule as SQL,
    true where the worker `{worker}` (a uuid expression) is held for the kind `{kind}` (a text
    expression); the claim statement checks it on PostgreSQL, so a batch needs no read of it first."""
    if hold not in _seat_holds:
        _seat_holds.append(hold)
        _seat_hold_reads.extend(r for r in reads if r not in _seat_hold_reads)
        if condition is not None:
            _seat_hold_conditions.append(condition)


def seat_hold_reads() -> tuple[str, ...]:
    return tuple(_seat_hold_reads)


def seat_held_sql(*, worker: str, kind: str) -> str:
    """Every registered rule's condition for one worker and kind, or-ed ("false" when none is)."""
    parts = [f"({c.format(worker=worker, kind=kind)})" for c in _seat_hold_conditions]
    return " OR ".join(parts) if parts else "false"


def seat_holds_in_sql() -> bool:
    """Whether every registered rule has its condition in SQL (the claim statement can check them all)."""
    return len(_seat_hold_conditions) == len(_seat_holds)


def workers_held(worker_ids: Sequence[uuid.UUID], kind: JobKind) -> set[uuid.UUID]:
    """Those of these workers whose slots of this kind a registered rule holds (a cluster's reserved
    seat): asked once for a whole batch of RequestJobs."""
    held: set[uuid.UUID] = set()
    for hold in _seat_holds:
        held |= hold(worker_ids, kind)
    return held


def worker_held(worker_id: uuid.UUID, kind: JobKind) -> bool:
    """Whether a registered rule holds this worker's slots of this kind (a cluster's reserved seat)."""
    return worker_id in workers_held([worker_id], kind)


def build_capable_worker_ids(build: DerivationBuild) -> list[uuid.UUID]:
    """Active workers with an open session that could build it (architecture and features)."""
    workers = Worker.objects.filter(active=True, can_build=True, sessions__closed_at__isnull=True).distinct()
    return [w.id for w in workers if worker_can_build(w, build.system, list(build.required_features))]


def build_capable_workers(build: DerivationBuild) -> int:
    return len(build_capable_worker_ids(build))


def build_waiting_text(build: DerivationBuild, ahead: int | None = None) -> str:
    """Why a pending build is not running, in words ("" once it runs or ended). `ahead`: the builds
    ahead of it in its workers' hand-out order (queue_position, which the console shows beside it);
    without it, the Queued builds prioritized or older than it."""
    if build.drv_lost_at is not None:
        return "its .drv is lost: it waits for a DrvRecovery evaluation to restore it"
    if build.status == BuildStatus.CREATED:
        pending = build.dependency_edges.exclude(dependency__status__in=BUILD_SUCCESS).count()
        return f"waiting for {pending} dependenc{'y' if pending == 1 else 'ies'} to be built"
    if build.status == BuildStatus.FAILED_TRANSIENT:
        return (
            f"failed; retried after {build.retry_at:%H:%M:%S}" if build.retry_at else "failed; retried soon"
        )
    if build.status != BuildStatus.QUEUED:
        return ""
    capable_ids = build_capable_worker_ids(build)
    capable = len(capable_ids)
    if not capable:
        features = f" with {', '.join(build.required_features)}" if build.required_features else ""
        return f"no connected worker can build {build.system}{features}"
    held = len(workers_held(capable_ids, JobKind.BUILD))
    if held == capable:
        return (
            f"every connected worker that can build it ({capable}) holds a seat reserved for a waiting "
            "cluster: it gets no single build until the reservation ends"
        )
    ahead = build_queue_position(build) if ahead is None else ahead
    reserved = f" ({held} of them reserved for a waiting cluster)" if held else ""
    return (
        f"{capable} connected worker{'s' if capable != 1 else ''} can build it{reserved}; "
        f"{ahead} queued build{'s' if ahead != 1 else ''} ahead of it"
        + (" (prioritized)" if build.prioritized else "")
    )


@dataclass(frozen=True)
class Lineage:
    generation: int
    restarts: Evaluation | None  # the evaluation this one restarted
    restarted_as: Evaluation | None  # the evaluation that restarted this one
    pending: bool  # a restart is recorded, its evaluation not made yet


def evaluation_lineage(evaluation_id: uuid.UUID) -> Lineage | None:
    """What evaluation_lineage_text says, as rows (the console links them); None without a readable record."""
    try:
        job = record_job(job_key=str(JobKey.of(JobKeyKind.EVAL, evaluation_id)), now=timezone.now())
    except (UnknownRecord, DecodeError, InvalidHistory):
        return None

    def evaluation(key: str | None) -> Evaluation | None:
        parsed = JobKey.parse(key) if key else None
        return Evaluation.objects.filter(id=parsed.id).first() if parsed is not None else None

    return Lineage(
        generation=job.generation,
        restarts=evaluation(job.supersedes),
        restarted_as=evaluation(job.successor),
        pending=job.successor is None and job.pending_resubmit,
    )


def evaluation_lineage_text(evaluation_id: uuid.UUID) -> str:
    """Which evaluation this one restarted and which restarted it, from its record (header and facts)."""
    try:
        job = record_job(job_key=str(JobKey.of(JobKeyKind.EVAL, evaluation_id)), now=timezone.now())
    except (UnknownRecord, DecodeError, InvalidHistory):
        return "no readable record"
    parts = [f"generation {job.generation}"]
    if job.supersedes:
        parts.append(f"restarts {job.supersedes}")
    if job.successor:
        parts.append(f"restarted as {job.successor}")
    elif job.pending_resubmit:
        parts.append("restart pending")
    return ", ".join(parts)


def recent_assignments(worker_id: uuid.UUID, limit: int = 20) -> list[DispatchedJob]:
    """The worker's latest closed assignments, newest first."""
    rows = DispatchedJob.objects.filter(worker_id=worker_id, finished_at__isnull=False)
    rows = rows.select_related("derivation_build", "evaluation", "worker")
    return list(rows.order_by("-finished_at")[:limit])


def evaluation_next_step(
    evaluation: Evaluation, now: datetime | None = None, at: Callable[[datetime], str] = clock_time
) -> str:
    """What happens next to a waiting evaluation, in words (decisions.waiting.what_happens_next), its
    deadline as `at` says it."""
    if evaluation.status != EvaluationStatus.WAITING:
        return ""
    boot = ServerBoot.objects.filter(stopped_at__isnull=True).order_by("-started_at").first()
    deadline = unbuildable_deadline(
        reason=evaluation.waiting_reason,
        waiting_since=evaluation.waiting_since,
        wait_for_workers=evaluation.wait_for_workers,
        pool_stable_since=boot.started_at if boot else (now or timezone.now()),
        grace_secs=settings.GRADIENT_SCHEDULER_UNBUILDABLE_GRACE_SECS,
    )
    return what_happens_next(
        reason=evaluation.waiting_reason,
        deadline=deadline,
        wait_for_workers=evaluation.wait_for_workers,
        at=at,
    )
