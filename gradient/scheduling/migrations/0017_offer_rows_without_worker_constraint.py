# The offer rows keep no worker constraint or index of their own (see SentCandidate.worker).

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0016_build_name_lookup"),
        ("workers", "0003_offer_state_to_scheduling"),
    ]

    operations = [
        migrations.AlterField(
            model_name="candidatescore",
            name="worker",
            field=models.ForeignKey(
                db_constraint=False,
                db_index=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="candidate_scores",
                to="workers.worker",
            ),
        ),
        migrations.AlterField(
            model_name="sentcandidate",
            name="worker",
            field=models.ForeignKey(
                db_constraint=False,
                db_index=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="sent_candidates",
                to="workers.worker",
            ),
        ),
    ]
