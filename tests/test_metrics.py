"""GET /metrics (rest.md "Metrics"): the named families in the Prometheus text format, figures that move
with the service, the same totals whichever of two real `serve` processes answers, and the token."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest
from django.test import Client, override_settings
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from gradient.runtime.passes import pass_run
from gradient.scheduling.models import Evaluation, EvaluationStatus
from gradient.scheduling.services.lifecycle import claim_build
from tests.factories import DerivationBuildFactory, ProjectFactory, WorkerFactory
from tests.support.processes import (
    database_env,
    free_port,
    http_json,
    operator_token,
    reference_worker,
    serve,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)

FAMILIES = {
    "gradient_jobs_pending": "gauge",
    "gradient_assignments": "counter",
    "gradient_workers_connected": "gauge",
    "gradient_evaluations": "gauge",
    "gradient_clusters": "gauge",
    "gradient_pass_duration_seconds": "histogram",
    "gradient_claims_lost": "counter",
    "gradient_builds": "gauge",
    "gradient_build_duration_seconds": "histogram",
    "gradient_queue_wait_seconds": "histogram",
    # Issue 33's, beside the spec's ("at least these families"): the start estimate's error.
    "gradient_eta_error_seconds": "histogram",
}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def families(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def scrape(base_url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:  # noqa: S310 (loopback)
        assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        return response.read().decode()


def test_the_families_of_the_spec_with_their_labels_and_types() -> None:
    response = Client().get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = response.content.decode()
    assert families(text) == FAMILIES
    figures = samples(text)
    assert ("gradient_jobs_pending", (("kind", "flake"),)) in figures
    assert ("gradient_jobs_pending", (("kind", "build"),)) in figures
    assert ("gradient_assignments_total", (("kind", "build"),)) in figures
    assert ("gradient_evaluations", (("status", "Queued"),)) in figures
    assert ("gradient_clusters", (("status", "Running"),)) in figures
    assert ("gradient_claims_lost_total", ()) in figures


def test_figures_move_a_lost_claim_and_a_pass_run_are_counted() -> None:
    before = samples(Client().get("/metrics").content.decode())
    build = DerivationBuildFactory(status="Queued", queued_at=timezone.now())
    one, two = WorkerFactory(), WorkerFactory()
    assert claim_build(build=build, worker_id=one.id, now=timezone.now()) is not None
    assert claim_build(build=build, worker_id=two.id, now=timezone.now()) is None  # lost
    pass_run(name="metrics-test", body=lambda: None)
    after = samples(Client().get("/metrics").content.decode())
    assert after[("gradient_claims_lost_total", ())] == before[("gradient_claims_lost_total", ())] + 1
    assert after[("gradient_assignments_total", (("kind", "build"),))] == (
        before[("gradient_assignments_total", (("kind", "build"),))] + 1
    )
    assert after[("gradient_pass_duration_seconds_count", (("pass", "metrics-test"),))] == 1
    assert after[("gradient_pass_duration_seconds_bucket", (("le", "+Inf"), ("pass", "metrics-test")))] == 1


@override_settings(GRADIENT_METRICS_TOKEN="s3cret")
def test_with_a_metrics_token_a_scrape_without_it_is_a_401() -> None:
    assert Client().get("/metrics").status_code == 401
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret").status_code == 200


@pytest.mark.e2e
def test_two_serve_processes_answer_the_same_totals_as_the_service_works(tmp_path: Path) -> None:
    # Embedded channel layer and in-process passes in each serve, one PostgreSQL: both run passes (one
    # at a time per pass, by the leases); the worker connects to the first.
    env = database_env(redis=False, GRADIENT_SCHEDULER_PASS_INTERVAL_SECS="1")
    with ExitStack() as stack:
        first = stack.enter_context(serve(env, tmp_path, port=free_port()))
        second = stack.enter_context(serve(env, tmp_path, port=free_port()))
        start = samples(scrape(second.base_url))
        token = operator_token(first)
        project = ProjectFactory(name="metrics")
        status, body = http_json(
            "POST", f"{first.base_url}/api/v1/workers", {"name": "m1", "projects": ["metrics"]}, token
        )
        assert status == 201, body
        stack.enter_context(
            reference_worker(
                first.ws_url,
                body["id"],
                body["token"],
                tmp_path,
                name="m1",
                extra_args=["--heartbeat-secs", "1"],
            )
        )
        status, submitted = http_json(
            "POST",
            f"{second.base_url}/api/v1/evaluations",
            {"project": project.name, "repository": "sim:chain?n=3", "commit": "m"},
            token,
        )
        assert status == 201, submitted
        wait_until(
            lambda: Evaluation.objects.get(id=submitted["id"]).status == EvaluationStatus.COMPLETED,
            timeout=120,
            what="the evaluation to complete\n" + first.log()[-3000:],
        )

        a1 = samples(scrape(first.base_url))
        b = samples(scrape(second.base_url))
        a2 = samples(scrape(first.base_url))

    assert (
        b[("gradient_evaluations", (("status", "Completed"),))]
        == start[("gradient_evaluations", (("status", "Completed"),))] + 1
    )
    assert b[("gradient_assignments_total", (("kind", "flake"),))] >= 1
    assert b[("gradient_assignments_total", (("kind", "build"),))] >= 3
    assert b[("gradient_workers_connected", ())] == 1
    for key, value in b.items():
        if key[0].startswith("gradient_pass_duration_seconds"):
            # the passes keep running while we scrape: a total the second answers lies between two
            # answers of the first, taken before and after it
            assert a1.get(key, 0) <= value <= a2.get(key, 0), key
        else:
            assert a1[key] == value == a2[key], key
    assert any(k[0] == "gradient_pass_duration_seconds_count" and v > 0 for k, v in b.items())


def test_the_grafana_dashboard_plots_only_the_families_served() -> None:
    import json
    import re

    from tests.support.processes import ROOT

    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"gradient_[a-z_]+", e)}
    served = set(FAMILIES) | {"gradient_assignments_total", "gradient_claims_lost_total"}
    histograms = (
        "gradient_pass_duration_seconds",
        "gradient_build_duration_seconds",
        "gradient_queue_wait_seconds",
        "gradient_eta_error_seconds",
    )
    served |= {f"{h}_{s}" for h in histograms for s in ("bucket", "sum", "count")}
    assert used and used <= served, used - served
    assert set(FAMILIES) - {"gradient_assignments", "gradient_claims_lost"} <= {
        u.removesuffix("_bucket").removesuffix("_count") for u in used
    } | {"gradient_assignments", "gradient_claims_lost"}


def test_compacting_folds_every_process_into_one_row_and_keeps_the_totals() -> None:
    from gradient.recovery.models import MetricCount
    from gradient.runtime import metrics as totals

    totals.count(totals.CLAIMS_LOST, amount=2)
    MetricCount.objects.create(name=totals.CLAIMS_LOST, labels="", process="gone-host:1", value=3)
    pass_run(name="compact-test", body=lambda: None)
    before = totals.totals()
    assert totals.compact() >= 2
    assert totals.totals() == before
    assert set(MetricCount.objects.values_list("process", flat=True)) == {totals.RETIRED}
    totals.count(totals.CLAIMS_LOST)
    assert totals.totals()[totals.CLAIMS_LOST][""] == before[totals.CLAIMS_LOST][""] + 1
