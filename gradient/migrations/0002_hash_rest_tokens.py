"""REST tokens stored in plain text by DRF's authtoken before knox (gradient.auth) are kept as knox
keeps its own (digest and lookup key, an expiry from now) and deleted: their clients keep working."""

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import migrations
from django.utils import timezone


def hash_plain_tokens(apps: Any, schema_editor: Any) -> None:
    from knox.crypto import hash_token
    from knox.settings import CONSTANTS

    plain = apps.get_model("authtoken", "Token")
    hashed = apps.get_model("knox", "AuthToken")
    expiry = timezone.now() + timedelta(days=settings.GRADIENT_API_TOKEN_TTL_DAYS)
    hashed.objects.bulk_create(
        [
            hashed(
                digest=hash_token(token.key),
                token_key=token.key[: CONSTANTS.TOKEN_KEY_LENGTH],
                user_id=token.user_id,
                created=timezone.now(),
                expiry=expiry,
            )
            for token in plain.objects.all()
        ],
        ignore_conflicts=True,
    )
    plain.objects.all().delete()


class Migration(migrations.Migration):
    dependencies = [
        ("gradient", "0001_rate_counter"),
        ("authtoken", "0004_alter_tokenproxy_options"),
        ("knox", "0009_extend_authtoken_field"),
    ]

    operations = [migrations.RunPython(hash_plain_tokens, migrations.RunPython.noop)]
