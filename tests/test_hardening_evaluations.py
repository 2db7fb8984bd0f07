"""An evaluation's warnings and errors are capped (issue 25, finding 4): in count and in bytes, of all
parts of its eval_result together, with a last line saying how many were left out; and the list route
neither carries nor loads them (the evaluation's own route does).

The cap's rules are a pure function (decisions.messages); the whole of it over the full ASGI
application: a worker sends 40 parts of one 900 KB warning each."""

from __future__ import annotations

import json
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import User
from django.db import connection
from django.test.utils import CaptureQueriesContext, override_settings
from rest_framework.test import APIClient

from gradient.scheduling.decisions.messages import MessageCap, cut_message, left_out_line, with_messages
from gradient.scheduling.models import Evaluation
from gradient.scheduling.services.eval_parts import message_cap
from tests.factories import EvaluationFactory, ProjectFactory
from tests.scheduling_helpers import drv
from tests.support.proto import assigned, finish, handshake

CAP = MessageCap(max_count=3, max_bytes=100, max_message_bytes=40)


def _size(messages: list[str]) -> int:
    return sum(len(m.encode()) for m in messages)


# --- The rules ---------------------------------------------------------------------------------------


def test_messages_within_the_cap_are_kept_as_they_are() -> None:
    assert with_messages([], ["a", "b"], what="warnings", cap=CAP) == ["a", "b"]
    assert with_messages(["a"], [], what="warnings", cap=CAP) == ["a"]


def test_beyond_the_count_one_last_line_says_how_many_were_left_out() -> None:
    kept = with_messages([], ["a", "b", "c", "d", "e"], what="warnings", cap=CAP)
    assert kept == ["a", "b", "c", left_out_line(2, "warnings", CAP)]
    # A later part adds to the count, and the line stays last and alone.
    kept = with_messages(kept, ["f"], what="warnings", cap=CAP)
    assert kept == ["a", "b", "c", left_out_line(3, "warnings", CAP)]
    assert with_messages(kept, [], what="warnings", cap=CAP) == kept


def test_beyond_the_bytes_the_rest_is_left_out_even_a_small_one_after() -> None:
    kept = with_messages([], ["x" * 40, "y" * 40, "z" * 30, "s"], what="errors", cap=CAP)
    assert kept == ["x" * 40, "y" * 40, left_out_line(2, "errors", CAP)]
    assert "errors left out" in kept[-1]


def test_a_long_message_is_cut_at_a_whole_character_with_its_size() -> None:
    cut = cut_message("é" * 30, 41)  # 60 bytes; 41 would split the 21st character
    assert cut.startswith("é" * 20 + " [... cut: the message was 60 bytes")
    assert cut_message("short", 41) == "short"
    [kept] = with_messages([], ["é" * 30], what="warnings", cap=MessageCap(3, 1000, 41))
    assert kept == cut


def test_the_defaults_and_settings() -> None:
    with override_settings(GRADIENT_EVAL_MESSAGES_MAX_COUNT=7, GRADIENT_EVAL_MESSAGES_MAX_BYTES=1000):
        assert message_cap() == MessageCap(max_count=7, max_bytes=1000, max_message_bytes=1000)
    assert message_cap().max_message_bytes == 64 * 1024


# --- Over the consumer, and the REST routes ---------------------------------------------------------

PARTS = 40
WARNING = "w" * 900_000


def _ids(assign: dict[str, Any]) -> dict[str, str]:
    return {"job_id": assign["job_id"], "assignment_id": assign["assignment_id"]}


async def _handled(comm: WebsocketCommunicator, wait_secs: float = 30) -> None:
    """Every frame sent so far was handled: a RequestJobList is answered."""
    await comm.send_json_to({"type": "RequestJobList"})
    while True:
        frame = json.loads(await comm.receive_from(timeout=wait_secs))
        assert frame["type"] in ("JobListChunk", "JobOffer"), frame
        if frame["type"] == "JobListChunk" and frame["is_final"]:
            return


async def _evaluating(make_worker: Any) -> tuple[WebsocketCommunicator, dict[str, Any], str]:
    """A worker's socket past the handshake holding an accepted evaluation job: (socket, AssignJob,
    evaluation id)."""

    @database_sync_to_async
    def setup() -> tuple[Any, str, str]:
        project = ProjectFactory(name="p")
        worker, token = make_worker(projects=("p",))
        evaluation = EvaluationFactory(project=project, repository="sim:chain?n=1", commit="c0ffee")
        return worker, token, str(evaluation.id)

    worker, token, evaluation_id = await setup()
    comm, _ = await handshake(str(worker.id), token)
    flake = await assigned(comm, "flake")
    await comm.send_json_to({"type": "AssignJobResponse", **_ids(flake), "accepted": True, "reason": None})
    return comm, flake, evaluation_id


