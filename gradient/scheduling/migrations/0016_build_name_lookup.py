"""The built derivations of one name and system: what a waiting build's typical duration is read from
(queue_position.build_typical, issue 33)."""

import django.db.models.functions.text
import gradient.core.vocab
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('scheduling', '0015_dispatched_job_fillfactor'),
    ]

    operations = [
        migrations.AddIndex(
            model_name='derivationbuild',
            index=models.Index(django.db.models.functions.text.Substr('drv_path', 45), models.F('system'), condition=models.Q(('status__in', (gradient.core.vocab.BuildStatus['COMPLETED'], gradient.core.vocab.BuildStatus['SUBSTITUTED']))), name='idx-derivation_build-name'),
        ),
    ]
