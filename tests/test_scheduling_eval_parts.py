"""An eval_result in parts (protocol.md, "Large evaluations"): each part stored as it arrives, the graph
decided at the final part, stale parts and a JobCompleted before the final part as the spec says."""

from __future__ import annotations

import functools
import uuid
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from gradient.scheduling.models import (
    BuildStatus,
    DerivationBuild,
    DerivationBuildDependency,
    DispatchedJob,
    EvalIngestInput,
    Evaluation,
    EvaluationBuild,
    EvaluationStatus,
)
from gradient.scheduling.services import graph, ingest
from gradient.scheduling.services.assignment import Assignment
from gradient.scheduling.services.lifecycle import assignment_return_to_pool
from gradient.scheduling.services.passes import build_resync_pass
from tests.factories import EvaluationFactory, connected_worker
from tests.scheduling_helpers import ask, build, build_id_of, drv, evaluating, nixpkgs_like, report, update
from tests.support.plans import INGEST_TABLES, PlanWork, new_installation

pytestmark = pytest.mark.django_db


def _expected(derivations: list[dict[str, Any]]) -> tuple[set[tuple[str, str]], set[str]]:
    """The edges (build, dependency) by path, and the paths that can start at once (the leaves: every
    input cached, and not cached themselves)."""
    cached = {d["drv_path"] for d in derivations if d["cached_outputs"]}
    edges = {(d["drv_path"], i) for d in derivations for i in d["input_drvs"]}
    leaves = {
        d["drv_path"]
        for d in derivations
        if d["drv_path"] not in cached and all(i in cached for i in d["input_drvs"])
    }
    return edges, leaves


def _edges() -> set[tuple[str, str]]:
    return set(DerivationBuildDependency.objects.values_list("build__drv_path", "dependency__drv_path"))


def _status(status: str) -> set[str]:
    return set(DerivationBuild.objects.filter(status=status).values_list("drv_path", flat=True))


def _evaluating() -> tuple[Evaluation, Any, Assignment]:
    return evaluating()


def _send(
    worker: Any, a: Assignment, derivations: list[dict[str, Any]], size: int, **extra: Any
) -> list[Any]:
    chunks = [derivations[i : i + size] for i in range(0, len(derivations), size)] or [[]]
    outcomes = []
    for n, chunk in enumerate(chunks):
        final = n == len(chunks) - 1
        outcomes.append(
            update(
                worker.id,
                a,
                kind="eval_result",
                derivations=chunk,
                warnings=[f"w{n}"],
                errors=[],
                is_final=final,
                **extra,
            )
        )
    return outcomes


def _snapshot() -> list[tuple[object, ...]]:
    rows: list[tuple[object, ...]] = []
    rows += list(DerivationBuild.objects.order_by("drv_path").values_list("drv_path", "status", "ingest_id"))
    rows += sorted(_edges())
    rows += list(EvaluationBuild.objects.order_by("build__drv_path").values_list("build__drv_path", "attr"))
    rows += list(EvalIngestInput.objects.order_by("id").values_list("build_id", "input_drv_path"))
    rows += list(Evaluation.objects.order_by("id").values_list("id", "status", "warnings", "errors"))
    return rows


def test_a_result_in_parts_keeps_every_edge_and_queues_exactly_the_leaves() -> None:
    evaluation, worker, a = _evaluating()
    derivations = nixpkgs_like(1000)
    edges, leaves = _expected(derivations)
    chunks = [derivations[i : i + 100] for i in range(0, 1000, 100)]
    for chunk in chunks[:-1]:
        outcome = update(
            worker.id, a, kind="eval_result", derivations=chunk, warnings=["w"], errors=[], is_final=False
        )
        assert outcome.accepted and "part" in outcome.detail
    # Before the final part, what can start has started (issue 30): each build whose inputs all arrived
    # and are cached; the cached ones are substituted. Nothing else, even for the resync pass.
    arrived = {d["drv_path"]: d for chunk in chunks[:-1] for d in chunk}
    cached = {p for p, d in arrived.items() if d["cached_outputs"]}
    early = {p for p, d in arrived.items() if p not in cached and all(i in cached for i in d["input_drvs"])}
    build_resync_pass(now=timezone.now())
    assert early and _status(BuildStatus.QUEUED) == early
    assert _status(BuildStatus.SUBSTITUTED) == cached
    outcome = update(
        worker.id, a, kind="eval_result", derivations=chunks[-1], warnings=["w"], errors=[], is_final=True
    )
    assert outcome.accepted and "final part 10" in outcome.detail
    assert _edges() == edges
    assert _status(BuildStatus.QUEUED) == leaves
    assert _status(BuildStatus.SUBSTITUTED) == {d["drv_path"] for d in derivations if d["cached_outputs"]}
    assert not EvalIngestInput.objects.exists()
    assert EvaluationBuild.objects.filter(evaluation=evaluation).count() == 1000
    evaluation.refresh_from_db()
    assert evaluation.warnings == ["w"] * 10
    assert report(worker.id, a, "JobCompleted", elapsed_ms=1).accepted
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.BUILDING


