"""Storing the derivations of an eval_result (or of one part of it), set-based.

One part's rows are written in a handful of statements, whatever its size: on PostgreSQL its rows are
copied (psycopg's COPY) into temporary tables and each table written with one `INSERT ... SELECT`,
`ON CONFLICT DO NOTHING` where another evaluation may write the same row; elsewhere (SQLite, the
embedded mode, for small evaluations) the same steps through the ORM. Both do the same thing:

1. the cached outputs (`cached_path`, with their NAR sizes), each the claim of the projects that speak
   through this report (`cached_path_claim`; confirmed for every project with GRADIENT_TRUSTED_CACHE);
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

import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec
from django.conf import settings
from django.db import connection, transaction

from gradient.core.protocol import DiscoveredDerivation
from gradient.core.vocab import BuildStatus
from gradient.scheduling.decisions.derivations import HeldDerivation, conflicts, inputs_digest, outputs_of
from gradient.scheduling.models import (
    CachedPath,
    CachedPathClaim,
    DerivationBuild,
    DerivationBuildDependency,
    EvalIngestInput,
    Evaluation,
    EvaluationBuild,
)
from gradient.scheduling.services.cached_sql import SOME_OUTPUT_UNCACHED

_json = msgspec.json.Encoder()


@dataclass
class StoredPart:
    ids: dict[str, Any]  # every derivation path of the part -> its shared build's id (uuid, or its text)
    created: int = 0
    edges: int = 0
    pending: int = 0
    # The builds whose graph this part changed: created, wanted again (Aborted before), given inputs
    # (edges, or inputs pending), or given the last of their pending inputs. Only these are decided
    # again (graph.decide_builds): a part that brings nothing new decides nothing.
    touched: set[Any] = field(default_factory=set)
    # The builds of the part that existed and were Substituted with an output not cached for the
    # evaluation's project when the part read them (ids as text): the only ones another project's word
    # alone may have made done (graph.reopen_unconfirmed, which asks again as it writes); a build the
    # part created is Created. None: not read (every build of the part is to be looked at).
    unconfirmed: set[str] | None = None


class _Hints:
    """Per ingest (an assignment's result in parts), in this process: every derivation path its committed
    parts stored, to its build's id. Only a way to skip a lookup: an input of a later part found here is
    a derivation of this evaluation (linked by that committed part) and needs no query; one not found
    is looked up in the database as before (a miss costs a lookup, never a wrong edge). Filled when a
    part commits, dropped at the final part; bounded (the oldest ingests go first), so an ingest whose
    worker vanished costs memory only until others push it out. About 250 bytes a path."""

    MAX_PATHS = 1_000_000
    MAX_INGESTS = 8

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_ingest: OrderedDict[uuid.UUID, dict[str, str]] = OrderedDict()
        self._reusing: dict[uuid.UUID, bool] = {}

    def get(self, ingest_id: uuid.UUID) -> Mapping[str, str]:
        with self._lock:
            return self._by_ingest.get(ingest_id) or {}

    def reusing(self, ingest_id: uuid.UUID) -> bool:
        """Whether the last committed part of the ingest found most of its builds existing (a
        re-evaluation): the next part then reads its builds before it inserts the missing ones."""
        with self._lock:
            return self._reusing.get(ingest_id, False)

    def add(self, ingest_id: uuid.UUID, ids: Mapping[str, Any], created: int = 0) -> None:
        with self._lock:
            self._reusing[ingest_id] = created * 2 < len(ids)
            known = self._by_ingest.setdefault(ingest_id, {})
            known.update((p, str(i)) for p, i in ids.items())
            self._by_ingest.move_to_end(ingest_id)
            total = sum(len(k) for k in self._by_ingest.values())
            while total > self.MAX_PATHS or len(self._by_ingest) > self.MAX_INGESTS:
                key, dropped = self._by_ingest.popitem(last=False)
                self._reusing.pop(key, None)
                total -= len(dropped)

    def drop(self, ingest_id: uuid.UUID) -> None:
        with self._lock:
            self._by_ingest.pop(ingest_id, None)
            self._reusing.pop(ingest_id, None)


_hints = _Hints()


def _unique(derivations: Sequence[DiscoveredDerivation]) -> dict[str, DiscoveredDerivation]:
    """By path, in order; a derivation named twice counts once (its first naming)."""
    by_path: dict[str, DiscoveredDerivation] = {}
    for d in derivations:
        by_path.setdefault(d.drv_path, d)
    return by_path


def _cached(by_path: dict[str, DiscoveredDerivation]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in by_path.values():
        for o in d.cached_outputs:
            out.setdefault(o.path, o.nar_size)  # never negative: NonNegInt64, checked by the decoder
    return out


def _inputs(path: str, d: DiscoveredDerivation) -> set[str]:
    return {p for p in d.input_drvs if p != path}


def held_derivations(paths: Iterable[str]) -> dict[str, HeldDerivation]:
    """What the server holds of those of `paths` it has a shared build for (one indexed lookup)."""
    wanted = list(paths)
    if not wanted:
        return {}
    rows: Iterable[tuple[str, str, Any, str]]
    if connection.vendor == "postgresql":
        # The paths as one array parameter, each looked up by the unique index: an IN list of a part's
        # 1 500 paths cost a third more (every part of every result asks this, most find nothing).
        with connection.cursor() as cur:
            cur.execute(
                "SELECT drv_path, system, outputs, inputs_digest FROM derivation_build "
                "WHERE drv_path = ANY(%s::text[])",
                [wanted],
            )
            rows = cur.fetchall()
    else:
        rows = DerivationBuild.objects.filter(drv_path__in=wanted).values_list(
            "drv_path", "system", "outputs", "inputs_digest"
        )
    return {p: HeldDerivation(s, outputs_of(_json_value(o)), d) for p, s, o, d in rows}


def _json_value(value: Any) -> Any:
    """A JSON column as read: decoded by psycopg (jsonb), or by the ORM; text on a backend that returns
    it undecoded."""
    if isinstance(value, str | bytes):
        return msgspec.json.decode(value)
    return value or []


class ConflictingDerivations(Exception):
    """A part names derivation paths the server holds with another derivation (protocol.md, "Tenants"):
    raised by store_part(refuse_conflicts=True) before it returns, once it has read the part's existing
    builds, so the caller's savepoint undoes what it wrote. `found` says what differed, in the report's
    order (decisions.derivations.conflicts)."""

    def __init__(self, found: list[str]) -> None:
        super().__init__(f"{len(found)} derivation(s) held otherwise")
        self.found = found


def store_part(
    *,
    evaluation: Evaluation,
    derivations: Sequence[DiscoveredDerivation],
    ingest_id: uuid.UUID | None,
    hold: bool,
    final: bool,
    now: datetime,
    claimants: Iterable[uuid.UUID] = (),
    refuse_conflicts: bool = False,
) -> StoredPart:
    """Store one part (or a whole result: `final` and no earlier part), read from its decoded structs.
    `ingest_id` names the eval_ingest row the pending inputs belong to (None: a whole result, nothing
    can be pending). With `hold`, the builds this part creates are held by that ingest: never queued
    while it is undecided on an open assignment. The cached outputs it names count as cached for the
    evaluation's project and `claimants` (the projects the reporting worker serves: protocol.md,
    "Tenants"). With `refuse_conflicts`, a derivation the server holds otherwise raises
    ConflictingDerivations after some writes: call it inside a savepoint then. The check reads the
    existing builds the store reads anyway (on PostgreSQL), so a part costs one read of them, not two."""
    by_path = _unique(derivations)
    claims = _Claims(
        paths=_cached(by_path),
        projects=tuple(sorted({evaluation.project_id, *claimants})),
        trusted=settings.GRADIENT_TRUSTED_CACHE,
    )
    if connection.vendor == "postgresql":
        return _store_postgres(
            evaluation.id,
            evaluation.project_id,
            evaluation.priority,
            by_path,
            claims,
            ingest_id,
            hold,
            final,
            now,
            refuse_conflicts,
        )
    if refuse_conflicts and (found := conflicts(by_path.values(), held_derivations(by_path))):
        raise ConflictingDerivations(found)
    return _store_portable(evaluation.id, evaluation.priority, by_path, claims, ingest_id, hold, final, now)


@dataclass(frozen=True)
class _Claims:
    paths: dict[str, int]  # path -> NAR size
    projects: tuple[uuid.UUID, ...]  # for whom they count
    trusted: bool  # for everyone (GRADIENT_TRUSTED_CACHE)


# --- PostgreSQL --------------------------------------------------------------------------------------

_FIELD_DEFAULTS = {f.name: f.default for f in DerivationBuild._meta.concrete_fields}

# The part's rows go into temporary tables by COPY (psycopg's copy, formatted in C), and every write is
# one INSERT ... SELECT from them. Created in the transaction that uses them, so they exist whatever
# connection (or pooler) runs it; emptied at commit, and here (a part before in the same transaction).
#
# JIT off for the transaction: the lookups' estimated costs (large tables, stale statistics) pass
# jit_above_cost, and compiling a plan took 100-150 ms a statement, more than running it.
_TEMP_TABLES = "; ".join(
    [
        "SET LOCAL jit = off",
        *(
            f"CREATE TEMP TABLE IF NOT EXISTS {table} ({columns}) ON COMMIT DELETE ROWS; DELETE FROM {table}"  # noqa: S608 (constants)
            for table, columns in (
                ("gradient_ingest_drv", "p text, s text, f jsonb, o jsonb, d text"),
                ("gradient_ingest_new", "p text, s text, f jsonb, o jsonb, d text"),
                ("gradient_ingest_link", "b uuid, a text"),
                ("gradient_ingest_input", "i text"),
                ("gradient_ingest_edge", "b uuid, d uuid"),
                ("gradient_ingest_pending", "b uuid, i text"),
                ("gradient_ingest_cached", "p text, n bigint"),
            )
        ),
    ]
)
# The builds a part creates, from one of two temporary tables (all its derivations, or the missing ones).
_INSERT_BUILDS_FROM = (
    "INSERT INTO derivation_build (id, drv_path, system, required_features, outputs, inputs_digest, "
    "status, prioritized, attempts, max_attempts, timeout_secs, max_silent_secs, last_error, "
    "ingest_id, created_at, updated_at) "
    "SELECT gen_random_uuid(), t.p, t.s, t.f, t.o, t.d, %s, %s, 0, %s, %s, %s, '', %s, %s, %s FROM {table} t "
    "ORDER BY t.p ON CONFLICT (drv_path) DO NOTHING RETURNING drv_path, id::text"
)
_INSERT_BUILDS = {
    table: _INSERT_BUILDS_FROM.replace("{table}", table)
    for table in ("gradient_ingest_drv", "gradient_ingest_new")
}
# Looking rows up by a unique key, one at a time, the way the planner cannot get wrong: a correlated
# subquery in the select list (or a LATERAL one behind OFFSET 0) runs as an index lookup per row. As a
# join, with no statistics on the temporary tables and stale ones on tables that grow fast (a first
# large ingest), the planner hashes the whole table instead: every build read for every part.


# The builds of a part that existed: their ids, whether each is wanted again or still waits, what
# derivation each is (the conflicts check), and whether it is Substituted with an output not cached for
# the evaluation's project (parameters: Substituted, the project's id): to be reopened for it.
_READ_EXISTING = (
    "SELECT t.p, b.id::text, b.status, "  # noqa: S608 (constants)
    "EXISTS (SELECT 1 FROM eval_ingest_input u WHERE u.build_id = b.id), "
    "b.system, b.outputs, b.inputs_digest, "
    f"CASE WHEN b.status = %s THEN {SOME_OUTPUT_UNCACHED} ELSE false END "
    "FROM (SELECT p FROM gradient_ingest_drv) t CROSS JOIN LATERAL (SELECT id, status, system, outputs, "
    "inputs_digest FROM derivation_build WHERE drv_path = t.p OFFSET 0) b"
)


def _copy(cur: Any, table: str, columns: str, rows: Iterable[tuple[Any, ...]]) -> None:
    with cur.cursor.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(row)


def _store_postgres(
    evaluation_id: uuid.UUID,
    project_id: uuid.UUID,
    priority: bool,
    by_path: dict[str, DiscoveredDerivation],
    claims: _Claims,
    ingest_id: uuid.UUID | None,
    hold: bool,
    final: bool,
    now: datetime,
    refuse_conflicts: bool = False,
) -> StoredPart:
    stored = StoredPart(ids={})
    if not by_path:
        return stored
    paths = sorted(by_path)  # one order for every writer: concurrent ingests never deadlock on them
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(_TEMP_TABLES)
        if claims.paths:
            _copy(cur, "gradient_ingest_cached", "p, n", sorted(claims.paths.items()))
            cur.execute(
                "INSERT INTO cached_path (path, nar_size, confirmed, created_at) SELECT p, n, %s, %s "
                "FROM gradient_ingest_cached ORDER BY p ON CONFLICT (path) DO "
                + (
                    "UPDATE SET confirmed = true WHERE NOT cached_path.confirmed"
                    if claims.trusted
                    else "NOTHING"
                ),
                [claims.trusted, now],
            )
            if not claims.trusted:
                cur.execute(
                    "INSERT INTO cached_path_claim (path, project_id, created_at) "
                    "SELECT c.p, j.id, %s FROM gradient_ingest_cached c CROSS JOIN unnest(%s::uuid[]) j(id) "
                    "ORDER BY 1, 2 ON CONFLICT (path, project_id) DO NOTHING",
                    [now, list(claims.projects)],
                )

        def rows(ps: Iterable[str]) -> Iterable[tuple[Any, ...]]:
            for p in ps:
                d = by_path[p]
                yield (
                    p,
                    d.system,
                    _json.encode(sorted(set(d.required_features))).decode(),
                    _json.encode(d.outputs).decode(),  # OutputPath structs: {"name", "path"}
                    inputs_digest(p, d.input_drvs),
                )

        def insert(table: str) -> None:
            # The builds this part creates: new, no input known yet.
            cur.execute(
                _INSERT_BUILDS[table],
                [
                    BuildStatus.CREATED.value,
                    priority,
                    _FIELD_DEFAULTS["max_attempts"],
                    _FIELD_DEFAULTS["timeout_secs"],
                    _FIELD_DEFAULTS["max_silent_secs"],
                    ingest_id if hold else None,
                    now,
                    now,
                ],
            )
            created = dict(cur.fetchall())
            stored.ids.update(created)
            todo.update(created)
            stored.created += len(created)

        def read_existing() -> None:
            cur.execute(_READ_EXISTING, [BuildStatus.SUBSTITUTED.value, project_id])
            for p, build_id, status, waiting, system, outputs, digest, doubtful in cur.fetchall():
                if p in stored.ids:
                    continue
                stored.ids[p] = build_id
                if refuse_conflicts:
                    held[p] = HeldDerivation(system, outputs_of(_json_value(outputs)), digest)
                if status == BuildStatus.ABORTED:
                    aborted.append(build_id)
                elif doubtful:
                    unconfirmed.add(build_id)
                if waiting:  # some ingest still waits for one of its inputs: look at them again
                    todo.add(p)

        todo: set[str] = set()
        aborted: list[str] = []
        unconfirmed: set[str] = set()
        stored.unconfirmed = unconfirmed
        held: dict[str, HeldDerivation] = {}
        if ingest_id is not None and _hints.reusing(ingest_id):
            # A re-evaluation: most builds exist. Read them first, insert only the missing ones.
            _copy(cur, "gradient_ingest_drv", "p", ((p,) for p in paths))
            read_existing()
            missing = [p for p in paths if p not in stored.ids]
            if missing:
                _copy(cur, "gradient_ingest_new", "p, s, f, o, d", rows(missing))
                insert("gradient_ingest_new")
                if len(stored.ids) < len(paths):  # another ingest created some in between
                    read_existing()
        else:
            _copy(cur, "gradient_ingest_drv", "p, s, f, o, d", rows(paths))
            insert("gradient_ingest_drv")
            if stored.created < len(paths):
                read_existing()
        if held and (found := conflicts((d for p, d in by_path.items() if p in held), held)):
            raise ConflictingDerivations(found)
        if aborted:
            # A build aborted for an earlier evaluation nobody wanted any more is wanted again now.
            cur.execute(
                "UPDATE derivation_build SET status = %s, retry_at = NULL, updated_at = %s "
                "WHERE id = ANY(%s::uuid[]) AND status = %s",
                [BuildStatus.CREATED.value, now, aborted, BuildStatus.ABORTED.value],
            )
        _copy(cur, "gradient_ingest_link", "b, a", ((stored.ids[p], by_path[p].attr) for p in paths))
        cur.execute(
            "INSERT INTO evaluation_build (evaluation_id, build_id, attr, named, blocks_evaluation) "
            "SELECT %s, b, a, a IS NOT NULL, true FROM gradient_ingest_link ORDER BY b "
            "ON CONFLICT (evaluation_id, build_id) DO NOTHING",
            [evaluation_id],
        )
        # Ids as text from here on: hashing and comparing uuid.UUID objects costs more than the rest.
        edges: set[tuple[str, str]] = set()
        outside: list[tuple[str, str]] = []
        earlier = _hints.get(ingest_id) if ingest_id is not None else {}
        for p in todo:
            for i in _inputs(p, by_path[p]):
                target = stored.ids.get(i) or earlier.get(i)
                if target is not None:
                    edges.add((stored.ids[p], target))
                else:
                    outside.append((stored.ids[p], i))
        pending: list[tuple[str, str]] = []
        if outside:
            # An input outside this part is known when it is a derivation of an earlier part (linked).
            # Each looked up once (stdenv and its kind are everybody's input).
            _copy(cur, "gradient_ingest_input", "i", ((i,) for i in {i for _, i in outside}))
            cur.execute(
                "SELECT r.i, CASE WHEN EXISTS (SELECT 1 FROM evaluation_build eb "
                "WHERE eb.evaluation_id = %s AND eb.build_id = r.d) THEN r.d::text END FROM ("
                "SELECT x.i, (SELECT d.id FROM derivation_build d WHERE d.drv_path = x.i) AS d "
                "FROM gradient_ingest_input x OFFSET 0) r",
                [evaluation_id],
            )
            known = {i: target for i, target in cur.fetchall() if target is not None}
            for build_id, i in outside:
                target = known.get(i)
                if target is not None:
                    edges.add((build_id, target))
                elif not final and ingest_id is not None:
                    pending.append((build_id, i))
        if ingest_id is not None:
            # Inputs of earlier parts that this part brought.
            cur.execute(
                "DELETE FROM eval_ingest_input u WHERE u.ingest_id = %s "
                "AND u.input_drv_path IN (SELECT p FROM gradient_ingest_drv) "
                "RETURNING u.build_id::text, u.input_drv_path",
                [ingest_id],
            )
            arrived = cur.fetchall()
            edges.update((build_id, stored.ids[i]) for build_id, i in arrived)
            stored.touched.update(build_id for build_id, _ in arrived)
        stored.touched.update(stored.ids[p] for p in todo)
        stored.touched.update(aborted)
        edges = {(b, d) for b, d in edges if b != d}
        if edges:
            _copy(cur, "gradient_ingest_edge", "b, d", edges)
            cur.execute(
                "INSERT INTO derivation_build_dependency (build_id, dependency_id) "
                "SELECT b, d FROM gradient_ingest_edge ORDER BY b, d "
                "ON CONFLICT (build_id, dependency_id) DO NOTHING"
            )
            stored.edges = cur.rowcount
        if pending:
            _copy(cur, "gradient_ingest_pending", "b, i", pending)
            cur.execute(
                "INSERT INTO eval_ingest_input (ingest_id, build_id, input_drv_path) "
                "SELECT %s, b, i FROM gradient_ingest_pending "
                "ON CONFLICT (ingest_id, build_id, input_drv_path) DO NOTHING",
                [ingest_id],
            )
            stored.pending = cur.rowcount
    if ingest_id is not None:
        if final:
            _hints.drop(ingest_id)
        else:
            ids, key = stored.ids, ingest_id
            created = stored.created
            transaction.on_commit(lambda: _hints.add(key, ids, created))
    return stored


# --- Elsewhere (SQLite): the same steps through the ORM ---------------------------------------------


def _store_portable(
    evaluation_id: uuid.UUID,
    priority: bool,
    by_path: dict[str, DiscoveredDerivation],
    claims: _Claims,
    ingest_id: uuid.UUID | None,
    hold: bool,
    final: bool,
    now: datetime,
) -> StoredPart:
    stored = StoredPart(ids={})
    paths = sorted(by_path)
    if claims.paths:
        CachedPath.objects.bulk_create(
            [CachedPath(path=p, nar_size=n, confirmed=claims.trusted) for p, n in claims.paths.items()],
            ignore_conflicts=True,
        )
        if claims.trusted:
            CachedPath.objects.filter(path__in=list(claims.paths), confirmed=False).update(confirmed=True)
        else:
            CachedPathClaim.objects.bulk_create(
                [CachedPathClaim(path=p, project_id=j) for p in claims.paths for j in claims.projects],
                ignore_conflicts=True,
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
                system=by_path[p].system,
                required_features=sorted(set(by_path[p].required_features)),
                outputs=[{"name": o.name, "path": o.path} for o in by_path[p].outputs],
                inputs_digest=inputs_digest(p, by_path[p].input_drvs),
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
                attr=by_path[p].attr,
                named=by_path[p].attr is not None,
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
            stored.touched.add(build_id)
            if ids[path] != build_id:
                edges.append(DerivationBuildDependency(build_id=build_id, dependency_id=ids[path]))
        arrived.delete()
    stored.touched.update(ids[p] for p in todo)
    stored.touched.update(aborted)
    DerivationBuildDependency.objects.bulk_create(edges, ignore_conflicts=True)
    EvalIngestInput.objects.bulk_create(pending, ignore_conflicts=True)
    stored.edges = len(edges)
    stored.pending = len(pending)
    return stored
