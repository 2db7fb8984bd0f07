"""A part's `known_drvs` linked with their closures (services.known.link_known, one statement on
PostgreSQL): the whole closure across parts (a later part's walk stops at what an earlier one linked), an
Aborted build of the closure wanted again, and a part naming one unknown path linking nothing and
failing the evaluation with its name."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection

from gradient.core.vocab import BuildStatus, EvaluationStatus
from gradient.scheduling.models import DerivationBuild, Evaluation
from gradient.scheduling.services.assignment import Assignment
from gradient.scheduling.services.known import known_derivations
from tests.factories import ProjectFactory
from tests.scheduling_helpers import drv, evaluating, nixpkgs_like, report, update
from tests.support.plans import INGEST_TABLES, PlanWork

pytestmark = pytest.mark.django_db(transaction=True)


def _path(name: str) -> str:
    return str(drv(name)["drv_path"])


def _part(worker: Any, a: Assignment, derivations: list[dict[str, Any]], **extra: Any) -> Any:
    return update(worker.id, a, kind="eval_result", derivations=derivations, warnings=[], errors=[], **extra)


def _first_result(project: Any) -> None:
    """A chain a <- b <- c <- d, and e beside it, evaluated whole: each known afterwards."""
    _, worker, a = evaluating(project)
    chain = [drv("a"), drv("b", "a"), drv("c", "b"), drv("d", "c", attr="packages.x86_64-linux.d"), drv("e")]
    assert _part(worker, a, chain).accepted
    report(worker.id, a, "JobCompleted")


def _linked(evaluation: Evaluation) -> set[str]:
    return set(evaluation.build_links.values_list("build__drv_path", flat=True))


def test_known_closures_are_linked_whole_across_parts_and_an_aborted_build_in_one_is_wanted_again() -> None:
    project = ProjectFactory()
    _first_result(project)
    DerivationBuild.objects.filter(drv_path=_path("b")).update(status=BuildStatus.ABORTED)
    second, worker, a = evaluating(project)
    assert _part(worker, a, [], known_drvs=[_path("c")], is_final=False).accepted
    assert _linked(second) == {_path(n) for n in "abc"}
    assert DerivationBuild.objects.get(drv_path=_path("b")).status == BuildStatus.CREATED
    # d's closure is c's, linked by the part before: only d is new.
    assert _part(worker, a, [], known_drvs=[_path("d"), _path("c")], is_final=True).accepted
    assert _linked(second) == {_path(n) for n in "abcd"}
    second.refresh_from_db()
    assert second.status not in (EvaluationStatus.FAILED,)


def test_a_part_naming_one_unknown_path_links_nothing_and_fails_naming_it() -> None:
    project = ProjectFactory()
    _first_result(project)
    second, worker, a = evaluating(project)
    unknown = "/nix/store/" + "9" * 32 + "-retired.drv"
    assert _part(worker, a, [], known_drvs=[_path("d"), unknown], is_final=True).accepted
    second.refresh_from_db()
    assert second.status == EvaluationStatus.FAILED
    assert any(unknown in e for e in second.errors), second.errors
    assert _linked(second) == set()


@pytest.mark.django_db  # the statistics taken here are rolled back with the test
@pytest.mark.skipif(connection.vendor != "postgresql", reason="the plans of PostgreSQL")
def test_on_tables_analyzed_empty_the_known_query_and_link_handle_rows_in_proportion_to_the_result() -> None:
    """Issue 30's bar for every set statement of the ingest, here the known derivations': the answer to a
    QueryKnownDerivations (one indexed read) and a part's known_drvs linked with their closures, on
    statistics taken while the tables were empty, with rows the statistics do not know of beside them
    (another evaluation still streaming, an installation's cache)."""
    n = 1500
    project = ProjectFactory()
    with connection.cursor() as cur:
        cur.execute("ANALYZE " + ", ".join((*INGEST_TABLES, "dispatched_job")))
        cur.execute(
            "INSERT INTO cached_path (path, nar_size, confirmed, created_at) SELECT "
            "'/nix/store/' || lpad(i::text, 32, 'c') || '-history', 1000, true, now() "
            "FROM generate_series(1, 20000) i"
        )
    _, other_worker, other = evaluating()
    streaming = [
        d for d in nixpkgs_like(n + 300, prefix="other") if int(d["attr"][len("pkgs.other") :]) >= 300
    ]
    assert _part(other_worker, other, streaming, is_final=False).accepted
    first = nixpkgs_like(n)
    _, worker, a = evaluating(project)
    for i in range(0, n, 500):
        assert _part(worker, a, first[i : i + 500], is_final=i + 500 >= n).accepted
    report(worker.id, a, "JobCompleted")
    paths = [d["drv_path"] for d in first]
    second, worker, b = evaluating(project)
    with PlanWork() as work:
        answered = [
            p
            for i in range(0, n, 1000)
            for p in known_derivations(
                worker_id=worker.id,
                job_key=b.job_key,
                assignment_id=str(b.assignment_id),
                drv_paths=paths[i : i + 1000],
            )
        ]
        assert _part(worker, b, [], known_drvs=paths[:750], is_final=False).accepted
        assert _part(worker, b, [], known_drvs=paths[750:], is_final=True).accepted
    assert answered == paths
    assert _linked(second) == set(paths)
    second.refresh_from_db()
    assert second.status != EvaluationStatus.FAILED, second.errors
    handled, where = work.worst
    assert handled <= 10 * n, f"{handled} rows handled by one plan node for {n} derivations: {where}"
