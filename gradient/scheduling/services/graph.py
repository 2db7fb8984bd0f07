"""The shared-build graph: ingesting an eval_result, queueing builds whose dependencies succeeded,
completing and failing builds, and finishing evaluations.

Every function here runs inside the caller's transaction; every status change is a conditional
UPDATE on the status it expects, so a stale caller changes nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec
from django.db import connection, transaction
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.utils import timezone

from gradient.core.protocol import DiscoveredDerivation
from gradient.core.vocab import (
    BUILD_LASTING_FAILURE,
    BUILD_PENDING,
    BUILD_SUCCESS,
    BUILD_UNFINISHED,
    EVALUATION_ACTIVE,
    BuildStatus,
    EvaluationStatus,
)
from gradient.runtime import setsql
from gradient.scheduling import history
from gradient.scheduling.decisions.waiting import BUILDING_PARKS
from gradient.scheduling.models import (
    CachedPath,
    CachedPathClaim,
    DerivationBuild,
    DerivationBuildDependency,
    EvalIngest,
    EvalIngestInput,
    Evaluation,
    EvaluationBuild,
)
from gradient.scheduling.services.cached_sql import ALL_CACHED, NEEDED_BUILT_ELSEWHERE, SOME_OUTPUT_UNCACHED


@dataclass
class IngestResult:
    builds: int = 0
    created: int = 0
    queued: int = 0
    substituted: int = 0
    dependency_failed: int = 0
    build_ids: list[uuid.UUID] = field(default_factory=list)


def cache_paths(*, paths: Iterable[tuple[str, int]]) -> None:
    """Outputs a build job reported (built, or substituted by the worker the build was handed to): cached
    for every project (`confirmed`), with the NAR size the builder saw. An eval_result's cached_outputs
    are a project's claim instead (services.ingest, cached_for)."""
    # One row per path (ON CONFLICT DO UPDATE may touch a row once a statement), in one order for
    # every writer (two batches never wait on each other in a cycle).
    sizes = {p: max(0, int(n)) for p, n in paths}
    if not sizes:
        return
    ordered = sorted(sizes)
    if connection.vendor == "postgresql":
        # A path confirmed already is left as it is (no new row version on every repeated output).
        with setsql.fixed_cursor() as cur:
            cur.execute(
                "INSERT INTO cached_path (path, nar_size, confirmed, created_at) "
                "SELECT p, n, true, %s FROM unnest(%b::text[], %b::bigint[]) AS t(p, n) "
                "ON CONFLICT (path) DO UPDATE SET confirmed = true, nar_size = EXCLUDED.nar_size "
                "WHERE NOT cached_path.confirmed",
                [timezone.now(), ordered, [sizes[p] for p in ordered]],
            )
        return
    CachedPath.objects.bulk_create(
        [CachedPath(path=p, nar_size=sizes[p], confirmed=True) for p in ordered],
        update_conflicts=True,
        unique_fields=["path"],
        update_fields=["nar_size", "confirmed"],
    )


def cached_for(*, paths: Iterable[str], project_id: uuid.UUID) -> set[str]:
    """Those of `paths` that count as cached for the project's evaluations (protocol.md, "Tenants"):
    confirmed for every project, or claimed by a worker that serves this one."""
    wanted = set(paths)
    if not wanted:
        return set()
    confirmed = CachedPath.objects.filter(path__in=wanted, confirmed=True).values_list("path", flat=True)
    claimed = CachedPathClaim.objects.filter(path__in=wanted, project_id=project_id).values_list(
        "path", flat=True
    )
    return {*confirmed, *claimed}


def ingest_eval_result(
    *,
    evaluation: Evaluation,
    derivations: Sequence[DiscoveredDerivation | Mapping[str, Any]],
    now: datetime,
) -> IngestResult:
    """A whole eval_result at once: create or reuse one shared build per derivation path, their
    dependency edges, the evaluation's links and the cached outputs; then decide the graph (queue what
    can start, fail what cannot). A result in parts goes through eval_parts instead. A derivation given
    as a mapping (the wire form, as tests and fixtures write it) is decoded strictly first."""
    from gradient.scheduling.services.ingest import store_part

    typed = [
        d if isinstance(d, DiscoveredDerivation) else msgspec.convert(d, DiscoveredDerivation)
        for d in derivations
    ]
    stored = store_part(
        evaluation=evaluation, derivations=typed, ingest_id=None, hold=False, final=True, now=now
    )
    result = IngestResult(
        builds=len(stored.ids),
        created=stored.created,
        build_ids=[uuid.UUID(str(i)) for i in stored.ids.values()],
    )
    if not stored.ids:
        return result
    reopen_unconfirmed(build_ids=stored.ids.values(), project_id=evaluation.project_id, now=now)
    decided = decide_evaluation_graph(evaluation_id=evaluation.id, project_id=evaluation.project_id, now=now)
    result.substituted = decided.substituted
    result.dependency_failed = decided.dependency_failed
    result.queued = decided.queued
    return result


