"""Workers, their sessions, and what the server remembers per worker for offers and placement."""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models import Q

from gradient.core.vocab import JobKind, choices

# WorkerMetrics' fields as the worker row keeps them (with `metrics_at`, when they came).
METRIC_FIELDS = (
    "cpu_usage_pct",
    "ram_free_mb",
    "disk_speed_mbps",
    "upload_speed_mbps",
    "download_speed_mbps",
    "build_peak_ram_mb",
)


class Worker(models.Model):
    """A registered worker. The token is shown once at registration and only its hash is kept."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=200, unique=True)
    token_hash = models.CharField(max_length=128, editable=False)
    active = models.BooleanField(default=True, help_text="A deactivated worker is refused (403).")
    projects = models.ManyToManyField(
        "scheduling.Project", blank=True, related_name="workers", db_table="worker_project"
    )

    # InitConnection capabilities.
    can_fetch = models.BooleanField(default=False)
    can_eval = models.BooleanField(default=False)
    can_build = models.BooleanField(default=False)

    # WorkerCapabilities: replaced as a whole by each message.
    architectures = models.JSONField(default=list, blank=True)
    system_features = models.JSONField(default=list, blank=True)
    max_concurrent_builds = models.PositiveIntegerField(default=1)
    cpu_count = models.PositiveIntegerField(null=True, blank=True)
    ram_total_mb = models.PositiveIntegerField(null=True, blank=True)
    cpu_core_score = models.IntegerField(null=True, blank=True)
    zone = models.CharField(max_length=200, null=True, blank=True)
    endpoint = models.CharField(max_length=500, null=True, blank=True)
    capabilities_at = models.DateTimeField(null=True, blank=True)

    # WorkerMetrics, the latest heartbeat of the open session (cleared when a session opens); null is
    # "unknown" to scoring, and so are metrics older than scoring.METRICS_STALE_SECS.
    cpu_usage_pct = models.FloatField(null=True, blank=True)
    ram_free_mb = models.IntegerField(null=True, blank=True)
    disk_speed_mbps = models.FloatField(null=True, blank=True)
    upload_speed_mbps = models.FloatField(null=True, blank=True)
    download_speed_mbps = models.FloatField(null=True, blank=True)
    build_peak_ram_mb = models.IntegerField(null=True, blank=True)
    metrics_at = models.DateTimeField(null=True, blank=True)

    last_seen = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    deactivated_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "worker"
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class WorkerSession(models.Model):
    """One WebSocket session. At most one is open per worker (idx-worker_session-open): a second
    InitConnection is rejected with 496, whichever server instance holds the first."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    worker = models.ForeignKey(Worker, on_delete=models.CASCADE, related_name="sessions")
    channel_name = models.CharField(max_length=200, help_text="The per-session channel of the channel layer.")
    server_boot = models.UUIDField(help_text="The serve process (recovery.ServerBoot) holding the socket.")
    draining = models.BooleanField(
        default=False, help_text="The worker said Draining: assign it nothing more."
    )
    opened_at = models.DateTimeField()
    last_seen = models.DateTimeField()
    closed_at = models.DateTimeField(null=True, blank=True)
    close_reason = models.CharField(max_length=200, blank=True, default="")

    class Meta:
        db_table = "worker_session"
        ordering = ["-opened_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["worker"],
                condition=Q(closed_at__isnull=True),
                name="idx-worker_session-open",
                violation_error_message="This worker already has an open session.",
            ),
        ]
        indexes = [
            models.Index(
                fields=["last_seen"], name="idx-worker_session-open-seen", condition=Q(closed_at__isnull=True)
            ),
        ]

    def __str__(self) -> str:
        return f"session of {self.worker.name}" + (" (closed)" if self.closed_at else " (open)")


class IdleSlot(models.Model):
    """An unanswered RequestJob: the planner's only view of free capacity. Older than 25 s is ignored."""

    worker = models.ForeignKey(Worker, on_delete=models.CASCADE, related_name="idle_slots")
    kind = models.CharField(max_length=8, choices=choices(JobKind))
    recorded_at = models.DateTimeField()

    class Meta:
        db_table = "idle_slot"
        constraints = [
            models.UniqueConstraint(
                fields=["worker", "kind"],
                name="idle_slot-one-per-worker-kind",
                violation_error_message="A worker has one idle slot per kind.",
            ),
        ]
        indexes = [models.Index(fields=["kind", "recorded_at"], name="idx-idle_slot-kind-recorded")]

    def __str__(self) -> str:
        return f"{self.worker_id} idle for {self.kind}"
