"""A part's `known_drvs` linked with their closures (services.known.link_known, one statement on
PostgreSQL): the whole closure across parts (a later part's walk stops at what an earlier one linked), an
Aborted build of the closure wanted again, and a part naming one unknown path linking nothing and
failing the evaluation with its name."""

from __future__ import annotations

from typing import Any

import pytest

from gradient.core.vocab import BuildStatus, EvaluationStatus
from gradient.scheduling.models import DerivationBuild, Evaluation
from gradient.scheduling.services.assignment import Assignment
from tests.factories import ProjectFactory
from tests.scheduling_helpers import drv, evaluating, report, update

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
