"""Typed aiohttp application keys: the app's shared objects, no globals."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from gateway.auth import Authenticator
    from gateway.config import Settings
    from gateway.metrics import Metrics
    from gateway.models import ModelRegistry
    from gateway.probes import Lifecycle
    from gateway.tracing import TraceWriter

SETTINGS: web.AppKey[Settings] = web.AppKey("settings")
MODELS: web.AppKey[ModelRegistry] = web.AppKey("models")  # every slot has its own admission
AUTH: web.AppKey[Authenticator] = web.AppKey("auth")
METRICS: web.AppKey[Metrics] = web.AppKey("metrics")
LIFECYCLE: web.AppKey[Lifecycle] = web.AppKey("lifecycle")
TRACER: web.AppKey[TraceWriter | None] = web.AppKey("tracer")
