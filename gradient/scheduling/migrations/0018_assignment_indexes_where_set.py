# A shared build's assignment has no evaluation and no cluster attempt: those two are indexed only where set.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("clusters", "0006_plural_names"),
        ("scheduling", "0017_offer_rows_without_worker_constraint"),
        ("workers", "0003_offer_state_to_scheduling"),
    ]

    # The foreign keys themselves stay as they are (the cluster attempt's is ON DELETE SET NULL in
    # PostgreSQL, clusters migration 0002, which AlterField would recreate without): only the state
    # changes, and in the database the full indexes give way to partial ones.
    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="dispatchedjob",
                    name="cluster_attempt",
                    field=models.ForeignKey(
                        blank=True,
                        db_index=False,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="member_dispatches",
                        to="clusters.clusterattempt",
                    ),
                ),
                migrations.AlterField(
                    model_name="dispatchedjob",
                    name="evaluation",
                    field=models.ForeignKey(
                        blank=True,
                        db_index=False,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="dispatches",
                        to="scheduling.evaluation",
                    ),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    'DROP INDEX IF EXISTS "dispatched_job_evaluation_id_acb98a49";'
                    'DROP INDEX IF EXISTS "dispatched_job_cluster_attempt_id_d1bc9683";',
                    reverse_sql=(
                        'CREATE INDEX "dispatched_job_evaluation_id_acb98a49" ON dispatched_job (evaluation_id);'
                        'CREATE INDEX "dispatched_job_cluster_attempt_id_d1bc9683" ON dispatched_job (cluster_attempt_id);'
                    ),
                ),
            ],
        ),
        migrations.AddIndex(
            model_name="dispatchedjob",
            index=models.Index(
                condition=models.Q(("evaluation__isnull", False)),
                fields=["evaluation"],
                name="idx-dispatched_job-eval",
            ),
        ),
        migrations.AddIndex(
            model_name="dispatchedjob",
            index=models.Index(
                condition=models.Q(("cluster_attempt__isnull", False)),
                fields=["cluster_attempt"],
                name="idx-dispatched_job-cluster",
            ),
        ),
    ]
