"""An eval_result in parts (protocol.md, "Large evaluations"): the report side.

A result too large for one frame arrives as several `eval_result` updates on the same assignment,
every one but the last with `is_final: false` (absent means true: one frame is a whole result). Each
part is one report, so one short transaction: its derivations are stored as it arrives
(services.ingest), the known derivations it names linked with their closures (services.known), and
what it brought decided at once (graph.decide_builds), so builds start while the rest is arriving. The
`eval_ingest` row of the assignment keeps which parts came:

- a build whose inputs are not all known yet is never queued;
- a part after the final one is a stale report: dropped, nothing changes;
- a JobCompleted before the final part fails the evaluation with a clear error (the result is
  incomplete), and its builds that have not started and that nothing else needs end Aborted.

Call these from the report's transaction, with the assignment row locked by the fence (so the parts of
one assignment never race each other) and the evaluation row locked.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F

from gradient.core.protocol import EvalResult
from gradient.core.vocab import BUILD_PENDING, EvaluationKind, EvaluationStatus
from gradient.runtime import metrics
from gradient.scheduling import history
from gradient.scheduling.decisions.messages import MessageCap, with_messages
from gradient.scheduling.models import DispatchedJob, EvalIngest, EvalIngestInput, Evaluation, EvaluationBuild
from gradient.scheduling.services import drv_recovery, graph, known
from gradient.scheduling.services.evaluations import abort_orphaned_builds
from gradient.scheduling.services.ingest import ConflictingDerivations, store_part
from gradient.workers.models import Worker

log = logging.getLogger("gradient.reports")

# A message is cut beyond this (or beyond GRADIENT_EVAL_MESSAGES_MAX_BYTES, if lower).
MAX_MESSAGE_BYTES = 64 * 1024
CONFLICTS_NAMED = 10  # conflicting paths named in the evaluation's error; the rest are counted


def message_cap() -> MessageCap:
    """Warnings and errors kept per evaluation, of all parts together (decisions.messages)."""
    max_bytes = settings.GRADIENT_EVAL_MESSAGES_MAX_BYTES
    return MessageCap(
        max_count=settings.GRADIENT_EVAL_MESSAGES_MAX_COUNT,
        max_bytes=max_bytes,
        max_message_bytes=min(MAX_MESSAGE_BYTES, max_bytes),
    )


Outcome = tuple[bool, str]  # a ReportOutcome's (accepted, detail): reports.py calls into this module


def _outcome(accepted: bool, detail: str) -> Outcome:
    return accepted, detail


def eval_result_part(
    *, row: DispatchedJob, evaluation: Evaluation, update: EvalResult, now: datetime
) -> Outcome:
    """One eval_result update (a whole result, or one part of it) on the open assignment `row`, read as
    decoded (its typed structs: no conversion to dicts on this path)."""
    final = update.is_final is not False
    ingest = EvalIngest.objects.filter(assignment_id=row.id).first()
    if ingest is not None and ingest.decided_at is not None:
        return _outcome(False, "dropped: a part after the final one")
    if evaluation.kind != EvaluationKind.DRV_RECOVERY:
        reported = update.derivations
        so_far = ingest.derivations if ingest is not None else 0
        most = settings.GRADIENT_EVAL_MAX_DERIVATIONS
        if most > 0 and so_far + len(reported) > most:
            error = (
                f"the eval_result names more than {most} derivations (GRADIENT_EVAL_MAX_DERIVATIONS): "
                f"{so_far} received before this part, {len(reported)} in it; refused"
            )
            return _refuse(row=row, ingest=ingest, evaluation=evaluation, error=error, now=now)
    # A derivation the server holds otherwise is found as the part is stored (store_part reads the
    # existing builds anyway): the part is taken inside a savepoint, and a conflict undoes all of it.
    messages = (evaluation.warnings, evaluation.errors)
    try:
        with transaction.atomic():
            return _take_part(
                row=row, ingest=ingest, evaluation=evaluation, update=update, final=final, now=now
            )
    except ConflictingDerivations as conflict:
        evaluation.warnings, evaluation.errors = messages
        return _refuse_conflicting(
            row=row, ingest=ingest, evaluation=evaluation, found=conflict.found, now=now
        )


def _take_part(
    *,
    row: DispatchedJob,
    ingest: EvalIngest | None,
    evaluation: Evaluation,
    update: EvalResult,
    final: bool,
    now: datetime,
) -> Outcome:
    """The part stored, its known derivations linked, what it brought decided. Raises
    ConflictingDerivations (store_part) after writes: call inside a savepoint."""
    cap = message_cap()
    evaluation.warnings = with_messages(evaluation.warnings, update.warnings, what="warnings", cap=cap)
    evaluation.errors = with_messages(evaluation.errors, update.errors, what="errors", cap=cap)
    evaluation.save(update_fields=["warnings", "errors", "updated_at"])
    derivations = update.derivations
    if ingest is None:
        ingest = EvalIngest.objects.create(
            assignment_id=row.id,
            evaluation_id=evaluation.id,
            started_at=now,
            decided_at=now if final else None,
        )
    elif final:
        EvalIngest.objects.filter(pk=ingest.pk).update(decided_at=now)
    EvalIngest.objects.filter(pk=ingest.pk).update(
        parts=F("parts") + 1, derivations=F("derivations") + len(derivations)
    )
    part = ingest.parts + 1
    if evaluation.kind == EvaluationKind.DRV_RECOVERY:
        cleared = drv_recovery.drv_recovery_ingest(evaluation=evaluation, derivations=derivations, now=now)
        return _outcome(True, f"eval_result (DrvRecovery): {cleared} lost .drv recovered")
    touched: set[Any] = set()
    known_drvs = update.known_drvs or []
    if known_drvs:
        # First, so that a derivation of this part naming a known one finds it linked.
        linked, unknown = known.link_known(
            evaluation_id=evaluation.id, project_id=evaluation.project_id, drv_paths=known_drvs, now=now
        )
        if unknown:
            shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
            error = (
                f"known_drvs names derivations the server does not know (retired meanwhile?): {shown}; "
                "evaluate again without asking"
            )
            fail_result(evaluation=evaluation, error=error, now=now)
            return _outcome(True, f"eval_result part {part}: unknown known_drvs, failed")
        touched.update(linked)
        touched.update(known.resolve_pending_inputs(ingest_id=ingest.pk, evaluation_id=evaluation.id))
    stored = store_part(
        evaluation=evaluation,
        derivations=derivations,
        ingest_id=ingest.pk,
        hold=False,
        final=final,
        now=now,
        claimants=_served_projects(row),
        refuse_conflicts=evaluation.kind != EvaluationKind.DRV_RECOVERY,
    )
    touched.update(stored.touched)
    # A build of this part that another project's worker alone called cached is built for this one.
    # Only those it read Substituted and not cached for the project can be (it created the others,
    # Created; a known closure's were reopened as they were linked; an earlier part's, with their part).
    doubtful = stored.unconfirmed if stored.unconfirmed is not None else {*stored.ids.values(), *touched}
    reopened = graph.reopen_unconfirmed(build_ids=doubtful, project_id=evaluation.project_id, now=now)
    if reopened:
        log.info(
            "evaluation %s needs %d build(s) only another project's worker said were cached: built for it",
            evaluation.id,
            len(reopened),
        )
    touched.update(reopened)
    if final:
        touched.update(_forget_pending_inputs(ingest, evaluation))
    # What this part brought is decided now: builds start while the rest is still arriving.
    decided = graph.decide_builds(build_ids=touched, project_id=evaluation.project_id, now=now)
    what = f"eval_result part {part}" if not final else f"eval_result, final part {part}"
    return _outcome(
        True,
        f"{what}: {len(stored.ids)} derivations, {stored.created} new, {len(known_drvs)} known, "
        f"{stored.pending} inputs pending; {decided.queued} queued, {decided.substituted} substituted, "
        f"{decided.dependency_failed} failed",
    )


def _served_projects(row: DispatchedJob) -> list[Any]:
    """The projects the reporting worker serves: its cached_outputs count for them (protocol.md,
    "Tenants")."""
    through = Worker.projects.through
    return list(through.objects.filter(worker_id=row.worker_id).values_list("project_id", flat=True))


def _fail(evaluation: Evaluation, error: str, now: datetime) -> None:
    history.evaluation_transition(
        evaluation_id=evaluation.id,
        to=EvaluationStatus.FAILED,
        expect=None,
        reason=error,
        now=now,
        errors=[*evaluation.errors, error],  # the server's own line, past the cap: one, always kept
    )


def _refuse(
    *, row: DispatchedJob, ingest: EvalIngest | None, evaluation: Evaluation, error: str, now: datetime
) -> Outcome:
    """A part that cannot be taken: nothing of it is stored, and the evaluation fails with `error`. The
    ingest is decided, so a later part of the same result is dropped as stale; what earlier parts stored
    ends as a cancel ends it (builds that no other evaluation needs are aborted), so nothing of the
    refused result is queued."""
    if ingest is None:
        EvalIngest.objects.create(
            assignment_id=row.id, evaluation_id=evaluation.id, started_at=now, decided_at=now
        )
    else:
        EvalIngest.objects.filter(pk=ingest.pk).update(decided_at=now)
    _fail(evaluation, error, now)
    abort_orphaned_builds(evaluation_id=evaluation.id, reason=error, now=now)
    return _outcome(True, "eval_result refused; evaluation failed")


def _refuse_conflicting(
    *, row: DispatchedJob, ingest: EvalIngest | None, evaluation: Evaluation, found: list[str], now: datetime
) -> Outcome:
    """A part names derivation paths the server holds with another derivation (protocol.md, "Tenants"):
    refused (see `_refuse`), the held builds unchanged, the evaluation's error naming what differed."""
    more = len(found) - CONFLICTS_NAMED
    error = "the eval_result names derivations the server holds otherwise, refused: " + "; ".join(
        found[:CONFLICTS_NAMED]
    )
    if more > 0:
        error += f"; and {more} more"
    _refuse(row=row, ingest=ingest, evaluation=evaluation, error=error, now=now)
    metrics.count(metrics.DERIVATION_CONFLICTS, amount=len(found))
    log.warning(
        "worker %s reported %d derivation(s) unlike the held ones for evaluation %s: %s",
        row.worker_id,
        len(found),
        evaluation.id,
        found[0],
    )
    return _outcome(True, f"eval_result refused: {len(found)} conflicting derivation(s); evaluation failed")


