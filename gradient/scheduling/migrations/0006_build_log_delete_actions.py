"""Build logs go with their build and their assignment in PostgreSQL itself (Django emulates
on_delete in Python only), so a retention that deletes builds or assignments with plain SQL deletes
their logs. In its own migration: Django creates 0005's foreign keys at the end of that migration.
SQLite (embedded mode) keeps Django's emulation."""

from django.db import migrations

# Logs go with their build and their assignment in PostgreSQL itself too (Django emulates on_delete in
# Python only), so a retention that deletes builds or assignments with plain SQL deletes their logs.
ACTIONS = [
    ("build_log", "build_id", "derivation_build"),
    ("build_log", "assignment_id", "dispatched_job"),
    ("build_log_chunk", "log_id", "build_log"),
]

FIND_FK = """
SELECT c.conname FROM pg_constraint c
JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = c.conkey[1]
WHERE c.contype = 'f' AND c.conrelid = %s::regclass AND a.attname = %s AND cardinality(c.conkey) = 1
"""


def _set_actions(apps, schema_editor, restore=False):
    if schema_editor.connection.vendor != "postgresql":
        return
    qn = schema_editor.quote_name
    with schema_editor.connection.cursor() as cursor:
        for table, column, target in ACTIONS:
            cursor.execute(FIND_FK, [table, column])
            row = cursor.fetchone()
            if row is None:
                raise RuntimeError(f"no foreign key on {table}.{column}")
            on_delete = "" if restore else " ON DELETE CASCADE"
            cursor.execute(
                f"ALTER TABLE {qn(table)} DROP CONSTRAINT {qn(row[0])}, "
                f"ADD CONSTRAINT {qn(row[0])} FOREIGN KEY ({qn(column)}) REFERENCES {qn(target)} (id)"
                f"{on_delete} DEFERRABLE INITIALLY DEFERRED"
            )


def forwards(apps, schema_editor):
    _set_actions(apps, schema_editor)


def backwards(apps, schema_editor):
    _set_actions(apps, schema_editor, restore=True)



class Migration(migrations.Migration):
    dependencies = [("scheduling", "0005_build_logs")]

    operations = [migrations.RunPython(forwards, backwards)]
