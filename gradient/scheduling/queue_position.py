"""Where a waiting job stands (spec/rest.md): its place in the hand-out order, the slots that can run it,
and when it is expected to start and end. Reads only; the arithmetic is decisions.eta's.

The order is the one a worker that sent no scores is handed jobs in (services.assignment ranks with
decisions.scoring.rank and an empty WorkerView): prioritized first (Qos outweighs the whole WaitTime),
then the longest wait, then the smaller id. WaitTime is capped, so every wait past the cap ties and is
broken by id: a job's place in the order is decided by (not prioritized, max(wait start, cap time), id),
and the jobs before it are counted in one statement over the Queued builds (their partial indexes).

"The jobs the same workers can run" is read as: builds of the same system whose required features are
among this build's (every worker that can run it can run those), wanted by an active evaluation of a
project that wants this one; evaluations of the same project. Two simplifications, said here so that
nobody takes them for the rule: a worker serving several projects also sees their jobs (its own order
merges those queues); and RequestJob{flake} scores with the worker's own view, whose ReserveFetchWorkers
holds a follow-up evaluation back by up to 300 points on a fetch-capable worker, which the order here
leaves out (as a worker that cannot fetch sees it).
"""

from __future__ import annotations

import bisect
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.apps import apps
from django.conf import settings
from django.db import connection
from django.db.models import Case, Exists, F, OuterRef, Q, QuerySet, Value, When
from django.db.models.functions import Coalesce, Greatest, Substr

from gradient.core.vocab import (
    BUILD_SUCCESS,
    BUILTIN_SYSTEM,
    EVALUATION_ACTIVE,
    BuildAttemptOutcome,
    BuildStatus,
    EvaluationStatus,
    JobKind,
)
from gradient.scheduling import jobs, selectors
from gradient.scheduling.decisions import eta
from gradient.scheduling.decisions.access import may_take
from gradient.scheduling.decisions.scoring import wait_cap_secs
from gradient.scheduling.models import (
    NAME_START,
    STORE_PREFIX_LEN,
    BuildAttempt,
    DerivationBuild,
    DerivationBuildDependency,
    DispatchedJob,
    Evaluation,
    EvaluationBuild,
)
from gradient.scheduling.models import _name as derivation_name
from gradient.workers.models import Worker

HISTORY_SAMPLE = 20
"""How many of the latest ended attempts (of a derivation, of a project) the typical duration is the
median of."""
AHEAD_SAMPLE = 200
"""How many of the projects' latest ended attempts the jobs ahead are taken to last the mean of."""

_ENDED_OK = (BuildAttemptOutcome.BUILT, BuildAttemptOutcome.SUBSTITUTED)


@dataclass(frozen=True, slots=True)
class Holder:
    """A cluster that holds some of the slots that can run a waiting job: its members run on them
    (`running`), or a reservation keeps them free for it while it waits (until `until`)."""

    cluster: uuid.UUID
    slots: int
    running: bool
    until: datetime | None = None


@dataclass(frozen=True, slots=True)
class QueueStanding:
    position: int
    ahead: int
    slots: int
    busy: int
    expected_start: datetime | None
    expected_finish: datetime | None
    basis: eta.Basis
    # The start's range (decisions.eta): the console shows it; REST carries the fields above only.
    earliest_start: datetime | None = None
    latest_start: datetime | None = None
    # What it waits for (issue 33, item 2): when the busy slots are expected to free, the first of them
    # and the last (each running job's start plus its typical duration; None when none is busy or there
    # is nothing to go on); the free slots a waiting cluster's reservation holds (they take no single
    # job); the clusters holding slots, by running members or by that reservation.
    next_free: datetime | None = None
    busy_until: datetime | None = None
    held: int = 0
    holders: tuple[Holder, ...] = ()


@dataclass(frozen=True, slots=True)
class Slots:
    total: int
    busy: int
    # The busy slots' jobs: (when it was handed out, its derivation name; "" for an evaluation job).
    running: tuple[tuple[datetime, str], ...] = ()
    held: int = 0
    holders: tuple[Holder, ...] = ()


