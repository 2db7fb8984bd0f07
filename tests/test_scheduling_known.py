"""Known derivations (protocol.md, "Known derivations"; issue 30) over a real WebSocket on the full ASGI
application: QueryKnownDerivations answered with what the server holds with its whole closure, a stale
query answered empty, `known_drvs` linking the same shared builds and their closure, and an unknown
`known_drvs` path failing the evaluation with its name."""

from __future__ import annotations

import json
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator

from gradient.scheduling.models import (
    BuildStatus,
    DerivationBuild,
    DerivationBuildDependency,
    Evaluation,
    EvaluationBuild,
    EvaluationStatus,
)
from tests.factories import EvaluationFactory, ProjectFactory
from tests.scheduling_helpers import diamond, drv
from tests.support.proto import TIMEOUT, assigned, finish, handshake

pytestmark = pytest.mark.django_db(transaction=True)


def _ids(assign: dict[str, Any]) -> dict[str, str]:
    return {"job_id": assign["job_id"], "assignment_id": assign["assignment_id"]}


def _path(name: str) -> str:
    return str(drv(name)["drv_path"])


async def _evaluation(comm: WebsocketCommunicator) -> dict[str, Any]:
    flake = await assigned(comm, "flake")
    await comm.send_json_to({"type": "AssignJobResponse", **_ids(flake), "accepted": True, "reason": None})
    await comm.send_json_to({"type": "JobUpdate", **_ids(flake), "update": {"kind": "evaluating_flake"}})
    return flake


async def _result(comm: WebsocketCommunicator, flake: dict[str, Any], **fields: Any) -> None:
    update = {"kind": "eval_result", "warnings": [], "errors": [], **fields}
    await comm.send_json_to({"type": "JobUpdate", **_ids(flake), "update": update})


async def _ask(comm: WebsocketCommunicator, ids: dict[str, str], paths: list[str]) -> dict[str, Any]:
    await comm.send_json_to({"type": "QueryKnownDerivations", **ids, "drv_paths": paths})
    while True:
        frame = json.loads(await comm.receive_from(timeout=TIMEOUT))
        if frame["type"] == "KnownDerivations":
            return frame
        assert frame["type"] in ("JobOffer", "JobListChunk"), frame


async def test_known_derivations_are_answered_linked_and_the_same_shared_builds(make_worker: Any) -> None:
    @database_sync_to_async
    def setup() -> tuple[Any, str, Any]:
        project = ProjectFactory(name="p")
        worker, token = make_worker(projects=("p",))
        EvaluationFactory(project=project, commit="c1")
        return worker, token, project

    worker, token, project = await setup()
    comm, _ = await handshake(str(worker.id), token)
    first = await _evaluation(comm)
    # Nothing is known before the first result is whole.
    assert (await _ask(comm, _ids(first), [_path("d")]))["drv_paths"] == []
    await _result(comm, first, derivations=diamond())
    assert (await _ask(comm, _ids(first), [_path("d"), _path("x"), _path("b")])) == {
        "type": "KnownDerivations",
        **_ids(first),
        "drv_paths": [_path("d"), _path("b")],
    }
    await comm.send_json_to({"type": "JobCompleted", **_ids(first), "elapsed_ms": 1})

    @database_sync_to_async
    def second_evaluation() -> Any:
        return EvaluationFactory(project=project, commit="c2")

    second_row = await second_evaluation()
    second = await _evaluation(comm)
    assert second["job_id"] == second_row.job_key
    # A stale query (the first assignment, closed) is answered, empty.
    assert (await _ask(comm, _ids(first), [_path("d")]))["drv_paths"] == []
    assert (await _ask(comm, _ids(second), [_path("d")]))["drv_paths"] == [_path("d")]
    # e is new and needs the known d: d and its whole closure are linked, nothing is created again.
    await _result(
        comm, second, derivations=[drv("e", "d", attr="packages.x86_64-linux.e")], known_drvs=[_path("d")]
    )
    await comm.send_json_to({"type": "JobCompleted", **_ids(second), "elapsed_ms": 1})
    assert (await _ask(comm, _ids(second), [])) is not None  # every frame before it was handled
    await finish(comm)

    @database_sync_to_async
    def stored() -> tuple[set[str], int, set[tuple[str, str]], str, str]:
        linked = set(
            EvaluationBuild.objects.filter(evaluation=second_row).values_list("build__drv_path", flat=True)
        )
        edges = set(DerivationBuildDependency.objects.values_list("build__drv_path", "dependency__drv_path"))
        e = DerivationBuild.objects.get(drv_path=_path("e"))
        return (
            linked,
            DerivationBuild.objects.count(),
            edges,
            e.status,
            Evaluation.objects.get(id=second_row.id).status,
        )

    linked, builds, edges, e_status, status = await stored()
    assert linked == {_path(n) for n in "abcde"}
    assert builds == 5
    assert (_path("e"), _path("d")) in edges
    assert e_status == BuildStatus.CREATED  # waits for d, which is not built yet
    assert status == EvaluationStatus.BUILDING


async def test_an_unknown_known_drvs_path_fails_the_evaluation_with_its_name(make_worker: Any) -> None:
    @database_sync_to_async
    def setup() -> tuple[Any, str, Any]:
        project = ProjectFactory(name="p")
        worker, token = make_worker(projects=("p",))
        return worker, token, EvaluationFactory(project=project, commit="c1")

    worker, token, evaluation = await setup()
    comm, _ = await handshake(str(worker.id), token)
    flake = await _evaluation(comm)
    await _result(comm, flake, derivations=[drv("mine")], is_final=False)
    await _result(comm, flake, derivations=[], known_drvs=[_path("retired")], is_final=True)
    assert (await _ask(comm, _ids(flake), [])) is not None
    await finish(comm)

    @database_sync_to_async
    def stored() -> tuple[str, list[str], str]:
        row = Evaluation.objects.get(id=evaluation.id)
        return row.status, row.errors, DerivationBuild.objects.get(drv_path=_path("mine")).status

    status, errors, mine = await stored()
    assert status == EvaluationStatus.FAILED
    assert _path("retired") in errors[-1]
    assert mine == BuildStatus.ABORTED  # queued by the first part; nothing else needs it
