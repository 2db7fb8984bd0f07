"""Known derivations (protocol.md, "Known derivations"): a re-evaluation that changed little costs little.

During an evaluation the worker asks which derivations the server already knows
(QueryKnownDerivations, at most 1 000 paths) and leaves those out of its result, with their closures,
naming them in `known_drvs` of a part instead. A derivation is known when the server holds its shared
build with the whole input closure recorded: the build is linked to an evaluation whose result came
whole (its ingest decided: every derivation of the result stored, every input of each an edge), its
`.drv` is not lost, and no input of it is still pending. That evaluation's result held the build's
closure, so the edges from the build down are all there.

The answer is one indexed read (derivation paths by their unique index, each build's links by theirs);
the link of a part's `known_drvs` is one statement over the closure (a recursive walk of the edges,
each step an index lookup), whatever the number of known derivations.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.db import connection

from gradient.core.ids import parse_uuid
from gradient.core.vocab import BuildStatus
from gradient.scheduling.models import (
    DerivationBuild,
    DerivationBuildDependency,
    DispatchedJob,
    EvalIngestInput,
    EvaluationBuild,
)
from gradient.scheduling.services import cached_sql, graph

# Every condition is an EXISTS that cannot become a join (OFFSET 0): per path an index lookup, whatever
# the statistics say (see graph._PICK).
_KNOWN = (
    "b.drv_lost_at IS NULL "
    "AND NOT EXISTS (SELECT 1 FROM eval_ingest_input u WHERE u.build_id = b.id OFFSET 0) "
    "AND EXISTS (SELECT 1 FROM evaluation_build eb WHERE eb.build_id = b.id AND EXISTS ("
    "SELECT 1 FROM eval_ingest i WHERE i.evaluation_id = eb.evaluation_id AND i.decided_at IS NOT NULL "
    "OFFSET 0) OFFSET 0)"
)
_KNOWN_AMONG = "SELECT b.drv_path FROM derivation_build b WHERE b.drv_path = ANY(%s) AND " + _KNOWN  # noqa: S608 (constants)
_ANSWER = (
    _KNOWN_AMONG  # noqa: S608 (constants)
    + " AND EXISTS ("
    "SELECT 1 FROM dispatched_job d WHERE d.id = %s AND d.worker_id = %s AND d.job_id = %s "
    "AND d.finished_at IS NULL AND d.evaluation_id IS NOT NULL OFFSET 0)"
)
# A part's known paths, checked and linked with their closures in one statement: the paths are looked up
# once (by their unique index), and nothing is linked unless every one is known (`whole`; the caller
# then asks which were not, _KNOWN_AMONG). The walk stops at a build the evaluation links already: its
# closure is linked, or arrives in this result (the worker sends a result closed under inputs: every
# input of a derivation it sent is sent or named known); a named build is walked whatever (`seed`).
# Whether a build is linked is asked once per build reached, not once per edge to it (a build is the
# input of several: three edges to a build in bench/ingest.py's graph), and such a build is not offered
# to the INSERT, so the insert meets no conflict but a named build linked by an earlier part.
_LINK_KNOWN = (
    "WITH RECURSIVE k AS MATERIALIZED ("  # noqa: S608 (constants)
    "SELECT b.id FROM derivation_build b WHERE b.drv_path = ANY(%(paths)s) AND " + _KNOWN + "), "
    "whole AS MATERIALIZED (SELECT count(*) = %(count)s AS ok FROM k), "
    "c(id, seed) AS ("
    "SELECT id, true FROM k WHERE (SELECT ok FROM whole) "
    "UNION "
    "SELECT x.dependency_id, false FROM c CROSS JOIN LATERAL (SELECT e.dependency_id FROM "
    "derivation_build_dependency e WHERE e.build_id = c.id OFFSET 0) x WHERE c.seed OR NOT EXISTS ("
    "SELECT 1 FROM evaluation_build l WHERE l.evaluation_id = %(evaluation)s AND l.build_id = c.id OFFSET 0)"
    "), "
    "linked AS (INSERT INTO evaluation_build (evaluation_id, build_id, attr, named, blocks_evaluation) "
    "SELECT %(evaluation)s, n.id, NULL, false, true FROM (SELECT DISTINCT id FROM c) n WHERE NOT EXISTS ("
    "SELECT 1 FROM evaluation_build l WHERE l.evaluation_id = %(evaluation)s AND l.build_id = n.id OFFSET 0) "
    "ORDER BY n.id ON CONFLICT (evaluation_id, build_id) DO NOTHING RETURNING build_id), "
    # An Aborted build of the closure (its evaluations were cancelled) is wanted again, as when sent; a
    # build Substituted on another project's word alone is built for this one (graph.reopen_unconfirmed).
    # One UPDATE for both: one pass over the linked builds.
    "wanted AS (UPDATE derivation_build b SET status = %(created)s, updated_at = %(now)s, "
    "retry_at = CASE WHEN b.status = %(aborted)s THEN NULL ELSE b.retry_at END, "
    "finished_at = CASE WHEN b.status = %(substituted)s THEN NULL ELSE b.finished_at END, "
    "queued_at = CASE WHEN b.status = %(substituted)s THEN NULL ELSE b.queued_at END "
    "WHERE b.id = ANY(ARRAY(SELECT build_id FROM linked)) AND (b.status = %(aborted)s OR ("
    "b.status = %(substituted)s AND "
    + cached_sql.SOME_OUTPUT_UNCACHED.replace("%s", "%(project)s")
    + ")) RETURNING b.id::text) "
    "SELECT (SELECT ok FROM whole), ARRAY(SELECT id FROM wanted)"
)


def known_derivations(
    *, worker_id: uuid.UUID, job_key: str, assignment_id: str, drv_paths: Sequence[str]
) -> list[str]:
    """Those of `drv_paths` the server knows, in their order; none when `assignment_id` is not the
    worker's open evaluation assignment of `job_key` (a stale query is answered, empty)."""
    assignment = parse_uuid(assignment_id)
    if assignment is None or not drv_paths:
        return []
    if connection.vendor != "postgresql":
        if not DispatchedJob.objects.filter(
            id=assignment,
            worker_id=worker_id,
            job_id=job_key,
            finished_at__isnull=True,
            evaluation_id__isnull=False,
        ).exists():
            return []
        found = set(_known_portable(drv_paths))
    else:
        with connection.cursor() as cur:
            cur.execute(_ANSWER, [list(drv_paths), assignment, worker_id, job_key])
            found = {row[0] for row in cur.fetchall()}
    return [p for p in dict.fromkeys(drv_paths) if p in found]


