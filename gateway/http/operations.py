"""Probes and model status: /live, /startup, /ready, /health, /version, /models/...

- /live: the event loop answers. Never looks at the worker, so an orchestrator
  does not restart the gateway for a worker problem the supervisor handles.
- /startup: 200 once the initial model load finished (a latch: it stays 200
  through later worker restarts), else 503 with the startup phase; also 503
  (status "failed") while a pinned model is FAILED, with the seconds until its
  next start attempt (`retry_in_s`, null when none is scheduled).
- /ready (and /health, kept for compatibility): 200 only when the worker is READY,
  connected, healthy by the watchdog's own verdict (`Supervisor.health()`: a fresh
  heartbeat, step progress within the watchdog window while it had work), and
  admission is open; else 503 with the reason.
- /models, /models/{model}/status (admin): lifecycle state, load time, identity,
  queue depth, memory terms and the worker's stats; /models/{model}/ready is the
  per-model readiness probe (open, like /ready).

Threading: event loop only. Only /models/{model}/status talks to the worker (one
`stats` call); the probes read state the gateway already holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import platform
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.api.openai.schemas import dump
from gateway.http.app_keys import LIFECYCLE, MODELS
from gateway.http.errors import APIError
from gateway.http.schemas import (
    FaultAccepted,
    FaultRequest,
    Live,
    ModelsMemory,
    ModelStatus,
    QueueStatus,
    Rank,
    Readiness,
    ServedModel,
    ServedModels,
    Startup,
    Version,
)
from gateway.workers.registry import HostedModel
from gateway.workers.supervisor import WorkerState
from protocol.frames import PROTOCOL_VERSION

routes = web.RouteTableDef()


@dataclass(slots=True)
class Lifecycle:
    """Gateway-level timestamps (monotonic)."""

    started_at: float
    startup_done_at: float | None = None


async def startup_watch(app: web.Application) -> AsyncIterator[None]:
    """Cleanup context: latch /startup when every pinned model first became ready."""

    async def watch() -> None:
        for hosted in app[MODELS].pinned:
            if hosted.served is not None:
                await hosted.served.ready.wait()
        app[LIFECYCLE].startup_done_at = time.monotonic()

    task = asyncio.get_running_loop().create_task(watch())
    yield
    task.cancel()


def startup_seconds(app: web.Application) -> float | None:
    lc = app[LIFECYCLE]
    return None if lc.startup_done_at is None else lc.startup_done_at - lc.started_at


def readiness(app: web.Application) -> tuple[bool, str]:
    """(ready, reason): the /ready verdict. Every pinned model must be ready;
    stopped lazy models do not count (they start on their first request)."""
    registry = app[MODELS]
    for hosted in registry.pinned:
        ok, reason = model_readiness(app, hosted)
        if not ok:
            return False, reason if len(registry.hosted_models) == 1 else f"{hosted.name}: {reason}"
    return True, "ready"


def model_readiness(app: web.Application, hosted: HostedModel) -> tuple[bool, str]:
    """(ready, reason) for one model."""
    served = hosted.served
    adm = hosted.admission
    if served is None:
        return False, f"model is {hosted.phase}: {hosted.reason}"
    sup = served.supervisor
    if not served.ready.is_set():
        why = f": {sup.reason}" if sup.reason else ""
        return False, f"model is {served.phase.replace('_', ' ')}{why}"
    if sup.state != WorkerState.READY:
        return False, f"worker is {sup.state.value}" + (f": {sup.reason}" if sup.reason else "")
    client = sup.client
    if client is None or client.closed:
        return False, "worker connection closed"
    problem = sup.health()  # the watchdog's own verdict
    if problem:
        return False, problem
    if not adm.open:
        return False, (
            f"admission closed: {adm.in_flight} in flight and {adm.queued} queued fill the caps"
        )
    return True, "ready"


def _ready_response(app: web.Application, hosted: HostedModel | None = None) -> web.Response:
    """/ready (hosted None: every pinned model) or /models/{model}/ready."""
    name = hosted.name if hosted is not None else app[MODELS].primary.name
    ok, reason = readiness(app) if hosted is None else model_readiness(app, hosted)
    if ok:
        return web.json_response(dump(Readiness(status="ready", model=name)))
    phase = (hosted or app[MODELS].primary).phase
    body = Readiness(status="not_ready", model=name, phase=phase, reason=reason)
    return web.json_response(dump(body), status=503)


@routes.get("/live")
async def live(request: web.Request) -> web.Response:
    # Only says the event loop answers; never tied to the worker.
    return web.json_response(dump(Live(status="ok")))


@routes.get("/startup")
async def startup(request: web.Request) -> web.Response:
    app = request.app
    lc = app[LIFECYCLE]
    loading = [s for s in app[MODELS].pinned if s.served is None or not s.served.ready.is_set()]
    if lc.startup_done_at is None and not loading:
        lc.startup_done_at = time.monotonic()  # the watcher task may not have run yet
    failed = _failed_pinned(app)
    if failed is not None:
        return failed
    if lc.startup_done_at is not None:
        started = Startup(status="started", startup_s=startup_seconds(app))
        return web.json_response(dump(started))
    hosted = loading[0]
    starting = Startup(
        status="starting", model=hosted.name, phase=hosted.phase, reason=hosted.reason
    )
    return web.json_response(dump(starting), status=503)


def _failed_pinned(app: web.Application) -> web.Response | None:
    """/startup's answer while a pinned model is FAILED: the startup did not hold."""
    for hosted in app[MODELS].pinned:
        if hosted.served is not None and hosted.served.supervisor.state == WorkerState.FAILED:
            failed = Startup(
                status="failed",
                model=hosted.name,
                phase="failed",
                reason=hosted.reason,
                retry_in_s=_retry_in_s(hosted),
            )
            return web.json_response(dump(failed), status=503)
    return None