@pytest.mark.django_db(transaction=True)
async def test_forty_parts_of_a_900_kb_warning_keep_a_bounded_evaluation(make_worker: Any) -> None:
    comm, flake, evaluation_id = await _evaluating(make_worker)
    for update in ({"kind": "fetching"}, {"kind": "evaluating_flake"}):
        await comm.send_json_to({"type": "JobUpdate", **_ids(flake), "update": update})
    for n in range(PARTS):
        update = {
            "kind": "eval_result",
            "derivations": [drv(f"d{n}")],
            "warnings": [WARNING],
            "errors": [f"e{n}"],
            "is_final": n == PARTS - 1,
        }
        await comm.send_to(text_data=json.dumps({"type": "JobUpdate", **_ids(flake), "update": update}))
    await _handled(comm)
    await finish(comm)

    @database_sync_to_async
    def stored() -> tuple[list[str], list[str]]:
        row = Evaluation.objects.get(id=evaluation_id)
        return row.warnings, row.errors

    warnings, errors = await stored()
    cap = message_cap()
    assert _size(warnings[:-1]) <= cap.max_bytes
    one = len(cut_message(WARNING, cap.max_message_bytes).encode())
    assert len(warnings) - 1 == cap.max_bytes // one  # each one cut, as many as fit
    assert all("[... cut: the message was 900000 bytes ...]" in w for w in warnings[:-1])
    assert warnings[-1] == left_out_line(PARTS - (len(warnings) - 1), "warnings", cap)
    assert errors == [f"e{n}" for n in range(PARTS)]


@pytest.mark.django_db
def test_lists_carry_no_warnings_and_do_not_load_them_the_evaluations_route_does() -> None:
    project = ProjectFactory(name="p")
    evaluation = EvaluationFactory(project=project, warnings=["big " * 1000], errors=["bad"])
    client = APIClient()
    client.force_authenticate(User.objects.create_user("op", password="pw-op-1", is_staff=True))
    with CaptureQueriesContext(connection) as queries:
        page = client.get("/api/v1/evaluations").json()
    [listed] = page["results"]
    assert listed["id"] == str(evaluation.id) and listed["warnings"] == [] and listed["errors"] == []
    evaluation_selects = [q["sql"] for q in queries if 'FROM "evaluation"' in q["sql"]]
    assert evaluation_selects and not any('"evaluation"."warnings"' in sql for sql in evaluation_selects)
    one = client.get(f"/api/v1/evaluations/{evaluation.id}").json()
    assert one["warnings"] == ["big " * 1000] and one["errors"] == ["bad"]


@pytest.mark.django_db
def test_the_consoles_list_of_evaluations_does_not_load_them() -> None:
    from django.test import Client

    project = ProjectFactory(name="p")
    evaluation = EvaluationFactory(project=project, warnings=["big " * 1000])
    client = Client()
    client.force_login(User.objects.create_superuser("admin", password="pw-admin-1", email="a@b.c"))
    with CaptureQueriesContext(connection) as queries:
        assert client.get("/admin/scheduling/evaluation/").status_code == 200
    assert not any('"evaluation"."warnings"' in q["sql"] for q in queries)
    page = client.get(f"/admin/scheduling/evaluation/{evaluation.id}/change/")
    assert page.status_code == 200 and b"big big" in page.content


@pytest.mark.django_db(transaction=True)
async def test_parts_sent_faster_than_they_are_stored_slow_the_worker_and_never_close_it(
    make_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Back-pressure (protocol.md, "Large evaluations"; issue 30): a worker sends 600 parts back to back
    with the session's queue held to 16 KiB, so the socket waits on nearly every frame; every part is
    stored, builds start while it streams, and the session stays open."""
    from gradient.workers.proto import consumer

    monkeypatch.setattr(consumer, "INBOX_MAX_BYTES", 16 * 1024)
    parts = 600

    comm, flake, evaluation_id = await _evaluating(make_worker)
    for n in range(parts):
        update = {
            "kind": "eval_result",
            "derivations": [drv(f"d{n}", *([f"d{n - 1}"] if n else []))],
            "warnings": [],
            "errors": [],
            "is_final": n == parts - 1,
        }
        await comm.send_to(text_data=json.dumps({"type": "JobUpdate", **_ids(flake), "update": update}))
    await _handled(comm, wait_secs=600)  # answered: the session is open
    await comm.send_json_to({"type": "JobCompleted", **_ids(flake), "elapsed_ms": 1})
    await _handled(comm)
    await finish(comm)

    @database_sync_to_async
    def stored() -> tuple[int, int, str, str]:
        from gradient.scheduling.models import DerivationBuild, EvalIngest, EvaluationBuild

        ingest = EvalIngest.objects.get(evaluation_id=evaluation_id)
        first = DerivationBuild.objects.get(drv_path=drv("d0")["drv_path"])
        return (
            EvaluationBuild.objects.filter(evaluation_id=evaluation_id).count(),
            ingest.parts,
            first.status,
            Evaluation.objects.get(id=evaluation_id).status,
        )

    links, stored_parts, first_status, status = await stored()
    assert (links, stored_parts) == (parts, parts)
    assert first_status == "Queued"  # queued by the first part: nothing else to wait for
    assert status == "Building"
