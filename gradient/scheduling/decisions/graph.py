"""The shared-build graph: which builds may be queued, which fail with a dependency, and whether an
evaluation is done. Pure functions over build statuses."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from enum import StrEnum

SUCCESS = frozenset({"Completed", "Substituted"})
LASTING_FAILURE = frozenset({"FailedPermanent", "DependencyFailed", "FailedTimeout"})
PENDING = frozenset({"Created", "Queued"})
ABORTABLE = frozenset({"Created", "Queued", "Building"})


def ready_to_queue(statuses: Mapping[str, str], dependencies: Mapping[str, Iterable[str]]) -> set[str]:
    """Created builds whose every dependency succeeded."""
    return {
        build
        for build, status in statuses.items()
        if status == "Created" and all(statuses.get(dep) in SUCCESS for dep in dependencies.get(build, ()))
    }


def dependency_failures(
    statuses: Mapping[str, str], dependents: Mapping[str, Iterable[str]], failed: Iterable[str]
) -> set[str]:
    """Every pending build that transitively needs one of `failed`: they become DependencyFailed."""
    out: set[str] = set()
    stack = list(failed)
    while stack:
        for dependent in dependents.get(stack.pop(), ()):
            if dependent not in out and statuses.get(dependent) in PENDING:
                out.add(dependent)
                stack.append(dependent)
    return out


class EvaluationVerdict(StrEnum):
    COMPLETED = "Completed"
    FAILED = "Failed"
    BUILDING = "Building"


def evaluation_verdict(needed_statuses: Iterable[str]) -> EvaluationVerdict:
    """Completed when everything it needs succeeded, Failed on a lasting failure, Building otherwise."""
    statuses = list(needed_statuses)
    if any(s in LASTING_FAILURE for s in statuses):
        return EvaluationVerdict.FAILED
    if all(s in SUCCESS for s in statuses):
        return EvaluationVerdict.COMPLETED
    return EvaluationVerdict.BUILDING


def topological_order(nodes: Set[str], dependencies: Mapping[str, Iterable[str]]) -> list[str]:
    """Dependencies first; ties by name, so the order is stable. Cycles (impossible in Nix) end the walk
    with the remaining nodes in name order."""
    remaining = {n: {d for d in dependencies.get(n, ()) if d in nodes} for n in nodes}
    order: list[str] = []
    while remaining:
        ready = sorted(n for n, deps in remaining.items() if not deps)
        if not ready:
            order.extend(sorted(remaining))
            break
        for n in ready:
            order.append(n)
            del remaining[n]
        for deps in remaining.values():
            deps.difference_update(ready)
    return order
