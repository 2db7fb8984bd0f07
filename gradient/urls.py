from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from gradient.console import scheduler_first
from gradient.health import healthz
from gradient.index import ApiIndexView
from gradient.metrics import MetricsView
from gradient.overview import overview_json, overview_page
from gradient.throttling import limit_admin_login

admin.site.site_header = "Gradient"
admin.site.site_title = "Gradient console"
admin.site.index_title = "Scheduler console"
# Django's navigation sidebar repeats the index beside every list and took the width the lists' own
# columns need (progress, waiting for, outcome, last seen hid at 1 400 px); the breadcrumbs and the
# index remain.
admin.site.enable_nav_sidebar = False
# Failed logins are limited per account and per address (gradient.throttling); set before the admin's
# URLs are made, which take the view from here.
admin.site.login = limit_admin_login(admin.site.login)  # type: ignore[method-assign]
_app_list = admin.site.get_app_list
# The scheduler's own tables first, then accounts, tokens and Celery beat, named for what they are.
admin.site.get_app_list = lambda request, app_label=None: scheduler_first(  # type: ignore[method-assign]
    _app_list(request, app_label)
)

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False), name="root"),
    path("healthz", healthz, name="healthz"),
    path("metrics", MetricsView.as_view(), name="metrics"),
    path("admin/overview/", admin.site.admin_view(overview_page), name="console-overview"),
    path("admin/overview.json", admin.site.admin_view(overview_json), name="console-overview-json"),
    path("admin/", admin.site.urls),
    path("my/", include("gradient.member")),  # project members' read-only view (gradient/member.py)
    # The document is the same for everyone and reads no table: not counted (the counters are a table).
    path("api/schema/", SpectacularAPIView.as_view(throttle_classes=[]), name="schema"),
    path(
        "api/docs/", SpectacularSwaggerView.as_view(url_name="schema", throttle_classes=[]), name="api-docs"
    ),
    path("api/v1/", ApiIndexView.as_view(), name="api-index"),
    path("api/v1/", include("gradient.api_urls")),
]

handler404 = "gradient.rest.not_found"
handler500 = "gradient.rest.server_error"
