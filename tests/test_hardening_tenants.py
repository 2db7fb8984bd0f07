"""Tenants cannot decide each other's builds (issue 36, finding 2; protocol.md, "Tenants"): a derivation
path names one derivation, so an eval_result that names a held path with another system, other inputs or
other outputs is refused (its evaluation fails naming the path and what differed; the held build is
unchanged; counted in the gradient_derivation_conflicts_total total), across two projects, whichever
came first."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from gradient.core.protocol import DiscoveredDerivation
from gradient.runtime import metrics
from gradient.scheduling.decisions.derivations import HeldDerivation, conflict, inputs_digest, outputs_of
from gradient.scheduling.models import DerivationBuild, Evaluation, EvaluationStatus
from gradient.scheduling.services.assignment import Assignment
from tests.factories import ProjectFactory
from tests.scheduling_helpers import drv, evaluating, update

pytestmark = pytest.mark.django_db(transaction=True)


def _held(d: dict[str, Any]) -> HeldDerivation:
    return HeldDerivation(
        d["system"], outputs_of(d["outputs"]), inputs_digest(d["drv_path"], d["input_drvs"])
    )


def _reported(d: dict[str, Any]) -> DiscoveredDerivation:
    return msgspec.convert(d, DiscoveredDerivation)


def test_a_report_that_agrees_with_the_held_derivation_is_no_conflict_and_one_that_differs_says_how() -> None:
    r = drv("r", "q")
    assert conflict(_reported(r), _held(r)) is None
    assert (
        conflict(_reported({**r, "input_drvs": [*r["input_drvs"], r["drv_path"]]}), _held(r)) is None
    )  # itself: ignored
    text = conflict(_reported({**r, "system": "evil-none"}), _held(r))
    assert text is not None and r["drv_path"] in text and "system 'evil-none'" in text
    assert "other input_drvs" in (conflict(_reported({**r, "input_drvs": []}), _held(r)) or "")
    other = [{"name": "out", "path": "/nix/store/" + "9" * 32 + "-elsewhere"}]
    assert "other outputs" in (conflict(_reported({**r, "outputs": other}), _held(r)) or "")
    # A build stored before digests were kept: its inputs are not compared.
    held = HeldDerivation(r["system"], outputs_of(r["outputs"]), "")
    assert conflict(_reported({**r, "input_drvs": []}), held) is None


def _evaluating(project_name: str) -> tuple[Evaluation, Any, Assignment]:
    return evaluating(ProjectFactory(name=project_name))


def _report(worker: Any, a: Assignment, derivations: list[dict[str, Any]], **extra: Any) -> Any:
    return update(worker.id, a, kind="eval_result", derivations=derivations, warnings=[], errors=[], **extra)


def _held_rows() -> list[tuple[Any, ...]]:
    return list(
        DerivationBuild.objects.order_by("drv_path").values_list(
            "drv_path", "system", "outputs", "inputs_digest", "status"
        )
    )


def _conflicts_counted() -> float:
    return sum(metrics.totals().get(metrics.DERIVATION_CONFLICTS, {}).values())


def test_a_held_path_named_otherwise_by_another_project_is_refused_and_the_build_unchanged() -> None:
    true_p, true_r = drv("p"), drv("r", "p")
    # Project A's worker speaks first, and lies: R is for a system no worker has.
    a_eval, a_worker, a_job = _evaluating("tenant-a")
    liar_r = {**true_r, "system": "evil-none"}
    assert _report(a_worker, a_job, [true_p, liar_r]).accepted
    held = _held_rows()
    counted = _conflicts_counted()

    # Project B reports the truth about R: refused, B's evaluation fails saying so; R is unchanged.
    b_eval, b_worker, b_job = _evaluating("tenant-b")
    outcome = _report(b_worker, b_job, [true_p, true_r])
    assert outcome.accepted and "refused" in outcome.detail
    b_eval.refresh_from_db()
    assert b_eval.status == EvaluationStatus.FAILED
    (error,) = b_eval.errors
    assert true_r["drv_path"] in error and "system 'x86_64-linux' (held: 'evil-none')" in error
    assert true_p["drv_path"] not in error  # P agreed
    assert _held_rows() == held
    assert not b_eval.build_links.exists()  # nothing of the refused report was linked
    assert _conflicts_counted() == counted + 1
    # A part after the refusal is stale: dropped, nothing changes.
    assert not _report(b_worker, b_job, [true_p]).accepted

    # And the other way round: B first with the truth about Q, then A drops Q's input.
    true_q = drv("q", "p")
    b2_eval, b2_worker, b2_job = _evaluating("tenant-b2")
    assert _report(b2_worker, b2_job, [true_p, true_q]).accepted
    held = _held_rows()
    a2_eval, a2_worker, a2_job = _evaluating("tenant-a2")
    assert _report(a2_worker, a2_job, [{**true_q, "input_drvs": []}], is_final=False).accepted is True
    a2_eval.refresh_from_db()
    assert a2_eval.status == EvaluationStatus.FAILED
    assert "other input_drvs" in a2_eval.errors[0] and true_q["drv_path"] in a2_eval.errors[0]
    assert _held_rows() == held
    b2_eval.refresh_from_db()
    assert b2_eval.status != EvaluationStatus.FAILED


# --- An eval_result is bounded (issue 36, finding 9) -------------------------------------------------------


def test_an_eval_result_past_the_derivation_cap_fails_its_evaluation_and_nothing_of_it_is_queued() -> None:
    from django.test import override_settings
    from django.utils import timezone

    from gradient.scheduling.models import BuildStatus
    from gradient.scheduling.services.passes import build_resync_pass

    evaluation, worker, a = _evaluating("capped")
    parts = [[drv(f"c{n}-{i}") for i in range(20)] for n in range(4)]
    with override_settings(GRADIENT_EVAL_MAX_DERIVATIONS=50):
        assert _report(worker, a, parts[0], is_final=False).accepted
        assert _report(worker, a, parts[1], is_final=False).accepted
        outcome = _report(worker, a, parts[2], is_final=False)  # 60 > 50
        assert outcome.accepted and "refused" in outcome.detail
        assert not _report(worker, a, parts[3]).accepted  # the final part, after the refusal: stale
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.FAILED
    assert "more than 50 derivations" in evaluation.errors[-1]
    assert "GRADIENT_EVAL_MAX_DERIVATIONS" in evaluation.errors[-1]
    # What the first parts stored ends as a cancel ends it; the resync queues none of it.
    build_resync_pass(now=timezone.now())
    statuses = set(DerivationBuild.objects.values_list("status", flat=True))
    assert statuses == {BuildStatus.ABORTED}, statuses
    assert DerivationBuild.objects.count() == 40


# --- A cached claim is the reporting worker's projects' (issue 36, finding 2, second half) ------------------


def _status(d: dict[str, Any]) -> str:
    return DerivationBuild.objects.get(drv_path=d["drv_path"]).status


def _build_all(worker: Any) -> list[str]:
    """Every build the worker is handed, built (its outputs reported): their drv paths."""
    from tests.scheduling_helpers import ask, build, build_id_of

    built = []
    while (a := ask(worker.id)) is not None:
        built.append(DerivationBuild.objects.get(id=build_id_of(a)).drv_path)
        build(worker.id, a)
    return built


def test_another_projects_cached_claim_does_not_finish_a_build_for_this_project() -> None:
    from tests.scheduling_helpers import report

    p, r = drv("tp"), drv("tr", "tp")
    # Project A's worker says P's output is in its cache: P is Substituted for A.
    a_eval, a_worker, a_job = _evaluating("claims-a")
    assert _report(a_worker, a_job, [_claimed(p), r]).accepted
    assert _status(p) == "Substituted" and _status(r) == "Queued"

    # Project B needs P and R and says nothing of a cache: P is not done for B on A's word; it is built.
    b_eval, b_worker, b_job = _evaluating("claims-b")
    assert _report(b_worker, b_job, [p, r]).accepted
    assert _status(p) == "Queued"
    report(b_worker.id, b_job, "JobCompleted", elapsed_ms=5)
    b_eval.refresh_from_db()
    assert b_eval.status == EvaluationStatus.BUILDING
    assert set(_build_all(b_worker)) == {p["drv_path"], r["drv_path"]}
    b_eval.refresh_from_db()
    assert b_eval.status == EvaluationStatus.COMPLETED
    assert _status(p) == "Completed"  # built, not Substituted


def test_a_known_derivation_substituted_on_another_projects_word_is_built_for_this_one() -> None:
    """The same when B names P in known_drvs (protocol.md, "Known derivations") instead of sending it."""
    p, r = drv("kp"), drv("kr", "kp")
    _, a_worker, a_job = _evaluating("known-a")
    assert _report(a_worker, a_job, [_claimed(p)]).accepted
    assert _status(p) == "Substituted"
    b_eval, b_worker, b_job = _evaluating("known-b")
    assert _report(b_worker, b_job, [r], known_drvs=[p["drv_path"]]).accepted
    assert _status(p) == "Queued" and _status(r) == "Created"
    assert set(b_eval.build_links.values_list("build__drv_path", flat=True)) == {p["drv_path"], r["drv_path"]}


def test_a_build_substituted_on_another_projects_word_after_it_was_linked_is_built_before_completing() -> (
    None
):
    """The other order: B links P while it is pending; then A's claim substitutes it. The heal of A's graph
    does not (B needs P built: services.tenants), but one that read P's needs before B's link committed
    would. B does not complete on it: P is built first."""
    from django.utils import timezone

    from gradient.scheduling.services import graph
    from gradient.scheduling.services.passes import build_resync_pass
    from gradient.scheduling.services.waiting import repair_build_graph
    from tests.scheduling_helpers import report

    p, r = drv("up"), drv("ur", "up")
    b_eval, b_worker, b_job = _evaluating("late-b")
    assert _report(b_worker, b_job, [p, r]).accepted
    report(b_worker.id, b_job, "JobCompleted", elapsed_ms=5)
    assert _status(p) == "Queued"

    a_eval, a_worker, a_job = _evaluating("late-a")
    assert _report(a_worker, a_job, [_claimed(p)]).accepted
    assert repair_build_graph(evaluation_id=a_eval.id, now=timezone.now())["substituted"] == 0
    assert _status(p) == "Queued"
    # The racing heal: what repair_build_graph's substitution step does, without the check.
    p_id = DerivationBuild.objects.get(drv_path=p["drv_path"]).id
    assert graph.substitute_cached_builds(build_ids=[p_id], project_id=a_eval.project_id, now=timezone.now())
    build_resync_pass(now=timezone.now())  # R's dependency succeeded: queued by the resync
    assert _status(p) == "Substituted" and _status(r) == "Queued"

    # B's R builds; B would be done, but P was only A's word: P is built for B first.
    assert _build_all(b_worker) == [r["drv_path"], p["drv_path"]]
    b_eval.refresh_from_db()
    assert b_eval.status == EvaluationStatus.COMPLETED
    assert _status(p) == "Completed"


def _claimed(d: dict[str, Any]) -> dict[str, Any]:
    """`d` with its output said to be in the reporting worker's cache."""
    return {**d, "cached_outputs": [{"path": d["outputs"][0]["path"], "nar_size": 1}]}


