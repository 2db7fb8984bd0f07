from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = []

    operations = [
        migrations.CreateModel(
            name="RateCounter",
            fields=[
                ("key", models.CharField(max_length=255, primary_key=True, serialize=False)),
                ("window_start", models.DateTimeField()),
                ("hits", models.PositiveIntegerField(default=0)),
            ],
            options={"db_table": "rate_counter"},
        ),
    ]
