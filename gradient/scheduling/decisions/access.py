"""Which projects' jobs a worker may take: the one rule that the offers, the waiting pass and any
in-memory book of workers all ask.

A worker is registered for projects (worker_project). It may take an evaluation of one of them, and a
shared build that an active evaluation of one of them needs: a build is shared between projects, and a
worker's result speaks only for the projects it serves (spec/protocol.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from typing import TypeVar

P = TypeVar("P")


def may_take(worker_projects: AbstractSet[P] | None, job_projects: Iterable[P]) -> bool:
    """Whether a worker serving `worker_projects` may take a job wanted by `job_projects` (an
    evaluation: its project; a shared build: the projects of the active evaluations that need it).
    None is a worker that serves every project (the clusters' matcher uses it); an empty set serves
    none, and a job wanted by no project is taken by nobody."""
    if worker_projects is None:
        return any(True for _ in job_projects)
    return not worker_projects.isdisjoint(job_projects)
