"""End to end: SIGTERM `serve` (an instance drain) while an evaluation is building. The drain sends
Draining to the workers, closes their sessions, and parks the in-flight evaluation as `draining`; the
next start recovers the rows and unparks it; the same worker reconnects and finishes the work."""

from __future__ import annotations

import signal
from contextlib import ExitStack
from pathlib import Path

import pytest

from gradient.records.models import RecordEntry
from gradient.recovery.models import ServerBoot
from gradient.scheduling.models import DispatchedJob, DispatchOutcome, Evaluation, EvaluationStatus
from tests.support.processes import (
    base_env,
    database_env,
    http_json,
    operator_token,
    reference_worker,
    serve,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

FAST = ["--heartbeat-secs", "2", "--idle-request-secs", "1", "--cpu-core-score", "800"]


@pytest.fixture
def embedded_passes_env() -> dict[str, str]:
    """PostgreSQL, no Redis: the passes run in the serve process, and stop with it."""
    return database_env(redis=False, GRADIENT_SCHEDULER_PASS_INTERVAL_SECS="1")


def test_a_drained_server_parks_in_flight_evaluations_and_the_next_start_resumes_them(
    tmp_path: Path, embedded_passes_env: dict[str, str]
) -> None:
    with ExitStack() as stack:
        first = stack.enter_context(serve(embedded_passes_env, tmp_path))
        port, base = first.port, first.base_url
        token = operator_token(first)
        assert http_json("POST", f"{base}/api/v1/projects", {"name": "demo"}, token)[0] == 201
        status, worker = http_json(
            "POST", f"{base}/api/v1/workers", {"name": "w0", "projects": ["demo"]}, token
        )
        assert status == 201, worker
        w0 = stack.enter_context(
            reference_worker(
                first.ws_url,
                str(worker["id"]),
                str(worker["token"]),
                tmp_path,
                name="w0",
                extra_args=[*FAST, "--arch", "x86_64-linux"],
                env=base_env(),
            )
        )
        status, submitted = http_json(
            "POST",
            f"{base}/api/v1/evaluations",
            {"project": "demo", "repository": "sim:chain?n=3&duration_ms=2500", "commit": "1"},
            token,
        )
        assert status == 201, submitted
        evaluation_id = submitted["id"]

        def building_with_a_job() -> bool:
            return DispatchedJob.objects.filter(
                finished_at__isnull=True, derivation_build__evaluation_links__evaluation_id=evaluation_id
            ).exists()

        wait_until(building_with_a_job, timeout=40, what="a build of the chain on the worker")
        first_boot = ServerBoot.objects.get(pid=first.process.pid)

        # --- the drain ---------------------------------------------------------------------------------
        try:
            assert first.stop(signal.SIGTERM, timeout=45) == 0, first.log()[-4000:]
        except AssertionError:
            print(w0.log()[-3000:])
            raise
        first_boot.refresh_from_db()
        assert first_boot.draining_since is not None and first_boot.stopped_at is not None
        evaluation = Evaluation.objects.get(id=evaluation_id)
        assert (evaluation.status, evaluation.waiting_reason) == (
            EvaluationStatus.WAITING,
            {"reason": "draining", "resume": "Building"},
        ), first.log()[-4000:]

        # --- the next start ----------------------------------------------------------------------------
        second = stack.enter_context(serve(embedded_passes_env, tmp_path, port=port))
        second_boot = ServerBoot.objects.exclude(id=first_boot.id).get()
        assert second_boot.recovered_at is not None
        evaluation.refresh_from_db()
        assert evaluation.waiting_reason is None or evaluation.waiting_reason.get("reason") != "draining"
        status, shown = http_json("GET", f"{second.base_url}/api/v1/evaluations/{evaluation_id}", None, token)
        assert status == 200 and (shown.get("waiting_reason") or {}).get("reason") != "draining"
        try:
            wait_until(
                lambda: Evaluation.objects.get(id=evaluation_id).status == EvaluationStatus.COMPLETED,
                timeout=60,
                interval=0.5,
                what="the chain to complete after the restart",
            )
        except BaseException:
            print(w0.log()[-4000:])
            print(second.log()[-6000:])
            raise

    # Nothing of the first boot is open, and each of the three builds completed exactly once.
    assert not DispatchedJob.objects.filter(finished_at__isnull=True).exists()
    completed = DispatchedJob.objects.filter(
        derivation_build__isnull=False, outcome=DispatchOutcome.COMPLETED
    )
    assert completed.count() == completed.values("derivation_build").distinct().count() == 3
    bodies = list(
        RecordEntry.objects.filter(record__job_key=f"eval:{evaluation_id}").values_list("body", flat=True)
    )
    assert any("draining" in str(b) for b in bodies), "the park is in the evaluation's record"
