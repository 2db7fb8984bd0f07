"""Worker reports of single jobs: JobUpdate, JobCompleted, JobFailed, BuildProgress, EvalProgress, the
AssignJobResponse to an AssignJob, and BuildLog pieces. They arrive as the protocol's typed messages and
are matched by type.

Reports come in batches (gradient.workers.proto.dispatcher collects those of every session of a process
for a few milliseconds): `worker_reports` applies a whole batch in one transaction, which it owns. The
fence is one statement for the batch (services.fence): each report acts only when its assignment_id is
the job's open assignment on the worker that sent it; anything else is dropped (no state change, no
error, no close). Each report runs in a savepoint of its own, so one that the database refuses fails
alone (a result or failure then fails its assignment as `transient`, so the job's outcome is not lost),
never the batch. What the batch's completions leave behind (dependents to queue, evaluations to finish)
is settled once for the batch (lifecycle.BatchEffects). A single report is a batch of one.

What a report changes, it changes through services.lifecycle. A cluster member's report goes to the
cluster code (its registered member handler), which fences it itself.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeAlias

from django.db import DataError, IntegrityError, InterfaceError, OperationalError, transaction

from gradient.core.ids import parse_uuid
from gradient.core.lines import first_line
from gradient.core.protocol import (
    AssignJobResponse,
    BuildFailureKind,
    Building,
    BuildLog,
    BuildOutput,
    BuildProgress,
    EvalProgress,
    EvalResult,
    FetchResult,
    JobCompleted,
    JobFailed,
    JobUpdate,
    tag_of,
)
from gradient.core.vocab import DispatchOutcome, JobKind
from gradient.records.schemas import ReportKind
from gradient.runtime import savepoints, setsql
from gradient.scheduling.models import DispatchedJob
from gradient.scheduling.services import graph, lifecycle, logs
from gradient.scheduling.services.claims import AssignmentReports, assignment_close, assignments_reported
from gradient.scheduling.services.fence import DROPPED, fenced_assignment, fenced_assignments
from gradient.scheduling.services.lifecycle import BatchEffects, ReportOutcome

__all__ = ["DROPPED", "MEMBER", "fenced_assignment", "worker_report", "worker_reports", "handle_report"]

log = logging.getLogger("gradient.reports")

Report: TypeAlias = JobUpdate | JobCompleted | JobFailed | BuildProgress | EvalProgress
"""A report echoes the assignment_id it is about."""
Answer: TypeAlias = AssignJobResponse
"""The worker's answer to an AssignJob."""
Incoming: TypeAlias = Report | Answer | BuildLog
"""Anything a batch may hold: a report, an answer, a log piece."""

MEMBER = ReportOutcome(False, "a cluster member's report: the cluster code settles it")

# Reports whose refusal by the database fails their assignment (transient): the job's outcome would be
# lost otherwise.
RESULT_REPORTS = (JobUpdate, JobCompleted, JobFailed)

MemberHandler = Callable[..., ReportOutcome]
"""Called as handler(worker_id=, message=, now=) for a report or answer about a cluster member's
assignment (the cluster code's, registered from its AppConfig.ready)."""
_member_handler: MemberHandler | None = None


def register_member_handler(handler: MemberHandler) -> None:
    global _member_handler
    _member_handler = handler


@dataclass(frozen=True)
class Failed:
    """A report whose handling raised (a bug, not the worker's fault): its savepoint rolled back, the
    rest of the batch went on; the caller ends that worker's session."""

    error: BaseException


Result: TypeAlias = ReportOutcome | Failed


def worker_report(*, worker_id: uuid.UUID, message: Incoming, now: datetime) -> ReportOutcome:
    """One report, answer or log piece: a batch of one (its own transaction)."""
    [result] = worker_reports(batch=[(worker_id, message)], now=now)
    if isinstance(result, Failed):
        raise result.error
    return result


class _Contain(Exception):
    """A report failed in a batch applied without savepoints: apply the batch again with them."""