def _cap_time(now: datetime) -> datetime:
    """The wait start from which WaitTime is capped, with the pool's mean wait as RequestJob scores it."""
    return now - timedelta(seconds=wait_cap_secs(selectors.pool_view(now)))


def _before(prioritized: bool, start: datetime, job_id: uuid.UUID) -> Q:
    """The rows (annotated `ranked_start`) that a worker without scores is handed before this job."""
    same_rank_before = Q(ranked_start__lt=start) | Q(ranked_start=start, id__lt=job_id)
    if prioritized:
        return Q(prioritized_flag=True) & same_rank_before
    return Q(prioritized_flag=True) | same_rank_before


# --- Builds -------------------------------------------------------------------------------------------


def build_projects(build: DerivationBuild) -> set[uuid.UUID]:
    """The projects of the active evaluations that need the build (who may take it: decisions.access)."""
    return set(
        EvaluationBuild.objects.filter(
            build_id=build.id, blocks_evaluation=True, evaluation__status__in=EVALUATION_ACTIVE
        ).values_list("evaluation__project_id", flat=True)
    )


def _pool(
    *,
    system: str,
    features: list[str],
    projects: Iterable[uuid.UUID],
    now: datetime,
    cap: datetime,
    features_in_db: bool,
) -> QuerySet[DerivationBuild]:
    """The Queued builds handed out among the jobs of a build of this shape (see the module's
    docstring), annotated with their place in the order (`prioritized_flag`, `ranked_start`, then the
    id). Without `features_in_db` the required features are not compared: the caller does."""
    wanted = EvaluationBuild.objects.filter(
        build_id=OuterRef("pk"),
        blocks_evaluation=True,
        evaluation__status__in=EVALUATION_ACTIVE,
        evaluation__project_id__in=list(projects),
    )
    queued = DerivationBuild.objects.filter(status=BuildStatus.QUEUED, system=system)
    if features_in_db:
        queued = queued.filter(required_features__contained_by=features)
    return (
        queued.filter(Q(retry_at__isnull=True) | Q(retry_at__lte=now))
        .filter(selectors._no_member(DerivationBuild))
        .filter(Exists(wanted))
        .annotate(
            ranked_start=Greatest(Coalesce("queued_at", "created_at"), Value(cap)),
            prioritized_flag=F("prioritized"),
        )
    )


def build_position(
    build: DerivationBuild,
    now: datetime,
    projects: Iterable[uuid.UUID],
    *,
    features_in_db: bool | None = None,
) -> int:
    """The build's 1-based place in the hand-out order (see the module's docstring): one count.
    `features_in_db`: compare the required features in the statement (PostgreSQL's JSON containment;
    the default there) or here (the embedded SQLite mode has none)."""
    if features_in_db is None:
        features_in_db = connection.vendor == "postgresql"
    cap = _cap_time(now)
    start = max(build.queued_at or build.created_at, cap)
    features = list(build.required_features or [])
    before = (
        _pool(
            system=build.system,
            features=features,
            projects=projects,
            now=now,
            cap=cap,
            features_in_db=features_in_db,
        )
        .filter(_before(build.prioritized, start, build.id))
        .exclude(id=build.id)
    )
    if features_in_db:
        return before.count() + 1
    # Without containment on JSON the features are compared here (the embedded mode's queues are small).
    return 1 + sum(
        1 for f in before.values_list("required_features", flat=True) if set(f or []) <= set(features)
    )


OrderKey = tuple[bool, datetime, uuid.UUID]


def _order_key(prioritized: bool, start: datetime, build_id: uuid.UUID) -> OrderKey:
    """A build's place in the hand-out order as a sort key: prioritized first, then the capped wait
    start, then the id (uuid order is PostgreSQL's: both compare the 16 bytes big-endian)."""
    return (not prioritized, start, build_id)


