"""Waiting reasons: one test per reason and per unpark path, the unbuildable abort and its grace, and
the heal."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from gradient.records.models import RecordEntry
from gradient.recovery.models import ServerBoot
from gradient.scheduling.admin_waiting import brief
from gradient.scheduling.decisions import waiting as w
from gradient.scheduling.decisions.access import may_take
from gradient.scheduling.models import BuildStatus, DerivationBuild, EvaluationBuild, EvaluationStatus
from gradient.scheduling.services import graph
from gradient.scheduling.services.lifecycle import end_build
from gradient.scheduling.services.waiting import refresh_waiting_state, repair_build_graph
from gradient.workers.models import Worker, WorkerSession
from tests.factories import EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import drv

X86 = w.PoolWorker(True, True, True, ("x86_64-linux",), ())
EVAL_ONLY = w.PoolWorker(False, True, False, (), ())


def test_counters_decide_first() -> None:
    assert w.phase_from_counters(w.Counters(0, 0, 0)) == w.Phase.PRE_BUILD
    assert w.phase_from_counters(w.Counters(3, 0, 0)) == w.Phase.FINALIZE
    assert w.phase_from_counters(w.Counters(3, 2, 1)) == w.Phase.BUILDING
    assert w.phase_from_counters(w.Counters(3, 2, 0)) == w.Phase.ASSESS


def test_a_queued_evaluation_without_a_fetch_worker_waits_for_eval_workers() -> None:
    v = w.assess(
        status="Queued",
        counters=w.Counters(0, 0, 0),
        has_open_job=False,
        pool=w.Pool((EVAL_ONLY,)),
        blocking=None,
    )
    assert v.reason == {"reason": "eval_workers", "capability": "fetch", "connected_workers": 1}


def test_an_evaluating_evaluation_without_an_eval_worker_waits_for_eval_workers() -> None:
    v = w.assess(
        status="EvaluatingFlake",
        counters=w.Counters(0, 0, 0),
        has_open_job=False,
        pool=w.Pool(()),
        blocking=None,
    )
    assert v.reason == {"reason": "eval_workers", "capability": "eval", "connected_workers": 0}


def test_an_evaluation_whose_job_is_on_a_worker_is_not_waiting() -> None:
    v = w.assess(
        status="Fetching", counters=w.Counters(0, 0, 0), has_open_job=True, pool=w.Pool(()), blocking=None
    )
    assert v.reason is None


def test_a_building_evaluation_with_an_unmet_architecture_waits_for_workers_naming_it() -> None:
    blocking = [
        w.BlockingBuild("1", "Queued", "aarch64-linux", ("kvm",)),
        w.BlockingBuild("2", "Queued", "aarch64-linux", ("kvm",)),
        w.BlockingBuild("3", "Queued", "x86_64-linux", ()),
    ]
    v = w.assess(
        status="Building",
        counters=w.Counters(3, 3, 0),
        has_open_job=False,
        pool=w.Pool((X86,)),
        blocking=blocking,
    )
    assert v.reason == {
        "reason": "workers",
        "unmet": [{"architecture": "aarch64-linux", "required_features": ["kvm"], "builds": 2}],
        "connected_workers": 1,
        "available_architectures": ["x86_64-linux"],
    }
    assert "aarch64-linux with kvm (2 builds)" in w.describe(v.reason)


def test_every_blocking_build_fitting_but_none_handable_is_graph_stuck() -> None:
    blocking = [w.BlockingBuild("1", "Created", "x86_64-linux", ())]
    v = w.assess(
        status="Building",
        counters=w.Counters(1, 1, 0),
        has_open_job=False,
        pool=w.Pool((X86,)),
        blocking=blocking,
    )
    assert v.reason == {"reason": "graph_stuck", "pending_shared_builds": 1}


def test_a_needed_build_that_was_aborted_is_named_even_while_others_build() -> None:
    """Issue 34, item 9: an aborted build the evaluation needs, whatever aborted it, is named in its
    waiting reason; the counters alone send it to be assessed even while another build runs."""
    assert w.phase_from_counters(w.Counters(3, 1, 1, aborted=1)) == w.Phase.ASSESS
    assert w.phase_from_counters(w.Counters(3, 0, 0, aborted=1)) == w.Phase.ASSESS  # not finalized
    blocking = [
        w.BlockingBuild("1", "Aborted", "x86_64-linux", (), name="hello-2.12"),
        w.BlockingBuild("2", "Building", "x86_64-linux", ()),
        w.BlockingBuild("3", "Created", "x86_64-linux", ()),
    ]
    v = w.assess(
        status="Building",
        counters=w.Counters(3, 2, 1, aborted=1),
        has_open_job=False,
        pool=w.Pool((X86,)),
        blocking=blocking,
    )
    assert v.reason == {
        "reason": "graph_stuck",
        "pending_shared_builds": 2,
        "aborted_builds": [{"id": "1", "name": "hello-2.12"}],
        "aborted_count": 1,
    }
    assert w.describe(v.reason) == (
        "Stuck: it needs a shared build that was aborted: hello-2.12; the graph repair queues it again."
    )
    assert "queues the aborted builds again" in w.what_happens_next(
        reason=v.reason, deadline=None, wait_for_workers=False
    )


def test_a_reason_names_the_first_ten_aborted_builds_and_counts_the_rest() -> None:
    blocking = [w.BlockingBuild(str(i), "Aborted", "x86_64-linux", (), name=f"pkg-{i:02}") for i in range(12)]
    v = w.building_verdict(blocking, w.Pool((X86,)))
    assert v.reason is not None and len(v.reason["aborted_builds"]) == 10
    assert "12 shared builds that were aborted: pkg-00, pkg-01" in w.describe(v.reason)
    assert w.describe(v.reason).endswith("pkg-09 and 2 more; the graph repair queues them again.")


HOT = w.PoolWorker(True, True, True, ("x86_64-linux",), (), saturation=("CPU > 80 %",))


def test_work_held_back_by_resource_saturation_says_so() -> None:
    """Issue 34, item 9: a Queued build every capable worker is too loaded to take waited in silence."""
    blocking = [w.BlockingBuild("1", "Queued", "x86_64-linux", ())]
    v = w.assess(
        status="Building",
        counters=w.Counters(1, 1, 0),
        has_open_job=False,
        pool=w.Pool((HOT, HOT, HOT, EVAL_ONLY)),
        blocking=blocking,
    )
    assert v.reason == {
        "reason": "saturated",
        "builds": 1,
        "capable_workers": 3,
        "signals": {"CPU > 80 %": 3},
    }
    assert w.describe(v.reason) == (
        "Held back by ResourceSaturation: 3 workers can build it; all report CPU > 80 %."
    )
    assert "reports less load" in w.what_happens_next(reason=v.reason, deadline=None, wait_for_workers=False)
    assert not w.abortable(v.reason) and w.evaluation_job_done("Waiting", v.reason)


def test_one_capable_worker_under_the_thresholds_or_a_prioritized_build_is_not_held_back() -> None:
    queued = [w.BlockingBuild("1", "Queued", "x86_64-linux", ())]
    assert w.building_verdict(queued, w.Pool((HOT, X86))) == w.NOT_WAITING
    prioritized = [w.BlockingBuild("1", "Queued", "x86_64-linux", (), prioritized=True)]
    assert w.building_verdict(prioritized, w.Pool((HOT,))) == w.NOT_WAITING  # Qos outweighs one signal


def test_mixed_saturation_signals_are_counted_each() -> None:
    ram = w.PoolWorker(True, True, True, ("x86_64-linux",), (), saturation=("free RAM < 10 %",))
    v = w.building_verdict([w.BlockingBuild("1", "Queued", "x86_64-linux", ())], w.Pool((HOT, ram, HOT)))
    assert w.describe(v.reason) == (
        "Held back by ResourceSaturation: 3 workers can build it; all are saturated: "
        "2 report CPU > 80 %, 1 reports free RAM < 10 %."
    )


def test_a_draining_worker_is_no_capacity() -> None:
    draining = w.PoolWorker(True, True, True, ("x86_64-linux",), (), draining=True)
    blocking = [w.BlockingBuild("1", "Queued", "x86_64-linux", ())]
    v = w.assess(
        status="Building",
        counters=w.Counters(1, 1, 0),
        has_open_job=False,
        pool=w.Pool((draining,)),
        blocking=blocking,
    )
    assert v.name == "workers"


def test_the_unbuildable_abort_waits_for_the_grace_and_for_the_pool_after_a_restart() -> None:
    now = timezone.now()
    reason = {"reason": "workers", "unmet": [{"architecture": "a", "required_features": [], "builds": 1}]}
    old = now - timedelta(seconds=400)
    assert w.unbuildable_due(
        reason=reason, waiting_since=old, wait_for_workers=False, pool_stable_since=old, now=now
    )
    assert not w.unbuildable_due(
        reason=reason,
        waiting_since=now - timedelta(seconds=100),
        wait_for_workers=False,
        pool_stable_since=old,
        now=now,
    )
    restarted = now - timedelta(seconds=60)
    assert not w.unbuildable_due(
        reason=reason, waiting_since=old, wait_for_workers=False, pool_stable_since=restarted, now=now
    )
    assert not w.unbuildable_due(
        reason=reason, waiting_since=old, wait_for_workers=True, pool_stable_since=old, now=now
    )
    empty = {"reason": "workers", "unmet": []}
    assert not w.unbuildable_due(
        reason=empty, waiting_since=old, wait_for_workers=False, pool_stable_since=old, now=now
    )


def test_the_memo_reuses_a_verdict_only_while_the_pool_is_the_same_and_for_60_seconds() -> None:
    memo = w.AssessmentMemo()
    now = timezone.now()
    v = w.Verdict({"reason": "graph_stuck", "pending_shared_builds": 1})
    memo.put("k", ("fp",), v, now)
    assert memo.get("k", ("fp",), now + timedelta(seconds=59)) == v
    assert memo.get("k", ("fp",), now + timedelta(seconds=61)) is None
    assert memo.get("k", ("other",), now) is None


# --- the pass on the database ----------------------------------------------------------------------


def _building(project, derivations):  # type: ignore[no-untyped-def]
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=derivations, now=timezone.now())
    return evaluation


@pytest.mark.django_db
def test_the_pass_parks_a_building_evaluation_and_unparks_it_to_building_when_a_worker_fits() -> None:
    project = ProjectFactory()
    evaluation = _building(project, [drv("arm", system="aarch64-linux")])
    connected_worker([project], architectures=["x86_64-linux"])
    r = refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert (evaluation.status, evaluation.waiting_reason["reason"], r.parked) == ("Waiting", "workers", 1)
    since = evaluation.waiting_since
    refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert evaluation.waiting_since == since, "an unchanged reason is not rewritten"
    connected_worker([project], architectures=["aarch64-linux"])
    r = refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert (evaluation.status, evaluation.waiting_reason, r.unparked) == ("Building", None, 1)


@pytest.mark.django_db
def test_the_pass_parks_a_queued_evaluation_and_unparks_it_to_queued_when_the_capability_connects() -> None:
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project)
    refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert evaluation.status == "Waiting" and evaluation.waiting_reason["reason"] == "eval_workers"
    connected_worker([project])
    refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert (evaluation.status, evaluation.waiting_reason) == ("Queued", None)


@pytest.mark.django_db
def test_a_requeued_evaluation_with_builds_of_an_unfinished_evaluation_unparks_to_queued_not_building() -> (
    None
):
    # Its eval_result was ingested, then the server died before JobCompleted: startup recovery requeued it.
    # With no fetch worker connected it parks for eval_workers; when one connects it must be evaluated
    # again, not jump to Building on the builds of the unfinished run.
    project = ProjectFactory()
    evaluation = _building(project, [drv("solo")])
    evaluation.status = EvaluationStatus.QUEUED
    evaluation.save(update_fields=["status"])
    refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert evaluation.status == "Waiting" and evaluation.waiting_reason["reason"] == "eval_workers"
    connected_worker([project])
    refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert (evaluation.status, evaluation.waiting_reason) == ("Queued", None)


@pytest.mark.django_db
def test_the_pass_never_touches_reasons_owned_by_other_hooks() -> None:
    evaluation = EvaluationFactory(status=EvaluationStatus.WAITING, waiting_reason={"reason": "approval"})
    refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert evaluation.waiting_reason == {"reason": "approval"} and evaluation.status == "Waiting"


@pytest.mark.django_db
def test_an_unbuildable_evaluation_is_aborted_after_the_grace_with_a_warning_naming_what_is_missing() -> None:
    project = ProjectFactory()
    evaluation = _building(project, [drv("arm", system="aarch64-linux", features=["kvm"])])
    ServerBoot.objects.create(
        hostname="h", pid=1, started_at=timezone.now() - timedelta(hours=1), last_heartbeat=timezone.now()
    )
    connected_worker([project], architectures=["x86_64-linux"])
    refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    later = timezone.now() + timedelta(seconds=301)
    r = refresh_waiting_state(now=later, grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert r.aborted == 1 and evaluation.status == "Aborted"
    assert "aarch64-linux with kvm (1 builds)" in evaluation.warnings[-1]
    assert DerivationBuild.objects.get().status == BuildStatus.ABORTED


@pytest.mark.django_db
def test_the_grace_survives_a_restart() -> None:
    project = ProjectFactory()
    evaluation = _building(project, [drv("arm", system="aarch64-linux")])
    refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert evaluation.waiting_reason["reason"] == "workers"
    # The server restarts 10 minutes later: the park is older than the grace, the pool is not.
    restart = timezone.now() + timedelta(minutes=10)
    ServerBoot.objects.create(hostname="h", pid=2, started_at=restart, last_heartbeat=restart)
    r = refresh_waiting_state(now=restart + timedelta(seconds=30), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert r.aborted == 0 and evaluation.status == "Waiting"


@pytest.mark.django_db
def test_wait_for_workers_keeps_an_unbuildable_evaluation_waiting() -> None:
    project = ProjectFactory()
    evaluation = _building(project, [drv("arm", system="aarch64-linux")])
    evaluation.wait_for_workers = True
    evaluation.save()
    refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    r = refresh_waiting_state(now=timezone.now() + timedelta(hours=2), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert r.aborted == 0 and evaluation.status == "Waiting"


@pytest.mark.django_db
def test_graph_stuck_runs_the_heal_which_frees_a_shared_build() -> None:
    project = ProjectFactory()
    evaluation = _building(project, [drv("base"), drv("top", "base")])
    connected_worker([project])
    base = DerivationBuild.objects.get(drv_path__endswith="base.drv")
    top = DerivationBuild.objects.get(drv_path__endswith="top.drv")
    # A drifted graph: base completed but top was never queued, and a dependency is not named.
    DerivationBuild.objects.filter(id=base.id).update(status=BuildStatus.COMPLETED)
    EvaluationBuild.objects.filter(build=base).delete()
    r = refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    assert r.healed == 1
    top.refresh_from_db()
    assert top.status == BuildStatus.QUEUED
    assert EvaluationBuild.objects.filter(evaluation=evaluation, build=base).exists() is False


@pytest.mark.django_db
def test_a_build_aborted_by_a_path_other_than_a_cluster_abort_is_named_then_queued_again() -> None:
    """Issue 34, item 9: a needed build ended Aborted (here as a worker's aborted verdict or a cluster's
    settlement end it, lifecycle.end_build) left the evaluation Building for ever with no reason; it is
    parked naming the build, the heal queues the build again, and the next pass unparks it."""
    project = ProjectFactory()
    evaluation = _building(project, [drv("base"), drv("hello", "base")])
    connected_worker([project])
    base = DerivationBuild.objects.get(drv_path__endswith="-base.drv")
    hello = DerivationBuild.objects.get(drv_path__endswith="-hello.drv")
    DerivationBuild.objects.filter(id=base.id).update(status=BuildStatus.COMPLETED)
    DerivationBuild.objects.filter(id=hello.id).update(status=BuildStatus.QUEUED)
    end_build(
        build_id=hello.id, status=BuildStatus.ABORTED, kind="aborted", error="aborted", now=timezone.now()
    )
    r = refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert evaluation.status == "Waiting" and r.healed == 1
    assert evaluation.waiting_reason["aborted_builds"] == [{"id": str(hello.id), "name": "hello"}]
    assert "aborted: hello;" in w.describe(evaluation.waiting_reason)
    assert brief(evaluation.waiting_reason) == "aborted builds to be queued again: hello"  # the list's column
    hello.refresh_from_db()
    assert hello.status == BuildStatus.QUEUED  # revived by the heal, its dependency done
    refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert (evaluation.status, evaluation.waiting_reason) == ("Building", None)


def _hot(project, *, metrics_age: float = 0.0):  # type: ignore[no-untyped-def]
    return connected_worker(
        [project], cpu_usage_pct=95.0, metrics_at=timezone.now() - timedelta(seconds=metrics_age)
    )


@pytest.mark.django_db
def test_the_pass_parks_work_held_back_by_saturation_and_stale_metrics_hold_nothing_back() -> None:
    """Issue 34, item 9: "3 workers can build it; all report CPU > 80 %"; metrics older than 60 s are
    unknown, so they park nothing (and unpark what they parked)."""
    project = ProjectFactory()
    evaluation = _building(project, [drv("hello")])
    hot = [_hot(project) for _ in range(3)]
    refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert evaluation.status == "Waiting" and evaluation.waiting_reason["reason"] == "saturated"
    assert w.describe(evaluation.waiting_reason) == (
        "Held back by ResourceSaturation: 3 workers can build it; all report CPU > 80 %."
    )
    assert brief(evaluation.waiting_reason) == "a less loaded worker (theirs: CPU > 80 %)"
    later = timezone.now() + timedelta(seconds=61)
    refresh_waiting_state(now=later, grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert (evaluation.status, evaluation.waiting_reason) == ("Building", None)
    assert len(hot) == 3


@pytest.mark.django_db
def test_a_shift_in_the_workers_load_updates_the_words_but_adds_no_fact_to_the_record() -> None:
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv("hello")], now=timezone.now())
    worker = _hot(project)
    refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    facts = RecordEntry.objects.filter(record__job_key=evaluation.job_key).count()
    Worker.objects.filter(id=worker.id).update(ram_free_mb=100, ram_total_mb=16000)
    refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert evaluation.waiting_reason["signals"] == {"CPU > 80 %": 1, "free RAM < 10 %": 1}
    assert "it reports CPU > 80 % and free RAM < 10 %" in w.describe(evaluation.waiting_reason)
    assert RecordEntry.objects.filter(record__job_key=evaluation.job_key).count() == facts


@pytest.mark.django_db
def test_the_simple_policy_holds_nothing_back_for_saturation(settings) -> None:  # type: ignore[no-untyped-def]
    settings.GRADIENT_SCHEDULING_POLICY = "simple"
    project = ProjectFactory()
    evaluation = _building(project, [drv("hello")])
    _hot(project)
    refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert (evaluation.status, evaluation.waiting_reason) == ("Building", None)


@pytest.mark.django_db
def test_the_heal_thaws_retryable_failures_and_adopts_orphaned_pending_builds() -> None:
    project = ProjectFactory()
    evaluation = _building(project, [drv("dep"), drv("app", "dep")])
    dep = DerivationBuild.objects.get(drv_path__endswith="dep.drv")
    DerivationBuild.objects.filter(id=dep.id).update(status=BuildStatus.FAILED_TRANSIENT)
    EvaluationBuild.objects.filter(build=dep).delete()
    out = repair_build_graph(evaluation_id=evaluation.id, now=timezone.now())
    assert out["thawed"] == 1 and out["adopted"] == 1 and out["queued"] == 1
    dep.refresh_from_db()
    assert dep.status == BuildStatus.QUEUED


@pytest.mark.django_db
def test_a_draining_worker_session_counts_as_no_capacity_for_parking() -> None:
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project)
    worker = connected_worker([project])
    WorkerSession.objects.filter(worker=worker).update(draining=True)
    refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert evaluation.waiting_reason == {
        "reason": "eval_workers",
        "capability": "fetch",
        "connected_workers": 0,
    }


# --- a worker that may not take a project's jobs is no capacity for it (issue 34, item 1) ------------


def test_may_take_is_one_shared_project_and_none_serves_every_project() -> None:
    assert may_take(frozenset({"demo"}), ["demo", "other"])
    assert not may_take(frozenset({"demo"}), ["rest-proj"])
    assert not may_take(frozenset(), ["demo"]), "a worker of no project takes nothing"
    assert may_take(None, ["demo"]) and not may_take(None, []), "a job wanted by no project: nobody"


def _serving(*projects: str) -> w.PoolWorker:
    return w.PoolWorker(True, True, True, ("x86_64-linux",), (), projects=frozenset(projects))


def test_a_queued_evaluation_that_no_capable_worker_serves_waits_naming_its_project() -> None:
    pool = w.Pool((_serving("demo"), _serving("demo"), _serving("demo", "docs")))
    v = w.assess(
        status="Queued",
        counters=w.Counters(0, 0, 0),
        has_open_job=False,
        pool=pool,
        blocking=None,
        project="rest-proj",
    )
    assert v.reason == {
        "reason": "eval_workers",
        "capability": "fetch",
        "connected_workers": 3,
        "project": "rest-proj",
        "capable_workers": 3,
        "serving_projects": ["demo", "docs"],
    }
    words = w.describe(v.reason)
    assert "no connected worker serves project rest-proj; 3 connected serve: demo, docs" in words
    served = w.assess(
        status="Queued",
        counters=w.Counters(0, 0, 0),
        has_open_job=False,
        pool=pool,
        blocking=None,
        project="docs",
    )
    assert served.reason is None


def test_a_blocking_build_whose_fitting_workers_serve_no_project_needing_it_waits_for_workers() -> None:
    build = w.BlockingBuild("b1", BuildStatus.QUEUED, "x86_64-linux", (), projects=("rest-proj",))
    v = w.building_verdict([build], w.Pool((_serving("demo"),)))
    assert v.reason is not None and v.reason["reason"] == "workers"
    assert v.reason["unserved"] == [{"projects": ["rest-proj"], "builds": 1}]
    assert v.reason["unmet"] == [] and w.abortable(v.reason)
    assert "no connected worker serves project rest-proj; 1 connected serve: demo" in w.describe(v.reason)
    # A build that another served project's evaluation also needs is handed out for that one.
    shared = w.BlockingBuild("b1", BuildStatus.QUEUED, "x86_64-linux", (), projects=("demo", "rest-proj"))
    assert w.building_verdict([shared], w.Pool((_serving("demo"),))).reason is None


def test_a_project_park_is_aborted_after_the_grace_but_a_missing_capability_alone_is_not() -> None:
    now = timezone.now()
    since = now - timedelta(seconds=301)
    project_park = {"reason": "eval_workers", "capability": "eval", "project": "p", "connected_workers": 1}
    capability_park = {"reason": "eval_workers", "capability": "eval", "connected_workers": 0}
    due = {"waiting_since": since, "pool_stable_since": since, "now": now, "wait_for_workers": False}
    assert w.unbuildable_due(reason=project_park, **due)
    assert not w.unbuildable_due(reason=capability_park, **due)
    assert not w.unbuildable_due(reason=project_park, **{**due, "wait_for_workers": True})


@pytest.mark.django_db
def test_an_evaluation_of_a_project_no_connected_worker_serves_is_parked_then_aborted_after_grace() -> None:
    demo, rest_proj = ProjectFactory(name="demo"), ProjectFactory(name="rest-proj")
    ServerBoot.objects.create(
        hostname="h", pid=1, started_at=timezone.now() - timedelta(hours=1), last_heartbeat=timezone.now()
    )
    for _ in range(3):
        connected_worker([demo])
    evaluation = EvaluationFactory(project=rest_proj)
    refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert evaluation.status == "Waiting"
    assert evaluation.waiting_reason["project"] == "rest-proj"
    assert "no connected worker serves project rest-proj; 3 connected serve: demo" in w.describe(
        evaluation.waiting_reason
    )
    r = refresh_waiting_state(now=timezone.now() + timedelta(seconds=301), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert r.aborted == 1 and evaluation.status == "Aborted"
    assert "no connected worker serves project rest-proj" in evaluation.warnings[-1]


@pytest.mark.django_db
def test_a_project_park_clears_when_a_connected_worker_is_given_the_project() -> None:
    demo, rest_proj = ProjectFactory(name="demo"), ProjectFactory(name="rest-proj")
    worker = connected_worker([demo])
    evaluation = EvaluationFactory(project=rest_proj)
    refresh_waiting_state(now=timezone.now(), grace_secs=300)
    evaluation.refresh_from_db()
    assert evaluation.status == "Waiting" and evaluation.waiting_reason["project"] == "rest-proj"
    worker.projects.add(rest_proj)
    refresh_waiting_state(now=timezone.now(), grace_secs=300)  # the memo sees the pool changed
    evaluation.refresh_from_db()
    assert (evaluation.status, evaluation.waiting_reason) == ("Queued", None)


@pytest.mark.django_db
def test_a_building_evaluation_whose_builds_no_serving_worker_can_take_waits_for_workers() -> None:
    demo, rest_proj = ProjectFactory(name="demo"), ProjectFactory(name="rest-proj")
    evaluation = _building(rest_proj, [drv("solo")])
    connected_worker([demo], architectures=["x86_64-linux"])
    refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert evaluation.status == "Waiting"
    assert evaluation.waiting_reason["unserved"] == [{"projects": ["rest-proj"], "builds": 1}]
