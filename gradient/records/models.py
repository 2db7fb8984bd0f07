"""The event-sourced job record: a header written once, then entries that are only appended.

Bodies are stored as the exact JSON text that was written (not jsonb), so strict decoding reads the
bytes the writer produced and a digest over them stays stable.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q

from gradient.core.vocab import EntryKind, choices


class JobRecord(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    job_key = models.CharField(max_length=80, unique=True, help_text="eval:<uuid> or cluster:<uuid>.")
    header_schema = models.CharField(max_length=64)
    header = models.TextField(help_text="The header's JSON, as written once.")
    digest = models.CharField(max_length=80, help_text="sha256 of the spec's canonical JSON.")
    idempotency_key = models.CharField(max_length=255, null=True, blank=True)
    revision = models.PositiveIntegerField(default=0, help_text="Number of entries; bumped by every commit.")
    settled = models.BooleanField(default=False)
    settled_at = models.DateTimeField(null=True, blank=True)
    tombstoned_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField()

    class Meta:
        db_table = "job_record"
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                name="idx-job_record-idempotency_key",
                violation_error_message="This Idempotency-Key names another job.",
            ),
            models.CheckConstraint(
                condition=Q(tombstoned_at__isnull=True) | Q(settled=True),
                name="job_record-tombstone-only-settled",
                violation_error_message="Only a settled record can be tombstoned.",
            ),
            models.CheckConstraint(
                condition=Q(settled=False, settled_at__isnull=True)
                | Q(settled=True, settled_at__isnull=False),
                name="job_record-settled_at-iff-settled",
                violation_error_message="A record has settled_at exactly when it is settled.",
            ),
        ]
        indexes = [
            models.Index(fields=["created_at"], name="idx-job_record-unsettled", condition=Q(settled=False)),
            models.Index(fields=["settled_at"], name="idx-job_record-settled", condition=Q(settled=True)),
        ]

    def __str__(self) -> str:
        return f"record {self.job_key} r{self.revision}"


class RecordEntry(models.Model):
    """One appended entry. (record, revision) is unique: two writers that read the same revision race
    for the same slot and the database lets exactly one win."""

    record = models.ForeignKey(JobRecord, on_delete=models.CASCADE, related_name="entries")
    revision = models.PositiveIntegerField()
    kind = models.CharField(max_length=8, choices=choices(EntryKind))
    schema = models.CharField(max_length=64)
    body = models.TextField()
    actor = models.CharField(max_length=200, blank=True, default="")
    recorded_at = models.DateTimeField()

    class Meta:
        db_table = "record_entry"
        ordering = ["record", "revision"]
        constraints = [
            models.UniqueConstraint(
                fields=["record", "revision"],
                name="idx-record_entry-revision",
                violation_error_message="This revision of the record was already written.",
            ),
            models.CheckConstraint(
                condition=Q(revision__gte=1),
                name="record_entry-revision-positive",
                violation_error_message="Revisions start at 1.",
            ),
            models.CheckConstraint(
                condition=Q(kind=EntryKind.CONTROL, schema__startswith="gradient.control.")
                | Q(kind=EntryKind.FACT, schema__startswith="gradient.fact."),
                name="record_entry-one-kind",
                violation_error_message=(
                    "An entry is exactly one kind, a control intent or a fact, as its schema says."
                ),
            ),
        ]

    def __str__(self) -> str:
        return f"r{self.revision} {self.kind} {self.schema}"