def _known_portable(drv_paths: Sequence[str]) -> list[str]:
    return list(
        DerivationBuild.objects.filter(
            drv_path__in=list(drv_paths),
            drv_lost_at__isnull=True,
            evaluation_links__evaluation__ingests__decided_at__isnull=False,
        )
        .exclude(id__in=EvalIngestInput.objects.values("build_id"))
        .values_list("drv_path", flat=True)
        .distinct()
    )


def link_known(
    *, evaluation_id: uuid.UUID, project_id: uuid.UUID, drv_paths: Sequence[str], now: datetime
) -> tuple[list[Any], list[str]]:
    """A part's `known_drvs`: each known build and its closure linked to the evaluation (as if sent).
    Returns the builds of the closure that are to be decided again (Created now: they were Aborted, or
    Substituted on the word of another project than `project_id`, the evaluation's: protocol.md,
    "Tenants") and the paths that are not known (the caller fails the evaluation naming them; nothing is
    linked then). Call inside the part's transaction."""
    paths = sorted(set(drv_paths))
    if not paths:
        return [], []
    if connection.vendor == "postgresql":
        with connection.cursor() as cur:
            cur.execute(
                _LINK_KNOWN,
                {
                    "paths": paths,
                    "count": len(paths),
                    "evaluation": evaluation_id,
                    "created": BuildStatus.CREATED.value,
                    "aborted": BuildStatus.ABORTED.value,
                    "substituted": BuildStatus.SUBSTITUTED.value,
                    "project": project_id,
                    "now": now,
                },
            )
            row = cur.fetchone()
            assert row is not None  # a SELECT of two scalars: one row, always
            whole, wanted = row
            if whole:
                return list(wanted), []
            # Some path is not known (rare: the query went stale): nothing was linked; say which.
            cur.execute(_KNOWN_AMONG, [paths])
            known = {r[0] for r in cur.fetchall()}
        return [], [p for p in paths if p not in known]
    known = set(_known_portable(paths))
    unknown = [p for p in paths if p not in known]
    if unknown:
        return [], unknown
    linked = _link_portable(evaluation_id, paths)
    revived: list[Any] = list(
        DerivationBuild.objects.filter(id__in=linked, status=BuildStatus.ABORTED).values_list("id", flat=True)
    )
    DerivationBuild.objects.filter(id__in=revived).update(
        status=BuildStatus.CREATED, retry_at=None, updated_at=now
    )
    reopened = graph.reopen_unconfirmed(build_ids=linked, project_id=project_id, now=now)
    return [*revived, *reopened], []


