"""Storing the derivations of an eval_result (or of one part of it), set-based.

One part's rows are written in a handful of statements, whatever its size: on PostgreSQL multi-row
statements over arrays (`unnest`), with `ON CONFLICT DO NOTHING` where another evaluation may write
the same row; elsewhere (SQLite, the embedded mode, for small evaluations) the same steps through the
ORM. Both do the same thing:

1. the cached outputs (`cached_path`, with their NAR sizes);
2. one shared build per derivation path: existing ones reused, missing ones created (held by the
   part's ingest while the result is still arriving: graph.queue_ready_builds never queues them);
3. an Aborted build named again is wanted again (Created);
4. the evaluation's links;
5. the inputs of every build that is new, or whose inputs are not all known yet: an input that is a
   derivation of this part, or of an earlier part of the same evaluation, becomes a dependency edge;
   any other is noted as pending (`eval_ingest_input`), unless this is the final part (then the input
   is not part of the result, and as before such inputs are ignored);
6. the pending inputs of earlier parts that name a derivation of this part become edges.

A build that existed before with all its inputs known is only linked: a re-evaluation that adds
nothing writes no edge and no build (docs/performance.md, *Large evaluations*).

Call inside the report's transaction. Nothing here decides the graph (graph.decide_evaluation_graph).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec
from django.db import connection

from gradient.core.vocab import BuildStatus
from gradient.scheduling.models import (
    CachedPath,
    DerivationBuild,
    DerivationBuildDependency,
    EvalIngestInput,
    Evaluation,
    EvaluationBuild,
)

_json = msgspec.json.Encoder()


@dataclass
class StoredPart:
    ids: dict[str, uuid.UUID]  # every derivation path of the part -> its shared build
    created: int = 0
    edges: int = 0
    pending: int = 0


def _unique(derivations: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """By path, in order; a derivation named twice counts once (its first naming)."""
    by_path: dict[str, dict[str, Any]] = {}
    for d in derivations:
        by_path.setdefault(d["drv_path"], d)
    return by_path


def _cached(by_path: dict[str, dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in by_path.values():
        for o in d.get("cached_outputs") or []:
            out.setdefault(o["path"], max(0, int(o.get("nar_size") or 0)))
    return out


def _inputs(path: str, d: dict[str, Any]) -> list[str]:
    return sorted({p for p in d.get("input_drvs") or [] if p != path})


def store_part(
    *,
    evaluation: Evaluation,
    derivations: Sequence[dict[str, Any]],
    ingest_id: uuid.UUID | None,
    hold: bool,
    final: bool,
    now: datetime,
) -> StoredPart:
    """Store one part (or a whole result: `final` and no earlier part). `ingest_id` names the
    eval_ingest row the pending inputs belong to (None: a whole result, nothing can be pending);
    `hold` marks the new builds as held by it until the result is decided."""
    by_path = _unique(derivations)
    if connection.vendor == "postgresql":
        return _store_postgres(evaluation.id, evaluation.priority, by_path, ingest_id, hold, final, now)
    return _store_portable(evaluation.id, evaluation.priority, by_path, ingest_id, hold, final, now)


# --- PostgreSQL --------------------------------------------------------------------------------------

_FIELD_DEFAULTS = {f.name: f.default for f in DerivationBuild._meta.concrete_fields}


def _store_postgres(
    evaluation_id: uuid.UUID,
    priority: bool,
    by_path: dict[str, dict[str, Any]],
    ingest_id: uuid.UUID | None,
    hold: bool,
    final: bool,
    now: datetime,
) -> StoredPart:
    stored = StoredPart(ids={})
    paths = sorted(by_path)  # one order for every writer: concurrent ingests never deadlock on them
    with connection.cursor() as cur:
        cached = _cached(by_path)
        if cached:
            cached_paths = sorted(cached)
            cur.execute(
                "INSERT INTO cached_path (path, nar_size, created_at) "
                "SELECT p, n, %s FROM unnest(%s::text[], %s::bigint[]) AS t(p, n) "
                "ON CONFLICT (path) DO NOTHING",
                [now, cached_paths, [cached[p] for p in cached_paths]],
            )
        existing: dict[str, tuple[uuid.UUID, str]] = {}
        if paths:
            cur.execute("SELECT drv_path, id, status FROM derivation_build WHERE drv_path = ANY(%s)", [paths])
            existing = {p: (i, s) for p, i, s in cur.fetchall()}
        missing = [p for p in paths if p not in existing]
        created: dict[str, uuid.UUID] = {}
        if missing:
            new_ids = [uuid.uuid4() for _ in missing]
            cur.execute(
                "INSERT INTO derivation_build (id, drv_path, system, required_features, outputs, status, "
                "prioritized, attempts, max_attempts, timeout_secs, max_silent_secs, last_error, "
                "ingest_id, created_at, updated_at) "
                "SELECT i, p, s, f::jsonb, o::jsonb, %s, %s, 0, %s, %s, %s, '', %s, %s, %s "
                "FROM unnest(%s::uuid[], %s::text[], %s::text[], %s::text[], %s::text[]) AS t(i, p, s, f, o) "
                "ON CONFLICT (drv_path) DO NOTHING RETURNING drv_path, id",
                [
                    BuildStatus.CREATED.value,
                    priority,
                    _FIELD_DEFAULTS["max_attempts"],
                    _FIELD_DEFAULTS["timeout_secs"],
                    _FIELD_DEFAULTS["max_silent_secs"],
                    ingest_id if hold else None,
                    now,
                    now,
                    new_ids,
                    missing,
                    [by_path[p]["system"] for p in missing],
                    [
                        _json.encode(sorted(set(by_path[p].get("required_features") or []))).decode()
                        for p in missing
                    ],
                    [
                        _json.encode(
                            [{"name": o["name"], "path": o["path"]} for o in by_path[p].get("outputs") or []]
                        ).decode()
                        for p in missing
                    ],
                ],
            )
            created = dict(cur.fetchall())
            raced = [p for p in missing if p not in created]
            if raced:  # created by another evaluation meanwhile
                cur.execute(
                    "SELECT drv_path, id, status FROM derivation_build WHERE drv_path = ANY(%s)", [raced]
                )
                existing.update({p: (i, s) for p, i, s in cur.fetchall()})
        stored.ids = {p: existing[p][0] for p in existing}
        stored.ids.update(created)
        stored.created = len(created)

        aborted = [i for i, s in existing.values() if s == BuildStatus.ABORTED]
        if aborted:
            # A build aborted for an earlier evaluation nobody wanted any more is wanted again now.
            cur.execute(
                "UPDATE derivation_build SET status = %s, retry_at = NULL, updated_at = %s "
                "WHERE id = ANY(%s) AND status = %s",
                [BuildStatus.CREATED.value, now, aborted, BuildStatus.ABORTED.value],
            )

        link_ids = [stored.ids[p] for p in paths]
        cur.execute(
            "INSERT INTO evaluation_build (evaluation_id, build_id, attr, named, blocks_evaluation) "
            "SELECT %s, b, a, a IS NOT NULL, true FROM unnest(%s::uuid[], %s::text[]) AS t(b, a) "
            "ON CONFLICT (evaluation_id, build_id) DO NOTHING",
            [evaluation_id, link_ids, [by_path[p].get("attr") for p in paths]],
        )

        # Whose inputs to look at: new builds, and builds whose inputs some ingest still waits for.
        todo = set(created)
        old_ids = [existing[p][0] for p in existing]
        if old_ids:
            cur.execute(
                "SELECT DISTINCT b.drv_path FROM eval_ingest_input u JOIN derivation_build b "
                "ON b.id = u.build_id WHERE u.build_id = ANY(%s)",
                [old_ids],
            )
            todo.update(p for (p,) in cur.fetchall())
        pairs = [(p, i) for p in sorted(todo) for i in _inputs(p, by_path[p])]
        outside = sorted({i for _, i in pairs if i not in stored.ids})
        known: dict[str, uuid.UUID] = {}
        if outside:
            cur.execute(
                "SELECT b.drv_path, b.id FROM derivation_build b WHERE b.drv_path = ANY(%s) AND EXISTS "
                "(SELECT 1 FROM evaluation_build eb WHERE eb.evaluation_id = %s AND eb.build_id = b.id)",
                [outside, evaluation_id],
            )
            known = dict(cur.fetchall())
        edge_from: list[uuid.UUID] = []
        edge_to: list[uuid.UUID] = []
        pend_build: list[uuid.UUID] = []
        pend_path: list[str] = []
        for p, i in pairs:
            target = stored.ids.get(i) or known.get(i)
            if target is not None:
                edge_from.append(stored.ids[p])
                edge_to.append(target)
            elif not final and ingest_id is not None:
                pend_build.append(stored.ids[p])
                pend_path.append(i)
        if edge_from:
            cur.execute(
                "INSERT INTO derivation_build_dependency (build_id, dependency_id) "
                "SELECT b, d FROM unnest(%s::uuid[], %s::uuid[]) AS t(b, d) WHERE b <> d "
                "ON CONFLICT (build_id, dependency_id) DO NOTHING",
                [edge_from, edge_to],
            )
            stored.edges += cur.rowcount
        if pend_build:
            cur.execute(
                "INSERT INTO eval_ingest_input (ingest_id, build_id, input_drv_path) "
                "SELECT %s, b, p FROM unnest(%s::uuid[], %s::text[]) AS t(b, p) "
                "ON CONFLICT (ingest_id, build_id, input_drv_path) DO NOTHING",
                [ingest_id, pend_build, pend_path],
            )
            stored.pending += cur.rowcount
        if ingest_id is not None and paths:
            # Earlier parts' inputs that this part brought.
            cur.execute(
                "WITH r AS (DELETE FROM eval_ingest_input u WHERE u.ingest_id = %s "
                "AND u.input_drv_path = ANY(%s) RETURNING u.build_id, u.input_drv_path) "
                "INSERT INTO derivation_build_dependency (build_id, dependency_id) "
                "SELECT r.build_id, b.id FROM r JOIN derivation_build b ON b.drv_path = r.input_drv_path "
                "WHERE b.id <> r.build_id ON CONFLICT (build_id, dependency_id) DO NOTHING",
                [ingest_id, paths],
            )
            stored.edges += cur.rowcount
    return stored


# --- Elsewhere (SQLite): the same steps through the ORM ---------------------------------------------


def _store_portable(
    evaluation_id: uuid.UUID,
    priority: bool,
    by_path: dict[str, dict[str, Any]],
    ingest_id: uuid.UUID | None,
    hold: bool,
    final: bool,
    now: datetime,
) -> StoredPart:
    stored = StoredPart(ids={})
    paths = sorted(by_path)
    cached = _cached(by_path)
    if cached:
        CachedPath.objects.bulk_create(
            [CachedPath(path=p, nar_size=n) for p, n in cached.items()], ignore_conflicts=True
        )
    existing = {
        p: (i, s)
        for p, i, s in DerivationBuild.objects.filter(drv_path__in=paths).values_list(
            "drv_path", "id", "status"
        )
    }
    missing = [p for p in paths if p not in existing]
    DerivationBuild.objects.bulk_create(
        [
            DerivationBuild(
                drv_path=p,
                system=by_path[p]["system"],
                required_features=sorted(set(by_path[p].get("required_features") or [])),
                outputs=[{"name": o["name"], "path": o["path"]} for o in by_path[p].get("outputs") or []],
                prioritized=priority,
                ingest_id=ingest_id if hold else None,
            )
            for p in missing
        ],
        ignore_conflicts=True,
    )
    ids = dict(DerivationBuild.objects.filter(drv_path__in=paths).values_list("drv_path", "id"))
    stored.ids = ids
    new_paths = {p for p in missing if p in ids}
    stored.created = len(new_paths)
    aborted = [i for i, s in existing.values() if s == BuildStatus.ABORTED]
    if aborted:
        DerivationBuild.objects.filter(id__in=aborted, status=BuildStatus.ABORTED).update(
            status=BuildStatus.CREATED, retry_at=None, updated_at=now
        )
    EvaluationBuild.objects.bulk_create(
        [
            EvaluationBuild(
                evaluation_id=evaluation_id,
                build_id=ids[p],
                attr=by_path[p].get("attr"),
                named=by_path[p].get("attr") is not None,
            )
            for p in paths
        ],
        ignore_conflicts=True,
    )
    waiting = set(
        EvalIngestInput.objects.filter(build_id__in=[existing[p][0] for p in existing]).values_list(
            "build__drv_path", flat=True
        )
    )
    todo = new_paths | waiting
    pairs = [(p, i) for p in sorted(todo) for i in _inputs(p, by_path[p])]
    outside = {i for _, i in pairs if i not in ids}
    known = dict(
        DerivationBuild.objects.filter(
            drv_path__in=outside, evaluation_links__evaluation_id=evaluation_id
        ).values_list("drv_path", "id")
    )
    edges: list[DerivationBuildDependency] = []
    pending: list[EvalIngestInput] = []
    for p, i in pairs:
        target = ids.get(i) or known.get(i)
        if target is not None:
            if target != ids[p]:
                edges.append(DerivationBuildDependency(build_id=ids[p], dependency_id=target))
        elif not final and ingest_id is not None:
            pending.append(EvalIngestInput(ingest_id=ingest_id, build_id=ids[p], input_drv_path=i))
    if ingest_id is not None:
        arrived = EvalIngestInput.objects.filter(ingest_id=ingest_id, input_drv_path__in=paths)
        for build_id, path in arrived.values_list("build_id", "input_drv_path"):
            if ids[path] != build_id:
                edges.append(DerivationBuildDependency(build_id=build_id, dependency_id=ids[path]))
        arrived.delete()
    DerivationBuildDependency.objects.bulk_create(edges, ignore_conflicts=True)
    EvalIngestInput.objects.bulk_create(pending, ignore_conflicts=True)
    stored.edges = len(edges)
    stored.pending = len(pending)
    return stored
