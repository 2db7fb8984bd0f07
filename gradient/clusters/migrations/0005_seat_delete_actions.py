"""Make cluster_seat's delete actions real PostgreSQL foreign-key actions (as 0003 does for the other
cluster tables), so the retention pass's plain SQL DELETE of a cluster_job removes its attempts' seats:

- cluster_seat.attempt_id  ON DELETE CASCADE
- cluster_seat.member_id   ON DELETE CASCADE

The worker and assignment references of a seat carry no constraint at all (telemetry). SQLite keeps
Django's emulation.
"""

from django.db import migrations

ACTIONS = [
    ("cluster_seat", "attempt_id", "cluster_attempt", "CASCADE"),
    ("cluster_seat", "member_id", "cluster_member", "CASCADE"),
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
        for table, column, target, action in ACTIONS:
            cursor.execute(FIND_FK, [table, column])
            row = cursor.fetchone()
            if row is None:
                raise RuntimeError(f"no foreign key on {table}.{column}")
            name = row[0]
            on_delete = "" if restore else f" ON DELETE {action}"
            cursor.execute(
                f"ALTER TABLE {qn(table)} DROP CONSTRAINT {qn(name)}, "
                f"ADD CONSTRAINT {qn(name)} FOREIGN KEY ({qn(column)}) REFERENCES {qn(target)} (id)"
                f"{on_delete} DEFERRABLE INITIALLY DEFERRED"
            )


def forwards(apps, schema_editor):
    _set_actions(apps, schema_editor)


def backwards(apps, schema_editor):
    _set_actions(apps, schema_editor, restore=True)


class Migration(migrations.Migration):
    dependencies = [("clusters", "0004_seats_penalties_verdicts")]

    operations = [migrations.RunPython(forwards, backwards)]