def worker_reports(*, batch: Sequence[tuple[uuid.UUID, Incoming]], now: datetime) -> list[Result]:
    """Apply a batch of (worker id, message), in order, in one transaction: the entry that owns it.
    Returns one result per message, in the batch's order.

    The batch is first applied without a savepoint per report (two round trips each saved); if any
    report fails, that transaction rolls back whole and the batch is applied again with one savepoint
    per report, so the failing one fails alone (its result says how) and the others commit."""
    try:
        # Its statements read and write rows by their keys: planned once per connection.
        with transaction.atomic(durable=True), setsql.generic_plans():
            return _apply_batch(batch, now, members=True, savepoints=False)
    except _Contain:
        log.info("a report in a batch of %d failed; applying the batch report by report", len(batch))
    with transaction.atomic(durable=True), setsql.generic_plans():
        return _apply_batch(batch, now, members=True)


def handle_report(*, worker_id: uuid.UUID, message: Report | Answer, now: datetime) -> ReportOutcome:
    """One report or answer of a single job, fenced by its assignment_id, in one transaction (inside
    the caller's, if it has one). A cluster member's is refused as MEMBER."""
    with transaction.atomic():
        [result] = _apply_batch([(worker_id, message)], now, members=False)
    if isinstance(result, Failed):
        raise result.error
    return result


def _apply_batch(
    batch: Sequence[tuple[uuid.UUID, Incoming]], now: datetime, *, members: bool, savepoints: bool = True
) -> list[Result]:
    fenced, member_ids = fenced_assignments([(w, m.job_id, m.assignment_id) for w, m in batch])
    effects = BatchEffects()
    closed: set[uuid.UUID] = set()  # assignments a report of this batch closed: later ones are stale
    noted: list[uuid.UUID] = []
    results: list[Result | None] = [None] * len(batch)
    # Without savepoints, a shared build's usual reports go by kind into set statements (_Common); with
    # them (a batch applied again because a report failed) every report goes alone.
    common = _Common(now, effects, results) if not savepoints else None
    for index, (worker_id, message) in enumerate(batch):
        assignment_id = parse_uuid(message.assignment_id)
        if assignment_id is not None and assignment_id in member_ids:
            if not members:
                results[index] = MEMBER
                continue
            member = functools.partial(_member, worker_id, message, now)
            results[index] = _contained(member, worker_id, message, None, savepoint=savepoints)
            continue
        row = fenced.get(assignment_id) if assignment_id is not None else None
        if row is None or row.id in closed or (row.worker_id, row.job_id) != (worker_id, message.job_id):
            results[index] = DROPPED
            continue
        stage = common.stage_of(row, message) if common is not None else None
        if (
            common is not None
            and row.id in common.stages
            and (stage is None or stage <= common.stages[row.id])
        ):
            common.apply()  # what came before this report of the same job first, in order
        if common is not None and stage is not None:
            common.add(index, row, message, stage)
        else:
            mark = len(effects.completed)
            apply = functools.partial(_apply_and_record, row, message, now, effects)
            results[index] = _contained(
                apply, worker_id, message, row, effects=effects, mark=mark, now=now, savepoint=savepoints
            )
        if not isinstance(message, BuildLog):
            noted.append(row.id)
        if isinstance(message, JobCompleted | JobFailed) or (
            isinstance(message, AssignJobResponse) and not message.accepted
        ):
            closed.add(row.id)
    if common is not None:
        common.apply()
    stamped = common.stamped if common is not None else set()
    lifecycle.note_reports([n for n in noted if n not in stamped], now=now)
    effects.settle(now)
    return [r if r is not None else DROPPED for r in results]


