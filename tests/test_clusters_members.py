"""What a member's worker says (answers, reports, signals) and losing its worker: the prepare, the verdict
table of cluster-jobs.md's Recovery section, and signal forwarding, one test per clause."""

from __future__ import annotations

import uuid
from datetime import timedelta

import msgspec
import pytest
from django.utils import timezone

from gradient.clusters.models import (
    AttemptOutcome,
    ClusterAttempt,
    ClusterJob,
    ClusterMember,
    ClusterStatus,
    ClusterWorkerPenalty,
)
from gradient.clusters.services.attempts import ClaimedAttempt
from gradient.clusters.services.members import (
    cluster_member_answer,
    cluster_member_report,
    cluster_signal_forward,
    cluster_worker_lost,
)
from gradient.core.protocol import tag_of
from gradient.records.schemas import Outcome
from gradient.records.selectors import record_job
from gradient.scheduling.models import (
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    DispatchOutcome,
    Evaluation,
    EvaluationStatus,
)
from gradient.scheduling.services.evaluations import evaluation_cancel
from gradient.workers.models import Worker
from tests.clusters_helpers import (
    answer,
    as_json,
    claim,
    cluster_only_build,
    make_cluster,
    member_report,
    queued_evaluation,
    record_problems,
    seat_worker,
    started,
    types,
)
from tests.factories import DispatchedJobFactory, ProjectFactory
from tests.scheduling_helpers import drv, wire

pytestmark = pytest.mark.django_db


class Trio:
    """A cluster of a primary build, a server build and a client evaluation on three idle workers."""

    def __init__(self, retry_budget: int = 2, primary: bool = True) -> None:
        project = ProjectFactory()
        self.primary = cluster_only_build()
        self.server = cluster_only_build()
        self.client = queued_evaluation(project)
        self.cluster = make_cluster(
            [
                ("primary" if primary else "node", self.primary),
                ("server", self.server),
                ("client", self.client),
            ],
            retry_budget=retry_budget,
        )
        self.wp = seat_worker(project, zone="a", idle_for=("build",), endpoint="10.0.0.1:7000")
        self.ws = seat_worker(project, zone="a", idle_for=("build",))
        self.wc = seat_worker(project, zone="b", idle_for=("eval",))

    @property
    def workers(self) -> list[Worker]:
        # seats go in (role, index) order: client, primary/node, server
        return [self.wc, self.wp, self.ws]

    def claim(self) -> ClaimedAttempt:
        return claim(self.cluster, self.workers)

    def start(self) -> ClaimedAttempt:
        return started(self.cluster, self.workers)

    def refresh(self) -> None:
        for obj in (self.primary, self.server, self.client, self.cluster):
            obj.refresh_from_db()


def _attempt(claimed: ClaimedAttempt) -> ClusterAttempt:
    return ClusterAttempt.objects.get(id=claimed.attempt_id)


# --- The prepare ----------------------------------------------------------------------------------------


def test_the_last_accept_starts_the_attempt_and_sends_start_cluster_with_the_roster_to_every_member() -> None:
    t = Trio()
    claimed = t.claim()
    keys = {str(t.wc.id): t.client.job_key, str(t.wp.id): t.primary.job_key, str(t.ws.id): t.server.job_key}
    assert answer(t.wc, claimed.assignments[keys[str(t.wc.id)]]) == []
    assert answer(t.wp, claimed.assignments[keys[str(t.wp.id)]]) == []
    assert _attempt(claimed).started_at is None
    pushes = answer(t.ws, claimed.assignments[keys[str(t.ws.id)]])
    assert types(pushes) == ["StartCluster"] * 3 and {w for w, _ in pushes} == set(keys)
    roster = msgspec.to_builtins(pushes[0][1])["roster"]
    assert roster == [
        {"role": "client", "index": 0, "worker_id": str(t.wc.id), "zone": "b", "endpoint": None},
        {"role": "primary", "index": 0, "worker_id": str(t.wp.id), "zone": "a", "endpoint": "10.0.0.1:7000"},
        {"role": "server", "index": 0, "worker_id": str(t.ws.id), "zone": "a", "endpoint": None},
    ]
    assert pushes[0][1].attempt == str(claimed.attempt_id)
    t.refresh()
    assert (t.cluster.status, t.cluster.attempts) == (ClusterStatus.RUNNING, 1)
    assert _attempt(claimed).started_at is not None
    assert record_problems(t.cluster.job_key, t.client.job_key) == {}


