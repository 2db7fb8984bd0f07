"""The change feed's trigger on new evaluation links (0013_queue_change_feed) looks each new link's build
up by its primary key, whatever the statistics say (issue 30: the ingest's plans must not depend on them).

As a join, planned with derivation_build's statistics from when it was nearly empty (a fresh database),
PostgreSQL read every Queued build once per new link (a nested loop with a join filter): each part of an
evaluation's result paid (its links) x (the Queued builds), 0.77 s for a part of 500 links with 19 500
builds queued, 7.9 s of the 12 s that `bench/ingest.py --derivations 20000 --shape independent` took.
A correlated subquery behind OFFSET 0 is an index lookup per link (graph._PICK's way). Same answer.
PostgreSQL only, as 0013."""

from django.db import migrations

_LOOKUP = """
CREATE OR REPLACE FUNCTION gradient_queue_build_wanted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- A Queued build newly needed by an evaluation (maybe of another project).
    IF EXISTS (
        SELECT 1 FROM new_rows n WHERE n.blocks_evaluation AND EXISTS (
            SELECT 1 FROM derivation_build b WHERE b.id = n.build_id AND b.status = 'Queued' OFFSET 0)
    ) THEN
        PERFORM pg_notify('gradient_queue', '');
    END IF;
    RETURN NULL;
END $$;
"""

_JOIN = """
CREATE OR REPLACE FUNCTION gradient_queue_build_wanted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- A Queued build newly needed by an evaluation (maybe of another project).
    IF EXISTS (
        SELECT 1 FROM new_rows n JOIN derivation_build b ON b.id = n.build_id
        WHERE n.blocks_evaluation AND b.status = 'Queued'
    ) THEN
        PERFORM pg_notify('gradient_queue', '');
    END IF;
    RETURN NULL;
END $$;
"""


def _lookup(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_LOOKUP)


def _join(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_JOIN)


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0013_queue_change_feed"),
    ]

    operations = [migrations.RunPython(_lookup, _join, elidable=False)]
