"""REST tokens: hashed, expiring, listed and revoked (django-rest-knox).

- `POST /api/v1/auth/token` issues a new token per login (`issue_token`): 64 random hex characters,
  shown once; the database keeps only its SHA-512 digest and its first 15 characters (knox's lookup
  key), with an expiry `GRADIENT_API_TOKEN_TTL_DAYS` days on (default 30).
- `GET /api/v1/auth/tokens` lists the caller's tokens (`id` is the lookup key; `current` marks the one
  the request came with); `DELETE /api/v1/auth/tokens/{id}` revokes one; `POST /api/v1/auth/logout`
  revokes the one in use. Staff revoke anyone's in the admin (*Auth tokens*).
- A user's tokens are all revoked when their password changes or they are deactivated (`_revoke_on_change`).
- A plain DRF token (`rest_framework.authtoken`), wherever made (an older client, `manage.py
  drf_create_token`, a test), is turned into a hashed one as it is saved and not kept in plain text
  (`_hash_drf_token`); migration gradient 0002 does the same to the tokens stored before.

Why knox: it stores tokens the way worker tokens already are (only a digest), has expiry and many tokens
per user, and its authentication class is a drop-in for DRF's under the same `Token` prefix.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models.signals import post_save, pre_save
from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import extend_schema
from knox.crypto import hash_token
from knox.models import AuthToken
from knox.settings import CONSTANTS
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView


def token_ttl() -> timedelta:
    return timedelta(days=settings.GRADIENT_API_TOKEN_TTL_DAYS)


def issue_token(user: Any) -> str:
    """A new token for `user`, shown once. Its expired tokens go, and beyond GRADIENT_API_TOKENS_PER_USER
    its oldest: knox reads all of a user's tokens on every request it authenticates, so a client that
    logs in for every job must not make that list grow for a month."""
    AuthToken.objects.filter(user=user, expiry__lt=timezone.now()).delete()
    _instance, token = AuthToken.objects.create(user=user, expiry=token_ttl())
    keep = (
        AuthToken.objects.filter(user=user)
        .order_by("-created")
        .values("digest")[: settings.GRADIENT_API_TOKENS_PER_USER]
    )
    AuthToken.objects.filter(user=user).exclude(digest__in=keep).delete()
    return str(token)


def store_hashed(user_id: Any, key: str, *, created: Any = None) -> None:
    """Keep `key` (a token made elsewhere) the way knox keeps its own: digest and lookup key only."""
    token = AuthToken(
        digest=hash_token(key),
        token_key=key[: CONSTANTS.TOKEN_KEY_LENGTH],
        user_id=user_id,
        expiry=(created or timezone.now()) + token_ttl(),
    )
    token.save(force_insert=True)


def revoke_all(user_id: Any) -> int:
    deleted, _ = AuthToken.objects.filter(user_id=user_id).delete()
    return int(deleted)


# --- Signals (connected in gradient.apps) -------------------------------------------------------------


def _hash_drf_token(sender: Any, instance: Any, created: bool, **kwargs: Any) -> None:
    """A plain DRF token was saved: keep its digest instead (the instance keeps `key` in memory)."""
    store_hashed(instance.user_id, instance.key)
    type(instance).objects.filter(pk=instance.pk).delete()


def _note_credentials(sender: Any, instance: Any, **kwargs: Any) -> None:
    if instance.pk is None:
        return
    old = sender.objects.filter(pk=instance.pk).values("password", "is_active").first()
    instance._gradient_revoke_tokens = old is not None and (
        old["password"] != instance.password or (old["is_active"] and not instance.is_active)
    )


def _revoke_on_change(sender: Any, instance: Any, created: bool, **kwargs: Any) -> None:
    """A new password or a deactivation revokes every token of the user."""
    if getattr(instance, "_gradient_revoke_tokens", False):
        instance._gradient_revoke_tokens = False
        user_id = instance.pk
        transaction.on_commit(lambda: revoke_all(user_id))


def connect_signals() -> None:
    from rest_framework.authtoken.models import Token

    post_save.connect(_hash_drf_token, sender=Token, dispatch_uid="gradient-hash-drf-token")
    user_model = get_user_model()
    pre_save.connect(_note_credentials, sender=user_model, dispatch_uid="gradient-note-credentials")
    post_save.connect(_revoke_on_change, sender=user_model, dispatch_uid="gradient-revoke-tokens")


# --- REST -------------------------------------------------------------------------------------------------


class TokenInfoSerializer(serializers.Serializer[Any]):
    id = serializers.CharField(help_text="The token's lookup key: its first 15 characters.")
    created = serializers.DateTimeField()
    expiry = serializers.DateTimeField(allow_null=True, help_text="After this the token is refused.")
    current = serializers.BooleanField(help_text="The token this request came with.")


def _info(token: AuthToken, request: Request) -> dict[str, Any]:
    return {
        "id": token.token_key,
        "created": token.created,
        "expiry": token.expiry,
        "current": isinstance(request.auth, AuthToken) and request.auth.digest == token.digest,
    }


class TokensView(APIView):
    @extend_schema(responses={200: TokenInfoSerializer(many=True)}, summary="The caller's API tokens")
    def get(self, request: Request) -> Response:
        now = timezone.now()
        tokens = AuthToken.objects.filter(user=request.user).order_by("-created")
        return Response([_info(t, request) for t in tokens if t.expiry is None or t.expiry > now])


class TokenDetailView(APIView):
    @extend_schema(responses={204: None}, summary="Revoke one of the caller's API tokens")
    def delete(self, request: Request, token_id: str) -> Response:
        deleted, _ = AuthToken.objects.filter(user=request.user, token_key=token_id).delete()
        if not deleted:
            raise NotFound("No such token.")
        return Response(status=status.HTTP_204_NO_CONTENT)


class LogoutView(APIView):
    @extend_schema(request=None, responses={204: None}, summary="Revoke the API token of this request")
    def post(self, request: Request) -> Response:
        if isinstance(request.auth, AuthToken):
            request.auth.delete()
        return Response(status=status.HTTP_204_NO_CONTENT)


class TokenScheme(OpenApiAuthenticationExtension):  # type: ignore[no-untyped-call]
    """The OpenAPI scheme of knox's authentication: the `Token` header DRF's had, under its old name."""

    target_class = "gradient.authentication.TokenAuthentication"
    name = "tokenAuth"
    priority = 1

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "apiKey",
            "in": "header",
            "name": "Authorization",
            "description": 'Token-based authentication with required prefix "Token"',
        }


class BearerScheme(OpenApiAuthenticationExtension):  # type: ignore[no-untyped-call]
    """The OpenAPI scheme of BearerTokenAuthentication: the same token, `Authorization: Bearer <token>`."""

    target_class = "gradient.authentication.BearerTokenAuthentication"
    name = "bearerAuth"
    priority = 1

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {"type": "http", "scheme": "bearer", "description": "The API token as a bearer token"}