def test_the_same_result_in_one_frame_or_in_parts_makes_the_same_graph() -> None:
    derivations = nixpkgs_like(300, seed=3)
    whole_edges, leaves = _expected(derivations)
    evaluation, worker, a = _evaluating()
    _send(worker, a, derivations, 37)
    assert _edges() == whole_edges and _status(BuildStatus.QUEUED) == leaves


def test_a_derivation_named_in_two_parts_counts_once() -> None:
    evaluation, worker, a = _evaluating()
    parts = [[drv("a"), drv("b", "a", "c")], [drv("b", "a", "c"), drv("a")], [drv("c")]]
    for n, part in enumerate(parts):
        update(worker.id, a, kind="eval_result", derivations=part, warnings=[], errors=[], is_final=n == 2)
    assert DerivationBuild.objects.count() == 3
    assert EvaluationBuild.objects.filter(evaluation=evaluation).count() == 3
    assert _edges() == {
        (drv("b")["drv_path"], drv("a")["drv_path"]),
        (drv("b")["drv_path"], drv("c")["drv_path"]),
    }
    assert _status(BuildStatus.QUEUED) == {drv("a")["drv_path"], drv("c")["drv_path"]}


def test_an_input_that_is_in_no_part_is_ignored_as_in_a_whole_result() -> None:
    evaluation, worker, a = _evaluating()
    update(
        worker.id,
        a,
        kind="eval_result",
        derivations=[drv("top", "elsewhere")],
        warnings=[],
        errors=[],
        is_final=False,
    )
    assert EvalIngestInput.objects.count() == 1
    update(worker.id, a, kind="eval_result", derivations=[], warnings=[], errors=[], is_final=True)
    assert not _edges() and _status(BuildStatus.QUEUED) == {drv("top")["drv_path"]}
    assert not EvalIngestInput.objects.exists()


def test_a_part_after_the_final_one_is_dropped() -> None:
    evaluation, worker, a = _evaluating()
    _send(worker, a, [drv("a"), drv("b", "a")], 1)
    before = _snapshot()
    late = update(
        worker.id,
        a,
        kind="eval_result",
        derivations=[drv("late", "a")],
        warnings=["late"],
        errors=["late"],
        is_final=False,
    )
    assert late.accepted is False and "after the final" in late.detail
    again = update(worker.id, a, kind="eval_result", derivations=[drv("late2")], warnings=[], errors=[])
    assert again.accepted is False
    assert _snapshot() == before


def test_a_whole_result_followed_by_another_eval_result_drops_the_second() -> None:
    evaluation, worker, a = _evaluating()
    assert update(worker.id, a, kind="eval_result", derivations=[drv("a")], warnings=[], errors=[]).accepted
    before = _snapshot()
    assert not update(
        worker.id, a, kind="eval_result", derivations=[drv("b")], warnings=[], errors=[]
    ).accepted
    assert _snapshot() == before


