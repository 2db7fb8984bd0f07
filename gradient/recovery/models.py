"""Server boots and the bookkeeping of the periodic passes."""

from __future__ import annotations

import uuid

from django.db import models


class ServerBoot(models.Model):
    """One start of a `serve` process. Sessions name the boot that holds their socket."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    hostname = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    recovered_at = models.DateTimeField(null=True, blank=True, help_text="Startup recovery finished.")
    last_heartbeat = models.DateTimeField()
    stopped_at = models.DateTimeField(null=True, blank=True)
    draining_since = models.DateTimeField(
        null=True,
        blank=True,
        help_text="The instance began draining (SIGTERM): it assigns nothing more and is about to stop.",
    )

    class Meta:
        db_table = "server_boot"
        ordering = ["-started_at"]

    def __str__(self) -> str:
        # Named by host, process and the boot's short id, not its start time: the console shows times
        # in its one relative style (the start is a field of the boot's page).
        return f"{self.hostname}:{self.pid} (boot {str(self.id)[:8]})"


class PassState(models.Model):
    """One row per periodic pass: a lease so two runners never run the same pass at once, and what the
    last run did, for operators."""

    name = models.CharField(max_length=100, primary_key=True)
    lease_holder = models.CharField(max_length=200, blank=True, default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    last_started_at = models.DateTimeField(null=True, blank=True)
    last_finished_at = models.DateTimeField(null=True, blank=True)
    last_duration_ms = models.FloatField(null=True, blank=True)
    last_result = models.JSONField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    runs = models.PositiveBigIntegerField(default=0)

    class Meta:
        db_table = "pass_state"
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class MetricCount(models.Model):
    """A running total behind a Prometheus counter or histogram of GET /metrics, one row per (name,
    labels, process): each process adds to its own row (no two processes wait on one row), and
    /metrics sums the rows, so every process answers the service's totals (gradient.runtime.metrics)."""

    name = models.CharField(max_length=100)
    labels = models.CharField(max_length=200, blank=True, default="", help_text="k=v,k=v, sorted.")
    process = models.CharField(max_length=200, help_text="hostname:pid of the process adding to it.")
    value = models.FloatField(default=0)

    class Meta:
        db_table = "metric_count"
        constraints = [
            models.UniqueConstraint(
                fields=["name", "labels", "process"],
                name="metric_count-unique",
                violation_error_message="One row per metric, labels and process.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name}{{{self.labels}}} {self.value} ({self.process})"
