"""RequestJob: score every pending job of that kind for this worker, claim the best, hand it out.

One call is one unit of work in its own transaction. AssignJob goes out only after the claim committed:
the caller sends the returned message once this function has returned.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import InterfaceError, OperationalError, transaction
from django.utils import timezone

from gradient.core.protocol import AssignJob, FlakeStep, Job
from gradient.core.vocab import BuildStatus, EvaluationStatus, JobKind, JobKindName, job_kind_of
from gradient.runtime import lanes
from gradient.scheduling import jobs, selectors
from gradient.scheduling.decisions.scoring import Candidate, Score, WorkerView, rank, wait_cap_secs
from gradient.scheduling.models import CandidateScore, DerivationBuild, Evaluation, SentCandidate
from gradient.scheduling.services import lifecycle
from gradient.scheduling.services.lifecycle import ClaimTerms
from gradient.workers.models import IdleSlot

log = logging.getLogger("gradient.assignment")

MAX_LOST_CLAIMS = 3
# Candidates a RequestJob looks at, best first, skipping those another RequestJob is claiming.
MAX_TRIED_CANDIDATES = 32


@dataclass(frozen=True)
class Assignment:
    assignment_id: uuid.UUID
    job_key: str
    kind: str
    job: Job
    score: Score

    def message(self) -> AssignJob:
        return AssignJob(
            job_id=self.job_key, assignment_id=str(self.assignment_id), job=self.job, cluster=None
        )


def _worker_view(state: selectors.WorkerState) -> WorkerView:
    w = state.worker
    return WorkerView(
        can_fetch=w.can_fetch,
        cpu_core_score=w.cpu_core_score,
        cpu_usage_pct=w.cpu_usage_pct,
        ram_free_mb=w.ram_free_mb,
        ram_total_mb=w.ram_total_mb,
        build_peak_ram_mb=w.build_peak_ram_mb,
        download_speed_mbps=w.download_speed_mbps,
        large_transfers_running=selectors.large_transfers_running(w.id),
    )


def _worker_scores(worker_id: uuid.UUID) -> dict[str, tuple[int, int]]:
    """The worker's own RequestJobChunk answers: job key -> (missing NAR size, missing count)."""
    rows = CandidateScore.objects.filter(worker_id=worker_id).values_list(
        "job_id", "missing_nar_size", "missing_count"
    )
    return {job_id: (size, count) for job_id, size, count in rows}


