"""Probes and model status: /live, /startup, /ready, /health, /version, /models/...

- /live: the event loop answers. Never looks at the worker, so an orchestrator
  does not restart the gateway for a worker problem the supervisor handles.
- /startup: 200 once the initial model load finished (a latch: it stays 200
  through later worker restarts), else 503 with the startup phase.
- /ready (and /health, kept for compatibility): 200 only when the worker is READY,
  its heartbeat is fresh, it made step progress within `watchdog_s` while it had
  work, and admission is open; else 503 with the reason.
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

from gateway.http.app_keys import LIFECYCLE, MODELS, SETTINGS
from gateway.http.errors import APIError
from gateway.workers.registry import ModelSlot
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
        for slot in app[MODELS].pinned:
            if slot.served is not None:
                await slot.served.ready.wait()
        app[LIFECYCLE].startup_done_at = time.monotonic()

    task = asyncio.get_running_loop().create_task(watch())
    yield
    task.cancel()


def startup_seconds(app: web.Application) -> float | None:
    lc = app[LIFECYCLE]
    return None if lc.startup_done_at is None else lc.startup_done_at - lc.started_at


def _state(sup: Any) -> str:
    return str(getattr(sup.state, "value", sup.state))


def readiness(app: web.Application) -> tuple[bool, str]:
    """(ready, reason): the /ready verdict. Every pinned model must be ready;
    stopped lazy models do not count (they start on their first request)."""
    registry = app[MODELS]
    for slot in registry.pinned:
        ok, reason = slot_readiness(app, slot)
        if not ok:
            return False, reason if len(registry.slots) == 1 else f"{slot.name}: {reason}"
    return True, "ready"


def slot_readiness(app: web.Application, slot: ModelSlot) -> tuple[bool, str]:
    """(ready, reason) for one model."""
    served = slot.served
    settings = app[SETTINGS]
    adm = slot.admission
    if served is None:
        return False, f"model is {slot.phase}: {slot.reason}"
    sup = served.supervisor
    if not served.ready.is_set():
        why = f": {sup.reason}" if sup.reason else ""
        return False, f"model is {served.phase.replace('_', ' ')}{why}"
    state = _state(sup)
    if state != "ready":
        return False, f"worker is {state}" + (f": {sup.reason}" if sup.reason else "")
    client = sup.client
    if client is None or client.closed:
        return False, "worker connection closed"
    if getattr(sup, "wedged", False):
        return False, "worker is wedged"
    now = time.monotonic()
    beat_age = now - client.last_heartbeat_at
    if beat_age > settings.heartbeat_timeout_s:
        return False, f"no heartbeat from the worker for {beat_age:.1f} s"
    stalled = _stalled_for(client, adm.busy_since, now)
    window_fn = getattr(sup, "watchdog_window", None)
    window = window_fn(client) if callable(window_fn) else settings.watchdog_s
    if stalled > window:
        return False, (
            f"no engine step progress for {stalled:.1f} s with {adm.in_flight} requests in flight"
        )
    if not adm.open:
        return False, (
            f"admission closed: {adm.in_flight} in flight and {adm.queued} queued fill the caps"
        )
    return True, "ready"


def _stalled_for(client: Any, busy_since: float | None, now: float) -> float:
    """Seconds without step progress while work is in flight (0 when idle)."""
    fn = getattr(client, "stalled_for", None)
    if callable(fn):
        return float(fn())
    if busy_since is None and not client.active:
        return 0.0
    # Progress counts from when work began, so an idle spell is never a stall.
    return now - max(client.last_step_progress_at, busy_since or 0.0)


def _ready_response(app: web.Application, slot: ModelSlot | None = None) -> web.Response:
    """/ready (slot None: every pinned model) or /models/{model}/ready."""
    name = slot.name if slot is not None else app[MODELS].primary.name
    ok, reason = readiness(app) if slot is None else slot_readiness(app, slot)
    if ok:
        return web.json_response({"status": "ready", "model": name})
    phase = (slot or app[MODELS].primary).phase
    return web.json_response(
        {"status": "not_ready", "model": name, "phase": phase, "reason": reason}, status=503
    )


@routes.get("/live")
async def live(request: web.Request) -> web.Response:
    # Only says the event loop answers; never tied to the worker.
    return web.json_response({"status": "ok"})


@routes.get("/startup")
async def startup(request: web.Request) -> web.Response:
    app = request.app
    lc = app[LIFECYCLE]
    loading = [s for s in app[MODELS].pinned if s.served is None or not s.served.ready.is_set()]
    if lc.startup_done_at is None and not loading:
        lc.startup_done_at = time.monotonic()  # the watcher task may not have run yet
    if lc.startup_done_at is not None:
        return web.json_response({"status": "started", "startup_s": startup_seconds(app)})
    slot = loading[0]
    return web.json_response(
        {"status": "starting", "model": slot.name, "phase": slot.phase, "reason": slot.reason},
        status=503,
    )


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

    def identity(slot: ModelSlot) -> str | None:
        client = slot.served.supervisor.client if slot.served is not None else None
        return client.ready.identity if client is not None else None

    return web.json_response(
        {
            "version": dist("mlxd"),
            "protocol_version": PROTOCOL_VERSION,
            "python": platform.python_version(),
            "mlx": dist("mlx"),
            "mlx_lm": dist("mlx-lm"),
            "model_identity": identity(registry.primary),
            "models": {slot.name: identity(slot) for slot in registry.slots},
        }
    )


def _known_model(request: web.Request) -> ModelSlot:
    name = request.match_info["model"]
    slot = request.app[MODELS].get(name)
    if slot is None:
        raise APIError(404, f"the model {name!r} does not exist", code="model_not_found")
    return slot


def _slot_summary(app: web.Application, slot: ModelSlot) -> dict[str, Any]:
    ok, reason = slot_readiness(app, slot)
    return {
        "aliases": list(slot.entry.aliases),
        "pinned": slot.pinned,
        "state": slot.state,
        "phase": slot.phase,
        "ready": ok,
        "reason": reason,
    }


@routes.get("/models")
async def list_models(request: web.Request) -> web.Response:
    app = request.app
    data = []
    for slot in app[MODELS].slots:
        data.append({"id": slot.name, **_slot_summary(app, slot)})
    return web.json_response({"object": "list", "data": data})


@routes.get("/models/{model}/ready")
async def model_ready(request: web.Request) -> web.Response:
    return _ready_response(request.app, _known_model(request))


@routes.get("/models/{model}/status")
async def model_status(request: web.Request) -> web.Response:
    app = request.app
    slot = _known_model(request)
    registry = app[MODELS]
    served = slot.served
    sup = served.supervisor if served is not None else None
    adm = slot.admission
    client = sup.client if sup is not None else None
    stats: dict[str, Any] | None = None
    stats_error = None
    if client is not None and not client.closed:
        try:
            stats = await client.call("stats", timeout_s=5.0)
        except Exception as e:  # a busy or dying worker still gets a status answer
            stats_error = str(e) or type(e).__name__
    r = client.ready if client is not None else None
    restarts = 0 if sup is None else getattr(sup, "restarts", max(0, sup.epoch - 1))
    return web.json_response(
        {
            "model": slot.name,
            **_slot_summary(app, slot),
            "startup_s": startup_seconds(app),
            "restarts": restarts,
            "starts": slot.starts,
            "leases": slot.leases,
            "idle_timeout_s": slot.entry.idle_timeout_s,
            "idle_s": round(time.monotonic() - slot.last_used, 3) if slot.leases == 0 else 0.0,
            "footprint_bytes": slot.footprint,
            "models_memory": {"budget": registry.budget, "used": registry.used_bytes()},
            "identity": r.identity if r else None,
            "path": r.model_path if r else None,
            "backend": r.backend if r else None,
            "blas": r.blas if r else None,
            "context_length": r.context_length if r else None,
            "load_time_s": r.load_time_s if r else None,
            "warmup_s": (stats or {}).get("warmup_s", getattr(r, "warmup_s", None)),
            "worker_pid": r.pid if r else None,
            "epoch": r.epoch if r else None,
            # A sharded group: every rank's process (rank 0 is worker_pid).
            "ranks": [
                {"rank": i, "pid": p.pid, "alive": p.returncode is None}
                for i, p in enumerate(getattr(sup, "processes", []) if sup else [])
            ],
            "queue": {
                "queued": adm.queued,
                "in_flight": adm.in_flight,
                "max_queued": adm.max_queued,
                "max_in_flight": adm.max_in_flight,
                "drain_rate_per_s": round(adm.drain.rate(), 3),
                "retry_after_s": adm.retry_after(),
            },
            "in_flight": client.active if client is not None else 0,
            "memory": (stats or {}).get("governor", {}),
            "prefix_cache": (stats or {}).get("prefix_cache", {}),
            "worker": stats,
            "worker_error": stats_error,
        }
    )


async def model_fault(request: web.Request) -> web.Response:
    """Test-only (`test_faults`): inject a fault into the worker (wedge, crash, corrupt).

    Answers 202 at once: a wedge blocks the engine thread, so its utility call
    is not awaited here.
    """
    slot = _known_model(request)
    try:
        body = await request.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or body.get("kind") not in ("wedge", "crash", "corrupt"):
        raise APIError(400, 'expected {"kind": "wedge" | "crash" | "corrupt", "seconds"?}')
    if slot.served is None:
        raise APIError(503, f"the model {slot.name!r} is not running", code="model_not_ready")
    client = slot.served.client_or_503()
    args = {k: v for k, v in body.items() if k in ("kind", "seconds")}

    async def send() -> None:
        with contextlib.suppress(Exception):  # the worker may die of it: that is the point
            await client.call("fault", args, timeout_s=3600)

    task = asyncio.get_running_loop().create_task(send())
    _background.add(task)
    task.add_done_callback(_background.discard)
    return web.json_response({"status": "accepted", "kind": body["kind"]}, status=202)


_background: set[asyncio.Task[None]] = set()  # keeps fire-and-forget tasks referenced
