"""Typed aiohttp application keys: the app's shared objects, no globals."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from gateway.config import Settings
    from gateway.http.auth import Authenticator
    from gateway.http.operations import Lifecycle
    from gateway.observability.metrics import Metrics
    from gateway.observability.tracing import TraceWriter
    from gateway.serving.json_precheck import JsonPrecheck
    from gateway.workers.registry import ModelRegistry

SETTINGS: web.AppKey[Settings] = web.AppKey("settings")
MODELS: web.AppKey[ModelRegistry] = web.AppKey("models")  # every hosted model has its own admission
AUTH: web.AppKey[Authenticator] = web.AppKey("auth")
METRICS: web.AppKey[Metrics] = web.AppKey("metrics")
LIFECYCLE: web.AppKey[Lifecycle] = web.AppKey("lifecycle")
TRACER: web.AppKey[TraceWriter | None] = web.AppKey("tracer")
JSON_PRECHECK: web.AppKey[JsonPrecheck] = web.AppKey("json_precheck")
