# The offer state (sent_candidate, candidate_score), moved from the workers app: the same tables,
# columns, constraints and indexes, now owned by scheduling. Only Django's state changes.

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('scheduling', '0003_derivationbuild_drv_lost_at'),
        ('workers', '0003_offer_state_to_scheduling'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='SentCandidate',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('job_id', models.CharField(max_length=64)),
                        ('sent_at', models.DateTimeField(default=django.utils.timezone.now, help_text='When it was offered: RescoreWait waits up to 4 passes for its score.')),
                        ('worker', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='sent_candidates', to='workers.worker')),
                    ],
                    options={
                        'db_table': 'sent_candidate',
                        'indexes': [models.Index(fields=['job_id'], name='idx-sent_candidate-job')],
                        'constraints': [models.UniqueConstraint(fields=('worker', 'job_id'), name='sent_candidate-unique', violation_error_message='This candidate was already sent to this worker.')],
                    },
                ),
                migrations.CreateModel(
                    name='CandidateScore',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('job_id', models.CharField(max_length=64)),
                        ('missing_count', models.IntegerField()),
                        ('missing_nar_size', models.BigIntegerField()),
                        ('outputs_present', models.BooleanField(default=False)),
                        ('updated_at', models.DateTimeField()),
                        ('worker', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='candidate_scores', to='workers.worker')),
                    ],
                    options={
                        'db_table': 'candidate_score',
                        'indexes': [models.Index(fields=['job_id'], name='idx-candidate_score-job')],
                        'constraints': [models.UniqueConstraint(fields=('worker', 'job_id'), name='candidate_score-unique', violation_error_message='One score per worker and candidate.')],
                    },
                ),
            ],
            database_operations=[],
        ),
    ]
