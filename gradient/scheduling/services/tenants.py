"""What one project's word may decide of a shared build (protocol.md, "Tenants").

A worker's cached claim makes a pending build Substituted for the evaluations of the projects it serves
(graph.cached_for, which callers pass in). An evaluation of a project that has no such word reopens the
build to have it built (graph.reopen_unconfirmed). So a claim never substitutes a build that an active
evaluation of a project without the claim needs (decisions.derivations.needed_built_elsewhere): the two
would take turns, the build at the back of the queue each time. Runs in the caller's transaction.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from gradient.core.vocab import BUILD_PENDING, EVALUATION_ACTIVE
from gradient.scheduling.decisions.derivations import needed_built_elsewhere
from gradient.scheduling.models import DerivationBuild, EvaluationBuild

# graph.cached_for: those of the paths that count as cached for a project (passed in: graph calls this).
CachedFor = Callable[..., set[str]]


def substitutable(*, build_ids: Iterable[Any], project_id: uuid.UUID, cached_for: CachedFor) -> list[Any]:
    """Those of `build_ids` a cached claim for `project_id` may substitute: every one but the pending
    builds an active evaluation of another project needs built (their outputs not cached for it, as
    `cached_for(paths=..., project_id=...)` says: graph.cached_for)."""
    ids = list(build_ids)
    pending = dict(
        DerivationBuild.objects.filter(id__in=ids, status__in=BUILD_PENDING).values_list("id", "outputs")
    )
    if not pending:
        return ids
    needed_by = list(
        EvaluationBuild.objects.filter(build_id__in=list(pending), evaluation__status__in=EVALUATION_ACTIVE)
        .exclude(evaluation__project_id=project_id)
        .values_list("build_id", "evaluation__project_id")
        .distinct()
    )
    if not needed_by:
        return ids
    outputs = {b: [str(o["path"]) for o in (outs or [])] for b, outs in pending.items()}
    paths_of: dict[Any, set[str]] = defaultdict(set)
    for build, project in needed_by:
        paths_of[project].update(outputs[build])
    cached = {project: cached_for(paths=paths, project_id=project) for project, paths in paths_of.items()}
    held = needed_built_elsewhere(outputs, needed_by, cached)
    return [i for i in ids if i not in held]
