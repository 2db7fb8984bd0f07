"""Arbitrary text in every string a worker sends (issue 17, "Done when"): Hypothesis puts any Unicode,
NUL and lone surrogates included, into every string field of every worker -> server message, and sends
them over a real session to the full ASGI application (channels' WebsocketCommunicator: the real
consumer, job loop and scheduler on the real PostgreSQL). For every example:

- the session is never closed (no 1011, no 4400) and Gradient logs no error;
- no job is lost: the evaluation and the build it was given end by the worker's own reports, never by a
  lost dispatch;
- what is stored is what docs/workers.md says it becomes: the text, with every NUL and lone surrogate
  replaced by U+FFFD (gradient.core.protocol.clean_text).

Lengths stay within the columns (30 characters); a longer value is the data error of
test_hardening_text.py. The short form runs few examples; the long form (--faults-long) many.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradient.core.protocol import clean_text
from gradient.scheduling.models import (
    BuildAttempt,
    BuildStatus,
    DispatchedJob,
    Evaluation,
    EvaluationBuild,
    EvaluationStatus,
)
from gradient.scheduling.services import graph
from gradient.workers.models import Worker, WorkerSession
from tests.factories import EvaluationFactory, ProjectFactory
from tests.scheduling_helpers import drv
from tests.support.proto import TIMEOUT, assigned, finish, handshake

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]

SHORT_EXAMPLES, LONG_EXAMPLES = 12, 200

# Any code point, surrogates and NUL included (st.characters leaves out surrogates unless told); half the
# strings hold at least one of the characters that are not text.
NOT_TEXT = ["\x00", "\ud800", "\udbff", "\udc00", "\udfff", "\ud83d", "\ude00"]
any_char = st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=())
_plain = st.text(alphabet=any_char, max_size=14)
text = st.one_of(_plain, st.builds(lambda a, b, c: a + b + c, _plain, st.sampled_from(NOT_TEXT), _plain))
texts = st.lists(text, max_size=3)


class Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@database_sync_to_async
def _setup(make_worker: Any) -> tuple[Worker, str, str, str]:
    """A worker of its own project, a Queued evaluation, and a Queued build of a Building evaluation."""
    name = f"p-{uuid.uuid4().hex[:8]}"
    project = ProjectFactory(name=name)
    worker, token = make_worker(name=f"w-{uuid.uuid4().hex[:8]}", projects=(name,))
    queued = EvaluationFactory(project=project, repository="sim:chain?n=1", commit="c0ffee")
    building = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(
        evaluation=building, derivations=[drv(f"solo{uuid.uuid4().hex[:8]}")], now=timezone.now()
    )
    build = EvaluationBuild.objects.get(evaluation=building).build
    assert build.status == BuildStatus.QUEUED
    return worker, token, str(queued.id), str(build.id)


async def _send(comm: WebsocketCommunicator, message: dict[str, Any]) -> None:
    # json.dumps escapes NUL and every surrogate (ensure_ascii), as any JSON encoder may.
    await comm.send_to(text_data=json.dumps(message))


async def _handled(comm: WebsocketCommunicator) -> None:
    """Every frame sent so far was handled and the socket is open: a RequestJobList is answered."""
    await comm.send_json_to({"type": "RequestJobList"})
    while True:
        frame = json.loads(await comm.receive_from(timeout=TIMEOUT))
        assert frame["type"] in ("JobListChunk", "JobOffer"), frame
        if frame["type"] == "JobListChunk" and frame["is_final"]:
            return


def _ids(assign: dict[str, Any]) -> dict[str, str]:
    return {"job_id": assign["job_id"], "assignment_id": assign["assignment_id"]}


strings = st.fixed_dictionaries(
    {
        "architecture": text,
        "features": texts,
        "zone": st.none() | text,
        "endpoint": st.none() | text,
        "reason": st.none() | text,
        "score_job": text,
        "source": text,
        "drv_path": text,
        "attr": st.none() | text,
        "system": text,
        "required_features": texts,
        "output_name": text,
        "output_path": text,
        "input_drv": text,
        "cached_path": text,
        "warnings": texts,
        "build_id": text,
        "error": text,
        "missing_paths": st.none() | texts,
        "attempt": text,
        "payload": text,
        "role": text,
        "fenced_job": text,
        "fenced_assignment": text,
    }
)


def _clean(value: Any) -> Any:
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def test_every_worker_message_with_arbitrary_text_keeps_the_session_and_its_jobs(
    make_worker: Any, faults_long: bool
) -> None:
    errors = Errors()
    logging.getLogger("gradient").addHandler(errors)
    try:

        @settings(
            max_examples=LONG_EXAMPLES if faults_long else SHORT_EXAMPLES,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
            database=None,
        )
        @given(s=strings)
        def example(s: dict[str, Any]) -> None:
            asyncio.run(_example(make_worker, s))
            assert errors.records == [], [r.getMessage() for r in errors.records]

        example()
    finally:
        logging.getLogger("gradient").removeHandler(errors)


async def _example(make_worker: Any, s: dict[str, Any]) -> None:
    worker, token, evaluation_id, build_id = await _setup(make_worker)
    comm, _ = await handshake(str(worker.id), token)
    capabilities = {
        "type": "WorkerCapabilities",
        "architectures": ["x86_64-linux", s["architecture"]],
        "system_features": s["features"],
        "max_concurrent_builds": 2,
        "cpu_count": 4,
        "ram_total_mb": 8192,
        "cpu_core_score": 800,
        "zone": s["zone"],
        "endpoint": s["endpoint"],
    }
    await _send(comm, capabilities)
    await _send(comm, {"type": "WorkerMetrics", "cpu_usage_pct": 1.0})
    flake = await assigned(comm, "flake")
    build = await assigned(comm, "build")
    assert (flake["job_id"], build["job_id"]) == (f"eval:{evaluation_id}", f"build:{build_id}")
    await _send(
        comm,
        {
            "type": "RequestJobChunk",
            "scores": [
                {
                    "job_id": s["score_job"],
                    "missing_count": 0,
                    "missing_nar_size": 0,
                    "outputs_present": False,
                }
            ],
            "is_final": True,
        },
    )
    for assign in (flake, build):
        await _send(
            comm, {"type": "AssignJobResponse", **_ids(assign), "accepted": True, "reason": s["reason"]}
        )

    # A path of its own per example (drv_path is unique: a path named again is the same build).
    unique = f"/nix/store/{uuid.uuid4().hex}-"
    derivation = {
        "drv_path": unique + s["drv_path"],
        "attr": s["attr"],
        "system": s["system"],
        "required_features": s["required_features"],
        "outputs": [{"name": s["output_name"], "path": s["output_path"]}],
        "input_drvs": [s["input_drv"]],
        "cached_outputs": [{"path": s["cached_path"], "nar_size": 1}],
    }
    spec = build["job"]["builds"][0]
    fenced = {"job_id": s["fenced_job"], "assignment_id": s["fenced_assignment"]}
    for message in [
        {"type": "JobUpdate", **_ids(flake), "update": {"kind": "fetching"}},
        {"type": "JobUpdate", **_ids(flake), "update": {"kind": "fetch_result", "flake_source": s["source"]}},
        {"type": "EvalProgress", **_ids(flake), "phase": "evaluating", "done": 1, "total": None},
        {
            "type": "JobUpdate",
            **_ids(flake),
            "update": {
                "kind": "eval_result",
                "derivations": [derivation],
                "warnings": s["warnings"],
                "errors": [],
            },
        },
        {"type": "JobCompleted", **_ids(flake), "elapsed_ms": 5},
        {"type": "JobUpdate", **_ids(build), "update": {"kind": "building", "build_id": s["build_id"]}},
        {"type": "JobUpdate", **_ids(build), "update": {"kind": "building", "build_id": spec["build_id"]}},
        {
            "type": "BuildProgress",
            **_ids(build),
            "build_id": s["build_id"],
            "phase": "download",
            "bytes_done": 1,
            "bytes_total": None,
        },
        {
            "type": "JobFailed",
            **_ids(build),
            "error": s["error"],
            "kind": "permanent",
            "missing_paths": s["missing_paths"],
            "elapsed_ms": 3,
        },
        {
            "type": "ClusterSignal",
            "attempt": s["attempt"],
            "to": {"role": s["role"], "index": 0},
            "payload": s["payload"],
        },
        {"type": "ClusterSignal", "attempt": str(uuid.uuid4()), "to": None, "payload": s["payload"]},
        # Fenced reports with arbitrary ids: dropped.
        {"type": "JobCompleted", **fenced, "elapsed_ms": 1},
        {"type": "JobFailed", **fenced, "error": s["error"], "kind": "transient", "elapsed_ms": 1},
        {"type": "AssignJobResponse", **fenced, "accepted": False, "reason": s["reason"]},
        {"type": "JobUpdate", **fenced, "update": {"kind": "fetch_result", "flake_source": s["source"]}},
    ]:
        await _send(comm, message)
    await _handled(comm)

    @database_sync_to_async
    def stored() -> dict[str, Any]:
        evaluation = Evaluation.objects.get(id=evaluation_id)
        row = Worker.objects.get(id=worker.id)
        return {
            "evaluation": evaluation,
            "worker": row,
            "session_open": WorkerSession.objects.filter(
                worker_id=worker.id, closed_at__isnull=True
            ).exists(),
            "assignments": {
                a.job_id: a
                for a in DispatchedJob.objects.filter(worker_id=worker.id).order_by("dispatched_at")
            },
            "attempt": BuildAttempt.objects.filter(build_id=build_id).get(),
            "ingested": list(
                EvaluationBuild.objects.filter(evaluation_id=evaluation_id).values_list(
                    "build__drv_path", "build__system", "build__required_features", "build__outputs", "attr"
                )
            ),
        }

    got = await stored()
    assert got["session_open"]
    evaluation, row = got["evaluation"], got["worker"]
    assert evaluation.lost_dispatches == 0
    assert evaluation.status not in (EvaluationStatus.QUEUED, EvaluationStatus.FAILED), evaluation.status
    assert evaluation.flake_source == clean_text(s["source"])
    assert evaluation.warnings == _clean(s["warnings"])
    assert row.architectures == ["x86_64-linux", clean_text(s["architecture"])]
    assert row.system_features == _clean(s["features"])
    assert (row.zone, row.endpoint) == (_clean(s["zone"]), _clean(s["endpoint"]))
    outcomes = {job: a.outcome for job, a in got["assignments"].items()}
    assert outcomes == {flake["job_id"]: "Completed", build["job_id"]: "Failed"}
    assert got["attempt"].error == clean_text(s["error"])
    [(drv_path, system, features, outputs, attr)] = got["ingested"]
    assert (drv_path, system, attr) == (
        unique + clean_text(s["drv_path"]),
        clean_text(s["system"]),
        _clean(s["attr"]),
    )
    assert features == sorted(set(_clean(s["required_features"])))
    assert outputs == [{"name": clean_text(s["output_name"]), "path": clean_text(s["output_path"])}]
    await finish(comm)