def _offered_passes_ago(worker_id: uuid.UUID, job_keys: list[str], now: datetime) -> dict[str, int]:
    """For the candidates the worker has not scored: how many assignment passes ago they were offered to
    it (RescoreWait holds such a build back for up to 4 passes, waiting for the worker's score)."""
    if not job_keys:
        return {}
    interval = max(1.0, float(settings.GRADIENT_SCHEDULER_PASS_INTERVAL_SECS))
    rows = SentCandidate.objects.filter(worker_id=worker_id, job_id__in=job_keys).values_list(
        "job_id", "sent_at"
    )
    return {job_id: int(max(0.0, (now - sent_at).total_seconds()) // interval) for job_id, sent_at in rows}


def _is_full(state: selectors.WorkerState, kind: str) -> bool:
    if kind == JobKind.BUILD:
        running = selectors.open_assignments(state.id, JobKind.BUILD).count()
        return running >= max(1, state.worker.max_concurrent_builds)
    return False  # evaluation slots: the worker limits itself (GRADIENT_WORKER_EVAL_MAX_CONCURRENT)


def _clear_idle_slot(worker_id: uuid.UUID, kind: str) -> None:
    IdleSlot.objects.filter(worker_id=worker_id, kind=kind).delete()


def _record_idle_slot(worker_id: uuid.UUID, kind: str, now: datetime) -> None:
    IdleSlot.objects.update_or_create(worker_id=worker_id, kind=kind, defaults={"recorded_at": now})


def request_job(
    *,
    worker_id: uuid.UUID,
    protocol_kind: JobKindName,
    now: datetime,
    tried: list[uuid.UUID] | None = None,
) -> Assignment | None:
    """Answer one RequestJob. Returns the assignment to send, or None: then the request stays
    unanswered and is remembered as an idle slot for cluster placement. `tried` collects the id of
    every claim it makes, before making it (hand_out finds a claim whose commit went unheard by them)."""
    kind = job_kind_of(protocol_kind)
    tried = tried if tried is not None else []
    with transaction.atomic(durable=True):  # the RequestJob's one transaction: this entry owns it
        state = selectors.worker_state(worker_id)
        if state is None or state.draining:
            return None
        if _is_full(state, kind):
            _clear_idle_slot(worker_id, kind)
            return None
        if selectors.worker_held(worker_id, kind):
            _record_idle_slot(worker_id, kind, now)  # a reserved seat: it waits, idle, for its cluster
            return None
        assignment = (
            _assign_build(state, now, tried) if kind == JobKind.BUILD else _assign_eval(state, now, tried)
        )
        if assignment is None:
            _record_idle_slot(worker_id, kind, now)
        else:
            _clear_idle_slot(worker_id, kind)
        return assignment


def _policy() -> str:
    return str(getattr(settings, "GRADIENT_SCHEDULING_POLICY", "resource-aware"))


def _assign_build(state: selectors.WorkerState, now: datetime, tried: list[uuid.UUID]) -> Assignment | None:
    scores = _worker_scores(state.id)
    pool = selectors.pool_view(now)
    refs = {
        b.job_key: b
        for b in selectors.queued_build_refs(state, now, wait_cap_secs=wait_cap_secs(pool), scored=scores)
    }
    if not refs:
        return None
    # RescoreWait holds back what a scoring worker was offered and has not scored yet; a worker that
    # never sends scores is not held back for them.
    offered = _offered_passes_ago(state.id, [k for k in refs if k not in scores], now) if scores else {}
    candidates = []
    for key, b in refs.items():
        s = scores.get(key)
        candidates.append(
            Candidate(
                job_id=key,
                kind="build",
                waited_secs=(now - (b.queued_at or b.created_at)).total_seconds(),
                prioritized=b.prioritized,
                missing_nar_size=s[0] if s else None,
                missing_count=s[1] if s else None,
                offered_passes_ago=offered.get(key),
            )
        )
    ranked = rank(candidates, _worker_view(state), pool, _policy())
    lost = 0
    for choice in ranked[:MAX_TRIED_CANDIDATES]:
        build = _lock_if_free(DerivationBuild, refs[choice.job_id].id, BuildStatus.QUEUED)
        if build is None:  # another RequestJob is claiming it right now, or it is gone: the next one
            continue
        # The claim's time is when the row was locked, not when the request arrived: a build queued by a
        # dependency that finished meanwhile is never shown dispatched before that dependency finished.
        claimed_at = max(now, timezone.now())
        s = scores.get(choice.job_id)
        terms = ClaimTerms(
            score=choice.total,
            breakdown=choice.breakdown,
            missing_nar_size=s[0] if s else None,
            missing_count=s[1] if s else None,
        )
        tried.append(assignment_id := uuid.uuid4())
        claimed = lifecycle.claim_build(
            build=build, worker_id=state.id, now=claimed_at, terms=terms, assignment_id=assignment_id
        )
        if claimed is not None:
            return Assignment(claimed.assignment_id, build.job_key, JobKind.BUILD, claimed.job, choice)
        lost += 1
        if lost >= MAX_LOST_CLAIMS:
            break
    return None


def _assign_eval(state: selectors.WorkerState, now: datetime, tried: list[uuid.UUID]) -> Assignment | None:
    split = selectors.has_idle_eval_only_worker()
    evaluations: dict[str, tuple[Evaluation, tuple[FlakeStep, ...]]] = {}
    for e in selectors.queued_evaluations(state)[:5000]:
        steps = jobs.eval_steps(e, split=split)
        if selectors.worker_can_run_eval_steps(state.worker, steps):
            evaluations[e.job_key] = (e, steps)
    if not evaluations:
        return None
    scores = _worker_scores(state.id)
    candidates = [
        Candidate(
            job_id=key,
            kind="eval",
            waited_secs=(now - e.updated_at).total_seconds()
            if e.followup_pending
            else (now - e.created_at).total_seconds(),
            prioritized=e.priority,
            has_fetch_step=jobs.FETCH_FLAKE in steps,
            missing_nar_size=scores[key][0] if key in scores else None,
        )
        for key, (e, steps) in evaluations.items()
    ]
    ranked = rank(candidates, _worker_view(state), selectors.pool_view(now), _policy())
    lost = 0
    for choice in ranked[:MAX_TRIED_CANDIDATES]:
        evaluation, steps = evaluations[choice.job_id]
        if _lock_if_free(Evaluation, evaluation.id, EvaluationStatus.QUEUED) is None:
            continue
        # Stamped when the row was locked, as a build's claim is: an evaluation whose last assignment a
        # report batch closed (and requeued) while this request was on its way is never shown dispatched
        # again before that assignment's close.
        claimed_at = max(now, timezone.now())
        tried.append(assignment_id := uuid.uuid4())
        claimed = lifecycle.claim_evaluation(
            assignment_id=assignment_id,
            evaluation=evaluation,
            steps=steps,
            worker_id=state.id,
            worker_name=state.worker.name,
            reason=f"assigned to {state.worker.name}: {', '.join(steps)}",
            now=claimed_at,
            terms=ClaimTerms(score=choice.total, breakdown=choice.breakdown),
        )
        if claimed is not None:
            return Assignment(claimed.assignment_id, evaluation.job_key, JobKind.EVAL, claimed.job, choice)
        lost += 1
        if lost >= MAX_LOST_CLAIMS:
            break
    return None


def _lock_if_free(model: Any, row_id: uuid.UUID, status: str) -> Any:
    """The job's row, locked for this transaction, if it still has `status` and no concurrent RequestJob
    holds it (SKIP LOCKED): concurrent requests spread over the best jobs instead of queueing behind the
    same one. The claim statement still decides who wins; this only avoids waiting for a likely loser.
    (SQLite serializes writers and ignores the lock.)"""
    return (
        model.objects.select_for_update(skip_locked=True, no_key=True)
        .filter(id=row_id, status=status)
        .first()
    )


IdleListener = Callable[[datetime], None]
_idle_listeners: list[IdleListener] = []


def register_idle_listener(listener: IdleListener) -> None:
    """Called with `now` after a RequestJob went unanswered (a new idle slot): the cluster code places
    waiting clusters at once instead of at its next pass (registered from its AppConfig.ready)."""
    if listener not in _idle_listeners:
        _idle_listeners.append(listener)


def hand_out(*, worker_id: uuid.UUID, protocol_kind: JobKindName, now: datetime) -> AssignJob | None:
    """A worker's RequestJob: the AssignJob to send back once this returned (its claim has committed), or
    None: the request stays unanswered, an idle slot for cluster placement, and the idle listeners run.

    When the database connection dies while claiming, the claim may have committed without this call
    hearing so (dying at COMMIT): that job is this worker's now and must go out, or it would stay open on
    a worker that never heard of it. Otherwise the claim rolled back and the error propagates (the caller
    asks again on a fresh connection)."""
    tried: list[uuid.UUID] = []
    try:
        handed = request_job(worker_id=worker_id, protocol_kind=protocol_kind, now=now, tried=tried)
    except (OperationalError, InterfaceError):
        lanes.drop_connection()
        unheard = selectors.unheard_assignment(worker_id, tried)
        if unheard is None:
            raise
        log.warning("a claim for worker %s committed unheard; handing it out", worker_id)
        return unheard
    if handed is None:
        for listener in list(_idle_listeners):
            try:
                listener(timezone.now())
            except Exception:  # a failing listener must not cost the worker its session
                log.exception("an idle-slot listener failed")
        return None
    return handed.message()