def test_a_part_on_a_stale_assignment_changes_nothing() -> None:
    evaluation, worker, a = _evaluating()
    update(worker.id, a, kind="eval_result", derivations=[drv("a")], warnings=[], errors=[], is_final=False)
    row = DispatchedJob.objects.get(id=a.assignment_id)
    assert assignment_return_to_pool(row=row, reason="worker lost", lost=True, now=timezone.now())
    before = _snapshot()
    for final in (False, True):
        outcome = update(
            worker.id,
            a,
            kind="eval_result",
            derivations=[drv("b", "a")],
            warnings=["x"],
            errors=[],
            is_final=final,
        )
        assert outcome.accepted is False
    bogus = Assignment.__new__(Assignment)
    object.__setattr__(bogus, "job_key", a.job_key)
    object.__setattr__(bogus, "assignment_id", uuid.uuid4())
    assert not update(
        worker.id, bogus, kind="eval_result", derivations=[drv("c")], warnings=[], errors=[]
    ).accepted
    assert _snapshot() == before


def test_job_completed_before_the_final_part_fails_the_evaluation_and_nothing_of_it_is_built() -> None:
    evaluation, worker, a = _evaluating()
    derivations = nixpkgs_like(200)
    for i in range(0, 100, 50):
        update(
            worker.id,
            a,
            kind="eval_result",
            derivations=derivations[i : i + 50],
            warnings=[],
            errors=[],
            is_final=False,
        )
    outcome = report(worker.id, a, "JobCompleted", elapsed_ms=5)
    assert outcome.accepted and "before the final" in outcome.detail
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.FAILED
    assert (
        "before the final part of its eval_result (2 parts, 100 derivations received)"
        in evaluation.errors[-1]
    )
    build_resync_pass(now=timezone.now())
    builder = connected_worker([evaluation.project])
    assert ask(builder.id) is None
    assert not DerivationBuild.objects.filter(status=BuildStatus.BUILDING).exists()
    # The session goes on: the same worker takes the next evaluation.
    nxt = EvaluationFactory(project=evaluation.project)
    b = ask(worker.id, "flake")
    assert b is not None and b.job_key == nxt.job_key


def test_a_re_evaluation_in_parts_after_a_lost_assignment_arrives_whole() -> None:
    evaluation, worker, a = _evaluating()
    derivations = nixpkgs_like(400, seed=11)
    edges, leaves = _expected(derivations)
    for i in range(0, 200, 50):
        update(
            worker.id,
            a,
            kind="eval_result",
            derivations=derivations[i : i + 50],
            warnings=[],
            errors=[],
            is_final=False,
        )
    row = DispatchedJob.objects.get(id=a.assignment_id)
    assert assignment_return_to_pool(row=row, reason="worker lost", lost=True, now=timezone.now())
    build_resync_pass(now=timezone.now())
    # Builds whose inputs are not all known yet never start.
    pending = set(EvalIngestInput.objects.values_list("build__drv_path", flat=True))
    assert pending and not pending & _status(BuildStatus.QUEUED)
    again = ask(worker.id, "flake")
    assert again is not None and again.job_key == evaluation.job_key
    _send(worker, again, derivations, 60)
    assert _edges() == edges
    assert _status(BuildStatus.QUEUED) == leaves
    assert not EvalIngestInput.objects.exists()


def test_re_evaluating_the_same_result_writes_no_edge_and_no_build() -> None:
    derivations = nixpkgs_like(300, seed=5)
    first, worker, a = _evaluating()
    _send(worker, a, derivations, 40)
    report(worker.id, a, "JobCompleted", elapsed_ms=1)
    edges = DerivationBuildDependency.objects.count()
    builds = list(DerivationBuild.objects.order_by("id").values_list("id", "updated_at", "status"))
    second = EvaluationFactory(project=first.project)
    b = ask(worker.id, "flake")
    assert b is not None and b.job_key == second.job_key
    _send(worker, b, derivations, 40)
    assert DerivationBuildDependency.objects.count() == edges
    assert list(DerivationBuild.objects.order_by("id").values_list("id", "updated_at", "status")) == builds
    assert EvaluationBuild.objects.filter(evaluation=second).count() == 300


