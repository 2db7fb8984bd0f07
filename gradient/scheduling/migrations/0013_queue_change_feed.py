"""The change feed of the queue (gradient.scheduling.book): statement-level triggers that send
NOTIFY gradient_queue when a statement may have put a shared build ahead of what a process's book holds.
PostgreSQL only (the embedded SQLite mode keeps no book)."""

from django.db import migrations

_FUNCTIONS = """
CREATE OR REPLACE FUNCTION gradient_queue_build_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM new_rows WHERE status = 'Queued') THEN
        PERFORM pg_notify('gradient_queue', '');
    END IF;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION gradient_queue_build_updated() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Queued now, and not before, or prioritized, or out of backoff. A build that leaves Queued (a
    -- claim, an abort) announces nothing: a book that still holds it only loses its claim.
    IF EXISTS (
        SELECT 1 FROM new_rows n JOIN old_rows o ON o.id = n.id
        WHERE n.status = 'Queued' AND (
            o.status <> 'Queued' OR n.prioritized IS DISTINCT FROM o.prioritized
            OR n.retry_at IS DISTINCT FROM o.retry_at)
    ) THEN
        PERFORM pg_notify('gradient_queue', '');
    END IF;
    RETURN NULL;
END $$;

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

_TRIGGERS = """
CREATE OR REPLACE TRIGGER gradient_queue_build_inserted AFTER INSERT ON derivation_build
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION gradient_queue_build_inserted();
CREATE OR REPLACE TRIGGER gradient_queue_build_updated AFTER UPDATE ON derivation_build
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION gradient_queue_build_updated();
CREATE OR REPLACE TRIGGER gradient_queue_build_wanted AFTER INSERT ON evaluation_build
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION gradient_queue_build_wanted();
"""

_DROP = """
DROP TRIGGER IF EXISTS gradient_queue_build_inserted ON derivation_build;
DROP TRIGGER IF EXISTS gradient_queue_build_updated ON derivation_build;
DROP TRIGGER IF EXISTS gradient_queue_build_wanted ON evaluation_build;
DROP FUNCTION IF EXISTS gradient_queue_build_inserted();
DROP FUNCTION IF EXISTS gradient_queue_build_updated();
DROP FUNCTION IF EXISTS gradient_queue_build_wanted();
"""


def _create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_FUNCTIONS)
        schema_editor.execute(_TRIGGERS)


def _drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_DROP)


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0012_cache_claims"),
    ]

    operations = [migrations.RunPython(_create, _drop, elidable=False)]
