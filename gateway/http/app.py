"""The aiohttp application: middleware chain, routes, logging, and the served model's lifetime.

Layering: middleware (request id + error rendering + the request record ->
auth + rate limits) -> routes (gateway/api/openai/routes, gateway/http/operations, /metrics) ->
admission (gateway/serving/admission, inside the generation handlers) -> ServedModel
(gateway/workers/registry: a hosted model per configured model, each with its
supervisor and frontend while it runs). Cleanup contexts start the worker when the app starts
and stop it, then the frontend, in reverse order on shutdown; the trace file
(trace mode) is opened and closed the same way.

Every finished request becomes one `RequestRecord` (gateway/observability/tracing): one JSON
log line, its metrics, and in trace mode its Chrome trace events.

Threading: event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from gateway.api.anthropic.routes import error_payload as anthropic_error
from gateway.api.anthropic.routes import routes as anthropic_routes
from gateway.api.openai.responses import routes as responses_routes
from gateway.api.openai.responses_store import RESPONSE_STORE, ResponseStore
from gateway.api.openai.routes import routes as openai_routes
from gateway.config import Settings
from gateway.http.app_keys import (
    AUTH,
    JSON_PRECHECK,
    LIFECYCLE,
    METRICS,
    MODELS,
    SETTINGS,
    TRACER,
)
from gateway.http.auth import Authenticator, auth_middleware, required_scope
from gateway.http.errors import APIError
from gateway.http.openapi import openapi_handler
from gateway.http.operations import Lifecycle, model_fault, startup_watch
from gateway.http.operations import routes as probe_routes
from gateway.http.request_state import begin, state, state_or_none
from gateway.http.slow_clients import body_deadline_middleware, close_if_asked
from gateway.observability.log_safety import cap
from gateway.observability.metrics import Metrics, metrics_handler
from gateway.observability.tracing import RequestRecord, TraceWriter, collect_stages
from gateway.serving.json_precheck import JsonPrecheck
from gateway.workers.registry import ModelRegistry

log = logging.getLogger("mlxd.gateway")
request_log = structlog.get_logger("mlxd.request")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_HTTP_MESSAGES = {
    404: "no such route",
    405: "method not allowed on this route",
    413: "the request body is too large",
}
CLIENT_CLOSED = 499  # nginx's status for "the client went away"; only ever logged


def _client_request_id(request: web.Request) -> str | None:
    """The client's X-Request-ID: a label echoed and logged, never a key (any
    client may send any value, another client's included)."""
    given = request.headers.get("X-Request-ID", "")
    if given and len(given) <= 128 and given.isprintable():
        return given
    return None


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    # on_response_prepare: also reaches streamed responses, whose headers leave
    # before the handler returns. The client's own label if it sent one, else
    # the internal id (which is also the response body's id).
    st = state_or_none(request)
    if st is not None:
        response.headers["X-Request-ID"] = st.client_request_id or st.request_id


@web.middleware
async def request_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request id, OpenAI error rendering, and the request's record (log, metrics, trace)."""
    start = time.monotonic()
    # The internal id keys the request end to end (gateway, IPC, worker, logs).
    begin(request, start, _client_request_id(request))
    status = 500
    error = None
    cancelled = False
    try:
        try:
            resp = await handler(request)
        except APIError as e:
            resp, error = _error_response(request, e), e.message
        except web.HTTPException as e:
            if e.status < 400:
                raise
            msg = _HTTP_MESSAGES.get(e.status, e.reason)
            if e.status == 413:
                limit = request.app[SETTINGS].max_body_bytes
                msg = f"the request body is larger than {limit} bytes"
            headers = {"Allow": e.headers.get("Allow", "")} if e.status == 405 else None
            resp, error = _error_response(request, APIError(e.status, msg, headers=headers)), msg
        except asyncio.CancelledError:
            # handler_cancellation: the client went away mid-request.
            cancelled, status = True, CLIENT_CLOSED
            raise
        except Exception:
            log.exception("unhandled error in %s %s", request.method, cap(request.path))
            error = "internal error"
            resp = _error_response(request, APIError(500, "internal server error"))
        status = resp.status
        return resp
    finally:
        _finish(request, status, error, cancelled, start)


def _error_response(request: web.Request, e: APIError) -> web.Response:
    """The error in the shape the route's clients parse: Anthropic's on /v1/messages
    (auth, body size and routing errors raised before its handler included)."""
    if request.path.startswith("/v1/messages"):
        return web.json_response(anthropic_error(e), status=e.status, headers=e.headers)
    return e.response()