Shape = tuple[str, frozenset[str], frozenset[uuid.UUID]]


def _shape(build: DerivationBuild, projects: Iterable[uuid.UUID]) -> Shape:
    return (build.system, frozenset(build.required_features or []), frozenset(projects))


def build_positions(
    builds: Iterable[DerivationBuild],
    now: datetime,
    projects_of: dict[uuid.UUID, set[uuid.UUID]],
    *,
    features_in_db: bool | None = None,
) -> dict[uuid.UUID, int]:
    """build_position of many Queued builds at once (the ETA pass's): one read of the order per shape
    (system, required features, projects) instead of one count per build, the same positions."""
    if features_in_db is None:
        features_in_db = connection.vendor == "postgresql"
    cap = _cap_time(now)
    shapes: dict[Shape, list[DerivationBuild]] = {}
    for build in builds:
        shapes.setdefault(_shape(build, projects_of.get(build.id, set())), []).append(build)
    positions: dict[uuid.UUID, int] = {}
    for (system, features, projects), members in shapes.items():
        rows = _pool(
            system=system,
            features=sorted(features),
            projects=projects,
            now=now,
            cap=cap,
            features_in_db=features_in_db,
        ).values_list("id", "prioritized", "queued_at", "created_at", "required_features")
        order = sorted(
            _order_key(prioritized, max(queued or created, cap), build_id)
            for build_id, prioritized, queued, created, required in rows
            if features_in_db or set(required or []) <= features
        )
        for build in members:
            key = _order_key(build.prioritized, max(build.queued_at or build.created_at, cap), build.id)
            positions[build.id] = bisect.bisect_left(order, key) + 1
    return positions


Connected = list[tuple[Worker, frozenset[uuid.UUID]]]


def connected_workers() -> Connected:
    """Active workers with an open session that is not draining, with their projects."""
    workers = list(
        Worker.objects.filter(
            active=True, sessions__closed_at__isnull=True, sessions__draining=False
        ).distinct()
    )
    projects: dict[uuid.UUID, set[uuid.UUID]] = {w.id: set() for w in workers}
    for worker_id, project_id in Worker.projects.through.objects.filter(
        worker_id__in=list(projects)
    ).values_list("worker_id", "project_id"):
        projects[worker_id].add(project_id)
    return [(w, frozenset(projects[w.id])) for w in workers]


def _open_rows(worker_ids: list[uuid.UUID], kind: JobKind) -> list[tuple[uuid.UUID, datetime, str, Any]]:
    """The open assignments of these workers of a kind: (worker, handed out at, the build's drv path or
    "", the cluster whose attempt it belongs to or None)."""
    rows = DispatchedJob.objects.filter(worker_id__in=worker_ids, kind=kind, finished_at__isnull=True)
    return [
        (worker_id, dispatched_at, drv_path or "", cluster)
        for worker_id, dispatched_at, drv_path, cluster in rows.order_by("dispatched_at").values_list(
            "worker_id", "dispatched_at", "derivation_build__drv_path", "cluster_attempt__cluster_job_id"
        )
    ]


def _reservation() -> tuple[uuid.UUID, datetime] | None:
    """The waiting cluster that holds a reservation (there is at most one) and when it expires. Through
    the app registry: scheduling imports nothing of clusters (selectors.workers_held asks the clusters'
    own rule which workers it holds; this only names the cluster)."""
    try:
        model = apps.get_model("clusters", "ClusterReservation")
    except LookupError:
        return None
    row = model.objects.values_list("cluster_job_id", "expires_at").first()
    return (row[0], row[1]) if row is not None else None


