"""The row check: does the job's row (evaluation or cluster_job, and its open dispatched_job or
cluster_attempt rows) agree with its folded record? A state change and its fact are written in one
transaction, so any disagreement is a bug or a lost write, and the records pass reports it."""

from __future__ import annotations

from datetime import datetime, timedelta

from gradient.records.decisions.discovery import Discovery, foreign_objects
from gradient.records.decisions.fold import Job
from gradient.records.schemas import ROW_STATUS_OUTCOME, TERMINAL_ROW_STATUSES

# A control intent (cancel, give up) commits the outcome first; the owning app then ends the row.
CONTROL_APPLY_GRACE_SECS = 120.0


def disagreements(
    job: Job, discovery: Discovery, now: datetime, *, grace_secs: float = CONTROL_APPLY_GRACE_SECS
) -> tuple[str, ...]:
    found: list[str] = []
    row = discovery.row_status
    if row is None:
        if not job.has_outcome:
            found.append("the row is gone but the record has no outcome")
        return tuple(found)
    if row in TERMINAL_ROW_STATUSES:
        expected = ROW_STATUS_OUTCOME[row]
        if not job.has_outcome:
            found.append(f"the row is {row.value} but the record has no outcome")
        elif job.outcome is not expected:
            found.append(f"the row is {row.value} but the record's outcome is {job.outcome.value}")
    elif job.has_outcome:
        controlled = job.outcome_revision is not None and any(
            c.revision == job.outcome_revision for c in job.controls
        )
        overdue = job.outcome_at is None or now - job.outcome_at > timedelta(seconds=grace_secs)
        if not controlled or overdue:
            found.append(f"the row is still {row.value} but the record's outcome is {job.outcome.value}")
    if job.status_tracked and job.status is not row:
        found.append(f"the row is {row.value} but the record last recorded {job.status.value}")
    for sub in job.submissions:
        observed = discovery.find(sub.object)
        if sub.open and not sub.waived and (observed is None or not observed.open):
            found.append(f"{sub.object} is open in the record but its row is closed or gone")
        if not sub.open and observed is not None and observed.open:
            found.append(f"{sub.object} is closed in the record but its row is open")
    found.extend(f"{ref} is open but the record never named it" for ref in foreign_objects(job, discovery))
    return tuple(found)
