# The offer state (sent_candidate, candidate_score) belongs to the scheduling app now. Only Django's
# state changes here: the tables stay as they are (scheduling's 0004 takes them over).

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('workers', '0002_sentcandidate_sent_at'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.DeleteModel(name='SentCandidate'),
                migrations.DeleteModel(name='CandidateScore'),
            ],
            database_operations=[],
        ),
    ]