@dataclass
class GraphDecision:
    substituted: int = 0
    dependency_failed: int = 0
    queued: int = 0


_LINKS_SQL = (
    "SELECT eb.build_id FROM evaluation_build eb WHERE eb.evaluation_id = %s "
    "AND (%s::uuid IS NULL OR eb.build_id > %s) AND (%s::uuid IS NULL OR eb.build_id <= %s)"
)


def _no_jit() -> None:
    """JIT off for the rest of the transaction (PostgreSQL): the decision's statements have estimated
    costs (an evaluation's links, the whole tables) above jit_above_cost, and compiling each plan took
    100-150 ms, more than running it."""
    if connection.vendor == "postgresql" and connection.in_atomic_block:
        with connection.cursor() as cur:
            cur.execute("SET LOCAL jit = off")


def _scoped(template: str, scope: str) -> str:
    """A statement over a BuildRange: `{scope}` is its subquery (constant text; values are parameters)."""
    return template.replace("{scope}", scope)


@dataclass(frozen=True)
class BuildRange:
    """The builds an evaluation links (its result) whose id is in (after, upto] (None: unbounded)."""

    evaluation_id: uuid.UUID
    after: uuid.UUID | None = None
    upto: uuid.UUID | None = None

    def ids(self) -> QuerySet[Any]:
        qs = EvaluationBuild.objects.filter(evaluation_id=self.evaluation_id)
        if self.after is not None:
            qs = qs.filter(build_id__gt=self.after)
        if self.upto is not None:
            qs = qs.filter(build_id__lte=self.upto)
        return qs.values("build_id")

    def sql(self) -> tuple[str, list[Any]]:
        """A subquery of the ids (column build_id), with its parameters."""
        return _LINKS_SQL, [self.evaluation_id, self.after, self.after, self.upto, self.upto]


@dataclass(frozen=True)
class BuildSet:
    """Builds named by id: what one part of a result brought (services.eval_parts)."""

    build_ids: tuple[str, ...]

    def ids(self) -> QuerySet[Any]:
        return DerivationBuild.objects.filter(id__in=self.build_ids).values("id")

    def sql(self) -> tuple[str, list[Any]]:
        return "SELECT unnest(%s::uuid[]) AS build_id", [list(self.build_ids)]


@dataclass(frozen=True)
class CreatedBuilds:
    """Every Created build whose .drv is not lost (the resync's scope)."""

    def ids(self) -> QuerySet[Any]:
        return DerivationBuild.objects.filter(status=BuildStatus.CREATED, drv_lost_at__isnull=True).values(
            "id"
        )

    def sql(self) -> tuple[str, list[Any]]:
        return (
            "SELECT id AS build_id FROM derivation_build WHERE status = %s AND drv_lost_at IS NULL",
            [BuildStatus.CREATED.value],
        )


Scope = BuildRange | BuildSet | CreatedBuilds


def decide_builds(*, build_ids: Iterable[Any], project_id: uuid.UUID, now: datetime) -> GraphDecision:
    """decide_evaluation_graph for the builds a part brought (created, wanted again, or whose inputs it
    completed) and the dependents of those it substitutes: a part decides only what it changed, as soon
    as it is stored, so builds start while the result is still arriving (protocol.md, "Large
    evaluations"). A build waits while an input of it has not arrived (eval_ingest_input) or has not
    succeeded. What is cached is what is cached for `project_id` (the evaluation's project: cached_for).
    Runs in the caller's transaction."""
    ids = tuple(sorted({str(i) for i in build_ids}))
    decision = GraphDecision()
    if not ids:
        return decision
    scope = BuildSet(ids)
    _no_jit()
    substituted = _substitute_cached(scope, project_id, now)
    decision.substituted = len(substituted)
    if substituted:
        scope = BuildSet(tuple(sorted({*ids, *(str(i) for i in dependents_of(substituted))})))
    decision.dependency_failed, decision.queued = _fail_and_queue(scope, now)
    return decision


def decide_evaluation_graph(
    *, evaluation_id: uuid.UUID, project_id: uuid.UUID, now: datetime
) -> GraphDecision:
    """The evaluation's whole result is in: what is cached for its project is Substituted, what needs a
    lasting failure fails, what can start is Queued. Set-based over the evaluation's links and their
    edges: a few statements whatever the size, writing only builds whose status changes. Runs in the
    caller's transaction."""
    scope = BuildRange(evaluation_id)
    decision = GraphDecision()
    _no_jit()
    decision.substituted = len(_substitute_cached(scope, project_id, now))
    decision.dependency_failed, decision.queued = _fail_and_queue(scope, now)
    return decision