def test_a_cached_claim_counts_for_every_project_its_worker_serves_and_with_a_trusted_cache_for_all() -> None:
    from django.test import override_settings

    from tests.factories import EvaluationFactory, connected_worker
    from tests.scheduling_helpers import ask, update

    # A worker of A and C says P is cached in an evaluation of A: C's evaluation takes its word, and so
    # does A's next one; E's does not (P is built for E).
    p = drv("vp")
    a, c = ProjectFactory(name="serves-a"), ProjectFactory(name="serves-c")
    a_eval = EvaluationFactory(project=a)
    both = connected_worker([a, c])
    job = ask(both.id, "flake")
    assert job is not None and job.job_key == a_eval.job_key
    update(both.id, job, kind="evaluating_derivations")
    assert _report(both, job, [_claimed(p)]).accepted
    assert _status(p) == "Substituted"
    for project in (c, a):
        _, worker, job = evaluating(project)
        assert _report(worker, job, [p]).accepted
        assert _status(p) == "Substituted"
    _, e_worker, e_job = _evaluating("serves-e")
    assert _report(e_worker, e_job, [p]).accepted
    assert _status(p) == "Queued"
    # With one cache the operator trusts for all (GRADIENT_TRUSTED_CACHE), a claim counts for everyone.
    r = drv("vr")
    with override_settings(GRADIENT_TRUSTED_CACHE=True):
        _, f_worker, f_job = _evaluating("trusting-f")
        assert _report(f_worker, f_job, [_claimed(r)]).accepted
    _, g_worker, g_job = _evaluating("trusting-g")
    assert _report(g_worker, g_job, [r]).accepted
    assert _status(r) == "Substituted"