def test_two_evaluations_sending_the_same_new_derivations_in_parts_at_once_make_one_graph() -> None:
    derivations = nixpkgs_like(200, seed=9)
    edges, leaves = _expected(derivations)
    e1, w1, a1 = _evaluating()
    e2, w2, a2 = _evaluating()
    chunks = [derivations[i : i + 30] for i in range(0, 200, 30)]
    for n, chunk in enumerate(chunks):
        final = n == len(chunks) - 1
        update(w1.id, a1, kind="eval_result", derivations=chunk, warnings=[], errors=[], is_final=final)
        update(
            w2.id,
            a2,
            kind="eval_result",
            derivations=list(reversed(chunk)),
            warnings=[],
            errors=[],
            is_final=final,
        )
    assert DerivationBuild.objects.count() == 200
    assert _edges() == edges and _status(BuildStatus.QUEUED) == leaves


def test_a_build_of_a_result_still_arriving_is_queued_once_its_closure_arrived() -> None:
    """Builds start while the evaluation streams (protocol.md, "Large evaluations"): a build is queued
    after the part that completes its input closure, once its inputs are built or cached; not before."""
    evaluation, worker, a = _evaluating()
    send = functools.partial(update, worker.id, a, kind="eval_result", warnings=[], errors=[])
    # b needs a, which has not arrived; c needs nothing; d needs the cached e.
    send(derivations=[drv("b", "a"), drv("c"), drv("d", "e"), drv("e", cached=True)], is_final=False)
    assert _status(BuildStatus.QUEUED) == {drv("c")["drv_path"], drv("d")["drv_path"]}
    assert EvalIngestInput.objects.filter(input_drv_path=drv("a")["drv_path"]).exists()
    # a arrives: queued; b waits for a to be built.
    send(derivations=[drv("a")], is_final=False)
    assert _status(BuildStatus.QUEUED) == {drv(n)["drv_path"] for n in "acd"}
    assert (drv("b")["drv_path"], drv("a")["drv_path"]) in _edges()
    builder = connected_worker([evaluation.project])
    while (job := ask(builder.id)) is not None:
        build(builder.id, job)
    assert _status(BuildStatus.COMPLETED) == {drv(n)["drv_path"] for n in "abcd"}
    outcome = send(derivations=[], is_final=True)
    assert outcome.accepted and "0 queued" in outcome.detail


def test_a_shared_build_of_a_result_still_arriving_is_queued_for_the_other_evaluation_too() -> None:
    evaluation, worker, a = _evaluating()
    update(
        worker.id, a, kind="eval_result", derivations=[drv("shared")], warnings=[], errors=[], is_final=False
    )
    other = EvaluationFactory(project=evaluation.project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=other, derivations=[drv("shared")], now=timezone.now())
    assert _status(BuildStatus.QUEUED) == {drv("shared")["drv_path"]}
    update(worker.id, a, kind="eval_result", derivations=[], warnings=[], errors=[], is_final=True)
    assert _status(BuildStatus.QUEUED) == {drv("shared")["drv_path"]}


def test_job_completed_before_the_final_part_aborts_its_unstarted_builds_that_nothing_else_needs() -> None:
    evaluation, worker, a = _evaluating()
    update(
        worker.id,
        a,
        kind="eval_result",
        derivations=[drv("mine"), drv("shared"), drv("running")],
        warnings=[],
        errors=[],
        is_final=False,
    )
    other = EvaluationFactory(project=evaluation.project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=other, derivations=[drv("shared")], now=timezone.now())
    assert _status(BuildStatus.QUEUED) == {drv(n)["drv_path"] for n in ("mine", "shared", "running")}
    builder = connected_worker([evaluation.project])
    started = ask(builder.id)
    assert started is not None
    update(builder.id, started, kind="building", build_id=build_id_of(started))
    running = DerivationBuild.objects.get(status=BuildStatus.BUILDING).drv_path
    outcome = report(worker.id, a, "JobCompleted", elapsed_ms=1)
    assert outcome.accepted and "failed" in outcome.detail
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.FAILED
    assert "before the final part" in evaluation.errors[-1]
    aborted = _status(BuildStatus.ABORTED)
    assert running not in aborted  # started: it goes on
    assert drv("shared")["drv_path"] not in aborted  # the other evaluation needs it
    assert aborted == {drv(n)["drv_path"] for n in ("mine", "shared", "running")} - {
        running,
        drv("shared")["drv_path"],
    }


