"""Next: the steps that should happen next for a job, from its Job and what the scheduler shows.

The scheduler and the records pass carry them out; none is carried out here.
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from gradient.core.vocab import AttemptOutcome, DispatchOutcome, RecordKind
from gradient.records.decisions.discovery import (
    Discovery,
    call_expires_at,
    foreign_objects,
    unsettled_reasons,
)
from gradient.records.decisions.fold import Job
from gradient.records.schemas import (
    CallKind,
    Desired,
    ObjectRef,
    ObjectTable,
    Outcome,
)


class _Step(msgspec.Struct, tag_field="step", frozen=True, kw_only=True):
    pass


class Offer(_Step, tag="offer", frozen=True):
    """The job wants a new submission: it belongs in the assignment (or cluster dispatch) passes."""


class AbortObject(_Step, tag="abort_object", frozen=True):
    """Stop this object (AbortJob, AbortCluster) and close its row: the job has ended or is cancelled."""

    object: ObjectRef
    reason: str


class RequeueObject(_Step, tag="requeue_object", frozen=True):
    """End this submission (close the row Abandoned, abort the worker's job) so the job is offered again."""

    object: ObjectRef


class ExpireHold(_Step, tag="expire_hold", frozen=True):
    """A cluster attempt's prepare deadline passed without a start: close it PrepareFailed."""

    object: ObjectRef
    deadline: datetime


class CommitOutcome(_Step, tag="commit_outcome", frozen=True):
    outcome: Outcome
    cause: str


class Resubmit(_Step, tag="resubmit", frozen=True):
    """Create the next generation of the job, superseding this one."""

    supersedes: str
    generation: int


class Settle(_Step, tag="settle", frozen=True):
    pass


class Wait(_Step, tag="wait", frozen=True):
    """Nothing to do before `until`, when a recorded call deadline expires."""

    until: datetime
    reason: str


Step = Offer | AbortObject | RequeueObject | ExpireHold | CommitOutcome | Resubmit | Settle | Wait


def _budget_spent(job: Job) -> str | None:
    """The cause, if the plan's attempt bound is spent and nothing else will end the job."""
    if job.kind is RecordKind.EVALUATION:
        lost = sum(1 for s in job.submissions if s.close_outcome == DispatchOutcome.ABANDONED.value)
        if lost >= job.plan.max_attempts:
            return f"{lost} dispatches lost (the plan allows {job.plan.max_attempts})"
        return None
    started = sum(1 for s in job.submissions if s.started_at is not None)
    current = job.current
    failed_last = current is not None and current.close_outcome in (
        AttemptOutcome.FAILED.value,
        AttemptOutcome.ABORTED.value,
    )
    if failed_last and started >= max(1, job.plan.retry_budget):
        return f"{started} started attempts spent the retry budget of {job.plan.retry_budget}"
    return None


def next_steps(job: Job, discovery: Discovery, now: datetime) -> list[Step]:
    steps: list[Step] = []
    ending = job.has_outcome or job.desired is Desired.CANCEL
    live = [s for s in job.open_submissions if not s.waived]
    for sub in live:
        if ending:
            steps.append(AbortObject(object=sub.object, reason=job.cause or "cancelled"))
        elif job.pending_requeue == sub.object:
            steps.append(RequeueObject(object=sub.object))
        elif sub.object.table is ObjectTable.CLUSTER_ATTEMPT and sub.started_at is None:
            for record in job.deadlines:
                if record.object == sub.object and record.call is CallKind.HOLD and now >= record.deadline:
                    steps.append(ExpireHold(object=sub.object, deadline=record.deadline))
                    break
    if ending and not job.abandoned:
        steps.extend(
            AbortObject(object=ref, reason="foreign object") for ref in foreign_objects(job, discovery)
        )
    if not ending and not job.open_submissions and job.desired is Desired.RUN:
        cause = _budget_spent(job)
        steps.append(CommitOutcome(outcome=Outcome.FAILED, cause=cause) if cause else Offer())
    if job.has_outcome and job.pending_resubmit and not live:
        steps.append(Resubmit(supersedes=job.job_key, generation=job.generation + 1))
    if job.has_outcome and not job.settled and not steps:
        if not unsettled_reasons(job, discovery):
            steps.append(Settle())
        else:
            pending = [
                call_expires_at(job, r.call, r.deadline)
                for r in job.deadlines
                if call_expires_at(job, r.call, r.deadline) > discovery.observed_at
            ]
            if pending:
                steps.append(Wait(until=max(pending), reason="a recorded call has not landed or expired"))
    return steps