def _slots(capable: list[tuple[uuid.UUID, int]], kind: JobKind) -> Slots:
    """The slots of these workers ((worker, its slots of the kind)): how many, how many hold a job and
    which, how many free ones a waiting cluster's reservation holds, and the clusters holding any."""
    rows = _open_rows([w for w, _ in capable], kind)
    by_worker: dict[uuid.UUID, list[tuple[datetime, str, Any]]] = {}
    for worker_id, dispatched_at, drv_path, cluster in rows:
        by_worker.setdefault(worker_id, []).append((dispatched_at, drv_path, cluster))
    held_workers = selectors.workers_held([w for w, _ in capable], kind) if capable else set()
    total = busy = held = 0
    running: list[tuple[datetime, str]] = []
    members: dict[uuid.UUID, int] = {}
    for worker_id, slots in capable:
        jobs_of = by_worker.get(worker_id, [])[:slots]
        total += slots
        busy += len(jobs_of)
        if worker_id in held_workers:
            held += slots - len(jobs_of)
        for dispatched_at, drv_path, cluster in jobs_of:
            running.append((dispatched_at, derivation_name(drv_path) if drv_path else ""))
            if cluster is not None:
                members[cluster] = members.get(cluster, 0) + 1
    holders = [Holder(cluster, n, running=True) for cluster, n in sorted(members.items(), key=str)]
    if held and (reservation := _reservation()) is not None:
        holders.append(Holder(reservation[0], held, running=False, until=reservation[1]))
    return Slots(total, busy, tuple(running), held, tuple(holders))


def build_slots(build: DerivationBuild, projects: set[uuid.UUID], workers: Connected | None = None) -> Slots:
    """The build slots of connected workers that may run the build (architecture, features, project),
    how many of them hold an open build assignment, and which hold them (_slots). `workers`:
    connected_workers() read already."""
    capable = [
        (w.id, max(1, w.max_concurrent_builds))
        for w, served in (connected_workers() if workers is None else workers)
        if selectors.worker_can_build(w, build.system, list(build.required_features or []))
        and may_take(served, projects)
    ]
    return _slots(capable, JobKind.BUILD)


def _secs(rows: Iterable[tuple[datetime, datetime | None]]) -> list[float]:
    return [(end - begin).total_seconds() for begin, end in rows if end is not None]


def _built_of_name(build: DerivationBuild) -> QuerySet[DerivationBuild, uuid.UUID]:
    """The built derivations of the build's name and system: through idx-derivation_build-name in the
    default store, else by a pattern (no index: a store elsewhere is rare)."""
    built = DerivationBuild.objects.filter(status__in=BUILD_SUCCESS, system=build.system)
    name = build.name
    if len(build.drv_path) - len(name) - len(".drv") == STORE_PREFIX_LEN:
        built = built.annotate(drv_name=Substr("drv_path", NAME_START)).filter(drv_name=f"{name}.drv")
    else:
        built = built.filter(drv_path__regex=rf"^.*/[0-9a-z]{{32}}-{re.escape(name)}\.drv$")
    return built.values_list("id", flat=True)


def build_typical(build: DerivationBuild, projects: set[uuid.UUID]) -> eta.Typical:
    """The median of the latest ended tries of the same derivation name and system, else of the
    project's builds, else GRADIENT_ETA_DEFAULT_BUILD_SECS."""
    ended = BuildAttempt.objects.filter(finished_at__isnull=False, outcome__in=_ENDED_OK)
    derivation = _secs(
        ended.filter(build_id__in=_built_of_name(build))
        .order_by("-finished_at")
        .values_list("started_at", "finished_at")[:HISTORY_SAMPLE]
    )
    project: list[float] = []
    if not derivation and projects:
        of_project = EvaluationBuild.objects.filter(
            build_id=OuterRef("build_id"), evaluation__project_id__in=list(projects)
        )
        project = _secs(
            ended.filter(Exists(of_project))
            .order_by("-finished_at")
            .values_list("started_at", "finished_at")[:HISTORY_SAMPLE]
        )
    return eta.typical_duration(derivation, project, float(settings.GRADIENT_ETA_DEFAULT_BUILD_SECS))


