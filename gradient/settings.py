"""Settings come from the environment, as ../shared/spec/operations.md fixes them.

Embedded default: no DATABASE_URL means an SQLite file under var/, no REDIS_URL means the in-memory
channel layer and the in-process pass runner. Naming PostgreSQL and Redis turns the same code into a
multi-instance service (several `serve` processes, Celery worker and beat).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() in {"1", "true", "yes", "on"}


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from exc


def _application_name() -> str:
    """How this process's connections show in pg_stat_activity: `gradient <role> <pid>`, the role being
    the manage.py command (serve, migrate, ...), celery, or the program's name. Operators (and the fault
    tests) find a given process's sessions by it."""
    argv = sys.argv or ["python"]
    program = Path(argv[0]).name
    if program == "manage.py" and len(argv) > 1:
        role = argv[1]
    elif "celery" in argv[0]:
        role = "celery"
    else:
        role = Path(argv[0]).stem or "python"
    return f"gradient {role} {os.getpid()}"[:63]


DEVELOPMENT_SECRET_KEY = "gradient-development-key-not-for-production"
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY") or DEVELOPMENT_SECRET_KEY
# True when no DJANGO_SECRET_KEY was given: `serve` then refuses to listen beyond loopback outside the
# embedded mode (gradient.deploy), and `check --deploy` warns (W009).
USING_DEVELOPMENT_SECRET_KEY = SECRET_KEY == DEVELOPMENT_SECRET_KEY
DEBUG = _env_bool("DJANGO_DEBUG", False)
ALLOWED_HOSTS = [
    h.strip() for h in os.environ.get("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1").split(",") if h.strip()
]
if "testserver" not in ALLOWED_HOSTS:
    # Django's and Channels' test clients send Host: testserver.
    ALLOWED_HOSTS.append("testserver")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "rest_framework",
    "rest_framework.authtoken",
    "knox",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's assets, served from the package: /api/docs/ works offline
    "django_celery_beat",
    "gradient",
    "gradient.scheduling",
    "gradient.workers",
    "gradient.clusters",
    "gradient.records",
    "gradient.recovery",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "gradient.middleware.refuse_nul",
    "gradient.middleware.ApiTrailingSlash",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, so the first asked about a view's exception: a database that is away is a 503 (Retry-After).
    "gradient.middleware.DatabaseOutageMiddleware",
]

ROOT_URLCONF = "gradient.urls"
ASGI_APPLICATION = "gradient.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- Database -------------------------------------------------------------------------------------

EMBEDDED_DATABASE = BASE_DIR / "var" / "gradient.sqlite3"
DATABASE_URL = os.environ.get("DATABASE_URL", "").strip()
if DATABASE_URL:
    # Persistent connections: the worker sessions of a serve process issue many short transactions.
    _db = dj_database_url.parse(DATABASE_URL, conn_max_age=600, conn_health_checks=True)
else:
    EMBEDDED_DATABASE.parent.mkdir(parents=True, exist_ok=True)
    _db = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(EMBEDDED_DATABASE)}
if _db["ENGINE"] == "django.db.backends.sqlite3":
    # Several threads (the ASGI server, the pass runner) share one file: wait for the lock, never fail.
    _db.setdefault("OPTIONS", {})
    _db["OPTIONS"].update({"timeout": 30, "transaction_mode": "IMMEDIATE"})
if _db["ENGINE"] == "django.db.backends.postgresql":
    _db.setdefault("OPTIONS", {})
    _db["OPTIONS"].setdefault("application_name", _application_name())
DATABASES = {"default": _db}
EMBEDDED = not DATABASE_URL
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Redis: channel layer and Celery --------------------------------------------------------------

REDIS_URL = os.environ.get("REDIS_URL", "").strip()
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [REDIS_URL], "capacity": 5000, "expiry": 60},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

CELERY_BROKER_URL = REDIS_URL or "memory://"
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_TIMEZONE = "UTC"
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

