# The pattern-ops twins Django makes beside the unique index of a CharField on PostgreSQL (for LIKE
# 'prefix%'), on derivation_build.drv_path and cached_path.path: no query searches a prefix of either
# (the console's searches are icontains, the history's a regex from the start), and every change of a
# build's status (never a HOT update: the status is in partial indexes' conditions) and every cached
# output wrote an entry of a long text into it. The unique indexes stay.

from django.db import migrations

_INDEXES = (
    ("derivation_build", "drv_path", "derivation_build_drv_path_affeb05f_like"),
    ("cached_path", "path", "cached_path_path_13ce5d7e_like"),
)


def drop(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor != "postgresql":
        return
    for _, _, name in _INDEXES:
        schema_editor.execute(f'DROP INDEX IF EXISTS "{name}"')


def create(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor != "postgresql":
        return
    for table, column, name in _INDEXES:
        schema_editor.execute(
            f'CREATE INDEX IF NOT EXISTS "{name}" ON "{table}" ("{column}" varchar_pattern_ops)'
        )


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0019_attempt_without_assignment_constraint"),
    ]

    operations = [migrations.RunPython(drop, create)]