def test_a_repeated_accept_counts_once() -> None:
    t = Trio()
    claimed = t.claim()
    aid = claimed.assignments[t.client.job_key]
    assert answer(t.wc, aid) == [] and answer(t.wc, aid) == []
    assert _attempt(claimed).started_at is None


def test_a_reject_closes_the_attempt_prepare_failed_aborts_every_member_and_spends_no_budget() -> None:
    t = Trio()
    claimed = t.claim()
    answer(t.wc, claimed.assignments[t.client.job_key])
    now = timezone.now()
    pushes = answer(t.ws, claimed.assignments[t.server.job_key], accepted=False, reason="slot full")
    assert types(pushes) == ["AbortCluster"] * 3
    assert {w for w, _ in pushes} == {str(w.id) for w in t.workers}
    attempt = _attempt(claimed)
    assert attempt.outcome == AttemptOutcome.PREPARE_FAILED and "slot full" in attempt.reason
    assert set(DispatchedJob.objects.filter(cluster_attempt=attempt).values_list("outcome", flat=True)) == {
        DispatchOutcome.ABANDONED
    }
    t.refresh()
    assert (t.primary.status, t.primary.attempts, t.server.status) == (
        BuildStatus.QUEUED,
        0,
        BuildStatus.QUEUED,
    )
    assert t.client.status == EvaluationStatus.QUEUED
    assert (t.cluster.status, t.cluster.attempts, t.cluster.prepare_failures) == (ClusterStatus.QUEUED, 0, 1)
    assert t.cluster.retry_at is not None and t.cluster.retry_at >= now + timedelta(seconds=30)
    assert t.cluster.waiting_reason == {
        "code": "backoff",
        "until": t.cluster.retry_at.isoformat(),
        "prepare_failures": 1,
    }
    assert list(ClusterWorkerPenalty.objects.values_list("worker_id", flat=True)) == [t.ws.id]
    assert record_problems(t.cluster.job_key, t.client.job_key) == {}


def test_past_the_prepare_failure_cap_the_cluster_parks_instead_of_retrying() -> None:
    t = Trio()
    ClusterJob.objects.filter(id=t.cluster.id).update(prepare_failures=7)
    claimed = t.claim()
    answer(t.wp, claimed.assignments[t.primary.job_key], accepted=False)
    t.refresh()
    assert (t.cluster.prepare_failures, t.cluster.retry_at) == (8, None)
    assert t.cluster.waiting_reason is not None and t.cluster.waiting_reason["code"] == "parked"


def test_a_held_members_job_failed_before_the_start_fails_the_prepare_and_never_reaches_the_build() -> None:
    t = Trio()
    claimed = t.claim()
    outcome = member_report(
        t.ws,
        claimed,
        t.server.job_key,
        "JobFailed",
        kind="aborted",
        error="cluster start timed out",
        elapsed_ms=0,
    )
    assert outcome.accepted
    assert _attempt(claimed).outcome == AttemptOutcome.PREPARE_FAILED
    t.refresh()
    assert (t.server.status, t.server.attempts, t.server.failure_kind) == (BuildStatus.QUEUED, 0, None)
    assert list(ClusterWorkerPenalty.objects.values_list("worker_id", flat=True)) == [t.ws.id]  # hold expired


def test_progress_of_a_held_member_is_dropped() -> None:
    t = Trio()
    claimed = t.claim()
    outcome = member_report(
        t.ws,
        claimed,
        t.server.job_key,
        "JobUpdate",
        update={"kind": "building", "build_id": str(t.server.id)},
    )
    assert not outcome.accepted
    assert DispatchedJob.objects.get(id=claimed.assignments[t.server.job_key]).phase == ""


