"""End to end: a real `serve` process and three real reference workers (sim executor) bring
evaluations to Completed over the real protocol: evaluation jobs, then shared builds in dependency
order; a build for an architecture no worker has is never assigned."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.db.models import Min

from gradient.scheduling.models import (
    DerivationBuild,
    DerivationBuildDependency,
    DispatchedJob,
    Evaluation,
    EvaluationStatus,
)
from tests.support.processes import base_env, database_env, http_json, reference_worker, serve, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

FAST = ["--heartbeat-secs", "1", "--idle-request-secs", "0.5", "--cpu-core-score", "800"]


@pytest.fixture
def service_env() -> dict[str, str]:
    # Server and workers share this machine: base_env scores with `simple` (see there).
    return database_env()


def _post(base: str, path: str, body: dict, token: str) -> dict:  # type: ignore[type-arg]
    status, answer = http_json("POST", f"{base}{path}", body, token)
    assert status == 201, answer
    return answer  # type: ignore[no-any-return]


def test_three_workers_bring_a_diamond_and_a_wide_graph_to_completed_in_dependency_order(
    tmp_path: Path, service_env: dict[str, str]
) -> None:
    User.objects.create_user("operator", password="operator-pw", is_staff=True)
    with ExitStack() as stack:
        server = stack.enter_context(serve(service_env, tmp_path, extra_args=["--no-passes"]))
        _, body = http_json(
            "POST",
            f"{server.base_url}/api/v1/auth/token",
            {"username": "operator", "password": "operator-pw"},
        )
        token = body["token"]
        _post(server.base_url, "/api/v1/projects", {"name": "demo"}, token)
        workers = []
        for i in range(3):
            registered = _post(
                server.base_url, "/api/v1/workers", {"name": f"w{i}", "projects": ["demo"]}, token
            )
            workers.append(
                stack.enter_context(
                    reference_worker(
                        server.ws_url,
                        str(registered["id"]),
                        str(registered["token"]),
                        tmp_path,
                        name=f"w{i}",
                        extra_args=[*FAST, "--arch", "x86_64-linux", "--slots", "2"],
                        env=base_env(),
                    )
                )
            )
        submitted = {
            url: _post(
                server.base_url,
                "/api/v1/evaluations",
                {"project": "demo", "repository": url, "commit": "1"},
                token,
            )["id"]
            for url in (
                "sim:diamond?duration_ms=200",
                "sim:wide?n=40&duration_ms=20",
                "sim:chain?n=2&system=riscv64-linux",
            )
        }

        def done() -> bool:
            statuses = dict(Evaluation.objects.values_list("repository", "status"))
            return all(statuses[u] == EvaluationStatus.COMPLETED for u in list(submitted)[:2])

        try:
            wait_until(done, timeout=180, what="diamond and wide to complete")
        except AssertionError:
            print("\n".join(w.log()[-3000:] for w in workers), server.log()[-8000:])
            raise

        riscv = Evaluation.objects.get(repository__contains="riscv64")
        assert riscv.status in (EvaluationStatus.BUILDING, EvaluationStatus.WAITING)
        riscv_builds = DerivationBuild.objects.filter(system="riscv64-linux")
        assert riscv_builds.count() == 2
        assert not DispatchedJob.objects.filter(derivation_build__in=riscv_builds).exists()

    wide = Evaluation.objects.get(id=submitted["sim:wide?n=40&duration_ms=20"])
    assert wide.build_links.count() == 40
    # Every build was handed out only after each of its dependencies had finished.
    first_dispatch = dict(
        DispatchedJob.objects.filter(derivation_build__isnull=False)
        .values("derivation_build_id")
        .annotate(first=Min("dispatched_at"))
        .values_list("derivation_build_id", "first")
    )
    edges = DerivationBuildDependency.objects.select_related("dependency")
    assert edges.count() >= 4
    for edge in edges:
        if edge.build_id in first_dispatch:
            assert edge.dependency.finished_at is not None
            assert first_dispatch[edge.build_id] >= edge.dependency.finished_at, edge
    # Work spread over the workers, and every hand-out kept its score breakdown.
    used = set(DispatchedJob.objects.values_list("worker_id", flat=True))
    assert len(used) >= 2
    assert all(row for row in DispatchedJob.objects.values_list("score_breakdown", flat=True))