def _retry_in_s(hosted: HostedModel) -> float | None:
    """Seconds until a FAILED model is started again (gateway/workers/supervisor)."""
    value = hosted.served.supervisor.retry_in_s() if hosted.served is not None else None
    return None if value is None else round(value, 3)


@routes.get("/ready")
async def ready(request: web.Request) -> web.Response:
    return _ready_response(request.app)


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    return _ready_response(request.app)


@routes.get("/version")
async def version(request: web.Request) -> web.Response:
    def dist(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    registry = request.app[MODELS]

    def identity(hosted: HostedModel) -> str | None:
        client = hosted.served.supervisor.client if hosted.served is not None else None
        return client.ready.identity if client is not None else None

    body = Version(
        version=dist("mlxd"),
        protocol_version=PROTOCOL_VERSION,
        python=platform.python_version(),
        mlx=dist("mlx"),
        mlx_lm=dist("mlx-lm"),
        model_identity=identity(registry.primary),
        models={hosted.name: identity(hosted) for hosted in registry.hosted_models},
    )
    return web.json_response(dump(body))


def _known_model(request: web.Request) -> HostedModel:
    name = request.match_info["model"]
    hosted = request.app[MODELS].get(name)
    if hosted is None:
        raise APIError(404, f"the model {name!r} does not exist", code="model_not_found")
    return hosted


def _served_model(app: web.Application, hosted: HostedModel) -> ServedModel:
    ok, reason = model_readiness(app, hosted)
    return ServedModel(
        id=hosted.name,
        aliases=list(hosted.entry.aliases),
        pinned=hosted.pinned,
        state=hosted.state,
        phase=hosted.phase,
        ready=ok,
        reason=reason,
    )


@routes.get("/models")
async def list_models(request: web.Request) -> web.Response:
    app = request.app
    data = [_served_model(app, hosted) for hosted in app[MODELS].hosted_models]
    return web.json_response(dump(ServedModels(object="list", data=data)))


@routes.get("/models/{model}/ready")
async def model_ready(request: web.Request) -> web.Response:
    return _ready_response(request.app, _known_model(request))


@routes.get("/models/{model}/status")
async def model_status(request: web.Request) -> web.Response:
    app = request.app
    hosted = _known_model(request)
    sup = hosted.served.supervisor if hosted.served is not None else None
    client = sup.client if sup is not None else None
    stats: dict[str, Any] | None = None
    stats_error = None
    if client is not None and not client.closed:
        try:
            stats = await client.call("stats", timeout_s=5.0)
        except Exception as e:  # a busy or dying worker still gets a status answer
            stats_error = str(e) or type(e).__name__
    r = client.ready if client is not None else None
    summary = _served_model(app, hosted).model_dump(exclude={"id"})
    body = ModelStatus(
        model=hosted.name,
        **summary,
        startup_s=startup_seconds(app),
        restarts=0 if sup is None else sup.restarts,
        retry_in_s=_retry_in_s(hosted),
        poisoned_requests=0 if sup is None else sup.poisoned_requests,
        starts=hosted.starts,
        leases=hosted.leases,
        idle_timeout_s=hosted.entry.idle_timeout_s,
        idle_s=round(time.monotonic() - hosted.last_used, 3) if hosted.leases == 0 else 0.0,
        footprint_bytes=hosted.footprint,
        models_memory=ModelsMemory(budget=app[MODELS].budget, used=app[MODELS].used_bytes()),
        identity=r.identity if r else None,
        path=r.model_path if r else None,
        backend=r.backend if r else None,
        blas=r.blas if r else None,
        context_length=r.context_length if r else None,
        load_time_s=r.load_time_s if r else None,
        warmup_s=(stats or {}).get("warmup_s"),
        worker_pid=r.pid if r else None,
        epoch=r.epoch if r else None,
        # A sharded group: every rank's process (rank 0 is worker_pid).
        ranks=[
            Rank(rank=i, pid=p.pid, alive=p.returncode is None)
            for i, p in enumerate(sup.processes if sup else [])
        ],
        queue=_queue(hosted),
        in_flight=client.active if client is not None else 0,
        memory=(stats or {}).get("governor", {}),
        prefix_cache=(stats or {}).get("prefix_cache", {}),
        worker=stats,
        worker_error=stats_error,
    )
    return web.json_response(dump(body))


def _queue(hosted: HostedModel) -> QueueStatus:
    adm = hosted.admission
    return QueueStatus(
        queued=adm.queued,
        in_flight=adm.in_flight,
        max_queued=adm.max_queued,
        max_in_flight=adm.max_in_flight,
        drain_rate_per_s=round(adm.drain.rate(), 3),
        retry_after_s=adm.retry_after(),
    )


async def model_fault(request: web.Request) -> web.Response:
    """Test-only (`test_faults`): inject a fault into the worker (wedge, crash,
    corrupt, or a step that runs out of device memory).

    Answers 202 at once: a wedge blocks the engine thread, so its utility call
    is not awaited here.
    """
    hosted = _known_model(request)
    try:
        fault = FaultRequest.model_validate(await request.json())
    except ValueError:  # bad JSON, or pydantic's ValidationError
        raise APIError(
            400,
            'expected {"kind": "wedge" | "crash" | "corrupt" | "step_no_memory", '
            '"seconds"?, "steps"?}',
        ) from None
    if hosted.served is None:
        raise APIError(503, f"the model {hosted.name!r} is not running", code="model_not_ready")
    client = hosted.served.client_or_503()
    args = fault.model_dump(exclude_unset=True)

    async def send() -> None:
        with contextlib.suppress(Exception):  # the worker may die of it: that is the point
            await client.call("fault", args, timeout_s=3600)

    task = asyncio.get_running_loop().create_task(send())
    _background.add(task)
    task.add_done_callback(_background.discard)
    return web.json_response(dump(FaultAccepted(status="accepted", kind=fault.kind)), status=202)


_background: set[asyncio.Task[None]] = set()  # keeps fire-and-forget tasks referenced
