"""The operator's actions on evaluations, shared builds and workers: what the console's buttons and the
REST routes beside ../shared/spec/rest.md call, the same function for both.

Each action appends a control intent naming the operator (`admin:alice`, or a REST user's name) to the
record of every job it touches, then carries it out through the services that own the rows, so the
record says who did what and `check_records` finds every status change with its fact:

- restart a finished evaluation: `resubmit` (v1); a new evaluation of the same commit whose header
  supersedes the old one (generation + 1), and `resubmitted {successor}` on the old record;
- prioritize an active evaluation: `prioritize` (v2); `priority` (Qos +5000), and its pending shared
  builds `prioritized`;
- rebuild a finished or failed build: `rebuild` (v2) on every evaluation needing it;
  `lifecycle.rebuild_build`;
- prioritize a pending build: `prioritize` (v2) on every active evaluation needing it; `prioritized`;
- drain a worker: `drain_worker` (v2) on its running evaluations' records; its open session drains;
- deactivate a worker: `deactivate_worker` (v2) on the same records; `workers.services.worker_deactivate`.

A shared build and a worker have no record of their own: their intents go on the records of the
evaluations they serve. An action that does not apply (a restart of a running evaluation, a rebuild of
a queued build) raises ActionRefused and changes nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from gradient.core.jobkey import build_key, eval_key
from gradient.core.vocab import (
    BUILD_PENDING,
    EVALUATION_ACTIVE,
    EVALUATION_TERMINAL,
    BuildStatus,
    EvaluationKind,
)
from gradient.records.decisions.fold import fold
from gradient.records.errors import DecodeError, InvalidHistory, RecordTombstoned, UnknownRecord
from gradient.records.schemas import (
    AnyControl,
    DeactivateWorker,
    DrainWorker,
    Prioritize,
    Rebuild,
    Resubmit,
    Resubmitted,
    parse_job_key,
)
from gradient.records.selectors import record_job, record_read
from gradient.records.services import Receipt, commit_control, record_append_facts
from gradient.scheduling.models import DerivationBuild, DispatchedJob, Evaluation, EvaluationBuild
from gradient.scheduling.services import lifecycle
from gradient.scheduling.services.evaluations import evaluation_create
from gradient.workers.models import Worker
from gradient.workers.services import worker_deactivate, worker_drain


class ActionRefused(Exception):
    """The action does not apply to the job as it is now; nothing was changed."""


@dataclass(frozen=True)
class ActionResult:
    """What an action did: the job's status right after it, in words, and the records it signed."""

    id: uuid.UUID
    status: str
    message: str
    records: tuple[str, ...] = ()
    successor: uuid.UUID | None = None


def _commit_on(job_keys: Iterable[str], intent: AnyControl, actor: str, now: datetime) -> tuple[str, ...]:
    """The intent on each record that exists and still takes entries; the keys it landed on."""
    signed = []
    for key in dict.fromkeys(job_keys):
        try:
            commit_control(job_key=key, intent=intent, actor=actor, now=now)
        except (UnknownRecord, RecordTombstoned):
            continue
        signed.append(key)
    return tuple(signed)


# --- Evaluations ------------------------------------------------------------------------------------------


def rebuildable_failed_builds(evaluation_id: uuid.UUID) -> list[DerivationBuild]:
    """The evaluation's builds that failed for good on their own (their dependents that failed because of
    them come back with them): a restart without rebuilding them fails again on them at once."""
    return list(
        DerivationBuild.objects.filter(
            evaluation_links__evaluation_id=evaluation_id,
            evaluation_links__blocks_evaluation=True,
            status__in=FAILED_FOR_GOOD,
        ).order_by("drv_path")
    )


FAILED_FOR_GOOD = (BuildStatus.FAILED_PERMANENT, BuildStatus.FAILED_TIMEOUT, BuildStatus.ABORTED)


