"""Idempotency-Keys stored before they were scoped per user (gradient.idempotency) are scoped to the user
that submitted them, so a repeat of such a submission still finds its job."""

from types import SimpleNamespace
from typing import Any

from django.db import migrations


def scope_keys(apps: Any, schema_editor: Any) -> None:
    from gradient.idempotency import scoped_key

    records = apps.get_model("records", "JobRecord")
    for record in records.objects.filter(idempotency_key__isnull=False, created_by__isnull=False).iterator():
        record.idempotency_key = scoped_key(SimpleNamespace(pk=record.created_by_id), record.idempotency_key)
        record.save(update_fields=["idempotency_key"])


class Migration(migrations.Migration):
    dependencies = [
        ("gradient", "0002_hash_rest_tokens"),
        ("records", "0002_settled_labels_and_entry_kinds"),
    ]

    operations = [migrations.RunPython(scope_keys, migrations.RunPython.noop)]