# The decision's statements on PostgreSQL: each picks the builds of a BuildRange that meet a condition,
# then writes exactly those by id. Their plans must not depend on the tables' statistics: on a fresh
# database they were taken while the tables were empty (autovacuum looks again only later), and a plan
# made on "1 Created build" read the evaluation's links once per build (issue 30: 73 s for 20 000
# leaves). So the pick is driven from the range's links (one index read), each link's build found by its
# primary key in a LATERAL subquery (with no other condition in it, so no partial index on a status can
# look cheaper on stale statistics), and every condition is an EXISTS that cannot become a join
# (OFFSET 0): per build an index lookup, whatever the planner believes. The write is by a constant array
# of ids (its length known to the planner, hashed when it filters). ANALYZE instead would cost a sample
# of every large table in the report's transaction, and only after the write that made it stale.
_PICK = (
    "SELECT b.id::text FROM ({scope} OFFSET 0) s CROSS JOIN LATERAL (SELECT id, status, drv_lost_at, "
    "ingest_id, outputs FROM derivation_build WHERE id = s.build_id OFFSET 0) b WHERE {condition}"
)
# A dependency's status by its primary key (a subquery per edge): as a join, a stale "a few builds"
# made the planner scan every build for every edge.
_DEPENDENCY_STATUS = "(SELECT x.status FROM derivation_build x WHERE x.id = e.dependency_id)"
_NEEDS_UNFINISHED = (
    "EXISTS (SELECT 1 FROM derivation_build_dependency e "  # noqa: S608 (constants)
    f"WHERE e.build_id = b.id AND {_DEPENDENCY_STATUS} <> ALL(%s) OFFSET 0)"
)
_NEEDS_FAILED = (
    "EXISTS (SELECT 1 FROM derivation_build_dependency e "  # noqa: S608 (constants)
    f"WHERE e.build_id = b.id AND {_DEPENDENCY_STATUS} = ANY(%s) OFFSET 0)"
)
_INPUT_PENDING = "EXISTS (SELECT 1 FROM eval_ingest_input u WHERE u.build_id = b.id OFFSET 0)"
_HELD = (
    "EXISTS (SELECT 1 FROM eval_ingest i WHERE i.assignment_id = b.ingest_id AND i.decided_at IS NULL "
    "AND (SELECT d.finished_at FROM dispatched_job d WHERE d.id = i.assignment_id) IS NULL OFFSET 0)"
)


# _ready's conditions.
_READY = (
    f"b.status = %s AND b.drv_lost_at IS NULL AND NOT {_NEEDS_UNFINISHED} AND NOT {_INPUT_PENDING} "
    f"AND NOT {_HELD}"
)


# _fail_needing_failed's and _queue_ready's picks in one pass over the scope: each build found once by
# its key and its edges read once for both (a dependency's status by its key per edge, as above). A
# build that needs a lasting failure is never ready (a failure is no success). The pending-input and
# held conditions are asked only of a Created build whose dependencies all succeeded (AND stops at the
# first false). Parameters: Created, the scope's, the lasting failures, the successes, the pending.
_FAILED_OR_READY = (
    "SELECT b.id::text, d.failed, (b.status = %s AND b.drv_lost_at IS NULL AND NOT d.unfinished "  # noqa: S608 (constants)
    f"AND NOT {_INPUT_PENDING} AND NOT {_HELD}) "
    "FROM ({scope} OFFSET 0) s CROSS JOIN LATERAL (SELECT id, status, drv_lost_at, ingest_id "
    "FROM derivation_build WHERE id = s.build_id OFFSET 0) b CROSS JOIN LATERAL ("
    "SELECT coalesce(bool_or(q.st = ANY(%s)), false) AS failed, "
    "coalesce(bool_or(q.st <> ALL(%s)), false) AS unfinished "
    f"FROM (SELECT {_DEPENDENCY_STATUS} AS st FROM derivation_build_dependency e "
    "WHERE e.build_id = b.id OFFSET 0) q) d "
    "WHERE b.status = ANY(%s)"
)


def _ready_params() -> list[Any]:
    return [BuildStatus.CREATED.value, [s.value for s in BUILD_SUCCESS]]


def _pick(r: Scope, condition: str, params: Sequence[Any]) -> list[str]:
    """The ids (as text) of the builds of `r` that meet `condition` (SQL over `b`, with `params`)."""
    sql, scope_params = r.sql()
    with connection.cursor() as cur:
        cur.execute(_scoped(_PICK, sql).replace("{condition}", condition), [*scope_params, *params])
        return [row[0] for row in cur.fetchall()]


