"""The ingest path's decision (graph.decide_builds, over what a part brought) keeps the tenants' rule
that the heal already keeps (services.tenants, decisions.derivations.needed_built_elsewhere; protocol.md,
"Tenants"): one project's cached claim does not substitute a pending build that an active evaluation of
another project, without that word, needs built. Otherwise that evaluation reopens it, the next claim
substitutes it again, and the build goes to the back of the queue each time."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from gradient.scheduling.models import DerivationBuild, Evaluation, EvaluationStatus
from gradient.scheduling.services import graph
from gradient.scheduling.services.assignment import Assignment
from tests.factories import ProjectFactory
from tests.scheduling_helpers import ask, build, build_id_of, drv, evaluating, report, update

pytestmark = pytest.mark.django_db(transaction=True)


def _evaluating(project_name: str) -> tuple[Evaluation, Any, Assignment]:
    return evaluating(ProjectFactory(name=project_name))


def _part(worker: Any, a: Assignment, derivations: list[dict[str, Any]], **extra: Any) -> Any:
    return update(worker.id, a, kind="eval_result", derivations=derivations, warnings=[], errors=[], **extra)


def _claimed(d: dict[str, Any]) -> dict[str, Any]:
    """`d` with its output said to be in the reporting worker's cache."""
    return {**d, "cached_outputs": [{"path": d["outputs"][0]["path"], "nar_size": 1}]}


def _row(d: dict[str, Any]) -> DerivationBuild:
    return DerivationBuild.objects.get(drv_path=d["drv_path"])


def _build_all(worker: Any) -> list[str]:
    built = []
    while (a := ask(worker.id)) is not None:
        built.append(DerivationBuild.objects.get(id=build_id_of(a)).drv_path)
        build(worker.id, a)
    return built


def test_one_projects_part_leaves_pending_what_another_projects_streaming_evaluation_needs_built() -> None:
    q, p = drv("iq"), drv("ip", "iq")
    # B's first part names P, whose input Q is still to come: P waits, linked to B.
    b_eval, b_worker, b_job = _evaluating("ingest-b")
    assert _part(b_worker, b_job, [p], is_final=False).accepted
    assert _row(p).status == "Created"

    # A's worker brings Q and says P is in its cache: P's graph changes with A's part, so A's part decides
    # it. B needs P built and has no such word: P stays pending (it was Substituted here, for B to reopen).
    a_eval, a_worker, a_job = _evaluating("ingest-a")
    outcome = _part(a_worker, a_job, [q, _claimed(p)])
    assert outcome.accepted
    assert _row(p).status == "Created" and _row(q).status == "Queued"
    report(a_worker.id, a_job, "JobCompleted", elapsed_ms=5)

    # B's final part brings Q: P waits on Q, is built once after it, and both evaluations complete.
    assert _part(b_worker, b_job, [q]).accepted
    report(b_worker.id, b_job, "JobCompleted", elapsed_ms=5)
    assert _build_all(b_worker) == [q["drv_path"], p["drv_path"]]
    for evaluation in (a_eval, b_eval):
        evaluation.refresh_from_db()
        assert evaluation.status == EvaluationStatus.COMPLETED, evaluation.status
    assert _row(p).status == "Completed"


def test_a_claim_substitutes_a_build_nobody_else_needs_built_on_the_ingest_path() -> None:
    """The rule holds back only what another project's active evaluation needs built: a build only the
    claiming project needs, or one the other project's finished evaluation needed, is Substituted."""
    q, p = drv("jq"), drv("jp", "jq")
    b_eval, b_worker, b_job = _evaluating("ended-b")
    assert _part(b_worker, b_job, [p], is_final=False).accepted
    # B's evaluation ends (an operator's cancel, say): it needs nothing any more.
    Evaluation.objects.filter(id=b_eval.id).update(status=EvaluationStatus.ABORTED)

    _, a_worker, a_job = _evaluating("ended-a")
    assert _part(a_worker, a_job, [q, _claimed(p)]).accepted
    assert _row(p).status == "Substituted"


def test_the_decision_of_a_part_and_of_a_whole_result_both_keep_the_rule() -> None:
    """decide_builds (a part's scope) and decide_evaluation_graph (a whole result's links) share the
    substitution: each leaves the build pending while B needs it, and substitutes it once B has the word
    too."""
    from gradient.scheduling.models import CachedPathClaim

    p = drv("kp")
    b_eval, b_worker, b_job = _evaluating("both-b")
    assert _part(b_worker, b_job, [p], is_final=False).accepted
    a_eval, a_worker, a_job = _evaluating("both-a")
    assert _part(a_worker, a_job, [_claimed(p)]).accepted
    assert _row(p).status == "Queued"  # B's, without inputs: queued with B's part
    p_id = _row(p).id
    now = timezone.now()
    assert graph.decide_builds(build_ids=[p_id], project_id=a_eval.project_id, now=now).substituted == 0
    assert (
        graph.decide_evaluation_graph(
            evaluation_id=a_eval.id, project_id=a_eval.project_id, now=now
        ).substituted
        == 0
    )
    assert _row(p).status == "Queued"
    # B's side says so too (a worker of B confirmed the path): nothing holds it back any more.
    CachedPathClaim.objects.create(path=p["outputs"][0]["path"], project_id=b_eval.project_id, created_at=now)
    assert graph.decide_builds(build_ids=[p_id], project_id=a_eval.project_id, now=now).substituted == 1
    assert _row(p).status == "Substituted"