class _Common:
    """A shared build's usual reports (accepted, building, build_output, completed), collected from a
    batch and applied by kind: a statement or two per kind, however many jobs reported. They make the
    same transitions as `_apply` does one by one (lifecycle's batch forms of the same functions), and
    shared builds keep no record of their own yet, so there is no fact to append.

    The kinds are applied in the order a job goes through them (its stages), so one job's reports in
    that order are collected together; any other report of a job with reports collected (a repeat, a
    log piece, a failure) first applies what was collected, so a job's reports still apply in order."""

    ACCEPTED, BUILDING, OUTPUT, COMPLETED = range(4)

    def __init__(self, now: datetime, effects: BatchEffects, results: list[Result | None]) -> None:
        self.now, self.effects, self.results = now, effects, results
        self.stamped: set[uuid.UUID] = set()  # rows whose last_report_at apply() wrote
        self._clear()

    def _clear(self) -> None:
        self.stages: dict[uuid.UUID, int] = {}  # the last stage collected of each job
        self.accepted: list[tuple[int, DispatchedJob]] = []
        self.building: list[tuple[int, DispatchedJob]] = []
        self.outputs: list[tuple[int, DispatchedJob, BuildOutput]] = []
        self.completed: list[tuple[int, DispatchedJob]] = []

    @classmethod
    def stage_of(cls, row: DispatchedJob, message: Incoming) -> int | None:
        """The stage of this report, or None when it is not one of these (it goes alone)."""
        if row.kind != JobKind.BUILD or row.derivation_build_id is None:
            return None
        match message:
            case AssignJobResponse(accepted=True):
                return cls.ACCEPTED
            case JobCompleted():
                return cls.COMPLETED
            case JobUpdate(update=Building() | BuildOutput() as update) if update.build_id == str(
                row.derivation_build_id
            ):
                return cls.OUTPUT if isinstance(update, BuildOutput) else cls.BUILDING
        return None

    def out_of_order(self, row: DispatchedJob, stage: int | None) -> bool:
        """Whether this report of a job with reports collected must wait until they are applied."""
        last = self.stages.get(row.id)
        return last is not None and (stage is None or stage <= last)

    def add(self, index: int, row: DispatchedJob, message: Incoming, stage: int) -> None:
        self.stages[row.id] = stage
        match message:
            case AssignJobResponse():
                self.accepted.append((index, row))
            case JobUpdate(update=BuildOutput() as update):
                self.outputs.append((index, row, update))
            case JobUpdate():
                self.building.append((index, row))
            case JobCompleted():
                self.completed.append((index, row))

    def apply(self) -> None:
        now = self.now
        # Each job's row written once for all its reports collected (accepted, phase, reported, closed).
        folded: dict[uuid.UUID, dict[str, Any]] = {}

        def fold(row: DispatchedJob, **what: Any) -> None:
            folded.setdefault(row.id, {"row": row}).update(what)

        for _, row in self.accepted:
            fold(row, accepted=True)
        for _, row in self.building:
            fold(row, phase=tag_of(Building))
        for _, row, _ in self.outputs:
            fold(row, phase=tag_of(BuildOutput))
        for _, row in self.completed:
            fold(row, completed=True)
        assignments_reported(reports=[AssignmentReports(**f) for f in folded.values()], now=now)
        self.stamped.update(folded)
        outputs = [(o.path, o.nar_size) for _, _, update in self.outputs for o in update.outputs]
        graph.cache_paths(paths=outputs)
        lifecycle.complete_builds(
            [(row, update.substituted) for _, row, update in self.outputs], now=now, effects=self.effects
        )
        # A job whose outputs this same apply reported is complete already (its build and attempt ended
        # with the outputs): its JobCompleted closes the assignment only (assignments_reported, above).
        output_rows = {row.id for _, row, _ in self.outputs}
        rows = [row for _, row in self.completed if row.id not in output_rows]
        lifecycle.complete_builds([(row, False) for row in rows], now=now, effects=self.effects)
        for index, _ in self.accepted:
            self.results[index] = ReportOutcome(True, "accepted")
        for index, _ in self.building:
            self.results[index] = ReportOutcome(True, "building")
        for index, _, _ in self.outputs:
            self.results[index] = ReportOutcome(True, "build_output")
        for index, _ in self.completed:
            self.results[index] = ReportOutcome(True, "build completed")
        self._clear()


def _apply_and_record(
    row: DispatchedJob, message: Incoming, now: datetime, effects: BatchEffects
) -> ReportOutcome:
    outcome = _apply(row, message, now, effects)
    if not isinstance(message, BuildLog):
        record_evidence(row, message, outcome, now)
    return outcome


def _member(worker_id: uuid.UUID, message: Incoming, now: datetime) -> ReportOutcome:
    if isinstance(message, BuildLog):
        return logs.build_log_append(worker_id=worker_id, message=message, now=now)
    if _member_handler is None:
        return MEMBER
    return _member_handler(worker_id=worker_id, message=message, now=now)


