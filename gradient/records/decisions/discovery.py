"""Discovery: what the scheduler shows about a job now (its open rows, the workers holding them), and
the settled predicate judged on it."""

from __future__ import annotations

from datetime import datetime, timedelta

import msgspec

from gradient.records.decisions.fold import Job
from gradient.records.schemas import CallKind, ObjectRef, RowStatus


class ObservedObject(msgspec.Struct, frozen=True, kw_only=True):
    """One dispatched_job or cluster_attempt row of the job, as the database shows it now."""

    object: ObjectRef
    open: bool
    worker: str | None = None
    worker_connected: bool = False
    started: bool = False


class Discovery(msgspec.Struct, frozen=True, kw_only=True):
    """What the scheduler shows now. `row_status` is the evaluation's or cluster_job's status, None
    when the row is gone (retention). `objects` holds every open row of the job and every row the
    record names."""

    observed_at: datetime
    objects: tuple[ObservedObject, ...] = ()
    row_status: RowStatus | None = None

    def find(self, ref: ObjectRef) -> ObservedObject | None:
        for observed in self.objects:
            if observed.object == ref:
                return observed
        return None


def call_expires_at(job: Job, call: CallKind, deadline: datetime) -> datetime:
    """A held worker lets go of its slot `hold_margin_secs` after the server's prepare deadline."""
    if call is CallKind.HOLD:
        return deadline + timedelta(seconds=job.plan.hold_margin_secs)
    return deadline


def foreign_objects(job: Job, discovery: Discovery) -> tuple[ObjectRef, ...]:
    """Open rows of the job that its record never named."""
    return tuple(o.object for o in discovery.objects if o.open and job.submission_for(o.object) is None)


def unsettled_reasons(job: Job, discovery: Discovery) -> tuple[str, ...]:
    """Why the job cannot be settled yet; empty when the settled predicate holds.

    The predicate: the job has an outcome; every object ever recorded has ended (or an operator
    abandoned it), and so has every object discovery shows; no foreign object is undisposed; the
    discovery was taken after every recorded call deadline whose call has not visibly landed; and no
    resubmit is pending.
    """
    reasons: list[str] = []
    if not job.has_outcome:
        reasons.append("no outcome yet")
    for sub in job.submissions:
        if sub.waived:
            continue
        observed = discovery.find(sub.object)
        if sub.open:
            reasons.append(f"{sub.object} has not ended")
        elif observed is not None and observed.open:
            reasons.append(f"{sub.object} is closed in the record but still open")
    if not job.abandoned:
        reasons.extend(f"foreign object {ref} is open" for ref in foreign_objects(job, discovery))
    for record in job.deadlines:
        target = job.submission_for(record.object)
        observed = discovery.find(record.object)
        landed = target is not None and not target.open and (observed is None or not observed.open)
        expires = call_expires_at(job, record.call, record.deadline)
        if not landed and discovery.observed_at < expires:
            reasons.append(f"{record.call.value} call on {record.object} has not landed or expired")
    if job.pending_resubmit:
        reasons.append("a resubmit is pending")
    return tuple(reasons)