@pytest.mark.parametrize("remembered", [True, False])
def test_a_re_evaluation_in_parts_builds_for_its_project_what_another_projects_word_alone_substituted(
    remembered: bool,
) -> None:
    """A re-evaluation's later parts read their builds before inserting (services.ingest: the process
    remembers that the earlier parts found them existing) or insert first; either way a build it reads
    Substituted on another project's word alone is Created again for it (graph.reopen_unconfirmed), and
    only those are looked at."""
    from gradient.scheduling.services import ingest

    p, q = drv("rp"), [drv(f"rq{i}") for i in range(4)]
    _, a_worker, a_job = _evaluating("reread-a")
    assert _part(a_worker, a_job, [_claimed(p), *q]).accepted
    report(a_worker.id, a_job, "JobCompleted", elapsed_ms=5)
    assert _row(p).status == "Substituted"

    b_eval, b_worker, b_job = _evaluating("reread-b")
    assert _part(b_worker, b_job, q, is_final=False).accepted  # all existing: the next part reads first
    ingest_id = b_eval.ingests.get().pk
    assert ingest._hints.reusing(ingest_id) or connection.vendor != "postgresql"  # remembered on PostgreSQL
    if not remembered:
        ingest._hints.drop(ingest_id)
    outcome = _part(b_worker, b_job, [p])
    assert outcome.accepted
    assert _row(p).status == "Queued", outcome.detail  # Created again for B, and queued (no inputs)


def test_a_part_refused_for_a_conflict_found_as_it_is_stored_leaves_nothing_of_it() -> None:
    """The conflicts check reads the existing builds the store reads (services.ingest), after its first
    writes: the part is taken in a savepoint, so a refused part leaves no new build, no cached claim, no
    link (its known derivations' neither), no warning, whether it inserted first or read first."""
    from gradient.scheduling.models import CachedPathClaim, EvalIngest
    from gradient.scheduling.models import EvaluationBuild as Link

    held, q, known_one = drv("ch"), [drv(f"cq{i}") for i in range(4)], drv("ck")
    _, a_worker, a_job = _evaluating("conflict-a")
    assert _part(a_worker, a_job, [held, *q, known_one]).accepted
    report(a_worker.id, a_job, "JobCompleted", elapsed_ms=5)
    before = set(DerivationBuild.objects.values_list("drv_path", "system", "status"))

    for first in ([], q):  # a first part that inserts first; a later one that reads first
        b_eval, b_worker, b_job = _evaluating(f"conflict-b{len(first)}")
        if first:
            assert _part(b_worker, b_job, first, is_final=False).accepted
        linked = set(Link.objects.filter(evaluation=b_eval).values_list("build_id", flat=True))
        new = drv(f"cnew{len(first)}")
        outcome = update(
            b_worker.id,
            b_job,
            kind="eval_result",
            derivations=[_claimed(new), {**held, "system": "evil-none"}],
            warnings=["a warning of the refused part"],
            errors=[],
            known_drvs=[known_one["drv_path"]],
        )
        assert outcome.accepted and "refused" in outcome.detail, outcome.detail
        b_eval.refresh_from_db()
        assert b_eval.status == EvaluationStatus.FAILED
        assert b_eval.warnings == [] and len(b_eval.errors) == 1 and held["drv_path"] in b_eval.errors[0]
        assert set(DerivationBuild.objects.values_list("drv_path", "system", "status")) == before
        assert not CachedPathClaim.objects.filter(path=new["outputs"][0]["path"]).exists()
        assert set(Link.objects.filter(evaluation=b_eval).values_list("build_id", flat=True)) == linked
        assert EvalIngest.objects.get(evaluation=b_eval).decided_at is not None  # later parts: stale


def test_a_part_names_as_unconfirmed_only_its_substituted_builds_not_cached_for_its_project() -> None:
    """What store_part hands to graph.reopen_unconfirmed: the existing builds it read Substituted with an
    output not cached for the evaluation's project, and no other (a build cached for the project by its
    own word, or one still pending, is not doubtful)."""
    from django.db import transaction

    from gradient.scheduling.services.ingest import store_part
    from tests.factories import EvaluationFactory

    p, q = drv("up"), drv("uq")
    a_eval, a_worker, a_job = _evaluating("unconfirmed-a")
    assert _part(a_worker, a_job, [_claimed(p), q]).accepted
    assert (_row(p).status, _row(q).status) == ("Substituted", "Queued")
    for evaluation, doubtful in (
        (EvaluationFactory(project=ProjectFactory(name="unconfirmed-b")), {str(_row(p).id)}),
        (EvaluationFactory(project=a_eval.project), set()),
    ):
        with transaction.atomic():
            stored = store_part(
                evaluation=evaluation,
                derivations=[wire_drv(p), wire_drv(q)],
                ingest_id=None,
                hold=False,
                final=True,
                now=timezone.now(),
            )
        assert stored.unconfirmed is None or stored.unconfirmed == doubtful, evaluation.project.name
        if connection.vendor == "postgresql":
            assert stored.unconfirmed == doubtful


def wire_drv(d: dict[str, Any]) -> Any:
    import msgspec

    from gradient.core.protocol import DiscoveredDerivation

    return msgspec.convert(d, DiscoveredDerivation)