def _link_portable(evaluation_id: uuid.UUID, paths: list[str]) -> list[uuid.UUID]:
    linked = set(
        EvaluationBuild.objects.filter(evaluation_id=evaluation_id).values_list("build_id", flat=True)
    )
    frontier = set(DerivationBuild.objects.filter(drv_path__in=paths).values_list("id", flat=True))
    closure: set[uuid.UUID] = set()
    while frontier:
        closure |= frontier
        frontier = {
            d
            for d in DerivationBuildDependency.objects.filter(build_id__in=frontier).values_list(
                "dependency_id", flat=True
            )
            if d not in closure and d not in linked
        }
    new = sorted(closure - linked)
    EvaluationBuild.objects.bulk_create(
        [EvaluationBuild(evaluation_id=evaluation_id, build_id=b) for b in new], ignore_conflicts=True
    )
    return new


# Pending inputs of the ingest that name a build the evaluation now links (a known closure just linked):
# edges now, pending no more. Each input looked up by its path (unique index).
_RESOLVE_PENDING = (
    "WITH r AS (SELECT u.id, u.build_id, (SELECT d.id FROM derivation_build d "
    "WHERE d.drv_path = u.input_drv_path) AS dep FROM eval_ingest_input u WHERE u.ingest_id = %s), "
    "k AS MATERIALIZED (SELECT r.id, r.build_id, r.dep FROM r WHERE r.dep IS NOT NULL AND EXISTS ("
    "SELECT 1 FROM evaluation_build l WHERE l.evaluation_id = %s AND l.build_id = r.dep OFFSET 0)), "
    "e AS (INSERT INTO derivation_build_dependency (build_id, dependency_id) SELECT build_id, dep FROM k "
    "WHERE build_id <> dep ORDER BY build_id, dep ON CONFLICT (build_id, dependency_id) DO NOTHING) "
    "DELETE FROM eval_ingest_input WHERE id IN (SELECT id FROM k) RETURNING build_id::text"
)


def resolve_pending_inputs(*, ingest_id: uuid.UUID, evaluation_id: uuid.UUID) -> set[Any]:
    """The ingest's pending inputs that the evaluation now links become edges. Returns the builds that
    had them."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cur:
            cur.execute(_RESOLVE_PENDING, [ingest_id, evaluation_id])
            return {row[0] for row in cur.fetchall()}
    pending = EvalIngestInput.objects.filter(ingest_id=ingest_id)
    by_path = dict(
        DerivationBuild.objects.filter(
            drv_path__in=pending.values("input_drv_path"), evaluation_links__evaluation_id=evaluation_id
        ).values_list("drv_path", "id")
    )
    resolved = [
        (u, b, by_path[p])
        for u, b, p in pending.values_list("id", "build_id", "input_drv_path")
        if p in by_path
    ]
    DerivationBuildDependency.objects.bulk_create(
        [DerivationBuildDependency(build_id=b, dependency_id=d) for _, b, d in resolved if b != d],
        ignore_conflicts=True,
    )
    EvalIngestInput.objects.filter(id__in=[u for u, _, _ in resolved]).delete()
    return {b for _, b, _ in resolved}