def _forget_pending_inputs(ingest: EvalIngest, evaluation: Evaluation) -> set[Any]:
    """The final part is in: an input still pending is not a derivation of the result (ignored, as in a
    whole result). Pending inputs of ingests that will never finish (their assignment closed), for builds
    of this result, go too: this ingest saw those builds' inputs whole. Returns the builds that had
    them (to be decided now)."""
    own = EvalIngestInput.objects.filter(ingest_id=ingest.pk)
    builds = set(own.values_list("build_id", flat=True))
    own.delete()
    stale = EvalIngestInput.objects.filter(
        build_id__in=EvaluationBuild.objects.filter(evaluation_id=evaluation.id).values("build_id")
    ).exclude(ingest__decided_at__isnull=True, ingest__assignment__finished_at__isnull=True)
    if stale.exists():
        builds.update(stale.values_list("build_id", flat=True))
        stale.delete()
    return builds


def incomplete_result(*, row: DispatchedJob, evaluation: Evaluation, now: datetime) -> Outcome | None:
    """JobCompleted of an evaluation job whose eval_result is still arriving (parts came, the final one
    did not): the evaluation fails with a clear error, and nothing of its result is built for it (a failed
    evaluation needs no build; builds with inputs still pending are never queued). None when the result
    is whole, or when no eval_result came at all."""
    ingest = EvalIngest.objects.filter(assignment_id=row.id).first()
    if ingest is None or ingest.decided_at is not None:
        return None
    error = (
        f"the evaluation job completed before the final part of its eval_result ({ingest.parts} parts, "
        f"{ingest.derivations} derivations received): the result is incomplete"
    )
    fail_result(evaluation=evaluation, error=error, now=now)
    return _outcome(True, "completed before the final eval_result part: failed")


def fail_result(*, evaluation: Evaluation, error: str, now: datetime) -> None:
    """The evaluation's result cannot be used: it fails with `error`, and its builds that have not
    started and that no other evaluation needs end as a cancel ends them (Aborted), so nothing of it is
    left queued; a build already running goes on (another evaluation may want it; its result is kept)."""
    _fail(evaluation, error, now)
    graph.abort_unneeded_builds(
        evaluation_id=evaluation.id, statuses=BUILD_PENDING, reason=f"evaluation failed: {error}", now=now
    )
