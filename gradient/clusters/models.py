"""Cluster jobs: existing jobs grouped for a joint start on distinct workers, all or nothing.

Table names and constraint names are the design page's (cluster-jobs.md); outside tools read them.
The delete actions of cluster_member, cluster_attempt (CASCADE) and dispatched_job.cluster_attempt
(SET NULL) are real PostgreSQL foreign-key actions, set by migration 0002, so a retention pass that
deletes with SQL behaves as the page says. The statuses, outcomes and verdicts are gradient.core.vocab's.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q

from gradient.core.jobkey import build_key, cluster_key, eval_key
from gradient.core.vocab import CLUSTER_ACTIVE as CLUSTER_ACTIVE
from gradient.core.vocab import (
    CLUSTER_TERMINAL,
    AttemptOutcome,
    ClusterStatus,
    SeatResult,
    Verdict,
    choices,
)


class ClusterJob(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    status = models.CharField(max_length=16, choices=choices(ClusterStatus), default=ClusterStatus.QUEUED)
    same_zone = models.BooleanField(default=False)
    priority = models.BooleanField(default=False, help_text="Prioritized clusters are placed first.")
    attempts = models.PositiveIntegerField(default=0, help_text="Started attempts (not claims).")
    retry_budget = models.PositiveIntegerField(
        default=2, help_text="Bounds started attempts: 0 or 1 allows one, 2 a first attempt and one retry."
    )
    prepare_failures = models.PositiveIntegerField(
        default=0, help_text="Consecutive failed prepares, for backoff; reset when an attempt starts."
    )
    retry_at = models.DateTimeField(null=True, blank=True, help_text="Not placed again before this.")
    waiting_reason = models.JSONField(
        null=True, blank=True, help_text="Why the last placement found no seats."
    )
    waiting_since = models.DateTimeField(null=True, blank=True)
    queued_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When it last entered the queue (created, or requeued by a Retry): orders and ages it.",
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "cluster_job"
        ordering = ["-created_at"]
        indexes = [
            models.Index(
                fields=["-priority", "created_at"],
                name="idx-cluster_job-queued",
                condition=Q(status=ClusterStatus.QUEUED),
            ),
            models.Index(
                fields=["finished_at"],
                name="idx-cluster_job-retention",
                condition=Q(status__in=CLUSTER_TERMINAL),
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(finished_at__isnull=True) | Q(status__in=CLUSTER_TERMINAL),
                name="cluster_job-finished-only-when-terminal",
                violation_error_message="Only a finished cluster job has finished_at.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.status})"

    @property
    def name(self) -> str:
        """What an operator calls it: its roles, how many of each: "cluster server + 2 client"."""
        roles: dict[str, int] = {}
        for role in self.members.order_by("role", "index").values_list("role", flat=True):
            roles[role] = roles.get(role, 0) + 1
        if not roles:
            return "cluster without members"
        return "cluster " + " + ".join(role if n == 1 else f"{n} {role}" for role, n in roles.items())

    @property
    def job_key(self) -> str:
        return cluster_key(self.id)


class ClusterMember(models.Model):
    """One member job: exactly one of an evaluation or a shared build, with its role and index."""

    cluster_job = models.ForeignKey(ClusterJob, on_delete=models.CASCADE, related_name="members")
    evaluation = models.ForeignKey(
        "scheduling.Evaluation",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="cluster_members",
    )
    derivation_build = models.ForeignKey(
        "scheduling.DerivationBuild",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="cluster_members",
    )
    role = models.CharField(max_length=100)
    index = models.PositiveIntegerField(default=0)
    primary = models.BooleanField(default=False, help_text="The cluster completes when the primary succeeds.")
    pin = models.CharField(
        max_length=200, null=True, blank=True, help_text="Name of the only worker to seat it."
    )

    class Meta:
        db_table = "cluster_member"
        ordering = ["cluster_job", "role", "index"]
        constraints = [
            models.CheckConstraint(
                condition=(Q(evaluation__isnull=False) & Q(derivation_build__isnull=True))
                | (Q(evaluation__isnull=True) & Q(derivation_build__isnull=False)),
                name="cluster_member-exactly-one-job",
                violation_error_message="A member names exactly one job: an evaluation or a shared build.",
            ),
            models.UniqueConstraint(
                fields=["evaluation"],
                condition=Q(evaluation__isnull=False),
                name="idx-cluster_member-evaluation",
                violation_error_message="This evaluation is already a member of a cluster.",
            ),
            models.UniqueConstraint(
                fields=["derivation_build"],
                condition=Q(derivation_build__isnull=False),
                name="idx-cluster_member-derivation_build",
                violation_error_message="This shared build is already a member of a cluster.",
            ),
            models.UniqueConstraint(
                fields=["cluster_job", "role", "index"],
                name="cluster_member-unique-address",
                violation_error_message="Role and index name one member of a cluster.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.role}[{self.index}]"

    @property
    def job_key(self) -> str:
        if self.evaluation_id is not None:
            return eval_key(self.evaluation_id)
        return build_key(self.derivation_build_id)  # type: ignore[arg-type]  # CHECK: exactly one is set


class ClusterAttempt(models.Model):
    """One try of a cluster. Open while finished_at is null; started once every member accepted."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    cluster_job = models.ForeignKey(ClusterJob, on_delete=models.CASCADE, related_name="attempt_rows")
    number = models.PositiveIntegerField(help_text="1 for the first claim of this cluster.")
    created_at = models.DateTimeField()
    prepare_deadline = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=16, choices=choices(AttemptOutcome), null=True, blank=True)
    reason = models.TextField(blank=True, default="")
    verdict = models.CharField(
        max_length=16,
        choices=choices(Verdict),
        null=True,
        blank=True,
        help_text="The recovery verdict that closed a started attempt.",
    )
    seats = models.JSONField(default=list, blank=True, help_text="[{role, index, worker_id, zone}] at claim.")

    class Meta:
        db_table = "cluster_attempt"
        ordering = ["cluster_job", "number"]
        constraints = [
            models.UniqueConstraint(
                fields=["cluster_job"],
                condition=Q(finished_at__isnull=True),
                name="idx-cluster_attempt-open",
                violation_error_message="This cluster already has an open attempt.",
            ),
            models.CheckConstraint(
                condition=Q(finished_at__isnull=True, outcome__isnull=True)
                | Q(finished_at__isnull=False, outcome__isnull=False),
                name="cluster_attempt-outcome-iff-finished",
                violation_error_message="An attempt has an outcome exactly when it is finished.",
            ),
            models.CheckConstraint(
                condition=Q(started_at__isnull=True) | Q(started_at__gte=models.F("created_at")),
                name="cluster_attempt-started-after-created",
                violation_error_message="An attempt cannot start before it was created.",
            ),
        ]
        indexes = [
            models.Index(
                fields=["prepare_deadline"],
                name="idx-cluster_attempt-preparing",
                condition=Q(finished_at__isnull=True, started_at__isnull=True),
            ),
        ]

    def __str__(self) -> str:
        return f"attempt {self.number} of {self.cluster_job.name}"