def _record(
    request: web.Request, status: int, error: str | None, cancelled: bool, start: float
) -> RequestRecord:
    resource = request.match_info.route.resource
    st = state(request)
    gen = st.generation
    extra = {"admitted": st.admitted_at, "cancelled": st.cancelled_at}
    rec = RequestRecord(
        request_id=st.request_id,
        method=request.method,
        path=request.path,
        endpoint=resource.canonical if resource is not None else "unmatched",
        status=status,
        start=start,
        end=time.monotonic(),
        stages=collect_stages(st.trace, extra),
        model=st.model,
        prompt_tokens=st.prompt_tokens,
        max_tokens=st.max_tokens,
        stream=st.stream,
        finish_reason=st.finish_reason,
        cancelled=cancelled,
        error=error or st.error,
        api_key=st.api_key,
        rejected=st.rejected,
        generation=gen is not None,
        client_request_id=st.client_request_id,
    )
    if gen is not None:
        rec.completion_tokens = gen.completion_tokens
        rec.finish_reason = rec.finish_reason or gen.finish_reason
        rec.cancelled = cancelled or gen.finish_reason == "abort"
        if gen.error and not rec.error:
            rec.error = gen.error
    return rec


def _finish(
    request: web.Request, status: int, error: str | None, cancelled: bool, start: float
) -> None:
    """One finished request: its metrics, its log line, its trace events."""
    app = request.app
    try:
        rec = _record(request, status, error, cancelled, start)
        app[METRICS].observe_request(rec)
        # API calls always; other routes only when refused, and never the probes,
        # which orchestrators poll every few seconds.
        loggable = rec.path.startswith("/v1/") or (
            status >= 400 and required_scope(rec.path) is not None
        )
        if app[SETTINGS].log_requests and loggable:
            request_log.info("request", **rec.log_fields())
        tracer = app[TRACER]
        if tracer is not None:
            tracer.write(rec)
    except Exception:  # bookkeeping must never turn a served request into an error
        st = state_or_none(request)
        log.exception("recording request %s failed", st.request_id if st else "?")


async def _drain(app: web.Application) -> None:
    # on_shutdown runs after the listener closed and before aiohttp waits
    # (shutdown_grace_s) for in-flight handlers: readiness goes false now.
    app[MODELS].drain()


def create_app(settings: Settings, worker_env: dict[str, str] | None = None) -> web.Application:
    auth = Authenticator(settings)
    app = web.Application(
        # Bodies are read (at a minimum rate) only once authenticated.
        middlewares=[request_middleware, auth_middleware(auth), body_deadline_middleware],
        client_max_size=settings.max_body_bytes,
    )
    app[SETTINGS] = settings
    app[METRICS] = metrics = Metrics()
    app[MODELS] = ModelRegistry(
        settings,
        worker_env,
        on_start=lambda served: metrics.install_retire_hook(served.supervisor.retire_hooks),
    )
    app[AUTH] = auth
    app[LIFECYCLE] = Lifecycle(started_at=time.monotonic())
    app[TRACER] = TraceWriter(settings.trace_file) if settings.trace_file else None
    app[JSON_PRECHECK] = JsonPrecheck(settings.max_json_values)
    app[RESPONSE_STORE] = ResponseStore(settings.responses_store_bytes, settings.responses_ttl_s)
    app.add_routes(openai_routes)
    app.add_routes(responses_routes)
    app.add_routes(anthropic_routes)
    app.add_routes(probe_routes)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/openapi.json", openapi_handler)
    if settings.test_faults:
        app.router.add_post("/models/{model}/fault", model_fault)
    app.on_response_prepare.append(_echo_request_id)
    app.on_response_prepare.append(close_if_asked)
    app.on_shutdown.append(_drain)

    async def tracer_lifetime(app: web.Application) -> AsyncIterator[None]:
        tracer = app[TRACER]
        if tracer is not None:
            tracer.open()
        yield
        if tracer is not None:
            tracer.close()

    async def model_lifetime(app: web.Application) -> AsyncIterator[None]:
        app[MODELS].start_pinned()
        yield
        await app[MODELS].stop_all()
        app[JSON_PRECHECK].shutdown()

    app.cleanup_ctx.append(tracer_lifetime)
    app.cleanup_ctx.append(model_lifetime)
    app.cleanup_ctx.append(startup_watch)
    return app


def configure_logging(level: str = "info") -> None:
    """structlog JSON lines on stderr; stdlib logging routed through the same renderer."""
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso"),
    ]
    structlog.configure(
        processors=[*processors, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *processors],
    )
    handler = logging.StreamHandler()
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