def evaluation_restart(
    *, evaluation_id: uuid.UUID, actor: str, now: datetime, rebuild_failed: bool = False
) -> ActionResult:
    """A finished evaluation runs again as a new evaluation of the same commit that supersedes it: a
    resubmit intent on the old record, then the successor (the control hook makes it too; whichever
    comes first, there is one successor). With `rebuild_failed`, its failed builds are rebuilt first
    (a `rebuild` intent each, beside the `resubmit`), so the successor builds them again instead of
    failing on them at once; without it, the answer says which failed builds it will fail on."""
    evaluation = Evaluation.objects.filter(id=evaluation_id).first()
    if evaluation is None:
        raise ActionRefused("No evaluation with this id.")
    if evaluation.status not in EVALUATION_TERMINAL:
        raise ActionRefused(f"Only a finished evaluation can be restarted; this one is {evaluation.status}.")
    if evaluation.kind != EvaluationKind.NORMAL:
        raise ActionRefused("A DrvRecovery evaluation is not restarted by hand; rebuild its build instead.")
    try:
        before = record_job(job_key=evaluation.job_key, now=now)
        if before.successor is not None or before.pending_resubmit:
            raise ActionRefused(f"Restarted already, as {before.successor or 'a pending resubmit'}.")
    except (UnknownRecord, RecordTombstoned, DecodeError, InvalidHistory) as exc:
        raise ActionRefused(f"The evaluation's record takes no intent: {exc}") from None
    failed = rebuildable_failed_builds(evaluation.id)
    rebuilt = 0
    if rebuild_failed:
        for build in failed:
            try:
                build_rebuild(build_id=build.id, actor=actor, now=now)
            except ActionRefused:
                continue  # it changed meanwhile (another operator rebuilt it): nothing to do
            rebuilt += 1
    try:
        commit_control(
            job_key=evaluation.job_key, intent=Resubmit(reason=f"restarted by {actor}"), actor=actor, now=now
        )
    except (UnknownRecord, RecordTombstoned, DecodeError, InvalidHistory) as exc:
        raise ActionRefused(f"The evaluation's record takes no intent: {exc}") from None
    successor = evaluation_resubmit(evaluation_id=evaluation.id, actor=actor, now=now)
    if successor is None:
        raise ActionRefused("The evaluation was resubmitted already.")
    message = f"restarted as evaluation {successor.id}"
    if rebuilt:
        message += f"; {_builds(rebuilt)} rebuilt first"
    elif failed:
        message += (
            f"; {_builds(len(failed), 'is', 'are')} still {failed[0].status}: the new evaluation fails on "
            "them again unless they are rebuilt (rebuild them, or restart with “also rebuild its failed "
            "builds”)"
        )
    return ActionResult(
        id=evaluation.id,
        status=evaluation.status,
        message=message,
        records=(evaluation.job_key,),
        successor=successor.id,
    )


def _builds(n: int, one: str = "was", many: str = "were") -> str:
    return f"its failed build {one}" if n == 1 else f"its {n} failed builds {many}"


def evaluation_resubmit(*, evaluation_id: uuid.UUID, actor: str, now: datetime) -> Evaluation | None:
    """Carry out a pending resubmit: the successor evaluation (the same spec, its header superseding this
    one) and `resubmitted` on this record, in one transaction that holds the record. Idempotent: the
    successor already made is returned; None when no resubmit is pending."""
    key = eval_key(evaluation_id)
    with transaction.atomic():
        try:
            _, view = record_read(job_key=key, lock=True)
        except UnknownRecord:
            return None
        job = fold(view.header, view.entries, now)
        if job.successor is not None:
            _, successor_id = parse_job_key(job.successor)
            return Evaluation.objects.filter(id=successor_id).first()
        if not job.pending_resubmit or not job.has_outcome:
            return None
        old = Evaluation.objects.select_related("project").get(id=evaluation_id)
        successor, _ = evaluation_create(
            project=old.project,
            repository=old.repository,
            commit=old.commit,
            wildcards=list(old.wildcards or []),
            wait_for_workers=old.wait_for_workers,
            priority=old.priority,
            created_by=old.created_by,
            supersedes=key,
            now=now,
        )
        record_append_facts(job_key=key, facts=[Resubmitted(successor=successor.job_key)], now=now)
    return successor


def on_control(receipt: Receipt) -> None:
    """The control hook for resubmit (registered in SchedulingConfig.ready): whoever appended it (the
    console's restart, the records page, REST), the successor follows."""
    if receipt.intent != "resubmit":
        return
    _, evaluation_id = parse_job_key(receipt.job_key)
    evaluation_resubmit(evaluation_id=evaluation_id, actor=receipt.actor, now=timezone.now())


def evaluation_prioritize(*, evaluation_id: uuid.UUID, actor: str, now: datetime) -> ActionResult:
    """Move an active evaluation ahead (the Qos rule: +5000 in scoring), and its pending shared builds."""
    evaluation = Evaluation.objects.filter(id=evaluation_id).first()
    if evaluation is None:
        raise ActionRefused("No evaluation with this id.")
    if evaluation.status not in EVALUATION_ACTIVE:
        raise ActionRefused(f"Only an active evaluation can be prioritized; this one is {evaluation.status}.")
    with transaction.atomic():
        signed = _commit_on(
            [evaluation.job_key], Prioritize(target=evaluation.job_key, reason=f"by {actor}"), actor, now
        )
        Evaluation.objects.filter(id=evaluation_id).update(priority=True, updated_at=now)
        builds = DerivationBuild.objects.filter(
            evaluation_links__evaluation_id=evaluation_id, status__in=BUILD_PENDING
        ).update(prioritized=True, updated_at=now)
    return ActionResult(
        id=evaluation.id,
        status=evaluation.status,
        message=f"prioritized, with {builds} pending shared builds",
        records=signed,
    )


