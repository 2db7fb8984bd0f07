"""Creating and aborting cluster jobs.

A cluster groups existing jobs (evaluations, shared builds); each member names exactly one job, and a
job is in at most one cluster (idx-cluster_member-evaluation, idx-cluster_member-derivation_build). The
cluster and its record are created in one transaction. Abort is a control intent on the cluster's record
(commit_control); the control hook registered in ClustersConfig.ready carries it out: the members'
running jobs get AbortJob, an open attempt closes Aborted, the cluster ends Aborted.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.utils import timezone

from gradient.clusters import history
from gradient.clusters.decisions.settlement import Verdict
from gradient.clusters.models import ClusterAttempt, ClusterJob, ClusterMember, ClusterReservation
from gradient.clusters.services.attempts import close_cluster_attempt, member_rows
from gradient.clusters.services.common import (
    Push,
    abort_cluster_message,
    attempt_seats,
    lock_cluster,
    push,
)
from gradient.clusters.services.settle import abort_member_job, resolve_attempt, set_cluster_status
from gradient.core.vocab import (
    BUILD_LASTING_FAILURE,
    BUILD_SUCCESS,
    CLUSTER_TERMINAL,
    EVALUATION_TERMINAL,
    AttemptOutcome,
    BuildStatus,
    ClusterStatus,
)
from gradient.records.errors import UnknownRecord
from gradient.records.schemas import Cancel, parse_job_key
from gradient.records.services import Receipt, commit_control
from gradient.scheduling.decisions.waiting import evaluation_job_done
from gradient.scheduling.models import DerivationBuild, Evaluation, EvaluationBuild, Project
from gradient.workers.models import Worker

log = logging.getLogger("gradient.clusters")

MAX_MEMBERS = 64


@dataclass(frozen=True)
class MemberSpec:
    """One member as submitted: exactly one of `evaluation_id` or `build_id`."""

    role: str
    evaluation_id: uuid.UUID | None = None
    build_id: uuid.UUID | None = None
    primary: bool = False
    pin: str | None = None


class ClusterInputError(ValueError):
    """Bad input for a cluster; `errors` are field errors (REST answers them with 400)."""

    def __init__(self, errors: dict[str, list[str]]) -> None:
        super().__init__("; ".join(f"{k}: {' '.join(v)}" for k, v in errors.items()))
        self.errors = errors


def _member_problems(members: Sequence[MemberSpec], caller: User | None) -> list[str]:
    """Per member, what is wrong with it ("" when nothing). A caller who is not staff sees only the jobs
    of its projects and the workers that serve them: another project's job, or a worker it may not see,
    is unknown, in the same words as one that does not exist (issue 36, finding 8)."""
    problems = ["" for _ in members]
    eval_ids = [m.evaluation_id for m in members if m.evaluation_id is not None]
    build_ids = [m.build_id for m in members if m.build_id is not None]
    evaluation_rows = Evaluation.objects.filter(id__in=eval_ids)
    build_rows = DerivationBuild.objects.filter(id__in=build_ids)
    workers = Worker.objects.all()
    if caller is not None and not caller.is_staff:
        projects = Project.objects.filter(members=caller).values("id")
        evaluation_rows = evaluation_rows.filter(project_id__in=projects)
        build_rows = build_rows.filter(
            id__in=EvaluationBuild.objects.filter(evaluation__project_id__in=projects).values("build_id")
        )
        workers = workers.filter(projects__in=projects)
    evaluations = dict(evaluation_rows.values_list("id", "status"))
    reasons = dict(evaluation_rows.values_list("id", "waiting_reason"))
    builds = dict(build_rows.values_list("id", "status"))
    taken = set(
        ClusterMember.objects.filter(evaluation_id__in=eval_ids).values_list("evaluation_id", flat=True)
    )
    taken |= set(
        ClusterMember.objects.filter(derivation_build_id__in=build_ids).values_list(
            "derivation_build_id", flat=True
        )
    )
    pins = {m.pin for m in members if m.pin}
    known_pins = set(workers.filter(name__in=pins).values_list("name", flat=True))
    seen = Counter(m.evaluation_id or m.build_id for m in members)
    for i, m in enumerate(members):
        job = m.evaluation_id or m.build_id
        if (m.evaluation_id is None) == (m.build_id is None):
            problems[i] = "A member names exactly one job: evaluation or build."
        elif not m.role or len(m.role) > 100:
            problems[i] = "A member needs a role of 1 to 100 characters."
        elif seen[job] > 1:
            problems[i] = f"Job {job} is named by more than one member."
        elif m.evaluation_id is not None and m.evaluation_id not in evaluations:
            problems[i] = f"Unknown evaluation {m.evaluation_id}."
        elif m.build_id is not None and m.build_id not in builds:
            problems[i] = f"Unknown build {m.build_id}."
        elif job in taken:
            problems[i] = f"Job {job} is already a member of a cluster."
        elif m.evaluation_id is not None and evaluations[m.evaluation_id] in EVALUATION_TERMINAL:
            problems[i] = f"Evaluation {m.evaluation_id} already ended ({evaluations[m.evaluation_id]})."
        elif m.evaluation_id is not None and evaluation_job_done(
            evaluations[m.evaluation_id], reasons[m.evaluation_id]
        ):
            problems[i] = f"Evaluation {m.evaluation_id} was evaluated already; its job cannot start again."
        elif m.build_id is not None and builds[m.build_id] in (
            *BUILD_SUCCESS,
            *BUILD_LASTING_FAILURE,
            BuildStatus.ABORTED,
        ):
            problems[i] = f"Build {m.build_id} already ended ({builds[m.build_id]})."
        elif m.pin and m.pin not in known_pins:
            problems[i] = f"Unknown worker {m.pin!r} to pin to."
    return problems


def _spec(
    members: Sequence[MemberSpec], same_zone: bool, retry_budget: int, priority: bool
) -> dict[str, object]:
    return {
        "members": [
            {
                "role": m.role,
                "evaluation": str(m.evaluation_id) if m.evaluation_id else None,
                "build": str(m.build_id) if m.build_id else None,
                "primary": m.primary,
                "pin": m.pin,
            }
            for m in members
        ],
        "same_zone": same_zone,
        "retry_budget": retry_budget,
        "priority": priority,
    }


def cluster_create(
    *,
    members: Sequence[MemberSpec],
    same_zone: bool = False,
    retry_budget: int = 2,
    priority: bool = False,
    created_by: User | None = None,
    now: datetime,
) -> ClusterJob:
    """A Queued cluster of existing jobs and its record, in one transaction. Members get their index in
    order of appearance within their role. Raises ClusterInputError (nothing written) for bad input: no
    member or too many, a member naming no job or two, an unknown job, a job named twice, a job already
    in a cluster, a job that can never start again, an unknown worker to pin to. What `created_by` may
    not see (not staff: another project's job, a worker that serves none of its projects) is unknown."""
    if not members:
        raise ClusterInputError({"members": ["A cluster needs at least one member."]})
    if len(members) > MAX_MEMBERS:
        raise ClusterInputError({"members": [f"At most {MAX_MEMBERS} members."]})
    if retry_budget < 0:
        raise ClusterInputError({"retry_budget": ["Must be 0 or more."]})
    problems = _member_problems(members, created_by)
    if any(problems):
        raise ClusterInputError({"members": [f"member {i}: {p}" for i, p in enumerate(problems) if p]})
    counters: Counter[str] = Counter()
    try:
        with transaction.atomic():
            cluster = ClusterJob.objects.create(
                status=ClusterStatus.QUEUED,
                same_zone=same_zone,
                priority=priority,
                retry_budget=retry_budget,
                created_by=created_by,
                queued_at=now,
            )
            for m in members:
                ClusterMember.objects.create(
                    cluster_job=cluster,
                    evaluation_id=m.evaluation_id,
                    derivation_build_id=m.build_id,
                    role=m.role,
                    index=counters[m.role],
                    primary=m.primary,
                    pin=m.pin or None,
                )
                counters[m.role] += 1
            history.cluster_record_create(
                cluster_id=cluster.id,
                spec=_spec(members, same_zone, retry_budget, priority),
                retry_budget=retry_budget,
                created_by=created_by,
                now=now,
            )
    except IntegrityError:  # a concurrent create took one of the jobs first
        raise ClusterInputError({"members": ["A job is already a member of a cluster."]}) from None
    return cluster


# --- Abort ----------------------------------------------------------------------------------------------


def cluster_request_abort(*, cluster_id: uuid.UUID, actor: str, now: datetime) -> Receipt | None:
    """Abort as a control intent on the cluster's record; the control hook carries it out once the intent
    committed. A cluster without a record (made outside the services) is aborted directly."""
    try:
        return commit_control(
            job_key=history.cluster_key(cluster_id),
            intent=Cancel(reason=f"aborted by {actor}"),
            actor=actor,
            now=now,
        )
    except UnknownRecord:
        cluster_abort(cluster_id=cluster_id, reason=f"aborted by {actor}", now=now)
        return None


def on_control(receipt: Receipt) -> None:
    """Carry out an operator's intent on a cluster (registered in ClustersConfig.ready)."""
    if receipt.intent not in ("cancel", "abandon", "give_up"):
        return
    _, cluster_id = parse_job_key(receipt.job_key)
    cluster_abort(cluster_id=cluster_id, reason=f"{receipt.intent} by {receipt.actor}", now=timezone.now())


def cluster_abort(*, cluster_id: uuid.UUID, reason: str, now: datetime) -> list[Push] | None:
    """End an active cluster Aborted: a started attempt resolves with the Abort verdict (running members
    get AbortJob, survivors end Aborted); an unstarted one gets AbortCluster and closes Aborted; every
    member job that has not ended ends Aborted. None (nothing changed) when the cluster already ended."""
    with transaction.atomic():
        cluster = lock_cluster(cluster_id)
        if cluster is None or cluster.status in CLUSTER_TERMINAL:
            return None
        attempt = ClusterAttempt.objects.filter(cluster_job_id=cluster_id, finished_at__isnull=True).first()
        pushes: list[Push] = []
        if attempt is not None and attempt.started_at is not None:
            resolved = resolve_attempt(cluster=cluster, attempt=attempt, now=now, abort_requested=True)
            if resolved is not None:
                return resolved
        if attempt is not None:
            message = abort_cluster_message(str(attempt.id), reason)
            pushes += [push(s.worker_id, message) for s in attempt_seats(attempt.id)]
            close_cluster_attempt(
                attempt_id=attempt.id,
                outcome=AttemptOutcome.ABORTED,
                reason=reason,
                now=now,
                verdict=Verdict.ABORT,
            )
        rows = {r.job_id: r for r in member_rows(attempt.id)} if attempt is not None else {}
        for member in ClusterMember.objects.filter(cluster_job_id=cluster_id).order_by("role", "index"):
            abort_member_job(job_key=member.job_key, row=rows.get(member.job_key), reason=reason, now=now)
        set_cluster_status(cluster=cluster, verdict=Verdict.ABORT, reason=reason, now=now)
        ClusterReservation.objects.filter(cluster_job_id=cluster_id).delete()
        return pushes
