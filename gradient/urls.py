from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from gradient.health import healthz
from gradient.index import ApiIndexView
from gradient.metrics import MetricsView
from gradient.overview import overview_json, overview_page

admin.site.site_header = "Gradient"
admin.site.site_title = "Gradient console"
admin.site.index_title = "Scheduler console"

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False), name="root"),
    path("healthz", healthz, name="healthz"),
    path("metrics", MetricsView.as_view(), name="metrics"),
    path("admin/overview/", admin.site.admin_view(overview_page), name="console-overview"),
    path("admin/overview.json", admin.site.admin_view(overview_json), name="console-overview-json"),
    path("admin/", admin.site.urls),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/v1/", ApiIndexView.as_view(), name="api-index"),
    path("api/v1/", include("gradient.api_urls")),
]

handler404 = "gradient.rest.not_found"
handler500 = "gradient.rest.server_error"