# --- Shared builds ----------------------------------------------------------------------------------------


def _evaluation_keys(build_id: uuid.UUID, *, active_only: bool) -> list[str]:
    links = EvaluationBuild.objects.filter(build_id=build_id)
    if active_only:
        links = links.filter(evaluation__status__in=EVALUATION_ACTIVE)
    ids = links.order_by("evaluation__created_at").values_list("evaluation_id", flat=True).distinct()
    return [eval_key(i) for i in ids]


def build_rebuild(*, build_id: uuid.UUID, actor: str, now: datetime) -> ActionResult:
    """Build a finished or failed shared build again (lifecycle.rebuild_build), signed on the record of
    every evaluation that needs it."""
    build = DerivationBuild.objects.filter(id=build_id).first()
    if build is None:
        raise ActionRefused("No build with this id.")
    if build.status not in lifecycle.BUILD_REBUILDABLE:
        raise ActionRefused(f"Only a finished or failed build can be rebuilt; this one is {build.status}.")
    key = build_key(build_id)
    with transaction.atomic():
        if not lifecycle.rebuild_build(build_id=build_id, now=now):
            raise ActionRefused("The build changed meanwhile; nothing was done.")
        signed = _commit_on(
            _evaluation_keys(build_id, active_only=False),
            Rebuild(build=key, reason=f"by {actor}"),
            actor,
            now,
        )
    build.refresh_from_db()
    return ActionResult(id=build.id, status=build.status, message=f"rebuild: {build.status}", records=signed)


def build_prioritize(*, build_id: uuid.UUID, actor: str, now: datetime) -> ActionResult:
    """Move a pending shared build ahead (Qos), signed on the record of every active evaluation needing it."""
    build = DerivationBuild.objects.filter(id=build_id).first()
    if build is None:
        raise ActionRefused("No build with this id.")
    if build.status not in BUILD_PENDING:
        raise ActionRefused(f"Only a pending build can be prioritized; this one is {build.status}.")
    key = build_key(build_id)
    with transaction.atomic():
        signed = _commit_on(
            _evaluation_keys(build_id, active_only=True),
            Prioritize(target=key, reason=f"by {actor}"),
            actor,
            now,
        )
        DerivationBuild.objects.filter(id=build_id).update(prioritized=True, updated_at=now)
    return ActionResult(id=build.id, status=build.status, message="prioritized", records=signed)


# --- Workers ----------------------------------------------------------------------------------------------


def _running_evaluation_keys(worker_id: uuid.UUID) -> list[str]:
    """The records of what the worker runs: its evaluation jobs, and the evaluations its builds serve."""
    rows = DispatchedJob.objects.filter(worker_id=worker_id, finished_at__isnull=True)
    keys = [
        eval_key(e)
        for e in rows.filter(evaluation_id__isnull=False).values_list("evaluation_id", flat=True)
        if e is not None
    ]
    builds = rows.filter(derivation_build_id__isnull=False).values_list("derivation_build_id", flat=True)
    for build_id in builds:
        if build_id is None:
            continue
        keys += _evaluation_keys(build_id, active_only=True)
    return keys


def _worker(worker_id: uuid.UUID) -> Worker:
    worker = Worker.objects.filter(id=worker_id).first()
    if worker is None:
        raise ActionRefused("No worker with this id.")
    return worker


def worker_request_drain(*, worker_id: uuid.UUID, actor: str, now: datetime) -> ActionResult:
    """Drain a connected worker: it gets nothing new and its running jobs finish."""
    worker = _worker(worker_id)
    signed = _commit_on(
        _running_evaluation_keys(worker_id), DrainWorker(worker=worker.name, reason=f"by {actor}"), actor, now
    )
    drained = worker_drain(worker_id=worker_id, now=now)
    message = "draining: it gets nothing new" if drained else "not connected (or draining already)"
    return ActionResult(
        id=worker.id, status="draining" if drained else "idle", message=message, records=signed
    )


def worker_request_deactivate(*, worker_id: uuid.UUID, actor: str, now: datetime) -> ActionResult:
    """Deactivate a worker: refused from now on, its session closed, its jobs back to the pool."""
    worker = _worker(worker_id)
    signed = _commit_on(
        _running_evaluation_keys(worker_id),
        DeactivateWorker(worker=worker.name, reason=f"by {actor}"),
        actor,
        now,
    )
    worker_deactivate(worker_id=worker_id, now=now)
    return ActionResult(id=worker.id, status="inactive", message="deactivated", records=signed)
