"""SIGKILL between the parts of an evaluation (issue 30): `serve` is killed while a worker's eval_result
is arriving in parts, builds of the parts already stored may have started; after the restart the
evaluation is evaluated again and finishes, every derivation built exactly once, every edge there."""

from __future__ import annotations

import signal
from contextlib import ExitStack
from pathlib import Path

import pytest

from gradient.scheduling.models import DerivationBuild, DerivationBuildDependency, EvalIngest
from tests.support.faults import (
    Operator,
    invariant_violations,
    jobs_not_completed_exactly_once,
    service_env,
    start_workers,
    statuses,
    wait_all_completed,
)
from tests.support.processes import ServeProcess, WorkerProcess, celery_worker, serve, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.django_db(transaction=True)]

N = 300


def test_serve_killed_between_the_parts_of_an_evaluation_loses_nothing(tmp_path: Path) -> None:
    env = service_env()
    workers: list[WorkerProcess] = []
    server: ServeProcess | None = None
    evaluation = ""
    with ExitStack() as stack:
        beat = stack.enter_context(celery_worker(env, tmp_path))
        server = stack.enter_context(serve(env, tmp_path))
        port = server.port
        op = Operator.login(server)
        op.project("demo")
        try:
            evaluation = op.evaluation(f"sim:chain?n={N}&duration_ms=10&eval_ms=100&salt=parts")
            # Parts of 4 KiB: about 50 of them.
            workers += start_workers(
                stack, op, server.ws_url, tmp_path, ["w0"], extra_args=["--eval-part-bytes", "4096"]
            )
            wait_until(
                lambda: EvalIngest.objects.filter(decided_at__isnull=True, parts__gte=1).exists(),
                timeout=60,
                interval=0.02,
                what="parts of the eval_result arriving",
            )
            assert server.stop(signal.SIGKILL) == -signal.SIGKILL
            server = None
            server = stack.enter_context(serve(env, tmp_path, port=port))
            wait_all_completed([evaluation], [], 240, "the evaluation to finish after the kill")
        except BaseException:
            for w in workers:
                print(f"--- {w.name}\n{w.log()[-3000:]}")
            if server is not None:
                print(f"--- serve\n{server.log()[-5000:]}")
            print(f"--- celery\n{beat.log()[-3000:]}")
            print("statuses", statuses([evaluation] if evaluation else []))
            raise

    ingests = list(EvalIngest.objects.order_by("started_at").values_list("parts", "decided_at"))
    assert len(ingests) >= 2 and ingests[0][1] is None  # the first was cut by the kill
    assert DerivationBuild.objects.count() == N
    assert set(DerivationBuild.objects.values_list("status", flat=True)) == {"Completed"}
    assert DerivationBuildDependency.objects.count() == N - 1
    assert invariant_violations() == {}
    assert jobs_not_completed_exactly_once([evaluation]) == {}