def _send_committing(
    worker: Any,
    a: Assignment,
    derivations: list[dict[str, Any]],
    size: int,
    capture: Any,
    *,
    forget: int = -1,
) -> None:
    """_send, each part's on-commit work run as when it commits (the test's transaction never does):
    the process remembers the paths of the parts it stored. `forget`: before that part, it forgets them
    (the next part landing on another process)."""
    chunks = [derivations[i : i + size] for i in range(0, len(derivations), size)]
    for n, chunk in enumerate(chunks):
        if n == forget:
            ingest._hints.drop(a.assignment_id)
        with capture(execute=True):
            update(
                worker.id,
                a,
                kind="eval_result",
                derivations=chunk,
                warnings=[],
                errors=[],
                is_final=n == len(chunks) - 1,
            )
        if n == 0 and connection.vendor == "postgresql":
            assert len(ingest._hints.get(a.assignment_id)) == len(chunk)
    assert not ingest._hints.get(a.assignment_id)  # dropped at the final part


@pytest.mark.parametrize("forget", [-1, 3])
def test_a_result_in_parts_is_whole_whether_the_earlier_parts_are_remembered_or_not(
    django_capture_on_commit_callbacks: Any, forget: int
) -> None:
    derivations = nixpkgs_like(600, seed=13)
    edges, leaves = _expected(derivations)
    evaluation, worker, a = _evaluating()
    _send_committing(worker, a, derivations, 70, django_capture_on_commit_callbacks, forget=forget)
    assert _edges() == edges
    assert _status(BuildStatus.QUEUED) == leaves
    assert not EvalIngestInput.objects.exists()


def test_two_evaluations_remembering_their_parts_at_once_make_one_graph(
    django_capture_on_commit_callbacks: Any,
) -> None:
    derivations = nixpkgs_like(200, seed=9)
    edges, leaves = _expected(derivations)
    e1, w1, a1 = _evaluating()
    e2, w2, a2 = _evaluating()
    chunks = [derivations[i : i + 30] for i in range(0, 200, 30)]
    for n, chunk in enumerate(chunks):
        final = n == len(chunks) - 1
        for w, a, part in ((w1, a1, chunk), (w2, a2, list(reversed(chunk)))):
            with django_capture_on_commit_callbacks(execute=True):
                update(w.id, a, kind="eval_result", derivations=part, warnings=[], errors=[], is_final=final)
    assert DerivationBuild.objects.count() == 200
    assert _edges() == edges and _status(BuildStatus.QUEUED) == leaves
    for e in (e1, e2):
        assert EvaluationBuild.objects.filter(evaluation=e).count() == 200