def _fail_needing_failed(r: Scope, now: datetime) -> int:
    if connection.vendor == "postgresql":
        doomed: list[Any] = _pick(
            r,
            f"b.status = ANY(%s) AND {_NEEDS_FAILED}",
            [[s.value for s in BUILD_PENDING], [s.value for s in BUILD_LASTING_FAILURE]],
        )
    else:
        failed_dep = DerivationBuildDependency.objects.filter(
            build_id=OuterRef("pk"), dependency__status__in=BUILD_LASTING_FAILURE
        )
        doomed = list(
            DerivationBuild.objects.filter(id__in=r.ids(), status__in=BUILD_PENDING)
            .filter(Exists(failed_dep))
            .values_list("id", flat=True)
        )
    return _fail_doomed(doomed, now)


def _fail_doomed(doomed: Sequence[Any], now: datetime) -> int:
    """The pending builds `doomed` (each needs a lasting failure) fail, and what needs them."""
    if not doomed:
        return 0
    # Proportional to what failed, not to the evaluation.
    failed = DerivationBuild.objects.filter(id__in=doomed, status__in=BUILD_PENDING).update(
        status=BuildStatus.DEPENDENCY_FAILED,
        last_error="a dependency failed",
        finished_at=now,
        updated_at=now,
    )
    return failed + fail_dependents(build_ids=doomed, now=now)


def _fail_and_queue(r: Scope, now: datetime) -> tuple[int, int]:
    """What needs a lasting failure fails (with what needs it, transitively), what can start is Queued:
    the builds failed and the builds queued. On PostgreSQL one pick decides both (_FAILED_OR_READY)."""
    if connection.vendor != "postgresql":
        return _fail_needing_failed(r, now), _queue_ready(r, now)
    _lock_waiting_on_building(r)
    sql, scope_params = r.sql()
    with connection.cursor() as cur:
        cur.execute(
            _scoped(_FAILED_OR_READY, sql),
            [
                BuildStatus.CREATED.value,
                *scope_params,
                [s.value for s in BUILD_LASTING_FAILURE],
                [s.value for s in BUILD_SUCCESS],
                [s.value for s in BUILD_PENDING],
            ],
        )
        rows = cur.fetchall()
    failed = _fail_doomed([i for i, needs_failed, _ in rows if needs_failed], now)
    ready = [i for i, needs_failed, is_ready in rows if is_ready and not needs_failed]
    queued = _write_status(
        ready, expect=[BuildStatus.CREATED], status=BuildStatus.QUEUED, now=now, queued=True
    )
    return failed, len(queued)


def _lock_waiting_on_building(r: Scope) -> None:
    """A dependency finishing in another transaction right now could read this evaluation's new builds
    as held while this transaction reads that dependency as Building: lock the builds of `r` that wait
    on a Building one first, as queue_ready_builds does. Found from the Building builds (few: what runs
    right now), not from the evaluation's. Call before reading what is ready."""
    # Read as lists, one statement each: as one join the planner, on stale statistics, read every edge.
    building = list(DerivationBuild.objects.filter(status=BuildStatus.BUILDING).values_list("id", flat=True))
    waiting_on_building = dependents_of(building) if building else []
    if waiting_on_building:
        candidates = DerivationBuild.objects.filter(
            id__in=r.ids(), status=BuildStatus.CREATED, drv_lost_at__isnull=True
        )
        _lock_ids(candidates.filter(id__in=waiting_on_building))


def _queue_ready(r: Scope, now: datetime) -> int:
    _lock_waiting_on_building(r)
    candidates = DerivationBuild.objects.filter(
        id__in=r.ids(), status=BuildStatus.CREATED, drv_lost_at__isnull=True
    )
    if connection.vendor != "postgresql":
        return int(_ready(candidates).update(status=BuildStatus.QUEUED, queued_at=now, updated_at=now))
    ready = _pick(r, _READY, _ready_params())
    return len(
        _write_status(ready, expect=[BuildStatus.CREATED], status=BuildStatus.QUEUED, now=now, queued=True)
    )


def _write_status(
    ids: Sequence[str], *, expect: Sequence[BuildStatus], status: BuildStatus, now: datetime, **stamp: bool
) -> list[str]:
    """Builds `ids` still in one of `expect` take `status`: one statement by a constant array of ids.
    Returns the ids written."""
    if not ids:
        return []
    stamps = "".join(f", {name}_at = %s" for name, on in stamp.items() if on)
    with connection.cursor() as cur:
        cur.execute(
            f"UPDATE derivation_build SET status = %s, updated_at = %s{stamps} "  # noqa: S608 (constants)
            "WHERE id = ANY(%s::uuid[]) AND status = ANY(%s) RETURNING id::text",
            [status.value, now, *(now for on in stamp.values() if on), list(ids), [s.value for s in expect]],
        )
        return [row[0] for row in cur.fetchall()]


