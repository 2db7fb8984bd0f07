"""The change feed's trigger on new evaluation links (0013, 0014) finds each new link's build by its
primary key whenever its plan was made: the function runs with enable_seqscan off.

Issue 30, found on a fresh database: PL/pgSQL keeps the plan of a statement with no parameters for the
life of its connection (a generic plan, made at the trigger's first firing and kept until the table's
statistics change), so a plan made while derivation_build held a few pages (the first part of the first
result of a new installation, analyzed empty or never analyzed) was a sequential scan of the whole table
per new link, kept while the table grew: each part then read (its links) x (every build). 0014's
correlated subquery stops a join from being planned; it does not stop the lookup inside it from being a
scan. With sequential scans disabled for the function the only way to derivation_build is its primary
key (an index lookup per link) whatever the statistics and whenever the plan was made; new_rows, the
transition table, is not a table scan and is unaffected. Same answer. PostgreSQL only, as 0013.

Not ANALYZE: the plan is kept across statistics that were right when it was made, and it is the size
at that moment, not stale statistics, that chose the scan."""

from django.db import migrations


def _set(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER FUNCTION gradient_queue_build_wanted() SET enable_seqscan = off")


def _reset(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER FUNCTION gradient_queue_build_wanted() RESET enable_seqscan")


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0026_open_assignments_by_worker_and_kind"),
    ]

    operations = [migrations.RunPython(_set, _reset, elidable=False)]
