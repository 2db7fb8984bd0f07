"""Room on each page of dispatched_job for the new version of a row: a job's accept and phase reports
change no indexed column, so with room left PostgreSQL writes them as heap-only updates (no new entry in
any of the table's nine indexes). PostgreSQL only; the pages written from now on keep the room."""

from django.db import migrations


def _set(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER TABLE dispatched_job SET (fillfactor = 70)")


def _reset(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER TABLE dispatched_job RESET (fillfactor)")


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0014_queue_build_wanted_lookup"),
    ]

    operations = [migrations.RunPython(_set, _reset, elidable=False)]