@pytest.mark.parametrize(
    ("needed_by", "cached", "held"),
    [
        ([], {}, set()),  # nobody else needs it: the claim may substitute it
        ([("p", "B")], {"B": {"/o/p"}}, set()),  # B has the word too
        ([("p", "B")], {"B": set()}, {"p"}),  # B needs P built
        ([("q", "B")], {"B": {"/o/q1"}}, {"q"}),  # one output of two is not enough
        ([("p", "B"), ("p", "C")], {"B": {"/o/p"}}, {"p"}),  # C has no word
        ([("gone", "B")], {}, set()),  # not among the candidates (no longer pending)
    ],
)
def test_a_claim_leaves_pending_what_another_projects_evaluation_needs_built(
    needed_by: list[tuple[str, str]], cached: dict[str, set[str]], held: set[str]
) -> None:
    from gradient.scheduling.decisions.derivations import needed_built_elsewhere

    outputs = {"p": ["/o/p"], "q": ["/o/q1", "/o/q2"]}
    assert needed_built_elsewhere(outputs, needed_by, cached) == held


def _finish(evaluation: Evaluation) -> None:
    """The completion check a finished build or the waiting pass makes (graph.finish_evaluations)."""
    from django.db import transaction
    from django.utils import timezone

    from gradient.scheduling.services import graph

    with transaction.atomic():
        graph.finish_evaluations(evaluation_ids=[evaluation.id], now=timezone.now())