def _substitute_cached(r: Scope, project_id: uuid.UUID, now: datetime) -> list[Any]:
    """The pending builds of `r` whose every output is cached for the project become Substituted, but
    those an active evaluation of another project needs built (protocol.md, "Tenants": that evaluation
    would reopen it, and the next claim substitute it again, at the back of the queue each time; left
    pending it is built once, for everyone). Returns their ids."""
    if connection.vendor != "postgresql":
        from gradient.scheduling.services import tenants

        ids = list(
            DerivationBuild.objects.filter(id__in=r.ids(), status__in=BUILD_PENDING).values_list(
                "id", flat=True
            )
        )
        allowed = tenants.substitutable(build_ids=ids, project_id=project_id, cached_for=cached_for)
        return substitute_cached_builds(build_ids=allowed, project_id=project_id, now=now)
    cached = _pick(
        r,
        # CASE: the other projects' links are read only for a build whose every output is cached (in
        # an AND the planner may put the cheaper-looking condition first).
        f"b.status = ANY(%s) AND CASE WHEN {ALL_CACHED} THEN NOT {NEEDED_BUILT_ELSEWHERE} ELSE false END",
        [
            [s.value for s in BUILD_PENDING],
            project_id,
            [s.value for s in EVALUATION_ACTIVE],
            project_id,
        ],
    )
    return _write_status(cached, expect=BUILD_PENDING, status=BuildStatus.SUBSTITUTED, now=now, finished=True)


def substitute_cached_builds(
    *, build_ids: Sequence[uuid.UUID], project_id: uuid.UUID, now: datetime
) -> list[Any]:
    """A pending build whose every output is cached for the project (cached_for) needs no build: it is
    Substituted (one statement for all of them). Returns their ids."""
    pending = DerivationBuild.objects.filter(id__in=build_ids, status__in=BUILD_PENDING).only("id", "outputs")
    candidates = [b for b in pending if b.outputs]
    cached = cached_for(paths=(o["path"] for b in candidates for o in b.outputs), project_id=project_id)
    done = [b.id for b in candidates if all(o["path"] in cached for o in b.outputs)]
    if not done:
        return []
    DerivationBuild.objects.filter(id__in=done, status__in=BUILD_PENDING).update(
        status=BuildStatus.SUBSTITUTED, finished_at=now, updated_at=now
    )
    return done


def reopen_unconfirmed(*, build_ids: Iterable[Any], project_id: uuid.UUID, now: datetime) -> list[str]:
    """The Substituted builds among `build_ids` that are not cached for the project (cached_for: another
    project's worker said their outputs were cached, and nobody of this one did) are not done for its
    evaluation (protocol.md, "Tenants"): Created again, to be built (decide_builds then queues them once
    their dependencies succeeded). Returns their ids (text). Runs in the caller's transaction."""
    ids = tuple(sorted({str(i) for i in build_ids}))
    if not ids:
        return []
    return _reopen(BuildSet(ids), project_id, now)


def _reopen(r: Scope, project_id: uuid.UUID, now: datetime) -> list[str]:
    if connection.vendor == "postgresql":
        doubtful = _pick(
            r, f"b.status = %s AND {SOME_OUTPUT_UNCACHED}", [BuildStatus.SUBSTITUTED.value, project_id]
        )
    else:
        rows = list(
            DerivationBuild.objects.filter(id__in=r.ids(), status=BuildStatus.SUBSTITUTED).values_list(
                "id", "outputs"
            )
        )
        cached = cached_for(paths=(o["path"] for _, outs in rows for o in outs or []), project_id=project_id)
        doubtful = [str(i) for i, outs in rows if any(o["path"] not in cached for o in outs or [])]
    if not doubtful:
        return []
    # Not _write_status: the build is no longer finished.
    if connection.vendor != "postgresql":
        DerivationBuild.objects.filter(id__in=doubtful, status=BuildStatus.SUBSTITUTED).update(
            status=BuildStatus.CREATED, finished_at=None, queued_at=None, updated_at=now
        )
        return doubtful
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE derivation_build SET status = %s, finished_at = NULL, queued_at = NULL, updated_at = %s "
            "WHERE id = ANY(%s::uuid[]) AND status = %s RETURNING id::text",
            [BuildStatus.CREATED.value, now, list(doubtful), BuildStatus.SUBSTITUTED.value],
        )
        return [row[0] for row in cur.fetchall()]


def _ready(qs: QuerySet[Any]) -> QuerySet[Any]:
    """The builds of `qs` that may be queued: every dependency succeeded, every input is known (no
    input pending from a result in parts), and not held by a result in parts still arriving on an open
    assignment."""
    unfinished_dep = DerivationBuildDependency.objects.filter(build_id=OuterRef("pk")).exclude(
        dependency__status__in=BUILD_SUCCESS
    )
    pending_input = EvalIngestInput.objects.filter(build_id=OuterRef("pk"))
    held = EvalIngest.objects.filter(
        assignment_id=OuterRef("ingest_id"), decided_at__isnull=True, assignment__finished_at__isnull=True
    )
    return qs.exclude(Exists(unfinished_dep)).exclude(Exists(pending_input)).exclude(Exists(held))