def test_answers_and_reports_for_anything_but_an_open_member_assignment_on_that_worker_are_dropped() -> None:
    t = Trio()
    claimed = t.claim()
    aid = claimed.assignments[t.server.job_key]
    single = DispatchedJobFactory(worker=t.ws)
    for worker, bogus in ((t.wp, aid), (t.ws, uuid.uuid4()), (t.ws, "not-a-uuid"), (t.ws, single.id)):
        assert (
            cluster_member_answer(
                worker_id=worker.id, assignment_id=bogus, accepted=False, reason=None, now=timezone.now()
            )
            == []
        )
        message = {
            "type": "JobFailed",
            "job_id": t.server.job_key,
            "assignment_id": str(bogus),
            "kind": "permanent",
            "error": "x",
            "elapsed_ms": 0,
        }
        assert not cluster_member_report(
            worker_id=worker.id, message=wire(message), now=timezone.now()
        ).accepted
    assert _attempt(claimed).finished_at is None


# --- Running: progress ----------------------------------------------------------------------------------


def test_progress_of_a_started_member_is_applied_like_a_single_jobs() -> None:
    t = Trio()
    claimed = t.start()
    assert member_report(
        t.wc, claimed, t.client.job_key, "JobUpdate", update={"kind": "evaluating_flake"}
    ).accepted
    assert Evaluation.objects.get(id=t.client.id).status == EvaluationStatus.EVALUATING_FLAKE
    result = {"kind": "eval_result", "derivations": [drv("leaf")], "warnings": [], "errors": []}
    assert member_report(t.wc, claimed, t.client.job_key, "JobUpdate", update=result).accepted
    assert DerivationBuild.objects.filter(evaluation_links__evaluation=t.client).count() == 1
    assert member_report(
        t.ws,
        claimed,
        t.server.job_key,
        "BuildProgress",
        build_id=str(t.server.id),
        phase="download",
        bytes_done=1,
        bytes_total=2,
    ).accepted


def test_a_started_build_members_output_is_held_until_the_verdict() -> None:
    t = Trio()
    claimed = t.start()
    outputs = [{"name": "out", "path": "/nix/store/" + "a" * 32 + "-server", "nar_size": 10}]
    update = {"kind": "build_output", "build_id": str(t.server.id), "outputs": outputs, "substituted": False}
    assert member_report(t.ws, claimed, t.server.job_key, "JobUpdate", update=update).accepted
    assert DerivationBuild.objects.get(id=t.server.id).status == BuildStatus.BUILDING


# --- Running: the verdicts ------------------------------------------------------------------------------


def test_a_non_primary_success_alone_decides_nothing_and_its_job_is_held() -> None:
    t = Trio()
    claimed = t.start()
    outcome = member_report(t.ws, claimed, t.server.job_key, "JobCompleted", elapsed_ms=5)
    assert outcome.accepted and "held" in outcome.detail
    assert (
        DispatchedJob.objects.get(id=claimed.assignments[t.server.job_key]).outcome
        == DispatchOutcome.COMPLETED
    )
    assert DerivationBuild.objects.get(id=t.server.id).status == BuildStatus.BUILDING
    assert _attempt(claimed).finished_at is None


def test_the_primary_succeeding_completes_the_cluster_and_still_running_members_end_aborted() -> None:
    t = Trio()
    claimed = t.start()
    member_report(t.ws, claimed, t.server.job_key, "JobCompleted", elapsed_ms=5)
    outcome = member_report(t.wp, claimed, t.primary.job_key, "JobCompleted", elapsed_ms=5)
    assert "Complete" in outcome.detail
    attempt = _attempt(claimed)
    assert (attempt.outcome, attempt.verdict) == (AttemptOutcome.SUCCEEDED, "Complete")
    t.refresh()
    assert (t.cluster.status, t.primary.status, t.server.status) == (
        ClusterStatus.COMPLETED,
        BuildStatus.COMPLETED,
        BuildStatus.COMPLETED,
    )
    assert t.client.status == EvaluationStatus.ABORTED  # still running when the primary decided
    job = record_job(job_key=t.cluster.job_key, now=timezone.now())
    assert job.outcome is Outcome.SUCCEEDED and job.current is not None and not job.current.open
    assert record_problems(t.cluster.job_key, t.client.job_key) == {}