def test_a_re_evaluation_remembering_its_parts_reads_first_and_still_adds_what_is_new(
    django_capture_on_commit_callbacks: Any,
) -> None:
    """After a part that found its builds existing, the next reads them before inserting the missing:
    a re-evaluation that brings a few new derivations among the old still gets all of them."""
    derivations = nixpkgs_like(400, seed=21)
    old = derivations[:300]
    first, worker, a = _evaluating()
    _send_committing(worker, a, old, 50, django_capture_on_commit_callbacks)
    report(worker.id, a, "JobCompleted", elapsed_ms=1)
    second = EvaluationFactory(project=first.project)
    b = ask(worker.id, "flake")
    assert b is not None and b.job_key == second.job_key
    # The old ones first (parts that create nothing), then parts mixing old and new.
    again = old[:150] + sorted(derivations[300:] + old[150:], key=lambda d: d["drv_path"])
    _send_committing(worker, b, again, 50, django_capture_on_commit_callbacks)
    # The old builds keep the inputs the first evaluation knew (a build that existed with its inputs
    # known is only linked); the new ones get every input of the result.
    old_paths = {d["drv_path"] for d in old}
    edges = {(d["drv_path"], i) for d in old for i in d["input_drvs"] if i in old_paths}
    edges |= {(d["drv_path"], i) for d in derivations[300:] for i in d["input_drvs"]}
    assert DerivationBuild.objects.count() == 400
    assert EvaluationBuild.objects.filter(evaluation=second).count() == 400
    assert _edges() == edges
    assert not EvalIngestInput.objects.exists()


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the plans of PostgreSQL")
@pytest.mark.parametrize("shape", ["independent", "nixpkgs"])
def test_on_tables_analyzed_empty_no_statement_of_the_ingest_or_the_decision_reads_a_table_per_build(
    shape: str,
) -> None:
    """Issue 30: on a fresh database (statistics taken while the tables were empty) the queueing statement
    was planned as a nested loop that read the evaluation's links once per build: quadratic (97 s for
    20 000 leaves). Every statement of every part and of the decision handles rows in proportion to the
    result, whatever the statistics say.

    The tables hold rows the statistics do not know of before the result arrives (a history: another
    evaluation's builds, an installation's cache), so that what is measured is the plans' dependence on the
    statistics and not on how many pages earlier tests left in a reused database: on a table of a few
    pages a scan per lookup is PostgreSQL's right choice (it stops choosing it as the table grows)."""
    n = 1500
    derivations = [drv(f"leaf{i}") for i in range(n)] if shape == "independent" else nixpkgs_like(n)
    evaluation, worker, a = _evaluating()
    with connection.cursor() as cur:
        cur.execute("ANALYZE " + ", ".join((*INGEST_TABLES, "dispatched_job")))
        cur.execute(
            "INSERT INTO cached_path (path, nar_size, confirmed, created_at) SELECT "
            "'/nix/store/' || lpad(i::text, 32, 'c') || '-history', 1000, true, now() "
            "FROM generate_series(1, 20000) i"
        )
        cur.execute(
            "INSERT INTO cached_path_claim (path, project_id, created_at) SELECT "
            "'/nix/store/' || lpad(i::text, 32, 'k') || '-history', %s, now() "
            "FROM generate_series(1, 20000) i",
            [evaluation.project_id],
        )
    # Another evaluation still streaming: the first part of its result, whose inputs among the
    # derivations it has not sent yet are pending.
    _, history_worker, history = _evaluating()
    earlier = [
        d for d in nixpkgs_like(n + 300, prefix="history") if int(d["attr"][len("pkgs.history") :]) >= 300
    ]
    update(
        history_worker.id,
        history,
        kind="eval_result",
        derivations=earlier,
        warnings=[],
        errors=[],
        is_final=False,
    )
    history_paths = {d["drv_path"] for d in earlier}
    assert DerivationBuild.objects.filter(drv_path__in=history_paths).count() == n
    assert EvalIngestInput.objects.count() > n / 2
    with PlanWork() as work:
        _send(worker, a, derivations, 150)
        build_resync_pass(now=timezone.now())  # every Created build, for the resync
    _, leaves = _expected(derivations)
    assert _status(BuildStatus.QUEUED) - history_paths == leaves
    handled, where = work.worst
    assert handled <= 10 * n, f"{handled} rows handled by one plan node for {n} derivations: {where}"


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the plans of PostgreSQL")
def test_on_a_new_installation_the_change_feed_trigger_looks_each_new_link_up_by_its_key() -> None:
    """The change feed's trigger on new links (migrations 0013, 0014, 0027) keeps its statement's plan for
    the life of the connection, made at its first firing: on a new installation, a first part of a few
    derivations. Made on a table of a few pages it was a scan of every build per new link, kept while the
    table grew (each part read its links x every build). Each link is found by its key however small the
    table was when the plan was made: the trigger's statement handles rows in proportion to a part."""
    new_installation()
    evaluation, worker, a = _evaluating()
    with connection.cursor() as cur:
        cur.execute("ANALYZE " + ", ".join(INGEST_TABLES))
    derivations = [drv(f"leaf{i}") for i in range(1200)]
    size = 300
    with PlanWork(only="new_rows n WHERE n.blocks_evaluation") as work:
        # The first part alone: the plan is made now, on a table of a few rows.
        update(
            worker.id,
            a,
            kind="eval_result",
            derivations=derivations[:3],
            warnings=[],
            errors=[],
            is_final=False,
        )
        _send(worker, a, derivations[3:], size)
    assert EvaluationBuild.objects.filter(evaluation=evaluation).count() == len(derivations)
    assert _status(BuildStatus.QUEUED) == {d["drv_path"] for d in derivations}
    handled, where = work.worst
    assert 0 < handled <= 2 * size, f"{handled} rows handled by one plan node for parts of {size}: {where}"
