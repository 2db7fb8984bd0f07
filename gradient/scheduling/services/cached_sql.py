"""SQL conditions on a build's outputs being cached for a project (protocol.md, "Tenants"), shared by the
graph's decisions (graph), the parts' ingest (ingest) and known derivations (known): text only, no
queries, so that each of them imports it without importing the others."""

from __future__ import annotations


def cached_for_sql(project: str) -> str:
    """An output `o` (an element of jsonb_array_elements, named `o`) cached for the project `project`
    (SQL: a parameter or a column): cached_for's condition. `o.value`, not `o`: a bare `o` would be a
    column `o` of any table around the statement before it is the element (a temporary table of the
    ingest has one)."""
    return (
        "(EXISTS (SELECT 1 FROM cached_path c WHERE c.path = o.value->>'path' AND c.confirmed OFFSET 0) "  # noqa: S608 (constants)
        "OR EXISTS (SELECT 1 FROM cached_path_claim k WHERE k.path = o.value->>'path' "
        f"AND k.project_id = {project} OFFSET 0))"
    )


# An output `o` cached for the project (one parameter, its id).
CACHED_FOR = cached_for_sql("%s")
ALL_CACHED = (
    "jsonb_array_length(b.outputs) > 0 AND NOT EXISTS (SELECT 1 FROM jsonb_array_elements(b.outputs) o "  # noqa: S608 (constants)
    f"WHERE NOT {CACHED_FOR} OFFSET 0)"
)
# A build `b` an active evaluation of another project than the deciding one needs built: an output of
# it not cached for that project (two parameters: the active statuses, the deciding project's id).
# services.tenants.substitutable's rule (decisions.derivations.needed_built_elsewhere), in SQL: each of
# the build's links by the link index, its evaluation by its primary key (statistics-proof as above).
NEEDED_BUILT_ELSEWHERE = (
    "EXISTS (SELECT 1 FROM evaluation_build l CROSS JOIN LATERAL (SELECT ev.project_id FROM evaluation ev "  # noqa: S608 (constants)
    "WHERE ev.id = l.evaluation_id AND ev.status = ANY(%s) AND ev.project_id <> %s OFFSET 0) ev "
    "WHERE l.build_id = b.id AND EXISTS (SELECT 1 FROM jsonb_array_elements(b.outputs) o "
    f"WHERE NOT {cached_for_sql('ev.project_id')} OFFSET 0) OFFSET 0)"
)
# A build `b` with an output not cached for the project (one parameter, its id): what reopen_unconfirmed
# reopens of the Substituted builds (services.known too, as it links a known closure).
SOME_OUTPUT_UNCACHED = (
    "EXISTS (SELECT 1 FROM jsonb_array_elements(b.outputs) o "  # noqa: S608 (constants)
    f"WHERE NOT {CACHED_FOR} OFFSET 0)"
)