def test_still_running_members_get_abort_job_once_the_verdict_committed(  # type: ignore[no-untyped-def]
    sent, django_capture_on_commit_callbacks
) -> None:
    t = Trio()
    claimed = t.start()
    with django_capture_on_commit_callbacks(execute=True):
        member_report(t.wp, claimed, t.primary.job_key, "JobCompleted", elapsed_ms=5)
    assert sorted((w, m["type"], m["job_id"], m["assignment_id"]) for w, m in sent) == sorted(
        [
            (str(t.ws.id), "AbortJob", t.server.job_key, str(claimed.assignments[t.server.job_key])),
            (str(t.wc.id), "AbortJob", t.client.job_key, str(claimed.assignments[t.client.job_key])),
        ]
    )


def test_every_member_succeeding_completes_a_cluster_without_a_primary() -> None:
    t = Trio(primary=False)
    claimed = t.start()
    result = {"kind": "eval_result", "derivations": [drv("leaf2")], "warnings": [], "errors": []}
    member_report(t.wc, claimed, t.client.job_key, "JobUpdate", update=result)
    member_report(t.wc, claimed, t.client.job_key, "JobCompleted", elapsed_ms=5)
    member_report(t.wp, claimed, t.primary.job_key, "JobCompleted", elapsed_ms=5)
    assert _attempt(claimed).finished_at is None
    member_report(t.ws, claimed, t.server.job_key, "JobCompleted", elapsed_ms=5)
    t.refresh()
    assert t.cluster.status == ClusterStatus.COMPLETED
    assert (t.primary.status, t.server.status) == (BuildStatus.COMPLETED, BuildStatus.COMPLETED)
    assert t.client.status == EvaluationStatus.BUILDING  # evaluated; its own builds follow as usual
    assert record_problems(t.cluster.job_key, t.client.job_key) == {}


def test_a_failure_with_budget_left_retries_every_member_through_the_book() -> None:
    t = Trio(retry_budget=2)
    claimed = t.start()
    outcome = member_report(
        t.ws, claimed, t.server.job_key, "JobFailed", kind="permanent", error="boom", elapsed_ms=1
    )
    assert "Retry" in outcome.detail
    attempt = _attempt(claimed)
    assert (attempt.outcome, attempt.verdict) == (AttemptOutcome.FAILED, "Retry")
    t.refresh()
    assert (t.cluster.status, t.cluster.attempts) == (ClusterStatus.QUEUED, 1)
    assert (t.primary.status, t.server.status, t.client.status) == (
        BuildStatus.QUEUED,
        BuildStatus.QUEUED,
        EvaluationStatus.QUEUED,
    )
    assert (t.primary.attempts, t.server.attempts) == (0, 0)
    assert not DispatchedJob.objects.filter(finished_at__isnull=True).exists()
    assert (
        ClusterMember.objects.filter(cluster_job=t.cluster).count() == 3
    )  # still members: never single jobs
    assert record_job(job_key=t.cluster.job_key, now=timezone.now()).status.value == "Queued"
    assert record_problems(t.cluster.job_key, t.client.job_key) == {}


def test_a_failure_without_budget_fails_the_cluster_with_requeueing_kinds_made_permanent() -> None:
    t = Trio(retry_budget=1)
    claimed = t.start()
    member_report(t.ws, claimed, t.server.job_key, "JobFailed", kind="transient", error="net", elapsed_ms=1)
    attempt = _attempt(claimed)
    assert (attempt.outcome, attempt.verdict) == (AttemptOutcome.FAILED, "Fail")
    t.refresh()
    assert t.cluster.status == ClusterStatus.FAILED and t.cluster.finished_at is not None
    assert (t.server.status, t.server.failure_kind) == (BuildStatus.FAILED_PERMANENT, "permanent")
    assert "made permanent" in t.server.last_error
    assert (t.primary.status, t.client.status) == (BuildStatus.ABORTED, EvaluationStatus.ABORTED)  # survivors
    assert record_job(job_key=t.cluster.job_key, now=timezone.now()).outcome is Outcome.FAILED
    assert record_problems(t.cluster.job_key, t.client.job_key) == {}


