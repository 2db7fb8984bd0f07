"""End to end: an evaluation of 10 000 derivations, sent by the reference worker (sim executor) over a
real WebSocket in parts, arrives whole: every edge kept, exactly the leaves queued, and the evaluation
completes once its builds do."""

from __future__ import annotations

import json
import random
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User

from gradient.scheduling.models import (
    BuildStatus,
    DerivationBuild,
    DerivationBuildDependency,
    EvalIngest,
    Evaluation,
    EvaluationStatus,
)
from tests.support.processes import (
    base_env,
    database_env,
    http_json,
    reference_worker,
    serve,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

FAST = ["--heartbeat-secs", "0.5", "--idle-request-secs", "1", "--cpu-core-score", "500"]
N = 10_000
TO_BUILD = 120  # the top of the graph; everything below is in the cache


def _graph(path: Path) -> dict[str, dict[str, Any]]:
    """N derivations, 1-5 inputs each among the earlier ones; all cached but the last TO_BUILD."""
    rng = random.Random(23)
    derivations = []
    for i in range(N):
        inputs = sorted({f"d{rng.randrange(i)}" for _ in range(rng.randint(1, 5))}) if i else []
        derivations.append({"name": f"d{i}", "inputs": inputs, "cached": i < N - TO_BUILD})
    path.write_text(json.dumps({"derivations": derivations}))
    return {d["name"]: d for d in derivations}


def _name(drv_path: str) -> str:
    match = re.fullmatch(r"/nix/store/[0-9a-z]{32}-(d\d+)(__.*)?\.drv", drv_path)
    assert match, drv_path
    return match.group(1)


def _post(base: str, path: str, body: dict[str, Any], token: str) -> dict[str, Any]:
    status, answer = http_json("POST", f"{base}{path}", body, token)
    assert status == 201, answer
    return answer  # type: ignore[no-any-return]


def test_ten_thousand_derivations_in_parts_arrive_whole_and_the_evaluation_completes(tmp_path: Path) -> None:
    graph = _graph(tmp_path / "graph.json")
    edges = {(name, i) for name, d in graph.items() for i in d["inputs"]}
    leaves = {n for n, d in graph.items() if not d["cached"] and all(graph[i]["cached"] for i in d["inputs"])}
    env = database_env(redis=False)
    User.objects.create_user("operator", password="operator-pw", is_staff=True)
    with ExitStack() as stack:
        server = stack.enter_context(serve(env, tmp_path, extra_args=["--no-passes"]))
        _, body = http_json(
            "POST",
            f"{server.base_url}/api/v1/auth/token",
            {"username": "operator", "password": "operator-pw"},
        )
        token = body["token"]
        _post(server.base_url, "/api/v1/projects", {"name": "big"}, token)
        evaluator = _post(
            server.base_url, "/api/v1/workers", {"name": "evaluator", "projects": ["big"]}, token
        )
        stack.enter_context(
            reference_worker(
                server.ws_url,
                str(evaluator["id"]),
                str(evaluator["token"]),
                tmp_path,
                name="evaluator",
                extra_args=[*FAST, "--capabilities", "fetch,eval"],
                env=base_env(),
            )
        )
        evaluation_id = _post(
            server.base_url,
            "/api/v1/evaluations",
            {"project": "big", "repository": f"sim:{tmp_path / 'graph.json'}", "commit": "1"},
            token,
        )["id"]

        def evaluated() -> bool:
            status = Evaluation.objects.values_list("status", flat=True).get(id=evaluation_id)
            assert status not in (EvaluationStatus.FAILED, EvaluationStatus.ABORTED), status
            return status == EvaluationStatus.BUILDING

        wait_until(evaluated, timeout=180, what="the evaluation to be evaluated")
        ingest = EvalIngest.objects.get(evaluation_id=evaluation_id)
        assert ingest.parts > 1 and ingest.derivations == N and ingest.decided_at is not None
        # Whole: every derivation, every edge; exactly the leaves queued, the rest cached or waiting.
        names = {b.id: _name(b.drv_path) for b in DerivationBuild.objects.only("id", "drv_path")}
        assert len(names) == N
        got = {
            (names[b], names[d])
            for b, d in DerivationBuildDependency.objects.values_list("build", "dependency")
        }
        assert got == edges
        by_status: dict[str, set[str]] = {}
        for build_id, status in DerivationBuild.objects.values_list("id", "status"):
            by_status.setdefault(status, set()).add(names[build_id])
        assert by_status[BuildStatus.QUEUED] == leaves
        assert by_status[BuildStatus.SUBSTITUTED] == {n for n, d in graph.items() if d["cached"]}
        assert by_status[BuildStatus.CREATED] == {n for n, d in graph.items() if not d["cached"]} - leaves

        builder = _post(server.base_url, "/api/v1/workers", {"name": "builder", "projects": ["big"]}, token)
        stack.enter_context(
            reference_worker(
                server.ws_url,
                str(builder["id"]),
                str(builder["token"]),
                tmp_path,
                name="builder",
                extra_args=[*FAST, "--capabilities", "build", "--slots", "8", "--sim-build-ms", "0"],
                env=base_env(),
            )
        )

        def completed() -> bool:
            status = Evaluation.objects.values_list("status", flat=True).get(id=evaluation_id)
            assert status not in (EvaluationStatus.FAILED, EvaluationStatus.ABORTED), status
            return status == EvaluationStatus.COMPLETED

        wait_until(completed, timeout=300, what="the evaluation to complete")
    assert DerivationBuild.objects.filter(status=BuildStatus.COMPLETED).count() == TO_BUILD