def queue_ready_builds(*, build_ids: Sequence[uuid.UUID] | None = None, now: datetime) -> int:
    """Created builds whose every dependency succeeded become Queued. With no ids, every Created build
    (the full resync)."""
    # A build whose .drv is lost waits for its DrvRecovery evaluation (services.drv_recovery).
    if build_ids is not None and not build_ids:
        return 0
    qs = DerivationBuild.objects.filter(status=BuildStatus.CREATED, drv_lost_at__isnull=True)
    if build_ids is not None:
        qs = qs.filter(id__in=build_ids)
        # Lock the candidates first (in id order, so two callers never wait on each other in a cycle).
        # Two dependencies finishing at once in two transactions would otherwise each read the other
        # as unfinished and neither queue the build, leaving it to the 60 s resync; with the lock the
        # second waits for the first to commit and then reads both (READ COMMITTED: a fresh snapshot
        # per statement).
        _lock_ids(qs)
    if connection.vendor == "postgresql":
        # _ready's conditions in the form whose plan does not depend on statistics (see _PICK): as the
        # ORM's anti joins, on a fresh database, every Created build read every edge (quadratic).
        scope: Scope = (
            BuildSet(tuple(str(i) for i in build_ids)) if build_ids is not None else CreatedBuilds()
        )
        return len(
            _write_status(
                _pick(scope, _READY, _ready_params()),
                expect=[BuildStatus.CREATED],
                status=BuildStatus.QUEUED,
                now=now,
                queued=True,
            )
        )
    ready = list(_ready(qs).values_list("id", flat=True))
    if not ready:
        return 0
    return DerivationBuild.objects.filter(id__in=ready, status=BuildStatus.CREATED).update(
        status=BuildStatus.QUEUED, queued_at=now, updated_at=now
    )


def _lock_ids(qs: QuerySet[Any]) -> list[uuid.UUID]:
    """The ids of `qs`, each row locked (FOR NO KEY UPDATE) in id order for this transaction. Outside a
    transaction (autocommit: every statement commits on its own) there is nothing to hold a lock for."""
    if transaction.get_connection().in_atomic_block:
        qs = qs.select_for_update(no_key=True)
    return list(qs.order_by("id").values_list("id", flat=True))


def fail_dependents(*, build_ids: Sequence[uuid.UUID], now: datetime) -> int:
    """Pending builds needing a build with a lasting failure fail with DependencyFailed, transitively."""
    failed_dep = DerivationBuildDependency.objects.filter(
        build_id=OuterRef("pk"), dependency__status__in=BUILD_LASTING_FAILURE
    )
    total = 0
    frontier: set[uuid.UUID] = set(build_ids)
    while frontier:
        # Builds among the frontier and their dependents that now need a failed build.
        scope = set(frontier) | set(
            DerivationBuildDependency.objects.filter(dependency_id__in=frontier).values_list(
                "build_id", flat=True
            )
        )
        doomed = list(
            DerivationBuild.objects.filter(id__in=scope, status__in=BUILD_PENDING)
            .filter(Exists(failed_dep))
            .values_list("id", flat=True)
        )
        if not doomed:
            break
        total += DerivationBuild.objects.filter(id__in=doomed, status__in=BUILD_PENDING).update(
            status=BuildStatus.DEPENDENCY_FAILED,
            last_error="a dependency failed",
            finished_at=now,
            updated_at=now,
        )
        frontier = set(doomed)
    return total


def dependents_of(build_ids: Sequence[uuid.UUID]) -> list[uuid.UUID]:
    """The builds that depend on any of `build_ids` (each once)."""
    return list(
        DerivationBuildDependency.objects.filter(dependency_id__in=list(build_ids))
        .values_list("build_id", flat=True)
        .distinct()
    )


def abort_unneeded_builds(
    *, evaluation_id: uuid.UUID, statuses: Sequence[BuildStatus], reason: str, now: datetime
) -> list[uuid.UUID]:
    """The evaluation's builds in one of `statuses` that no other active evaluation needs end Aborted
    (a cancel's end). Returns their ids."""
    other_needs = EvaluationBuild.objects.filter(
        build_id=OuterRef("pk"), blocks_evaluation=True, evaluation__status__in=EVALUATION_ACTIVE
    ).exclude(evaluation_id=evaluation_id)
    orphaned = list(
        DerivationBuild.objects.filter(evaluation_links__evaluation_id=evaluation_id, status__in=statuses)
        .exclude(Exists(other_needs))
        .values_list("id", flat=True)
    )
    if not orphaned:
        return []
    DerivationBuild.objects.filter(id__in=orphaned, status__in=statuses).update(
        status=BuildStatus.ABORTED, finished_at=now, updated_at=now, last_error=reason[:2000]
    )
    return orphaned


