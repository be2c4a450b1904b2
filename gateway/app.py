"""The aiohttp application: middleware, probes, and the served model's lifetime.

Layering: middleware (request id, error rendering, request log) -> routes
(gateway/openai_api, the probes here) -> ServedModel (supervisor + frontend).
The cleanup context starts the worker when the app starts and stops it, then
the frontend, in reverse order on shutdown.

Threading: event loop only.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from gateway.config import Settings
from gateway.errors import APIError, error_body
from gateway.keys import MODEL, SETTINGS
from gateway.openai_api import routes as openai_routes
from gateway.served_model import ServedModel

log = logging.getLogger("mlxd.gateway")
request_log = structlog.get_logger("mlxd.request")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_HTTP_MESSAGES = {
    404: "no such route",
    405: "method not allowed on this route",
    413: "the request body is too large",
}


def _request_id(request: web.Request) -> str:
    given = request.headers.get("X-Request-ID", "")
    if given and len(given) <= 128 and given.isprintable():
        return given
    return uuid.uuid4().hex


@web.middleware
async def request_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request id, OpenAI error rendering, and one log line per API request."""
    rid = _request_id(request)
    request["request_id"] = rid
    request["log"] = {}
    start = time.monotonic()
    status = 500
    error = None
    try:
        try:
            resp = await handler(request)
        except APIError as e:
            resp, error = e.response(), e.message
        except web.HTTPException as e:
            if e.status < 400:
                raise
            msg = _HTTP_MESSAGES.get(e.status, e.reason)
            if e.status == 413:
                limit = request.app[SETTINGS].max_body_bytes
                msg = f"the request body is larger than {limit} bytes"
            resp, error = web.json_response(error_body(e.status, msg), status=e.status), msg
            if e.status == 405:
                resp.headers["Allow"] = e.headers.get("Allow", "")
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            error = "internal error"
            resp = web.json_response(error_body(500, "internal server error"), status=500)
        status = resp.status
        resp.headers["X-Request-ID"] = rid
        return resp
    finally:
        if request.path.startswith("/v1/"):
            _log_request(request, rid, status, error, start)


def _log_request(request: web.Request, rid: str, status: int, error: str | None,
                 start: float) -> None:
    gen = request.get("generation")
    fields: dict[str, Any] = dict(request["log"])
    if gen is not None:
        t = gen.trace
        fields.update(
            completion_tokens=gen.completion_tokens,
            finish_reason=gen.finish_reason,
            cancelled=gen.finish_reason == "abort",
            ttft_ms=None if t.first_token is None else round((t.first_token - t.arrival) * 1e3, 2),
            queue_time_ms=None if t.submitted is None else round((t.submitted - t.arrival) * 1e3, 2),
        )
        if gen.error:
            error = gen.error
    request_log.info(
        "request",
        request_id=rid,
        method=request.method,
        path=request.path,
        status=status,
        latency_ms=round((time.monotonic() - start) * 1e3, 2),
        error=error,
        **fields,
    )


# -- probes ----------------------------------------------------------------------

probe_routes = web.RouteTableDef()


@probe_routes.get("/live")
async def live(request: web.Request) -> web.Response:
    # Only says the event loop answers; never tied to the worker.
    return web.json_response({"status": "ok"})


@probe_routes.get("/ready")
async def ready(request: web.Request) -> web.Response:
    served = request.app[MODEL]
    if served.ready.is_set() and served.supervisor.client and not served.supervisor.client.closed:
        return web.json_response({"status": "ready", "model": served.name})
    return web.json_response(
        {"status": "not_ready", "phase": served.phase, "reason": served.supervisor.reason},
        status=503,
    )


@probe_routes.get("/health")
async def health(request: web.Request) -> web.Response:
    return await ready(request)


@probe_routes.get("/models/{model}/status")
async def model_status(request: web.Request) -> web.Response:
    served = request.app[MODEL]
    name = request.match_info["model"]
    if served.name != name:
        raise APIError(404, f"the model {name!r} does not exist", code="model_not_found")
    client = served.client_or_503()
    stats = await client.call("stats")
    r = client.ready
    return web.json_response({
        "model": name,
        "state": served.supervisor.state.value,
        "phase": served.phase,
        "identity": r.identity,
        "path": r.model_path,
        "backend": r.backend,
        "blas": r.blas,
        "context_length": r.context_length,
        "load_time_s": r.load_time_s,
        "worker_pid": r.pid,
        "epoch": r.epoch,
        "in_flight": client.active,
        "worker": stats,
    })


def create_app(settings: Settings, worker_env: dict[str, str] | None = None) -> web.Application:
    app = web.Application(
        middlewares=[request_middleware], client_max_size=settings.max_body_bytes
    )
    app[SETTINGS] = settings
    app[MODEL] = ServedModel(settings, worker_env)
    app.add_routes(openai_routes)
    app.add_routes(probe_routes)

    async def model_lifetime(app: web.Application) -> AsyncIterator[None]:
        app[MODEL].start()
        yield
        await app[MODEL].stop()

    app.cleanup_ctx.append(model_lifetime)
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