def test_a_member_that_can_no_longer_start_turns_a_retry_into_a_fail() -> None:
    t = Trio(retry_budget=5)
    claimed = t.start()
    Evaluation.objects.filter(id=t.client.id).update(
        status=EvaluationStatus.FAILED, finished_at=timezone.now()
    )
    member_report(t.ws, claimed, t.server.job_key, "JobFailed", kind="permanent", error="boom", elapsed_ms=1)
    assert _attempt(claimed).verdict == "Fail"


def test_an_evaluation_abort_reaching_a_member_aborts_the_cluster() -> None:
    t = Trio(retry_budget=3)
    claimed = t.start()
    evaluation_cancel(evaluation_id=t.client.id, reason="cancelled by a user", now=timezone.now())
    member_report(
        t.wc, claimed, t.client.job_key, "JobFailed", kind="aborted", error="cancelled", elapsed_ms=1
    )
    attempt = _attempt(claimed)
    assert (attempt.outcome, attempt.verdict) == (AttemptOutcome.ABORTED, "Abort")
    t.refresh()
    assert t.cluster.status == ClusterStatus.ABORTED
    assert (t.primary.status, t.server.status) == (BuildStatus.ABORTED, BuildStatus.ABORTED)
    assert record_problems(t.cluster.job_key, t.client.job_key) == {}


def test_a_job_failed_canceled_counts_as_a_lost_member() -> None:
    t = Trio(retry_budget=2)
    claimed = t.start()
    member_report(
        t.ws, claimed, t.server.job_key, "JobFailed", kind="canceled", error="stopping", elapsed_ms=1
    )
    assert _attempt(claimed).verdict == "Retry"
    t.refresh()
    assert t.server.status == BuildStatus.QUEUED


def test_a_report_arriving_after_the_verdict_is_dropped_its_member_settled_by_that_verdict() -> None:
    t = Trio()
    claimed = t.start()
    member_report(t.wp, claimed, t.primary.job_key, "JobCompleted", elapsed_ms=5)
    late = member_report(t.ws, claimed, t.server.job_key, "JobCompleted", elapsed_ms=5)
    assert not late.accepted
    assert DerivationBuild.objects.get(id=t.server.id).status == BuildStatus.ABORTED


# --- Losing a worker ------------------------------------------------------------------------------------


def test_a_lost_worker_loses_its_member_into_the_verdict_and_never_requeues_it_as_a_single_job() -> None:
    t = Trio(retry_budget=2)
    claimed = t.start()
    pushes = cluster_worker_lost(worker_id=t.ws.id, now=timezone.now())
    assert sorted(types(pushes)) == ["AbortJob", "AbortJob"]  # the survivors, before they requeue
    row = DispatchedJob.objects.get(id=claimed.assignments[t.server.job_key])
    assert (row.outcome, row.reason) == (DispatchOutcome.ABANDONED, "worker lost")
    assert _attempt(claimed).verdict == "Retry"
    t.refresh()
    assert (t.cluster.status, t.server.status) == (ClusterStatus.QUEUED, BuildStatus.QUEUED)
    assert ClusterMember.objects.filter(derivation_build=t.server).exists()
    assert record_problems(t.cluster.job_key, t.client.job_key) == {}


def test_a_lost_worker_without_budget_fails_its_member_permanently() -> None:
    t = Trio(retry_budget=1)
    t.start()
    cluster_worker_lost(worker_id=t.ws.id, now=timezone.now())
    t.refresh()
    assert (t.cluster.status, t.server.status) == (ClusterStatus.FAILED, BuildStatus.FAILED_PERMANENT)


def test_a_lost_worker_during_the_prepare_fails_the_prepare() -> None:
    t = Trio()
    claimed = t.claim()
    pushes = cluster_worker_lost(worker_id=t.wc.id, now=timezone.now())
    assert types(pushes) == ["AbortCluster"] * 3
    assert _attempt(claimed).outcome == AttemptOutcome.PREPARE_FAILED
    t.refresh()
    assert (t.cluster.status, t.cluster.attempts, t.client.status) == (
        ClusterStatus.QUEUED,
        0,
        EvaluationStatus.QUEUED,
    )