# What a batch of completed builds may move on, read in one fixed-text statement (every report batch
# that completes builds asks): the builds depending on any of them, and the evaluations needing any.
_AFTER_COMPLETIONS = """
SELECT DISTINCT true, d.build_id FROM derivation_build_dependency d
WHERE d.dependency_id = ANY(%(ids)b::uuid[])
UNION ALL
SELECT DISTINCT false, eb.evaluation_id FROM evaluation_build eb
WHERE eb.build_id = ANY(%(ids)b::uuid[]) AND eb.blocks_evaluation
"""


def after_completions(build_ids: Sequence[uuid.UUID]) -> tuple[list[uuid.UUID], list[uuid.UUID]]:
    """(dependents_of, evaluations_needing) of these builds, in one statement on PostgreSQL."""
    if not build_ids:
        return [], []
    if connection.vendor != "postgresql":
        return dependents_of(build_ids), evaluations_needing(build_ids)
    with setsql.fixed_cursor() as cur:
        cur.execute(_AFTER_COMPLETIONS, {"ids": list(build_ids)})
        rows = cur.fetchall()
    return [i for dependent, i in rows if dependent], [i for dependent, i in rows if not dependent]


def evaluations_needing(build_ids: Iterable[uuid.UUID]) -> list[uuid.UUID]:
    return list(
        EvaluationBuild.objects.filter(build_id__in=list(build_ids), blocks_evaluation=True)
        .values_list("evaluation_id", flat=True)
        .distinct()
    )


MAX_REPORTED_FAILURES = 50


@dataclass(frozen=True)
class EvaluationFinish:
    evaluation_id: uuid.UUID
    status: str
    errors: tuple[str, ...] = ()


def _reopen_for(evaluation_id: uuid.UUID, now: datetime) -> bool:
    """Before the evaluation completes: the builds it needs that were Substituted on another project's
    word alone (reopen_unconfirmed) are built first. Catches every order of events, such as a build this
    evaluation linked while pending and another project's evaluation then substituted. Whether any was."""
    project_id = Evaluation.objects.filter(id=evaluation_id).values_list("project_id", flat=True).first()
    if project_id is None:
        return False
    reopened = _reopen(BuildRange(evaluation_id), project_id, now)
    if reopened:
        queue_ready_builds(build_ids=[uuid.UUID(i) for i in reopened], now=now)
    return bool(reopened)


# finish_evaluations' candidates on PostgreSQL, in fixed text (every report batch that completes builds
# asks): Building, or Waiting parked while building; locked in id order.
_BUILDING_EVALUATIONS_LOCKED = """
SELECT e.id FROM evaluation e
WHERE e.id = ANY(%(ids)b::uuid[]) AND (e.status = %(building)s OR (e.status = %(waiting)s AND (
    e.waiting_reason ->> 'reason' = ANY(%(parks)s)
    OR (e.waiting_reason ->> 'reason' = 'draining' AND e.waiting_reason ->> 'resume' = %(building)s))))
ORDER BY e.id FOR NO KEY UPDATE
"""

# Of these evaluations, those with no needed build unfinished: a statement of its own, after the lock
# (READ COMMITTED: its snapshot sees what the batch that held the lock committed). Each evaluation comes
# with a witness remembered from its last check (an unfinished build it needed then): while the witness
# is still unfinished, that is one probe; otherwise one unfinished build is looked for (the one likely
# to finish last: waiting for its dependencies, else the last in the queue) and becomes the next witness.
# Without the witness, an evaluation of 8 000 builds completing in queue order read every finished
# build before the first unfinished one after each batch (quadratic). Memory only saves reads: the
# answer is always the database's.
_WITHOUT_UNFINISHED = """
SELECT e.id, w.id FROM unnest(%(ids)b::uuid[], %(hints)b::uuid[]) AS e(id, hint)
LEFT JOIN LATERAL (
    (SELECT b.id FROM derivation_build b
     WHERE b.id = e.hint AND b.status = ANY(%(unfinished)s) AND EXISTS (
         SELECT 1 FROM evaluation_build eb
         WHERE eb.evaluation_id = e.id AND eb.build_id = b.id AND eb.blocks_evaluation))
    UNION ALL
    (SELECT b.id FROM evaluation_build eb JOIN derivation_build b ON b.id = eb.build_id
     WHERE eb.evaluation_id = e.id AND eb.blocks_evaluation AND b.status = ANY(%(unfinished)s)
     ORDER BY b.status = %(created)s DESC, b.queued_at DESC NULLS FIRST, b.id DESC LIMIT 1)
    LIMIT 1
) w ON true
ORDER BY e.id
"""
_WITNESSES_MAX = 10_000
_witnesses: dict[uuid.UUID, uuid.UUID] = {}