# --- Auth, REST -----------------------------------------------------------------------------------

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "admin:login"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # knox's hashed, expiring tokens (gradient.auth), refusing an undecodable one with 401
        "gradient.authentication.TokenAuthentication",
        "gradient.authentication.BearerTokenAuthentication",  # the same tokens as `Authorization: Bearer`
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    # DRF's three, with a JSON parser that answers a too deeply nested body with 400 (gradient.parsers).
    "DEFAULT_PARSER_CLASSES": [
        "gradient.parsers.JSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "UNAUTHENTICATED_USER": None,
    "EXCEPTION_HANDLER": "gradient.rest.exception_handler",
    "DEFAULT_THROTTLE_CLASSES": ["gradient.throttling.AnonThrottle", "gradient.throttling.UserThrottle"],
}
# Generous by default: they bound a runaway client, not normal use. "" turns a throttle off.
# GET /metrics: unset, no token is needed; set, scrapers send `Authorization: Bearer <it>`.
GRADIENT_METRICS_TOKEN = os.environ.get("GRADIENT_METRICS_TOKEN", "")
GRADIENT_API_THROTTLE_USER = os.environ.get("GRADIENT_API_THROTTLE_USER", "20000/hour")
GRADIENT_API_THROTTLE_ANON = os.environ.get("GRADIENT_API_THROTTLE_ANON", "2000/hour")
# Failed logins (the token route and the admin's login page), per account and per client address.
GRADIENT_LOGIN_THROTTLE_ACCOUNT = os.environ.get("GRADIENT_LOGIN_THROTTLE_ACCOUNT", "10/15m")
GRADIENT_LOGIN_THROTTLE_ADDRESS = os.environ.get("GRADIENT_LOGIN_THROTTLE_ADDRESS", "50/15m")
# Addresses or networks of the reverse proxies whose X-Forwarded-For is believed (comma-separated);
# unset, the client's address is the peer's, whatever a header says (gradient.throttling).
GRADIENT_TRUSTED_PROXIES = os.environ.get("GRADIENT_TRUSTED_PROXIES", "").strip()
# REST tokens (gradient.auth): the days a token issued by POST /api/v1/auth/token is good for.
GRADIENT_API_TOKEN_TTL_DAYS = _env_int("GRADIENT_API_TOKEN_TTL_DAYS", 30)
# A user's tokens kept at most: a login beyond that revokes the user's oldest.
GRADIENT_API_TOKENS_PER_USER = _env_int("GRADIENT_API_TOKENS_PER_USER", 100)
REST_KNOX = {"TOKEN_TTL": timedelta(days=GRADIENT_API_TOKEN_TTL_DAYS), "AUTH_HEADER_PREFIX": "Token"}
SPECTACULAR_SETTINGS = {
    "TITLE": "Gradient",
    "DESCRIPTION": "A distributed job scheduler for Nix CI.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "gradient.rest.add_error_responses",
    ],
}

# --- TLS (docs/security.md): what a deployment behind HTTPS turns on --------------------------------------

# Session and CSRF cookies only over HTTPS (check --deploy W012, W016).
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = _env_bool("GRADIENT_SECURE_COOKIES", False)
# Strict-Transport-Security for this many seconds (W004); 0 sends none.
SECURE_HSTS_SECONDS = _env_int("GRADIENT_HSTS_SECONDS", 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = SECURE_HSTS_SECONDS > 0
# Redirect plain HTTP to HTTPS (W008). Behind a TLS-terminating proxy, also say that the proxy's
# X-Forwarded-Proto is believed (only a proxy that always sets it may be trusted so).
SECURE_SSL_REDIRECT = _env_bool("GRADIENT_SSL_REDIRECT", False)
if _env_bool("GRADIENT_PROXY_SSL_HEADER", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
# /healthz is for load balancers that ask over plain HTTP.
SECURE_REDIRECT_EXEMPT = [r"^healthz$"]

# --- Locale, static -------------------------------------------------------------------------------

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "var" / "static"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "gradient": {"handlers": ["console"], "level": os.environ.get("GRADIENT_LOG_LEVEL", "INFO")},
        # Every 500 with its traceback (Django logs them here; its own handler prints only with DEBUG on).
        "django.request": {"handlers": ["console"], "level": "ERROR", "propagate": False},
    },
}

# --- Gradient's own settings (operations.md) ------------------------------------------------------
# These are the defaults a new job's record captures in its plan; an existing job keeps its own.