def _contained(
    apply: Callable[[], ReportOutcome],
    worker_id: uuid.UUID,
    message: Incoming,
    row: DispatchedJob | None,
    *,
    effects: BatchEffects | None = None,
    mark: int = 0,
    now: datetime | None = None,
    savepoint: bool = True,
) -> Result:
    """One report in a savepoint of its own. The database refusing it (a value too long for its column,
    say) rolls back that report alone; a result or failure then fails its assignment as `transient`
    with the reason, so the job is tried again. Any other error rolls back the report and is handed
    back (Failed); a lost connection ends the whole batch (the caller tries it again). Without
    `savepoint`, any failure but the connection's raises _Contain: the caller starts over with them."""
    if not savepoint:
        try:
            return apply()
        except (OperationalError, InterfaceError):
            raise
        except Exception as exc:
            raise _Contain from exc
    try:
        with savepoints.part():
            outcome = apply()
    except (OperationalError, InterfaceError):
        raise  # the connection: the whole batch rolled back, and its caller tries it again
    except (DataError, IntegrityError) as exc:
        if effects is not None:
            del effects.completed[mark:]
        detail = first_line(exc)
        log.error(
            "the database refused %s from worker %s (%s); the session goes on",
            tag_of(type(message)),
            worker_id,
            detail,
            exc_info=True,
        )
        if row is None or now is None or effects is None or not isinstance(message, RESULT_REPORTS):
            return ReportOutcome(False, f"refused by the database: {detail}")
        return _fail_transient(row, message, detail, effects, now)
    except Exception as exc:
        if effects is not None:
            del effects.completed[mark:]
        return Failed(exc)
    return outcome


def _fail_transient(
    row: DispatchedJob, message: Incoming, detail: str, effects: BatchEffects, now: datetime
) -> Result:
    failed = JobFailed(
        job_id=message.job_id,
        assignment_id=message.assignment_id,
        error=f"the server could not store the worker's {tag_of(type(message))}: {detail}"[:2000],
        kind=BuildFailureKind.TRANSIENT,
        elapsed_ms=getattr(message, "elapsed_ms", 0),
    )
    try:
        with savepoints.part():
            outcome = _apply_and_record(row, failed, now, effects)
    except (DataError, IntegrityError):
        log.error("failing assignment %s of worker %s failed too", row.id, row.worker_id)
        return ReportOutcome(False, "refused by the database")
    return outcome


def _apply(row: DispatchedJob, message: Incoming, now: datetime, effects: BatchEffects) -> ReportOutcome:
    match message:
        case BuildLog():
            return logs.build_log_append_fenced(row=row, message=message, now=now)
        case AssignJobResponse(accepted=True):
            lifecycle.note_accepted(row, now=now)
            return ReportOutcome(True, "accepted")
        case AssignJobResponse(reason=reason):
            why = f"declined: {reason or 'declined'}"
            lifecycle.assignment_return_to_pool(row=row, reason=why, lost=False, now=now)
            return ReportOutcome(True, "declined; requeued")
        case JobUpdate(update=update):
            return lifecycle.apply_job_update(row, update, now, effects)
        case JobCompleted():
            assignment_close(row=row, outcome=DispatchOutcome.COMPLETED, reason="completed", now=now)
            if row.kind == JobKind.BUILD:
                lifecycle.complete_build(row, now=now, effects=effects)
                return ReportOutcome(True, "build completed")
            return lifecycle.complete_evaluation(row, now)
        case JobFailed(kind=kind, error=error, missing_paths=missing_paths):
            reason = f"{kind.value}: {error}"
            assignment_close(row=row, outcome=DispatchOutcome.FAILED, reason=reason, now=now)
            if row.kind == JobKind.BUILD:
                return lifecycle.fail_build(
                    row, kind=kind.value, error=error, now=now, missing_paths=missing_paths
                )
            return lifecycle.fail_evaluation_job(row, kind=kind.value, error=error, now=now)
        case BuildProgress() | EvalProgress():
            return ReportOutcome(True, "progress")


def record_evidence(
    row: DispatchedJob, message: Report | Answer, outcome: ReportOutcome, now: datetime
) -> None:
    """What the worker showed goes onto the evaluation's record: answers, results and endings (not every
    progress tick)."""
    report: ReportKind | None = None
    match message:
        case AssignJobResponse(accepted=accepted):
            report = ReportKind.ACCEPTED if accepted else ReportKind.DECLINED
        case JobCompleted():
            report = ReportKind.COMPLETED
        case JobFailed():
            report = ReportKind.FAILED
        case JobUpdate(update=FetchResult() | EvalResult()):
            report = ReportKind.UPDATE
    if report is not None:
        lifecycle.record_report(row, worker=str(row.worker_id), kind=report, summary=outcome.detail, now=now)