def _building_evaluations_locked(ids: list[uuid.UUID]) -> list[uuid.UUID]:
    with setsql.fixed_cursor() as cur:
        cur.execute(
            _BUILDING_EVALUATIONS_LOCKED,
            {
                "ids": ids,
                "building": EvaluationStatus.BUILDING.value,
                "waiting": EvaluationStatus.WAITING.value,
                "parks": sorted(BUILDING_PARKS),
            },
        )
        return [row[0] for row in cur.fetchall()]


def _without_unfinished(ids: list[uuid.UUID]) -> list[uuid.UUID]:
    params = {
        "ids": ids,
        "hints": [_witnesses.get(i) for i in ids],
        "unfinished": sorted(s.value for s in BUILD_UNFINISHED),
        "created": BuildStatus.CREATED.value,
    }
    with setsql.fixed_cursor() as cur:
        cur.execute(_WITHOUT_UNFINISHED, params)
        rows = cur.fetchall()
    if len(_witnesses) > _WITNESSES_MAX:
        _witnesses.clear()
    done: list[uuid.UUID] = []
    for evaluation_id, witness in rows:
        if witness is None:
            _witnesses.pop(evaluation_id, None)
            done.append(evaluation_id)
        else:
            _witnesses[evaluation_id] = witness
    return done


def finish_evaluations(
    *, evaluation_ids: Iterable[uuid.UUID], now: datetime, after_successes: bool = False
) -> list[EvaluationFinish]:
    """check_evaluation_done: a Building (or Waiting while building) evaluation completes when everything
    it needs succeeded and fails on a lasting failure. Returns what changed. Two indexed EXISTS-style reads
    per evaluation, whatever its size: this runs after every finished build.

    `after_successes`: the caller only saw builds succeed (a batch's completions). A success adds no
    lasting failure (each one's own check ran when it happened), so an evaluation with a needed build
    still pending, building or waiting for its retry is left as it is after one EXISTS that stops at the
    first such build, instead of a scan of all its builds for failures."""
    finished: list[EvaluationFinish] = []
    # Only an evaluation whose evaluation job completed: Building, or parked while building. One requeued
    # mid-evaluation (builds from an eval_result, no JobCompleted) is evaluated again first.
    parked_building = Q(waiting_reason__reason__in=sorted(BUILDING_PARKS)) | Q(
        waiting_reason__reason="draining", waiting_reason__resume="Building"
    )
    # Locked, in id order, for the same reason as in queue_ready_builds: the last two builds of an
    # evaluation finishing in two transactions at once would each see the other still Building, and
    # the evaluation would wait for the next waiting pass to complete.
    ids = sorted(set(evaluation_ids))
    if not ids:
        return finished
    # After successes, an evaluation with a needed build unfinished is passed over (on PostgreSQL by
    # _without_unfinished, with the lock's transaction; elsewhere in the loop below).
    unfinished_checked = connection.vendor == "postgresql"
    if unfinished_checked:
        candidates = _building_evaluations_locked(ids)
        if after_successes and candidates:
            candidates = _without_unfinished(candidates)
    else:
        candidates = _lock_ids(
            Evaluation.objects.filter(
                Q(status=EvaluationStatus.BUILDING) | (Q(status=EvaluationStatus.WAITING) & parked_building),
                id__in=ids,
            )
        )
    for evaluation_id in candidates:
        links = EvaluationBuild.objects.filter(evaluation_id=evaluation_id, blocks_evaluation=True)
        if (
            after_successes
            and not unfinished_checked
            and links.filter(build__status__in=BUILD_UNFINISHED).exists()
        ):
            continue  # still building
        failed = list(
            links.filter(build__status__in=BUILD_LASTING_FAILURE).values_list(
                "build__drv_path", "build__status"
            )[:MAX_REPORTED_FAILURES]
        )
        if not failed and links.exclude(build__status__in=BUILD_SUCCESS).exists():
            continue  # still building
        if not failed and _reopen_for(evaluation_id, now):
            continue  # builds only another project's worker said were cached: built for this one first
        verdict = EvaluationStatus.FAILED if failed else EvaluationStatus.COMPLETED
        errors = tuple(f"{path}: {status}" for path, status in failed)
        extra: dict[str, Any] = {}
        if errors:
            previous = (
                Evaluation.objects.filter(id=evaluation_id).values_list("errors", flat=True).first() or []
            )
            extra["errors"] = [*previous, *errors][:200]
        reason = "every needed build succeeded" if not errors else f"{len(errors)} builds failed lastingly"
        if history.evaluation_transition(
            evaluation_id=evaluation_id,
            to=verdict.value,
            expect=[EvaluationStatus.BUILDING, EvaluationStatus.WAITING],
            reason=reason,
            now=now,
            **extra,
        ):
            finished.append(EvaluationFinish(evaluation_id, verdict.value, errors))
    return finished