@dataclass(frozen=True, slots=True)
class PoolHistory:
    """The latest ended tries of a pool's projects: what each job ahead and running takes of a slot
    (`turnover`: decisions.eta.slot_turnover), and how long a running build is expected to take: the
    median of the sample's tries of its derivation name, else the sample's mean."""

    turnover: eta.Typical | None = None
    by_name: dict[str, float] = field(default_factory=dict)
    mean_secs: float | None = None

    def expected_secs(self, name: str) -> float | None:
        """How long a try of a derivation of this name is expected to last; None with no sample."""
        return self.by_name.get(name, self.mean_secs)


def pool_history(projects: set[uuid.UUID]) -> PoolHistory:
    """From the latest AHEAD_SAMPLE ended tries of the projects' builds (one read): their mean duration
    plus the mean hand-out gap between a worker's tries (the pool turns over at that, not at a build's
    own duration), and each derivation name's median in the sample. Empty without any."""
    if not projects:
        return PoolHistory()
    of_project = EvaluationBuild.objects.filter(
        build_id=OuterRef("build_id"), evaluation__project_id__in=list(projects)
    )
    rows = [
        (worker, begin, end, drv_path)
        for worker, begin, end, drv_path in BuildAttempt.objects.filter(
            finished_at__isnull=False, outcome__in=_ENDED_OK
        )
        .filter(Exists(of_project))
        .order_by("-finished_at")
        .values_list("worker_id", "started_at", "finished_at", "build__drv_path")[:AHEAD_SAMPLE]
        if end is not None
    ]
    if not rows:
        return PoolHistory()
    durations: dict[str, list[float]] = {}
    for _, begin, end, drv_path in rows:
        durations.setdefault(derivation_name(drv_path), []).append((end - begin).total_seconds())
    every = [d for values in durations.values() for d in values]
    return PoolHistory(
        turnover=eta.slot_turnover(
            [(w, begin.timestamp(), end.timestamp()) for w, begin, end, _ in rows], "project"
        ),
        by_name={name: m for name, values in durations.items() if (m := eta.median(values)) is not None},
        mean_secs=sum(every) / len(every),
    )


def ahead_typical(projects: set[uuid.UUID]) -> eta.Typical | None:
    """What each job ahead and running takes of a slot (pool_history's turnover); None without any."""
    return pool_history(projects).turnover


def build_queue(
    build: DerivationBuild, now: datetime, workers: Connected | None = None
) -> QueueStanding | None:
    """Where a Queued build stands; None for a build in any other status. `workers`: the connected
    workers when the caller reads many builds' standing at once (the ETA pass)."""
    if build.status != BuildStatus.QUEUED:
        return None
    projects = build_projects(build)
    history = pool_history(projects)
    return _standing(
        now,
        build_position(build, now, projects),
        build_slots(build, projects, workers),
        build_typical(build, projects),
        history.turnover,
        _build_secs(history),
    )


def _build_secs(history: PoolHistory) -> Callable[[str], float | None]:
    """How long a running build of a derivation name is expected to take: its pool's history, else the
    configured default (None when that is 0 too)."""
    default = float(settings.GRADIENT_ETA_DEFAULT_BUILD_SECS)

    def secs(name: str) -> float | None:
        expected = history.expected_secs(name)
        return expected if expected is not None else (default if default > 0 else None)

    return secs