# --- Signals --------------------------------------------------------------------------------------------


def _signal(
    worker: Worker, claimed: ClaimedAttempt, to: dict[str, object] | None = None, payload: str = "hi"
):  # type: ignore[no-untyped-def]
    return cluster_signal_forward(
        worker_id=worker.id, attempt_id=claimed.attempt_id, to=to, payload=payload, now=timezone.now()
    )


def test_a_signal_is_forwarded_only_within_a_started_attempt() -> None:
    t = Trio()
    claimed = t.claim()
    assert _signal(t.wp, claimed) == []
    for job_key, aid in claimed.assignments.items():
        worker = {t.client.job_key: t.wc, t.primary.job_key: t.wp, t.server.job_key: t.ws}[job_key]
        answer(worker, aid)
    assert len(_signal(t.wp, claimed)) == 2
    member_report(t.wp, claimed, t.primary.job_key, "JobCompleted", elapsed_ms=1)  # closes the attempt
    assert _signal(t.wp, claimed) == []


def test_a_signal_without_to_reaches_every_other_member_with_the_senders_address() -> None:
    t = Trio()
    claimed = t.start()
    pushes = _signal(t.wp, claimed, payload="ready")
    assert {w for w, _ in pushes} == {str(t.wc.id), str(t.ws.id)}
    assert as_json(pushes)[0][1] == {
        "type": "ClusterSignal",
        "attempt": str(claimed.attempt_id),
        "from": {"role": "primary", "index": 0},
        "payload": "ready",
    }


def test_a_signal_with_to_reaches_only_the_member_it_names() -> None:
    t = Trio()
    claimed = t.start()
    pushes = _signal(t.wp, claimed, to={"role": "server", "index": 0})
    assert [w for w, _ in pushes] == [str(t.ws.id)]
    assert _signal(t.wp, claimed, to={"role": "server", "index": 7}) == []


def test_a_signal_from_a_worker_that_is_no_member_or_malformed_is_dropped() -> None:
    t = Trio()
    claimed = t.start()
    stranger = seat_worker(ProjectFactory())
    assert _signal(stranger, claimed) == []
    assert _signal(t.wp, claimed, to={"role": "server"}) == []
    assert _signal(t.wp, claimed, to={"role": "server", "index": True}) == []
    assert _signal(t.wp, claimed, payload="x" * (64 * 1024 + 1)) == []
    assert (
        cluster_signal_forward(worker_id=t.wp.id, attempt_id="nope", to=None, payload="x", now=timezone.now())
        == []
    )
    assert (
        cluster_signal_forward(
            worker_id=t.wp.id, attempt_id=uuid.uuid4(), to=None, payload="x", now=timezone.now()
        )
        == []
    )


def test_every_message_the_services_push_fits_the_protocols_strict_server_schema() -> None:
    protocol = pytest.importorskip("gradient.core.protocol")  # the wire structs of the workers app
    import msgspec

    t = Trio()
    claimed = t.claim()
    pushes = list(claimed.pushes)  # AssignJob with cluster, an evaluation's and builds' jobs
    by_key = {t.client.job_key: t.wc, t.primary.job_key: t.wp, t.server.job_key: t.ws}
    for job_key, aid in claimed.assignments.items():
        pushes += answer(by_key[job_key], aid)  # StartCluster with the roster
    pushes += cluster_signal_forward(
        worker_id=t.wp.id, attempt_id=claimed.attempt_id, to=None, payload="p", now=timezone.now()
    )
    pushes += cluster_worker_lost(worker_id=t.ws.id, now=timezone.now())  # AbortJob to the survivors
    other = Trio()
    held = other.claim()
    pushes += answer(other.wc, held.assignments[other.client.job_key], accepted=False)  # AbortCluster
    assert {tag_of(type(m)) for _, m in pushes} == {
        "AssignJob",
        "StartCluster",
        "ClusterSignal",
        "AbortJob",
        "AbortCluster",
    }
    for _, message in pushes:
        protocol.decode_server_message(msgspec.json.encode(message))
