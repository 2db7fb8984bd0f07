"""Make the cluster tables' delete actions real PostgreSQL foreign-key actions.

Django 5.2 creates every foreign key as NO ACTION and emulates on_delete in Python, so a retention pass
deleting cluster_job rows with SQL would be refused. cluster-jobs.md needs:

- cluster_member.cluster_job_id      ON DELETE CASCADE
- cluster_attempt.cluster_job_id     ON DELETE CASCADE
- dispatched_job.cluster_attempt_id  ON DELETE SET NULL  (member rows outlive their attempt as telemetry)

Each constraint keeps the name Django gave it and stays DEFERRABLE INITIALLY DEFERRED, as Django
creates it. SQLite (embedded mode) keeps Django's emulation. A later migration that alters one of these
three fields makes Django recreate its constraint without the action: re-apply this one then.
"""

from django.db import migrations

ACTIONS = [
    ("cluster_member", "cluster_job_id", "cluster_job", "CASCADE"),
    ("cluster_attempt", "cluster_job_id", "cluster_job", "CASCADE"),
    ("dispatched_job", "cluster_attempt_id", "cluster_attempt", "SET NULL"),
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
    dependencies = [
        ("clusters", "0002_initial"),
        ("scheduling", "0002_initial"),
    ]

    operations = [migrations.RunPython(forwards, backwards)]