def test_two_projects_that_disagree_on_a_shared_build_settle_it_is_built_once_and_keeps_its_place() -> None:
    """Project A's worker keeps saying P is cached (its heals, its new evaluations); project B, which
    needs P, has no such word. Before, each heal of A substituted P again and B's completion check
    reopened it, at the back of the queue each time, for as long as A kept at it. Now P, reopened once
    for B, is not substituted again while an evaluation of a project without the claim needs it: it
    keeps its place, is built once, and both evaluations complete."""
    from django.utils import timezone

    from gradient.scheduling.services.waiting import repair_build_graph
    from tests.scheduling_helpers import report

    p, ra, rb = drv("fp"), drv("fra", "fp"), drv("frb", "fp")
    a_eval, a_worker, a_job = _evaluating("flap-a")
    assert _report(a_worker, a_job, [_claimed(p), ra]).accepted
    report(a_worker.id, a_job, "JobCompleted", elapsed_ms=5)
    assert _status(p) == "Substituted" and _status(ra) == "Queued"

    b_eval, b_worker, b_job = _evaluating("flap-b")
    assert _report(b_worker, b_job, [p, rb]).accepted
    report(b_worker.id, b_job, "JobCompleted", elapsed_ms=5)
    assert _status(p) == "Queued"  # reopened once, for B
    queued_at = DerivationBuild.objects.get(drv_path=p["drv_path"]).queued_at

    for cycle in range(3):
        # A heals its graph (its claim still stands) and evaluates again, claiming P each time.
        repair_build_graph(evaluation_id=a_eval.id, now=timezone.now())
        again, worker, job = evaluating(a_eval.project)
        assert _report(worker, job, [_claimed(p), ra]).accepted, cycle
        report(worker.id, job, "JobCompleted", elapsed_ms=5)
        _finish(b_eval)
        row = DerivationBuild.objects.get(drv_path=p["drv_path"])
        assert (row.status, row.queued_at) == ("Queued", queued_at), cycle

    # P is built once (for everyone: its outputs confirmed), then what waited on it; both complete.
    built = _build_all(b_worker)
    assert built.count(p["drv_path"]) == 1 and built[0] == p["drv_path"], built
    _build_all(a_worker)
    for evaluation in (a_eval, b_eval):
        evaluation.refresh_from_db()
        assert evaluation.status == EvaluationStatus.COMPLETED, evaluation.status
    assert _status(p) == "Completed"