class ClusterReservation(models.Model):
    """An aging cluster's reserved placement. Only one cluster holds a reservation at a time."""

    cluster_job = models.OneToOneField(ClusterJob, on_delete=models.CASCADE, related_name="reservation")
    singleton = models.BooleanField(default=True, editable=False)
    seats = models.JSONField(default=list, help_text="[{role, index, worker_id}]")
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField()

    class Meta:
        db_table = "cluster_reservation"
        constraints = [
            models.UniqueConstraint(
                fields=["singleton"],
                name="idx-cluster_reservation-one",
                violation_error_message="Only one cluster can hold a reservation.",
            ),
        ]

    def __str__(self) -> str:
        return f"reservation for {self.cluster_job.name} until {self.expires_at:%H:%M:%S} UTC"


class ClusterSeat(models.Model):
    """One member seated on one worker for one attempt: what the coordinator and the settlement read.

    The member's assignment row (dispatched_job) is the fenced object every report names; this row keeps
    what those rows cannot: the acceptance during the prepare and the member's held-back result until the
    attempt's verdict settles it. Deleted with its attempt (ON DELETE CASCADE in PostgreSQL itself,
    migration 0005); the worker and assignment references carry no constraint, so deleting those rows
    never blocks on telemetry.
    """

    attempt = models.ForeignKey(ClusterAttempt, on_delete=models.CASCADE, related_name="seat_rows")
    member = models.ForeignKey(ClusterMember, on_delete=models.CASCADE, related_name="seats")
    role = models.CharField(max_length=100)
    index = models.PositiveIntegerField()
    kind = models.CharField(max_length=8, help_text="eval or build: the member's job kind.")
    job_key = models.CharField(max_length=64)
    worker = models.ForeignKey(
        "workers.Worker", on_delete=models.DO_NOTHING, db_constraint=False, related_name="+"
    )
    zone = models.CharField(max_length=200, null=True, blank=True)
    endpoint = models.CharField(max_length=500, null=True, blank=True)
    assignment = models.ForeignKey(
        "scheduling.DispatchedJob",
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        null=True,
        blank=True,
        related_name="+",
    )
    accepted_at = models.DateTimeField(null=True, blank=True)
    result = models.CharField(max_length=24, choices=choices(SeatResult), default=SeatResult.RUNNING)
    failure_kind = models.CharField(max_length=32, null=True, blank=True)
    error = models.TextField(blank=True, default="")
    substituted = models.BooleanField(
        default=False, help_text="build_output said the outputs were substituted."
    )
    reported_at = models.DateTimeField(null=True, blank=True)
    settlement = models.CharField(
        max_length=16, null=True, blank=True, help_text="How the verdict settled it."
    )
    settled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "cluster_seat"
        ordering = ["attempt", "role", "index"]
        constraints = [
            models.UniqueConstraint(
                fields=["attempt", "member"],
                name="cluster_seat-one-per-member",
                violation_error_message="A member has one seat per attempt.",
            ),
            models.UniqueConstraint(
                fields=["attempt", "worker"],
                name="cluster_seat-one-per-worker",
                violation_error_message="Members of one attempt sit on distinct workers.",
            ),
        ]
        indexes = [models.Index(fields=["assignment"], name="idx-cluster_seat-assignment")]

    def __str__(self) -> str:
        return f"{self.role}[{self.index}] on {self.worker.name}"


class ClusterWorkerPenalty(models.Model):
    """A worker rejected a prepare or let a hold expire: the matcher down-ranks it for a while."""

    worker = models.ForeignKey("workers.Worker", on_delete=models.CASCADE, related_name="+")
    at = models.DateTimeField()
    reason = models.TextField(blank=True, default="")
    attempt_id = models.UUIDField(null=True, blank=True)

    class Meta:
        db_table = "cluster_worker_penalty"
        ordering = ["-at"]
        verbose_name_plural = "cluster worker penalties"
        indexes = [models.Index(fields=["at"], name="idx-cluster_worker_penalty-at")]

    def __str__(self) -> str:
        return f"{self.worker.name} penalised at {self.at:%H:%M:%S} UTC"