GRADIENT_SCHEDULER_PASS_INTERVAL_SECS = _env_int("GRADIENT_SCHEDULER_PASS_INTERVAL_SECS", 5)
GRADIENT_SCHEDULER_CLUSTER_PREPARE_TIMEOUT_SECS = _env_int(
    "GRADIENT_SCHEDULER_CLUSTER_PREPARE_TIMEOUT_SECS", 30
)
GRADIENT_SCHEDULER_CLUSTER_RETRY_WAIT_SECS = _env_int("GRADIENT_SCHEDULER_CLUSTER_RETRY_WAIT_SECS", 30)
GRADIENT_SCHEDULER_CLUSTER_RESERVE_AFTER_SECS = _env_int("GRADIENT_SCHEDULER_CLUSTER_RESERVE_AFTER_SECS", 600)
GRADIENT_SCHEDULER_CLUSTER_RESERVE_TIMEOUT_SECS = _env_int(
    "GRADIENT_SCHEDULER_CLUSTER_RESERVE_TIMEOUT_SECS", 1800
)
GRADIENT_SCHEDULER_UNBUILDABLE_GRACE_SECS = _env_int("GRADIENT_SCHEDULER_UNBUILDABLE_GRACE_SECS", 300)
GRADIENT_PROTO_WORKER_HEARTBEAT_TIMEOUT_SECS = _env_int("GRADIENT_PROTO_WORKER_HEARTBEAT_TIMEOUT_SECS", 120)
GRADIENT_RETENTION_DAYS = _env_int("GRADIENT_RETENTION_DAYS", 90)
# /proto limits of one process (docs/security.md): seconds a socket may take to send its InitConnection,
# sockets that have not completed it (more are refused before the upgrade), handshakes at the database
# at once.
# Seconds a connection may take to send a request's headers (serve's uvicorn; gradient.http_protocol).
GRADIENT_HTTP_REQUEST_TIMEOUT_SECS = _env_int("GRADIENT_HTTP_REQUEST_TIMEOUT_SECS", 10)
# A whole request (headers and body) within this many seconds of its first byte (gradient.http_protocol).
GRADIENT_HTTP_BODY_TIMEOUT_SECS = _env_int("GRADIENT_HTTP_BODY_TIMEOUT_SECS", 30)
# Open HTTP connections per client address and process (not the trusted proxies'; 0: no cap).
GRADIENT_HTTP_MAX_CONNECTIONS_PER_ADDRESS = _env_int("GRADIENT_HTTP_MAX_CONNECTIONS_PER_ADDRESS", 128)
GRADIENT_PROTO_HANDSHAKE_TIMEOUT_SECS = _env_int("GRADIENT_PROTO_HANDSHAKE_TIMEOUT_SECS", 10)
# /proto sockets of a process before their handshake completes, silent and pending together: over it
# the oldest silent one (no InitConnection read yet) makes room (gradient.workers.proto.admission).
GRADIENT_PROTO_MAX_UNAUTHENTICATED = _env_int("GRADIENT_PROTO_MAX_UNAUTHENTICATED", 1024)
# ... silent ones per client address (not a trusted proxy's; 0: no cap of its own): over it the
# address's oldest that has been silent for GRADIENT_PROTO_SILENT_GRACE_SECS makes room.
GRADIENT_PROTO_MAX_UNAUTHENTICATED_PER_ADDRESS = _env_int(
    "GRADIENT_PROTO_MAX_UNAUTHENTICATED_PER_ADDRESS", 16
)
GRADIENT_PROTO_SILENT_GRACE_SECS = _env_int("GRADIENT_PROTO_SILENT_GRACE_SECS", 5)
# Handshakes opened together in one transaction (workers.services.worker_sessions_open), per process.
GRADIENT_PROTO_HANDSHAKE_CONCURRENCY = _env_int("GRADIENT_PROTO_HANDSHAKE_CONCURRENCY", 256)
# Derivations of one eval_result, of all its parts together (0: no cap): past it the evaluation fails and
# nothing of the result is built (scheduling.services.eval_parts).
GRADIENT_EVAL_MAX_DERIVATIONS = _env_int("GRADIENT_EVAL_MAX_DERIVATIONS", 250_000)
# Whether an eval_result's cached_outputs count for every project (protocol.md, "Tenants"): only for a
# fleet whose workers all read one cache that the operator trusts. Off: a claim counts only for the
# projects the reporting worker serves (scheduling.models.CachedPathClaim).
GRADIENT_TRUSTED_CACHE = _env_bool("GRADIENT_TRUSTED_CACHE", False)
# A build's tries that one worker may end `canceled` in a row without spending an attempt; past them each
# cancel is a failed attempt (backoff, max attempts) so such a worker cannot hold a build forever.
GRADIENT_BUILD_FREE_CANCELS = _env_int("GRADIENT_BUILD_FREE_CANCELS", 3)
GRADIENT_BUILD_LOG_MAX_BYTES = _env_int("GRADIENT_BUILD_LOG_MAX_BYTES", 64 * 1024 * 1024)
# ... of all tries of one build together, and of one worker's logs per hour (0: no such cap; docs/logs.md).
GRADIENT_BUILD_LOG_MAX_BYTES_PER_BUILD = _env_int("GRADIENT_BUILD_LOG_MAX_BYTES_PER_BUILD", 128 * 1024 * 1024)
GRADIENT_BUILD_LOG_MAX_BYTES_PER_WORKER_HOUR = _env_int(
    "GRADIENT_BUILD_LOG_MAX_BYTES_PER_WORKER_HOUR", 1024 * 1024 * 1024
)
# An evaluation's warnings, and its errors, each: at most this many messages and bytes of all its parts.
GRADIENT_EVAL_MESSAGES_MAX_COUNT = _env_int("GRADIENT_EVAL_MESSAGES_MAX_COUNT", 500)
GRADIENT_EVAL_MESSAGES_MAX_BYTES = _env_int("GRADIENT_EVAL_MESSAGES_MAX_BYTES", 512 * 1024)
# What a waiting job's expected start and end rest on when no past attempt of its derivation or project
# has ended yet (spec/rest.md "Where a waiting job stands"; gradient.scheduling.queue_position).
GRADIENT_ETA_DEFAULT_BUILD_SECS = _env_int("GRADIENT_ETA_DEFAULT_BUILD_SECS", 600)
GRADIENT_ETA_DEFAULT_EVAL_SECS = _env_int("GRADIENT_ETA_DEFAULT_EVAL_SECS", 300)
# The ETA pass (services.estimates): how often it writes down newly waiting builds' expected start and
# settles those handed out since (0 turns it off), and how many builds it estimates per run at most.
GRADIENT_ETA_PASS_INTERVAL_SECS = _env_int("GRADIENT_ETA_PASS_INTERVAL_SECS", 10)
GRADIENT_ETA_ESTIMATES_PER_PASS = _env_int("GRADIENT_ETA_ESTIMATES_PER_PASS", 200)
GRADIENT_SCHEDULING_POLICY = os.environ.get("GRADIENT_SCHEDULING_POLICY", "resource-aware")
# The hand-out path (docs/workers.md): database threads of one serve process for handshakes, closes and
# the presence flush ("sessions"), RequestJob and report batches ("hot"), and offers ("offers"); the most
# candidates one offer delta carries.
GRADIENT_SESSION_LANE_THREADS = _env_int("GRADIENT_SESSION_LANE_THREADS", 2)
# How often the presence flush writes every session's seen and metrics (gradient.workers.presence).
GRADIENT_PRESENCE_FLUSH_SECS = float(os.environ.get("GRADIENT_PRESENCE_FLUSH_SECS", "2") or 2)
GRADIENT_HOT_LANE_THREADS = _env_int("GRADIENT_HOT_LANE_THREADS", 4)
GRADIENT_OFFER_LANE_THREADS = _env_int("GRADIENT_OFFER_LANE_THREADS", 1)
GRADIENT_CLAIM_LANE_THREADS = _env_int("GRADIENT_CLAIM_LANE_THREADS", 4)
# Batches of each kind (claims, reports) applied at once by one serve (workers/proto/dispatcher.py).
GRADIENT_BATCH_IN_FLIGHT = _env_int("GRADIENT_BATCH_IN_FLIGHT", 1)
# serve's garbage collector (gradient/runtime/heap.py): young collections every this many allocations,
# the objects of startup frozen; 0 leaves CPython's defaults.
GRADIENT_GC_GEN0_THRESHOLD = _env_int("GRADIENT_GC_GEN0_THRESHOLD", 50_000)
# serve hands the GIL on after this many seconds (CPython: 0.005; 0 leaves it): gradient/runtime/heap.py.
GRADIENT_SWITCH_INTERVAL_SECS = float(os.environ.get("GRADIENT_SWITCH_INTERVAL_SECS", "0.001") or 0.001)
GRADIENT_OFFER_MAX_CANDIDATES = _env_int("GRADIENT_OFFER_MAX_CANDIDATES", 1000)