def build_queues(
    builds: Iterable[DerivationBuild], now: datetime, workers: Connected | None = None
) -> dict[uuid.UUID, QueueStanding]:
    """build_queue of many builds at once (the ETA pass's), the same standings: the projects in one
    read, the positions in one read of the order per shape (build_positions), and the slots, the
    typical durations and the pool's turnover read once per shape, name and projects rather than once
    per build. Builds not Queued are left out."""
    queued = [b for b in builds if b.status == BuildStatus.QUEUED]
    if not queued:
        return {}
    if workers is None:
        workers = connected_workers()
    projects_of: dict[uuid.UUID, set[uuid.UUID]] = {b.id: set() for b in queued}
    for build_id, project_id in EvaluationBuild.objects.filter(
        build_id__in=list(projects_of), blocks_evaluation=True, evaluation__status__in=EVALUATION_ACTIVE
    ).values_list("build_id", "evaluation__project_id"):
        projects_of[build_id].add(project_id)
    positions = build_positions(queued, now, projects_of)
    slots: dict[Shape, Slots] = {}
    typicals: dict[tuple[str, str, frozenset[uuid.UUID]], eta.Typical] = {}
    pools: dict[frozenset[uuid.UUID], PoolHistory] = {}
    standings: dict[uuid.UUID, QueueStanding] = {}
    for build in queued:
        projects = projects_of[build.id]
        shape = _shape(build, projects)
        if shape not in slots:
            slots[shape] = build_slots(build, projects, workers)
        named = (build.name, build.system, shape[2])
        if named not in typicals:
            typicals[named] = build_typical(build, projects)
        if shape[2] not in pools:
            pools[shape[2]] = pool_history(projects)
        history = pools[shape[2]]
        standings[build.id] = _standing(
            now, positions[build.id], slots[shape], typicals[named], history.turnover, _build_secs(history)
        )
    return standings


def _standing(
    now: datetime,
    position: int,
    slots: Slots,
    typical: eta.Typical,
    ahead: eta.Typical | None = None,
    running_secs: Callable[[str], float | None] | None = None,
) -> QueueStanding:
    """Where a waiting job stands, from its position, the slots that can run it, its typical time and
    that of the jobs ahead; `running_secs`: how long a running job of a name is expected to take (the
    busy slots' expected ends; without it, the job's own typical time). Free slots held for a waiting
    cluster take no single job: the estimate counts them as busy."""
    estimate = eta.queue_estimate(
        now=now,
        ahead=position - 1,
        slots=slots.total,
        busy=min(slots.total, slots.busy + slots.held),
        typical=typical,
        ahead_typical=ahead,
    )
    ends: list[datetime] = []
    for started, name in slots.running:
        secs = running_secs(name) if running_secs is not None else None
        if secs is None:
            secs = typical.secs if typical.basis != "none" else None
        if secs is None:
            ends = []
            break
        ends.append(max(now, started + timedelta(seconds=secs)))
    return QueueStanding(
        position=position,
        ahead=position - 1,
        slots=slots.total,
        busy=slots.busy,
        expected_start=estimate.expected_start,
        expected_finish=estimate.expected_finish,
        basis=estimate.basis,
        earliest_start=estimate.earliest_start,
        latest_start=estimate.latest_start,
        next_free=min(ends) if ends else None,
        busy_until=max(ends) if ends else None,
        held=slots.held,
        holders=slots.holders,
    )


# --- Evaluations ----------------------------------------------------------------------------------------


def _eval_wait_start(evaluation: Evaluation) -> datetime:
    """The start of an evaluation's wait as RequestJob{flake} scores it (services.assignment)."""
    return evaluation.updated_at if evaluation.followup_pending else evaluation.created_at


def evaluation_position(evaluation: Evaluation, now: datetime) -> int:
    """The evaluation's 1-based place among the Queued evaluations of its project that are free to be
    handed out (no open assignment, no cluster member), in RequestJob{flake}'s order: one count."""
    cap = _cap_time(now)
    start = max(_eval_wait_start(evaluation), cap)
    open_row = DispatchedJob.objects.filter(evaluation_id=OuterRef("pk"), finished_at__isnull=True)
    ahead = (
        Evaluation.objects.filter(status=EvaluationStatus.QUEUED, project_id=evaluation.project_id)
        .filter(selectors._no_member(Evaluation))
        .exclude(Exists(open_row))
        .annotate(
            ranked_start=Greatest(
                Case(When(followup_pending=True, then=F("updated_at")), default=F("created_at")), Value(cap)
            ),
            prioritized_flag=F("priority"),
        )
        .filter(_before(evaluation.priority, start, evaluation.id))
        .exclude(id=evaluation.id)
        .count()
    )
    return ahead + 1


