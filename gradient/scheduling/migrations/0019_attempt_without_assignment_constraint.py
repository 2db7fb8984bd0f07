# A build attempt keeps no database constraint on its assignment (see BuildAttempt.dispatched_job).

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0018_assignment_indexes_where_set"),
    ]

    operations = [
        migrations.AlterField(
            model_name="buildattempt",
            name="dispatched_job",
            field=models.ForeignKey(
                blank=True,
                db_constraint=False,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="build_attempts",
                to="scheduling.dispatchedjob",
            ),
        ),
    ]
