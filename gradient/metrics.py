"""GET /metrics: the Prometheus text exposition format (0.0.4), exactly the families of
../shared/spec/rest.md ("Metrics"), rendered with prometheus-client.

Every figure is the whole service's, whichever process answers: gauges count the rows they describe
when asked (queued jobs, connected workers, evaluations and clusters by status), assignments are the
`dispatched_job` rows by kind (never deleted), and the other counters and the pass histogram are the
totals of `metric_count`, which every process adds to (gradient.runtime.metrics). No token is needed
when GRADIENT_METRICS_TOKEN is unset; otherwise `Authorization: Bearer <that token>`, 401 without it.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Any

from django.conf import settings
from django.db.models import Count
from django.http import HttpResponse, JsonResponse
from drf_spectacular.utils import extend_schema
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from rest_framework.permissions import AllowAny
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.views import APIView

from gradient.clusters.models import ClusterJob
from gradient.core.vocab import BuildStatus, ClusterStatus, EvaluationStatus, JobKind
from gradient.runtime import metrics as totals
from gradient.scheduling.models import DerivationBuild, DispatchedJob, Evaluation
from gradient.workers.models import WorkerSession

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
JOB_KINDS = {JobKind.EVAL.value: "flake", JobKind.BUILD.value: "build"}  # the spec's label values


def _by_status(model: type[Evaluation] | type[ClusterJob]) -> dict[str, int]:
    return dict(
        model.objects.order_by().values_list("status").annotate(n=Count("id")).values_list("status", "n")
    )


class ServiceCollector(Collector):
    """Reads the service's figures from the database at each scrape."""

    def collect(self) -> Iterator[Metric]:
        pending = GaugeMetricFamily(
            "gradient_jobs_pending", "Jobs waiting to be handed out, by kind.", labels=["kind"]
        )
        pending.add_metric(["flake"], Evaluation.objects.filter(status=EvaluationStatus.QUEUED).count())
        pending.add_metric(["build"], DerivationBuild.objects.filter(status=BuildStatus.QUEUED).count())
        yield pending

        assignments = CounterMetricFamily(
            "gradient_assignments", "Jobs handed out to workers (claims won), by kind.", labels=["kind"]
        )
        handed = dict(
            DispatchedJob.objects.order_by()
            .values_list("kind")
            .annotate(n=Count("id"))
            .values_list("kind", "n")
        )
        for kind, label in JOB_KINDS.items():
            assignments.add_metric([label], handed.get(kind, 0))
        yield assignments

        yield GaugeMetricFamily(
            "gradient_workers_connected",
            "Active workers with an open session.",
            value=WorkerSession.objects.filter(closed_at__isnull=True, worker__active=True).count(),
        )

        evaluations = GaugeMetricFamily("gradient_evaluations", "Evaluations by status.", labels=["status"])
        counts = _by_status(Evaluation)
        for status in EvaluationStatus:
            evaluations.add_metric([status.value], counts.get(status.value, 0))
        yield evaluations

        clusters = GaugeMetricFamily("gradient_clusters", "Cluster jobs by status.", labels=["status"])
        counts = _by_status(ClusterJob)
        for cluster_status in ClusterStatus:
            clusters.add_metric([cluster_status.value], counts.get(cluster_status.value, 0))
        yield clusters

        recorded = totals.totals()
        yield _pass_histogram(recorded)
        lost = CounterMetricFamily(
            "gradient_claims_lost", "Claims that lost the race for a job (another claim won it first)."
        )
        lost.add_metric([], sum(recorded.get(totals.CLAIMS_LOST, {}).values()))
        yield lost


def _pass_histogram(recorded: dict[str, dict[str, float]]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(
        totals.PASS_DURATION, "How long each run of a periodic pass took.", labels=["pass"]
    )
    buckets: dict[str, dict[str, float]] = {}
    for labels, value in recorded.get(f"{totals.PASS_DURATION}_bucket", {}).items():
        parsed = totals.labels_of(labels)
        buckets.setdefault(parsed["pass"], {})[parsed["le"]] = value
    sums = {
        totals.labels_of(k)["pass"]: v for k, v in recorded.get(f"{totals.PASS_DURATION}_sum", {}).items()
    }
    for name in sorted(buckets):
        seen = buckets[name]
        bounds = [repr(float(b)) for b in totals.PASS_BUCKETS] + ["+Inf"]
        family.add_metric([name], [(b, seen.get(b, 0.0)) for b in bounds], sum_value=sums.get(name, 0.0))
    return family


_registry = CollectorRegistry(auto_describe=False)
_registry.register(ServiceCollector())


class PrometheusText(BaseRenderer):
    media_type = "text/plain"
    format = "prometheus"
    charset = "utf-8"

    def render(self, data: Any, accepted_media_type: str | None = None, renderer_context: Any = None) -> Any:
        return data if isinstance(data, bytes) else str(data).encode()


class MetricsView(APIView):
    """Outside /api/v1/ and its token scheme: a scraper sends the metrics token, if one is set."""

    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]
    throttle_classes: list[Any] = []
    renderer_classes = [PrometheusText, JSONRenderer]

    # Not in the OpenAPI document of /api/ (its token scheme, its 401/403 on every route): a scrape
    # target, described in rest.md's "Metrics" and docs/operators.md.
    @extend_schema(exclude=True)
    def get(self, request: Request) -> HttpResponse:
        token = settings.GRADIENT_METRICS_TOKEN
        if token:
            sent = request.headers.get("Authorization", "")
            if not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
                response = JsonResponse(
                    {"detail": "Send Authorization: Bearer <GRADIENT_METRICS_TOKEN>."}, status=401
                )
                response["WWW-Authenticate"] = 'Bearer realm="metrics"'
                return response
        return HttpResponse(generate_latest(_registry), content_type=CONTENT_TYPE)