def evaluation_slots(evaluation: Evaluation, workers: Connected | None = None) -> Slots:
    """Connected workers of the evaluation's project that can run its next job's steps (one evaluation
    each), how many of them hold an open evaluation assignment, and which hold them (_slots).
    `workers`: connected_workers() read already."""
    steps = jobs.eval_steps(evaluation, split=selectors.has_idle_eval_only_worker())
    capable = [
        (w.id, 1)
        for w, served in (connected_workers() if workers is None else workers)
        if selectors.worker_can_run_eval_steps(w, steps) and may_take(served, [evaluation.project_id])
    ]
    return _slots(capable, JobKind.EVAL)


def evaluation_typical(evaluation: Evaluation) -> eta.Typical:
    """The median of the project's latest ended evaluation jobs (claim to close), else
    GRADIENT_ETA_DEFAULT_EVAL_SECS. (No `derivation` basis: an evaluation has no derivation.)"""
    project = _secs(
        DispatchedJob.objects.filter(
            kind=JobKind.EVAL, evaluation__project_id=evaluation.project_id, finished_at__isnull=False
        )
        .order_by("-finished_at")
        .values_list("dispatched_at", "finished_at")[:HISTORY_SAMPLE]
    )
    return eta.typical_duration([], project, float(settings.GRADIENT_ETA_DEFAULT_EVAL_SECS))


def evaluation_queue(
    evaluation: Evaluation, now: datetime, workers: Connected | None = None
) -> QueueStanding | None:
    """Where a Queued evaluation stands; None in any other status. `workers`: the connected workers
    when the caller reads many evaluations' standing at once (the ETA pass)."""
    if evaluation.status != EvaluationStatus.QUEUED:
        return None
    position = evaluation_position(evaluation, now)
    return _standing(now, position, evaluation_slots(evaluation, workers), evaluation_typical(evaluation))


_UNFINISHED = (BuildStatus.CREATED, BuildStatus.QUEUED, BuildStatus.BUILDING, BuildStatus.FAILED_TRANSIENT)


def evaluation_expected_finish(evaluation: Evaluation, now: datetime) -> datetime | None:
    """While the evaluation is Building: when its last build is expected to end, from its remaining
    builds' critical path and their work over the build slots of its project (decisions.eta); the
    typical build is the project's (else the default). None otherwise."""
    if evaluation.status != EvaluationStatus.BUILDING:
        return None
    remaining = list(
        DerivationBuild.objects.filter(
            evaluation_links__evaluation_id=evaluation.id, status__in=_UNFINISHED
        ).values_list("id", "system")
    )
    if not remaining:
        return now
    ids = [b for b, _ in remaining]
    edges = DerivationBuildDependency.objects.filter(build_id__in=ids, dependency_id__in=ids).values_list(
        "build_id", "dependency_id"
    )
    chain = eta.longest_chain([(str(b), str(d)) for b, d in edges], [str(b) for b in ids])
    systems = {s for _, s in remaining}
    slots = sum(
        max(1, w.max_concurrent_builds)
        for w, served in connected_workers()
        if w.can_build
        and may_take(served, [evaluation.project_id])
        and any(s == BUILTIN_SYSTEM or s in (w.architectures or []) for s in systems)
    )
    project = {evaluation.project_id}
    of_project = EvaluationBuild.objects.filter(
        build_id=OuterRef("build_id"), evaluation__project_id__in=project
    )
    durations = _secs(
        BuildAttempt.objects.filter(finished_at__isnull=False, outcome__in=_ENDED_OK)
        .filter(Exists(of_project))
        .order_by("-finished_at")
        .values_list("started_at", "finished_at")[:HISTORY_SAMPLE]
    )
    typical = eta.typical_duration([], durations, float(settings.GRADIENT_ETA_DEFAULT_BUILD_SECS))
    if typical.basis == "none":
        return None
    return eta.evaluation_finish(
        now=now, remaining=len(remaining), chain=chain, slots=slots, typical_secs=typical.secs
    )
