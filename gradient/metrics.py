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
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, DurationField, ExpressionWrapper, F, Q, QuerySet, Sum
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
from gradient.scheduling.models import DerivationBuild, DispatchedJob, Evaluation, StartEstimate
from gradient.workers.models import WorkerSession

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
JOB_KINDS = {JobKind.EVAL.value: "flake", JobKind.BUILD.value: "build"}  # the spec's label values


def _by_status(model: type[Evaluation] | type[ClusterJob] | type[DerivationBuild]) -> dict[str, int]:
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

        builds = GaugeMetricFamily("gradient_builds", "Shared builds by status.", labels=["status"])
        counts = _by_status(DerivationBuild)
        for build_status in BuildStatus:
            builds.add_metric([build_status.value], counts.get(build_status.value, 0))
        yield builds

        yield _rows_histogram(
            "gradient_build_duration_seconds",
            "How long each finished try of a shared build took, from its claim to its end.",
            DispatchedJob.objects.filter(kind=JobKind.BUILD, finished_at__isnull=False),
            start="dispatched_at",
            end="finished_at",
            buckets=BUILD_DURATION_BUCKETS,
        )
        yield _rows_histogram(
            "gradient_queue_wait_seconds",
            "How long each job waited, from queued to claimed, by kind.",
            DispatchedJob.objects.filter(queued_at__isnull=False),
            start="queued_at",
            end="dispatched_at",
            buckets=QUEUE_WAIT_BUCKETS,
            by_kind=True,
        )

        yield _eta_error_histogram()

        recorded = totals.totals()
        yield _pass_histogram(recorded)
        lost = CounterMetricFamily(
            "gradient_claims_lost", "Claims that lost the race for a job (another claim won it first)."
        )
        lost.add_metric([], sum(recorded.get(totals.CLAIMS_LOST, {}).values()))
        yield lost


BUILD_DURATION_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0)
QUEUE_WAIT_BUCKETS = (0.1, 0.5, 1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


def _rows_histogram(
    name: str,
    documentation: str,
    rows: QuerySet[DispatchedJob],
    *,
    start: str,
    end: str,
    buckets: tuple[float, ...],
    by_kind: bool = False,
) -> HistogramMetricFamily:
    """A histogram of `end - start` over assignment rows (which are kept, so it only grows), counted by
    the database in one query per scrape: the whole service's figures, and nothing for the hot path to
    write. Rows retention has deleted drop out of it."""
    took = ExpressionWrapper(F(end) - F(start), output_field=DurationField())
    aggregates: dict[str, Any] = {
        f"le_{i}": Count("id", filter=Q(took__lte=timedelta(seconds=bound)))
        for i, bound in enumerate(buckets)
    }
    aggregates["n"] = Count("id")
    aggregates["total"] = Sum("took")
    grouped = rows.order_by().annotate(took=took)
    family = HistogramMetricFamily(name, documentation, labels=["kind"] if by_kind else [])
    if by_kind:
        found = {row["kind"]: row for row in grouped.values("kind").annotate(**aggregates)}
        labelled = [([label], found.get(kind)) for kind, label in JOB_KINDS.items()]
    else:
        labelled = [([], grouped.aggregate(**aggregates))]
    for labels, row in labelled:
        row = row or {}
        counts = [(repr(bound), float(row.get(f"le_{i}") or 0)) for i, bound in enumerate(buckets)]
        counts.append(("+Inf", float(row.get("n") or 0)))
        total = row.get("total")
        family.add_metric(labels, counts, sum_value=total.total_seconds() if total else 0.0)
    return family


ETA_ERROR_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 21600.0)


def _eta_error_histogram() -> HistogramMetricFamily:
    """|actual - expected| start of the builds handed out after the ETA pass estimated them
    (services.estimates): from the rows, like the histograms above (kept 7 days)."""
    aggregates: dict[str, Any] = {
        f"le_{i}": Count("id", filter=Q(error_secs__lte=bound)) for i, bound in enumerate(ETA_ERROR_BUCKETS)
    }
    # Builds' only, as its help says (the evaluations' estimates are on the overview beside them).
    row = StartEstimate.objects.filter(error_secs__isnull=False, build__isnull=False).aggregate(
        n=Count("id"), total=Sum("error_secs"), **aggregates
    )
    family = HistogramMetricFamily(
        "gradient_eta_error_seconds",
        "How far each estimated start of a waiting build was from its hand-out, once it started.",
    )
    counts = [(repr(bound), float(row.get(f"le_{i}") or 0)) for i, bound in enumerate(ETA_ERROR_BUCKETS)]
    counts.append(("+Inf", float(row.get("n") or 0)))
    family.add_metric([], counts, sum_value=float(row.get("total") or 0.0))
    return family


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
